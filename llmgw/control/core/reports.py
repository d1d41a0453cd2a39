"""
What agents report, as decisions (DESIGN §6.3, §6.5, §6.7): a registering
node's shards (adoption), the end of its registration, a shard's status,
a command its node could not be sent, and engine signals from heartbeats.

Each function takes the L{Context}, the report and C{now}, changes the
fleet through L{FleetState}'s methods, and appends what to send and log to
an L{Outcome}; L{unclaimed} is the one place a shard nothing claims is
stopped. None reads a clock, sends a command or touches a transport.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from llmgw.control.core import adoption, lifecycle, prefetching
from llmgw.control.core.commands import Command, DropModel, Prefetch, Start, Stop
from llmgw.control.core.context import Context
from llmgw.control.core.outcome import Outcome
from llmgw.control.state.fetches import FetchProgress
from llmgw.control.state.fleetstate import Phase, ReplicaRec, ShardRec
from llmgw.control.state.interfaces import ReportedShard, ShardReport
from llmgw.control.state.signals import SignalStore
from llmgw.control.state.signals import from_message as signals_from_message
from llmgw.routing import EngineSignals
from llmgw.states import ENDED, UNDER_WAY, ShardState


def unclaimed(ctx: Context, node_id: str, shard_id: str, replica_id: str, port: int, why: str,
              out: Outcome) -> None:
    """
    The one place a shard nothing claims is stopped. Its port stays
    reserved until it is seen gone.
    """
    out.event("shard_unclaimed", node=node_id, replica=replica_id, shard=shard_id, reason=why)
    ctx.state.reserve(shard_id, node_id, ctx.host(node_id), port)
    out.send(Stop(node_id, shard_id))


def adopt(ctx: Context, node_id: str, shards: list[ReportedShard], now: float,
          out: Outcome) -> list[ReportedShard]:
    """
    Claim what a registering node runs (DESIGN §6.5). Returns the shards
    nothing claims; they are stopped by the commands in C{out}.
    """
    st = ctx.state
    st.note_node(node_id, now, ctx.rules.suspect_after)
    host = ctx.host(node_id)
    refused: list[ReportedShard] = []
    reported: set[str] = set()
    ctx.listed[node_id] = {s.shard_id for s in shards}
    for s in shards:
        verdict = adoption.verdict(s, node_id, ctx.catalog, st)
        if isinstance(verdict, adoption.Refuse):
            refused.append(s)
            unclaimed(ctx, node_id, s.shard_id, s.replica_id, s.port, verdict.reason, out)
            continue
        state = ShardState(s.state)
        if isinstance(verdict, adoption.Known):
            known = st.shards[s.shard_id]
            rep = st.replicas[known.replica_id]
            lifecycle.set_state(ctx, known, rep, state, now)
            reported.add(s.shard_id)
            lifecycle.update_ready(ctx, rep, now, out)
            continue
        if isinstance(verdict, adoption.NewReplica):
            rep = ReplicaRec(id=s.replica_id, model=s.model, profile=s.profile,
                             world_size=verdict.world_size, created_at=now, adopted=True)
            st.add_replica(rep, incomplete=True)
            out.event("replica_adopted", node=node_id, replica=rep.id, reason=f"model {s.model}")
        else:
            rep = st.replicas[s.replica_id]
        shard = ShardRec(id=s.shard_id, replica_id=rep.id, node_id=node_id, rank=s.rank,
                         gpus=tuple(s.gpu_indices), port=s.port, host=host, state=state, since=now)
        st.add_shard(rep, shard)
        if state == ShardState.STARTING:
            st.check_at(shard.id, now + ctx.startup_timeout(rep.profile))
        reported.add(s.shard_id)
        if state == ShardState.DRAINING and rep.phase == Phase.ACTIVE:
            lifecycle.start_drain(ctx, rep, "it was draining when adopted", now, out, send=False)
        elif node_id in st.draining_nodes:
            # The node was being drained before a restart: go on moving its
            # replicas, make-before-break.
            lifecycle.evacuate(ctx, rep, "node drain", out)
        lifecycle.update_ready(ctx, rep, now, out)
    st.reported[node_id] = reported
    return refused


def registered(ctx: Context, node_id: str, now: float, out: Outcome) -> None:
    """
    A node's registration is complete: what the control plane holds there
    and the node did not list has ended (or, if never heard of, is sent
    again); what it reserved there and the node did not list is free.
    """
    st = ctx.state
    st.note_node(node_id, now, ctx.rules.suspect_after)
    st.registered.add(node_id)
    returned = node_id in st.lost
    was_suspect = node_id in st.suspect
    st.lost.discard(node_id)
    st.suspect.discard(node_id)
    st.lost_clock.pop(node_id, None)
    if returned or was_suspect:
        st.watch(node_id, now + ctx.rules.suspect_after)
        out.event("node_returned" if returned else "node_ready", node=node_id, reason="registered")
    reported = st.reported.pop(node_id, None)
    listed = ctx.listed.pop(node_id, None)
    if listed is not None:
        for sid in st.reserved_on(node_id) - listed:
            st.release_reserved(sid)
    if reported is None:
        return
    for sid in sorted(st.node_shards.get(node_id, set()) - reported):
        shard = st.shards[sid]
        rep = st.replicas.get(shard.replica_id)
        if shard.stopping or rep is None:
            st.drop_shard(shard, now)
        elif shard.state == ShardState.PENDING:
            # Sent on an older stream and maybe lost with it: send again
            # (one never sent, a borrower waiting out its lend's grace, waits).
            if shard.sends:
                lifecycle.send_start(ctx, rep, shard, now, False, out)
        else:
            out.event("shard_missing", level="warn", node=node_id, replica=rep.id, shard=sid,
                      reason="the node registered without it")
            # It ended while the stream was down: a failure like any other
            # (crash loops must back off), whose exit code and output may
            # still arrive in a status the agent kept for us.
            lifecycle.record_failure(ctx, rep.model, node_id, rep.id, sid, now, out, exit_code=0,
                                     signal=0, error="the shard ended while its node was disconnected")
            st.remember_missing(sid, node_id, rep.model)
            st.drop_shard(shard, now)
            lifecycle.teardown(ctx, rep, f"shard {sid} is gone from {node_id}", now, out)


def _failed(ctx: Context, report: ShardReport, replica_id: str, model: str, now: float,
            out: Outcome, backoff: bool = True, note: str = "") -> None:
    out.event(
        "shard_failed", level="error", node=report.node_id, replica=replica_id,
        shard=report.shard_id, reason=(report.error or "the process failed") + note,
        exit_code=report.exit_code, signal=report.signal, last_output=report.last_output,
        crash_class=report.crash_class,
    )
    lifecycle.record_failure(
        ctx, model, report.node_id, replica_id, report.shard_id, now, out,
        exit_code=report.exit_code, signal=report.signal, error=report.error,
        last_output=report.last_output, crash_class=report.crash_class, backoff=backoff,
    )


def shard_status(ctx: Context, report: ShardReport, now: float, out: Outcome) -> None:
    """
    A shard's new state, as its node reports it. A shard the control plane
    does not hold that reports itself running is stopped; a shard that
    failed or stopped unasked takes its replica down.
    """
    st = ctx.state
    shard = st.shards.get(report.shard_id)
    missing = st.missing.get(report.shard_id)
    if shard is None and missing is not None and missing[0] == report.node_id:
        if report.state in ENDED:
            # The final status of a shard that went missing while its node
            # was disconnected: its backoff was already counted.
            st.missing.pop(report.shard_id, None)
            if report.state == ShardState.FAILED:
                _failed(ctx, report, report.replica_id, missing[1], now, out, backoff=False,
                        note=" (reported after the node came back)")
            return
    if shard is None or shard.node_id != report.node_id:
        held = st.reserved.get(report.shard_id)
        if report.state in ENDED:
            if held is not None and held.node_id == report.node_id:
                st.release_reserved(report.shard_id)
        elif report.state in UNDER_WAY and held is None:
            unclaimed(ctx, report.node_id, report.shard_id, report.replica_id, 0,
                      f"reported {report.state} but the control plane holds no such shard", out)
        return
    rep = st.replicas.get(shard.replica_id)
    state = report.state
    if shard.stopping or rep is None:
        if state in ENDED:
            st.drop_shard(shard, now)
        return
    if state == ShardState.FAILED:
        st.set_shard_state(shard, ShardState.FAILED, now)
        _failed(ctx, report, rep.id, rep.model, now, out)
        lifecycle.teardown(ctx, rep, f"shard {shard.id} failed", now, out)
    elif state == ShardState.STOPPED:
        st.set_shard_state(shard, ShardState.STOPPED, now)
        out.event("shard_stopped", level="warn", node=shard.node_id, replica=rep.id, shard=shard.id,
                  reason=report.error or "stopped without being told to")
        lifecycle.teardown(ctx, rep, f"shard {shard.id} stopped", now, out)
    elif state in UNDER_WAY:
        # Fetching counts as starting, with no deadline here: the startup
        # timeout runs from "starting", once the weights are on the node.
        lifecycle.set_state(ctx, shard, rep, ShardState(state), now)
        lifecycle.update_ready(ctx, rep, now, out)
    elif state == ShardState.STOPPING:
        # Going away unasked, its processes not all gone yet: it serves no
        # more, and holds its GPUs and port until it reports stopped.
        st.set_shard_state(shard, ShardState.STOPPING, now)
        lifecycle.update_ready(ctx, rep, now, out)


def refused(ctx: Context, cmd: Command, why: str, now: float, out: Outcome) -> None:
    """
    C{cmd} could not be sent to its node (C{why}). A new shard's first
    start tears its replica down (a refused re-send waits for its next
    try); a shard that cannot be told to stop is forgotten, its port kept:
    if its node comes back, the registration lists it, and nothing claims
    it. A drain that cannot be sent ends at the drain timeout.
    """
    if isinstance(cmd, (Prefetch, DropModel)):
        prefetching.refused(ctx.prefetch, cmd, why, out)
        return
    st = ctx.state
    shard = st.shards.get(cmd.shard_id)
    if shard is None:
        return
    if isinstance(cmd, Stop):
        if shard.stopping:
            st.drop_shard(shard, now, confirmed=False)
        return
    if not isinstance(cmd, Start) or not cmd.first:
        return
    out.event("dispatch_refused", level="warn", node=shard.node_id, replica=shard.replica_id,
              shard=shard.id, reason=why)
    st.cap_dirty.add(shard.node_id)
    rep = st.replicas.get(shard.replica_id)
    if rep is not None:
        lifecycle.teardown(ctx, rep, f"could not start shard {shard.id}: {why}", now, out)


def obsolete(ctx: Context, cmd: Start) -> bool:
    """
    A start made obsolete before it went out (its replica was torn down
    meanwhile) is not sent.
    """
    shard = ctx.state.shards.get(cmd.shard_id)
    return shard is None or shard.stopping or shard.node_id != cmd.node_id


def shard_node(ctx: Context, shard_id: str) -> str | None:
    """
    The node that speaks for C{shard_id}: where it is held, went missing,
    or is reserved; C{None} for a shard the control plane does not know.
    """
    st = ctx.state
    shard = st.shards.get(shard_id)
    if shard is not None:
        return shard.node_id
    missing = st.missing.get(shard_id)
    if missing is not None:
        return missing[0]
    held = st.reserved.get(shard_id)
    return held.node_id if held is not None else None


def engine_signals(ctx: Context, store: SignalStore, node_id: str, msgs: Iterable[Any],
                   now: float) -> None:
    """
    Keep a heartbeat's engine signals in C{store}; those for shards not on
    C{node_id} are dropped (a node speaks only for its own shards). A
    leader's go into its replica's route.
    """
    st = ctx.state
    msgs = list(msgs)
    held = st.node_shards.get(node_id, ())
    if not msgs and not held:
        # The heartbeat of an idle node: only what it said before goes.
        store.record(node_id, ())
        return
    before = {sid for sid in held if store.get(sid) is not None}
    store.record(node_id, [(m.shard_id, signals_from_message(m, now)) for m in msgs
                           if shard_node(ctx, m.shard_id) == node_id])
    for sid in sorted(before | {m.shard_id for m in msgs}):
        shard = st.shards.get(sid)
        if shard is not None and shard.node_id == node_id and shard.rank == 0:
            st.set_signals(shard, store.signals(sid))
    for m in msgs:
        shard = st.shards.get(m.shard_id)
        rep = st.replicas.get(shard.replica_id) if shard is not None and shard.rank == 0 else None
        if rep is None or shard is None or shard.node_id != node_id:
            continue
        profile = ctx.profile(rep.profile)
        if profile is not None and profile.engine == "llamacpp" and not rep.lora_ids:
            rep.lora_ids, rep.route = True, None  # taken over after a restart
        # An agent that reports no adapters leaves a fixed set as it started.
        if m.adapters or not rep.lora_ids:
            st.set_adapters(rep, tuple(m.adapters))


def shard_signals(ctx: Context, node_id: str, shard_id: str, signals: EngineSignals | None) -> None:
    """
    An engine's load figures for a shard; figures for a shard C{node_id}
    does not hold are ignored.
    """
    shard = ctx.state.shards.get(shard_id)
    if shard is not None and shard.node_id == node_id:
        ctx.state.set_signals(shard, signals)


def fetches(ctx: Context, node_id: str, msgs: Iterable[Any]) -> None:
    """
    A heartbeat's fetch progress: each fetching shard of C{node_id} takes
    its entry; one the heartbeat leaves out keeps none. Entries for shards
    the node does not hold, or that are not fetching, are ignored.
    """
    st = ctx.state
    given = {m.shard_id: m for m in msgs}
    for sid in st.node_shards.get(node_id, ()):
        shard = st.shards[sid]
        msg = given.get(sid)
        if msg is not None and shard.state == ShardState.FETCHING:
            shard.fetch = FetchProgress.from_message(msg)
        else:
            shard.fetch = None
