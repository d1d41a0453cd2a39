"""
Decisions about whole nodes (DESIGN §6.3, §6.6, §6.7): applying what node
expiry judged (suspect, back, lost, the bulk-loss freeze and its lift), a
node the inventory dropped, and an operator's cordon, uncordon and drain.

Each function takes the L{Context}, its input and C{now}, changes the
fleet through L{FleetState}'s methods, and appends what to send and log to
an L{Outcome}. A node removed sets C{nodes_changed} (the cordoned and
draining nodes are kept in the state file); for an operator's cordon,
uncordon or drain the shell keeps them itself, and an error writing them
is the operator's. None reads a clock, sends a command or touches a
transport.
"""

from __future__ import annotations

from collections.abc import Iterable

from llmgw.control.core import lifecycle
from llmgw.control.core.context import Context
from llmgw.control.core.expiry import ExpiryRules, judge
from llmgw.control.core.outcome import Outcome
from llmgw.control.state.fleetstate import Phase
from llmgw.control.state.interfaces import UnknownNode


def _last_heard(ctx: Context, node_id: str) -> float | None:
    node = ctx.inventory.peek(node_id)
    if node is None:
        return None
    return max(node.last_seen, ctx.state.known_since.get(node_id, 0.0))


#: The most nodes whose check came due that one pass judges: when many
#: fall due at once (all registered together, or heartbeating in step),
#: the rest are the next pass's, which runs at once, so that no pass holds
#: the reactor for a whole fleet's checks.
EXPIRY_BATCH = 1000


def expire(ctx: Context, now: float, out: Outcome, limit: int | None = EXPIRY_BATCH) -> bool:
    """
    Judge the nodes whose check came due (L{judge}), at most C{limit} of
    them, and apply it: suspects, returns, the freeze or its lift (the
    suspects' lost clock restarts at a lift), and nodes lost, whose
    replicas are replaced. Returns whether due nodes are left for the next
    pass.
    """
    st = ctx.state
    r = ctx.rules
    verdict = judge(
        st.take_due(now, limit), st.suspect, len(st.known_since), len(st.lost),
        lambda n: _last_heard(ctx, n), st.lost_clock, ctx.frozen, now,
        ExpiryRules(r.suspect_after, r.lost_after, r.freeze_share),
    )
    st.eligibility_changed([n for n, _ in verdict.suspect] + verdict.back + verdict.gone
                           + [n for n, _ in verdict.lost])
    for node_id, silent in verdict.suspect:
        st.suspect.add(node_id)
        out.event("node_suspect", level="warn", node=node_id, reason=f"silent for {silent:.0f}s")
    if verdict.frozen is not None:
        ctx.frozen = verdict.frozen
        if verdict.frozen:
            ctx.frozen_reason = (
                f"{verdict.suspect_count} of {verdict.live_count} nodes are suspect at once: "
                "assuming the fault is on the control plane's side of the network"
            )
            out.event("replacements_frozen", level="critical", reason=ctx.frozen_reason)
        else:
            for node_id in verdict.fresh_clock:
                st.lost_clock[node_id] = now
            out.event(
                "replacements_resumed",
                level="warn",
                reason=f"{verdict.suspect_count} of {verdict.live_count} nodes are suspect; they "
                f"are lost only after {r.lost_after:g}s more of silence",
            )
            ctx.frozen_reason = ""
    for node_id in verdict.gone:
        st.suspect.discard(node_id)
        st.lost_clock.pop(node_id, None)
    for node_id in verdict.back:
        st.suspect.discard(node_id)
        st.lost_clock.pop(node_id, None)
        out.event("node_ready", node=node_id, reason="heard from again")
    for deadline, node_id in verdict.recheck:
        st.watch(node_id, deadline)
    for node_id, silent in verdict.lost:
        lost(ctx, node_id, silent, now, out)
    return st.due_left(now)


def lost(ctx: Context, node_id: str, silent: float, now: float, out: Outcome) -> None:
    """
    C{node_id} is lost: its replicas are replaced. Its shards' processes
    may still run, so their ports stay reserved.
    """
    st = ctx.state
    st.suspect.discard(node_id)
    st.lost_clock.pop(node_id, None)
    st.lost.add(node_id)
    # Its cache is out of reach: no peer, no placement preference, no
    # prefetch copy, until it registers again with a fresh report.
    ctx.inventory.models.drop(node_id)
    out.event("node_lost", level="error", node=node_id, reason=f"silent for {silent:.0f}s")
    for sid in sorted(st.node_shards.get(node_id, set())):
        shard = st.shards.get(sid)
        if shard is None:
            continue
        rep = st.replicas.get(shard.replica_id)
        st.drop_shard(shard, now, confirmed=False)
        if rep is not None:
            lifecycle.teardown(ctx, rep, f"node {node_id} is lost; replacing the replica", now, out)


def inventory_changed(ctx: Context, node_ids: Iterable[str], now: float, out: Outcome) -> None:
    """
    The inventory changed these nodes: one it still holds gets a check;
    one it dropped is L{removed}.
    """
    for node_id in node_ids:
        if node_id in ctx.inventory:
            ctx.state.note_node(node_id, now, ctx.rules.suspect_after)
        else:
            removed(ctx, node_id, now, out)


def removed(ctx: Context, node_id: str, now: float, out: Outcome) -> None:
    """
    The inventory no longer holds C{node_id}: its shards are forgotten and
    their replicas torn down.
    """
    st = ctx.state
    for sid in list(st.node_shards.get(node_id, ())):
        shard = st.shards[sid]
        rep = st.replicas.get(shard.replica_id)
        st.drop_shard(shard, now)
        if rep is not None:
            lifecycle.teardown(ctx, rep, f"node {node_id} was removed", now, out)
    st.forget_node(node_id)
    out.nodes_changed = True


def known(ctx: Context, node_id: str) -> None:
    """
    Raise L{UnknownNode} unless an operator may act on C{node_id}: a node
    cordoned or draining before a restart is known from the state file
    even before it registers again, so it can be uncordoned.
    """
    st = ctx.state
    if (node_id not in ctx.inventory and node_id not in st.known_since
            and node_id not in st.cordoned and node_id not in st.draining_nodes):
        raise UnknownNode(f"no node {node_id!r}")


def cordon(ctx: Context, node_id: str, out: Outcome) -> None:
    st = ctx.state
    st.eligibility_changed([node_id])
    if node_id not in st.cordoned:
        st.cordoned.add(node_id)
        out.event("node_cordoned", node=node_id, reason="no new placements")


def uncordon(ctx: Context, node_id: str, out: Outcome) -> None:
    """
    Allow placements on C{node_id} again; its replicas being moved off for
    a drain stay where they are, unless another of their nodes drains.
    """
    st = ctx.state
    st.eligibility_changed([node_id])
    if node_id in st.cordoned or node_id in st.draining_nodes:
        st.cordoned.discard(node_id)
        st.draining_nodes.discard(node_id)
        out.event("node_uncordoned", node=node_id, reason="placements allowed again")
    for sid in sorted(st.node_shards.get(node_id, ())):
        rep = st.replicas.get(st.shards[sid].replica_id)
        if rep is None or rep.evacuating != "node drain" or rep.phase != Phase.ACTIVE:
            continue
        if any(s.node_id in st.draining_nodes for s in rep.shards.values()):
            continue
        st.set_evacuating(rep, "")


def drain(ctx: Context, node_id: str, out: Outcome) -> None:
    """
    Cordon C{node_id} and move its replicas off, make-before-break.
    """
    st = ctx.state
    cordon(ctx, node_id, out)
    if node_id not in st.draining_nodes:
        st.draining_nodes.add(node_id)
        out.event("node_draining", node=node_id, reason="moving its replicas, make-before-break")
        for sid in sorted(st.node_shards.get(node_id, ())):
            rep = st.replicas.get(st.shards[sid].replica_id)
            if rep is not None:
                lifecycle.evacuate(ctx, rep, "node drain", out)
