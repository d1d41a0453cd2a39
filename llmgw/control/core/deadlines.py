"""
Deadlines a pass looks at (DESIGN §6.4, §6.5, §6.6): a shard sent and
never heard of, one not ready within its startup timeout, a stop never
confirmed, a replica drained or past its drain timeout, an adopted replica
still incomplete after the adoption grace, and a draining node left with
no shards.

Only what can be due is looked at, through the fleet state's indexes.
Each function takes the L{Context} and C{now}, changes the fleet through
L{FleetState}'s methods, and appends what to send and log to an
L{Outcome}. None reads a clock, sends a command or touches a transport.
"""

from __future__ import annotations

from llmgw.control.core import lifecycle
from llmgw.control.core.context import MAX_SENDS, STOP_SLACK, Context
from llmgw.control.core.outcome import Outcome
from llmgw.control.state.fleetstate import ShardRec
from llmgw.control.state.interfaces import IInFlight
from llmgw.states import ShardState


def check(ctx: Context, in_flight: IInFlight | None, now: float, out: Outcome) -> None:
    """
    Everything due at C{now}. C{in_flight}: the gateway's in-flight counts;
    without them a draining replica is stopped at its drain timeout.
    """
    st = ctx.state
    for sid in st.take_checks(now):
        shard = st.shards.get(sid)
        if shard is None:
            st.stopping.discard(sid)
            continue
        if sid in st.stopping:
            stopping(ctx, shard, now, out)
        elif sid in st.unsettled:
            unsettled(ctx, shard, now, out)
    for rid in sorted(st.draining):
        rep = st.replicas.get(rid)
        if rep is None:
            st.draining.discard(rid)
            continue
        timeout = ctx.drain_timeout(rep.profile)
        if in_flight is not None and in_flight.in_flight(rid) == 0:
            lifecycle.teardown(ctx, rep, "drained: no request in flight", now, out)
        elif now - rep.drain_started >= timeout:
            lifecycle.teardown(ctx, rep, f"drain timeout of {timeout}s passed", now, out)
    if now >= ctx.grace_end:
        for rid in sorted(st.incomplete):
            rep = st.replicas.get(rid)
            if rep is None or len(rep.shards) == rep.world_size:
                st.incomplete.discard(rid)
                continue
            if now - rep.created_at >= ctx.rules.adoption_grace:
                out.event("replica_incomplete", level="warn", replica=rid,
                          reason=f"{len(rep.shards)} of {rep.world_size} shards reported")
                lifecycle.teardown(ctx, rep, "incomplete after adoption", now, out)
    for node_id in sorted(st.draining_nodes):
        # A node not registered since start may still have shards that its
        # agent has not reported yet.
        if node_id in st.registered and not st.node_shards.get(node_id):
            st.draining_nodes.discard(node_id)
            out.event("node_drained", node=node_id, reason="no shards left")
            out.nodes_changed = True


def unsettled(ctx: Context, shard: ShardRec, now: float, out: Outcome) -> None:
    """
    A pending shard is sent again after the pending timeout, at most
    L{MAX_SENDS} times in all; then, or when a starting shard passes its
    startup timeout, its replica is replaced and the failure counted.
    """
    st = ctx.state
    rep = st.replicas[shard.replica_id]
    sid = shard.id
    if shard.state == ShardState.PENDING:
        deadline = shard.sent_at + ctx.rules.pending_timeout
        if now < deadline:
            st.check_at(sid, deadline)
            return
        if shard.sends < MAX_SENDS:
            lifecycle.send_start(ctx, rep, shard, now, False, out)
            out.event("shard_resent", node=shard.node_id, replica=rep.id, shard=sid,
                      reason=f"nothing heard for {ctx.rules.pending_timeout:g}s")
            return
        reason = f"nothing heard after {shard.sends} start commands"
        kind = "shard_unresponsive"
    else:
        timeout = ctx.startup_timeout(rep.profile)
        deadline = shard.since + timeout
        if now < deadline:
            st.check_at(sid, deadline)
            return
        reason = f"not ready within the startup timeout of {timeout}s"
        kind = "startup_timeout"
    out.event(kind, level="error", node=shard.node_id, replica=rep.id, shard=sid, reason=reason)
    lifecycle.record_failure(ctx, rep.model, shard.node_id, rep.id, sid, now, out, error=reason)
    lifecycle.teardown(ctx, rep, reason, now, out)


def stopping(ctx: Context, shard: ShardRec, now: float, out: Outcome) -> None:
    """
    A shard told to stop and not confirmed stopped by its stop grace and
    L{STOP_SLACK} is forgotten; not known to have ended, its port stays
    reserved.
    """
    st = ctx.state
    rep = st.replicas.get(shard.replica_id)
    grace = ctx.stop_grace(rep.profile) if rep is not None else ctx.stop_grace("")
    deadline = shard.stop_sent_at + grace + STOP_SLACK
    if now < deadline:
        st.check_at(shard.id, deadline)
        return
    out.event("shard_stop_unconfirmed", level="warn", node=shard.node_id, replica=shard.replica_id,
              shard=shard.id, reason=f"no stopped report {grace + STOP_SLACK:g}s after the stop")
    st.drop_shard(shard, now, confirmed=False)
