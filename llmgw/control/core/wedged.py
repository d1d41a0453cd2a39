"""
Wedged replicas (DESIGN §23): an engine that reports requests running while
its progress counters stand still is stuck, however its health check
answers. It is taken out of routing at once, its failure is classed
C{hung}, and it is replaced as any failed replica is.

Progress is the leader shard's generated-token counter together with its
prompt-token counter (a long prefill moves the second while the first waits),
as the agent's heartbeats carry them (L{llmgw.control.state.signals}). The
evidence is read on the control plane's clock, from each sample's age:

  - a shard is watched only while its newest sample says requests run and it
    exports the generated-token counter (an idle engine is never wedged, and
    an engine without the counter, or an older agent, is not judged);
  - the counters are flat from the first sample that showed their present
    values; the stall is measured up to the newest sample, or up to now while
    the agent reports the shard's scrapes failing (an engine that stopped
    answering its metrics while it had requests running counts as flat);
  - a stall of the profile's C{stall_after_s} or more wedges the replica
    (C{0}: never).

An agent that measures the standstill itself, on its scrapes once a second,
sends it as C{flat_for_s}, and that is the stall: it heartbeats as soon as
the standstill reaches the threshold, and L{check_node} decides on that
heartbeat at once, without waiting for a heartbeat interval or a pass. The
control plane's own reckoning from samples is for older agents.

L{observe} and L{stall} are pure; L{check} is the pass's decision. None reads
a clock, sends a command or touches a transport.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass

from llmgw.control.core import lifecycle
from llmgw.control.core.context import Context
from llmgw.control.core.outcome import Outcome
from llmgw.control.state.fleetstate import Phase
from llmgw.control.state.signals import ShardSignals, SignalStore
from llmgw.crash import CrashClass


@dataclass(frozen=True)
class Progress:
    """
    One watched shard: its progress counters as last seen moving
    (C{mark}), when that was (C{moved_at}, the control plane's clock), and
    the requests its newest sample says run.
    """

    mark: tuple[float | None, float | None]
    moved_at: float
    running: float


@dataclass(frozen=True)
class Stall:
    """
    The evidence against a wedged shard: C{running} requests, counters flat
    for C{flat_s} seconds, and why its scrapes fail ("" if they answer).
    """

    running: float
    flat_s: float
    scrape_error: str = ""

    def describe(self, stall_after_s: float) -> str:
        text = (f"{self.running:g} requests running, generated tokens flat for "
                f"{self.flat_s:.1f}s (stall_after_s {stall_after_s:g})")
        if self.scrape_error:
            text += f"; its metrics do not answer: {self.scrape_error}"
        return text


def observe(prev: Progress | None, entry: ShardSignals | None) -> Progress | None:
    """
    A shard's progress after its newest sample C{entry}: C{None} when it is
    not watched (no sample, no generated-token counter, nothing running);
    counters that moved since C{prev} restart the watch at the sample's time.
    """
    if entry is None or entry.signals is None:
        return None
    s = entry.signals
    if s.generated_tokens is None or not s.running:
        return None
    mark = (s.generated_tokens, s.prefix_cache_queries)
    if prev is None or prev.mark != mark:
        return Progress(mark, s.sampled_at, s.running)
    return Progress(prev.mark, prev.moved_at, s.running)


def stall(progress: Progress, entry: ShardSignals, now: float, stall_after_s: float) -> Stall | None:
    """
    The evidence that a watched shard is wedged at C{now}, or C{None}: its
    counters flat for C{stall_after_s} or more, up to its newest sample, or
    up to C{now} while its scrapes fail. C{stall_after_s} of 0 never wedges.
    """
    if stall_after_s <= 0 or entry.signals is None:
        return None
    if entry.flat_for_s is not None:
        flat = entry.flat_for_s
    else:
        seen = now if entry.error else entry.signals.sampled_at
        flat = max(0.0, seen - progress.moved_at)
    if flat < stall_after_s:
        return None
    return Stall(progress.running, flat, entry.error)


def observe_node(ctx: Context, store: SignalStore, watch: MutableMapping[str, Progress],
                 node_id: str) -> None:
    """
    Take a heartbeat's samples (already in C{store}) into C{watch} for the
    leader shards C{node_id} holds.
    """
    st = ctx.state
    for sid in st.node_shards.get(node_id, ()):
        shard = st.shards.get(sid)
        if shard is None or shard.rank != 0:
            continue
        progress = observe(watch.get(sid), store.get(sid))
        if progress is None:
            watch.pop(sid, None)
        else:
            watch[sid] = progress


def check_node(ctx: Context, store: SignalStore, watch: MutableMapping[str, Progress],
               node_id: str, now: float, out: Outcome) -> None:
    """
    A heartbeat from C{node_id} (its samples already in C{store}): observe
    them, then wedge those of its replicas whose stall reached the
    threshold, as L{check} does, now rather than at the next pass.
    """
    observe_node(ctx, store, watch, node_id)
    check(ctx, store, watch, now, out,
          [sid for sid in ctx.state.node_shards.get(node_id, ()) if sid in watch])


def check(ctx: Context, store: SignalStore, watch: MutableMapping[str, Progress], now: float,
          out: Outcome, shard_ids: Iterable[str] | None = None) -> None:
    """
    Wedge every watched replica (of C{shard_ids}, when given) whose stall
    reached its profile's C{stall_after_s}: a C{replica_wedged} event with
    the evidence (its reason gives the standstill it was judged on), a failure of
    class C{hung} (counted towards the crash backoff), and a teardown,
    which takes it out of routing in this decision; the reconciler places
    its replacement.
    """
    st = ctx.state
    for sid in sorted(watch if shard_ids is None else shard_ids):
        shard = st.shards.get(sid)
        rep = st.replicas.get(shard.replica_id) if shard is not None else None
        entry = store.get(sid)
        if shard is None or rep is None or entry is None or shard.stopping or rep.phase == Phase.STOPPING:
            del watch[sid]
            continue
        profile = ctx.profile(rep.profile)
        if profile is None:
            continue
        evidence = stall(watch[sid], entry, now, profile.stall_after_s)
        if evidence is None:
            continue
        del watch[sid]
        reason = evidence.describe(profile.stall_after_s)
        out.event("replica_wedged", level="error", node=shard.node_id, replica=rep.id, shard=sid,
                  reason=reason, crash_class=str(CrashClass.HUNG))
        lifecycle.record_failure(ctx, rep.model, shard.node_id, rep.id, sid, now, out,
                                 error=f"wedged: {reason}", crash_class=str(CrashClass.HUNG))
        lifecycle.teardown(ctx, rep, f"wedged: {reason}", now, out)
