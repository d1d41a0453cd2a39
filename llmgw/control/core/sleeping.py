"""
Sleeping replicas on the control plane's side (DESIGN §22): what a
heartbeat says of its leaders' sleep becomes an event when it changes
(C{replica_asleep}, C{replica_awake} with how long it slept), and which
replicas sleep is read from their leaders' signals for the admin API,
placement and eviction.

The agent decides when an idle engine sleeps (L{llmgw.agent.sleep}) and
a gateway wakes it (L{llmgw.gateway.waking}); the control plane watches,
and asks for a sleep only to make room (L{llmgw.control.core.swapping}).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from llmgw.control.core import lending, reports
from llmgw.control.core.context import Context
from llmgw.control.core.outcome import Outcome
from llmgw.control.state.fleetstate import ReplicaRec
from llmgw.control.state.signals import SignalStore

#: How much of an agent's reason for not sleeping a replica is kept.
REFUSAL_CHARS = 300


def asleep(rep: ReplicaRec) -> bool | None:
    """
    Whether C{rep}'s engine sleeps, by its leader's newest signals;
    C{None} when it does not sleep (or nothing was heard). It speaks for
    every shard: a multi-node engine sleeps and wakes as one through its
    leader's server (L{llmgw.agent.sleep}), and a follower's own signals
    never decide it.
    """
    return lending.asleep(rep)


def sleeping_gpus(rep: ReplicaRec) -> dict[str, tuple[int, ...]]:
    """
    The GPUs whose memory C{rep}'s sleep makes reclaimable, by node: every
    shard's, followers' included, while its leader says it sleeps; none
    otherwise.
    """
    if not asleep(rep):
        return {}
    out: dict[str, tuple[int, ...]] = {}
    for rank in sorted(rep.shards):
        shard = rep.shards[rank]
        out[shard.node_id] = (*out.get(shard.node_id, ()), *shard.gpus)
    return out


def record(ctx: Context, store: SignalStore, node_id: str, msgs: Iterable[Any], now: float,
           out: Outcome) -> None:
    """
    Keep a heartbeat's engine signals (L{reports.engine_signals}), with an
    event for each of the node's replicas that fell asleep or woke, and
    note why a leader's agent did not sleep it when asked
    (C{ctx.sleep_refused}, for L{llmgw.control.core.swapping}).
    """
    st = ctx.state
    leaders = [st.shards[sid] for sid in st.node_shards.get(node_id, ()) if st.shards[sid].rank == 0]
    before = {s.replica_id: (s.signals.sleeping if s.signals is not None else None) for s in leaders}
    msgs = list(msgs)
    reports.engine_signals(ctx, store, node_id, msgs, now)
    for m in msgs:
        shard = st.shards.get(m.shard_id) if m.sleep_refused else None
        if shard is not None and shard.node_id == node_id and shard.rank == 0:
            # The agent's words, bounded: they go into an event.
            ctx.sleep_refused[shard.replica_id] = m.sleep_refused[:REFUSAL_CHARS]
    for gone in [r for r in ctx.sleeping_since if r not in st.replicas]:
        del ctx.sleeping_since[gone]
    for gone in [r for r in ctx.sleep_refused if r not in st.replicas]:
        del ctx.sleep_refused[gone]
    for shard in leaders:
        sig = shard.signals
        now_asleep = sig.sleeping if sig is not None else None
        was = before.get(shard.replica_id)
        rep = st.replicas.get(shard.replica_id)
        since = ctx.sleeping_since
        if now_asleep and rep is not None:
            # Asleep since about now when first heard (as after a restart),
            # so that lending sees every sleeping replica; one that shares
            # a GPU is displaced before its route goes out.
            since.setdefault(rep.id, now)
            lending.check(ctx, rep, out)
        if rep is not None and rep.displaced_by and now_asleep is False and was is not False:
            lending.heard_awake(ctx, rep, node_id, now, out)
        if was is None or now_asleep is None or was == now_asleep or rep is None:
            continue
        if now_asleep:
            since[rep.id] = now
            gpus = sleeping_gpus(rep)
            out.event("replica_asleep", replica=rep.id, node=node_id, reason=(
                f"model {rep.model}: its engine sleeps (the memory of its {sum(map(len, gpus.values()))} "
                f"GPU(s) on {', '.join(sorted(gpus))} reclaimable)"))
        else:
            slept = now - since.pop(rep.id, now)
            out.event("replica_awake", replica=rep.id, node=node_id,
                      reason=f"model {rep.model}: its engine woke after {slept:.1f}s asleep")
