"""
Swapping models on demand (DESIGN §22): when requests wait for a model
that has fewer replicas than it wants and no GPU fits the missing one, the
control plane makes room by taking replicas of other deployments.

The rules, for a wanting deployment W (requests held for it this pass, a
replica missing, placement found no room):

  - only replicas of deployments with C{evictable = true} (which
    autoscale) and C{priority} at most W's are taken: a more important
    model is never taken for a less important one, so when demand exceeds
    the fleet the less important wait;
  - never below a deployment's C{min_replicas}, never a replica that is
    not ready, draining, or ready for less than its deployment's
    C{min_resident_s} (a swapped-in replica stays, against thrashing);
  - the lowest priority first, then the least recently used (the longest
    without demand), then sleeping ones (their memory is reclaimable at no
    cost to a request in flight), then the newest; sleeping first would
    take a popular model that merely dozed between its requests;
  - on the one node where replicas of the lowest priority, then the
    fewest, then the cheapest by the order above free enough GPUs for W's profile (one-shard profiles only);
  - taken replicas drain (their requests in flight finish) and stop, and
    their deployments' counts go down by one each, so the autoscaler does
    not place them again until their own demand asks; W is placed as soon
    as the GPUs are free, and its queued requests go as soon as it is
    ready (the routing table's change pumps the gateways' queues);
  - one swap at a time per wanting deployment, until its replica is
    placed or the taken replicas are gone;
  - among wanting deployments of one priority, the one that has found no
    room for longest is served first, both here and when placement hands
    out the freed GPUs (L{llmgw.control.core.placing.waiting_order}): the
    last in name order does not wait behind every later arrival.

While room is made for a model (a swap under way, its replica placed by a
swap and starting, or its requests waiting for a replica that a swap may
take once its stay is over), C{ctx.room} names it with the most its
waiting requests may need past their queue timeout: its profile's startup
timeout plus the longest drain of the replicas that may be taken. The
gateways learn it with the queue limits (L{queue_limits}) and keep such
requests waiting that much longer, so a request is not refused only
because a drain and a cold start took longer than its queue timeout.

L{choose} is the pure choice; L{Swapping.tick} reads the context, applies
it and says why in a C{swap} event per replica taken.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from llmgw import gputypes
from llmgw.control.core import lending, lifecycle
from llmgw.control.core.autoscale import ScalerState
from llmgw.control.core.catalog import Catalog, Deployment
from llmgw.control.core.context import Context
from llmgw.control.core.outcome import Outcome
from llmgw.control.core.placing import waiting_order
from llmgw.control.core.sleeping import asleep
from llmgw.control.state.fleetstate import Phase
from llmgw.routing import MAX_QUEUE_TIMEOUT_S, QueueLimits

#: The event a replica taken for another model makes.
SWAP = "swap"


@dataclass(frozen=True, slots=True)
class Resident:
    """
    A replica that may be taken: where it runs, how many GPUs it frees,
    and what orders it (see the module).
    """

    id: str
    model: str
    node_id: str
    gpus: int
    asleep: bool
    priority: int
    last_used: float
    created_at: float

    def key(self) -> tuple[int, float, int, float, str]:
        return (self.priority, self.last_used, 0 if self.asleep else 1, -self.created_at, self.id)


def choose(free: Mapping[str, int], need: int, residents: Iterable[Resident],
           spare: Mapping[str, int]) -> tuple[str, list[Resident]] | None:
    """
    The node and the replicas to take there so that C{need} GPUs are free
    on it, or C{None} when no node can get there.

    @param free: each eligible node's free GPUs that fit.
    @param residents: the replicas that may be taken.
    @param spare: per model, how many of its replicas may go (above its
        C{min_replicas}).
    """
    by_node: dict[str, list[Resident]] = {}
    for r in residents:
        if r.node_id in free:
            by_node.setdefault(r.node_id, []).append(r)
    best: tuple[tuple[object, ...], str, list[Resident]] | None = None
    for node_id, here in sorted(by_node.items()):
        got, taken, left = free[node_id], [], dict(spare)
        for r in sorted(here, key=Resident.key):
            if got >= need:
                break
            if left.get(r.model, 0) <= 0:
                continue
            left[r.model] -= 1
            taken.append(r)
            got += r.gpus
        if got < need or not taken:
            continue
        cost = (max(r.priority for r in taken), len(taken), max(r.key()[:2] for r in taken), node_id)
        if best is None or cost < best[0]:
            best = (cost, node_id, taken)
    return (best[1], best[2]) if best is not None else None


class Swapping:
    """
    What swapping remembers between passes: the replicas taken for each
    wanting deployment, until it is placed or they are gone.
    """

    def __init__(self) -> None:
        self.pending: dict[str, frozenset[str]] = {}
        #: Models a swap made room for, until their replica is ready or
        #: nothing of theirs is left to wait for.
        self.incoming: set[str] = set()
        #: Replicas taken since the process started (for the benchmark).
        self.taken = 0

    def tick(self, ctx: Context, scalers: dict[str, ScalerState], connected: Callable[[], set[str]],
             now: float, out: Outcome) -> None:
        """
        One pass: make room for each deployment that waits for it, after
        placement has found none (see the module). C{connected()} is
        asked only when one does.
        """
        st = ctx.state
        for model, rids in list(self.pending.items()):
            if not any(r in st.replicas for r in rids) or not ctx.deps[model].unplaceable:
                del self.pending[model]
        wanting = [
            dep for model, dep in ctx.catalog.deployments.items()
            if ctx.deps[model].unplaceable and model not in self.pending
            and (s := scalers.get(model)) is not None and s.busy_at == now
            and len(st.active.get(model, ())) < ctx.desired.get(model, dep.replicas)
        ]
        for dep in sorted(wanting, key=lambda d: waiting_order(ctx, d.model, now)):
            self._make_room(ctx, dep, scalers, connected(), now, out)
        self.taken += lending.reclaim(ctx, scalers, now, out)
        self._note_room(ctx)
        ctx.room = {**lending.room(ctx, now), **ctx.room}

    def _note_room(self, ctx: Context) -> None:
        """
        Set C{ctx.room} to the models room is being made for (see the
        module).
        """
        st, deps = ctx.state, ctx.catalog.deployments
        # Who may give a replica up: (priority, drain timeout) per deployment.
        givers = [(d.multiplex.priority, ctx.drain_timeout(d.profile)) for d in deps.values()
                  if d.multiplex.evictable and d.autoscale is not None
                  and len(st.active.get(d.model, ())) > d.autoscale.min_replicas]
        room: dict[str, float] = {}
        for model, dep in deps.items():
            active = st.active.get(model, ())
            if st.ready.get(model):
                self.incoming.discard(model)
                continue
            profile = ctx.profile(dep.profile)
            drains = [drain for priority, drain in givers if priority <= dep.multiplex.priority]
            waiting = (ctx.deps[model].unplaceable_since is not None and bool(drains)
                       and profile is not None and profile.shards == 1
                       and len(active) < ctx.desired.get(model, dep.replicas))
            if model in self.incoming and not (active or waiting or model in self.pending):
                self.incoming.discard(model)
            seconds = ctx.startup_timeout(dep.profile) + max(drains, default=ctx.drain_timeout(dep.profile))
            if (waiting or model in self.pending or model in self.incoming) and seconds > 0:
                room[model] = min(seconds, MAX_QUEUE_TIMEOUT_S)
        ctx.room = room

    def _make_room(self, ctx: Context, want: Deployment, scalers: dict[str, ScalerState],
                   connected: set[str], now: float, out: Outcome) -> None:
        st = ctx.state
        profile = ctx.profile(want.profile)
        if profile is None or profile.shards != 1:
            return
        free: dict[str, int] = {}
        for node_id in sorted(connected):
            cap = st.node_capacity(ctx.inventory, node_id) if st.eligible(node_id, connected) else None
            if cap is None:
                continue
            free[node_id] = sum(1 for mb, i in cap.free if mb >= profile.gpu_memory_mb and (
                not profile.gpu_types or gputypes.matches(cap.names.get(i, ""), profile.gpu_types)))
        if any(n >= profile.gpus_per_shard for n in free.values()):
            # Room by GPU count: what failed was something a swap cannot fix.
            return
        residents, spare = [], {}
        for dep in ctx.catalog.deployments.values():
            rules = dep.multiplex
            if (dep.model == want.model or not rules.evictable or dep.autoscale is None
                    or rules.priority > want.multiplex.priority):
                continue
            active = st.active.get(dep.model, set())
            spare[dep.model] = len(active) - dep.autoscale.min_replicas
            scaler = scalers.get(dep.model)
            used = scaler.busy_at if scaler is not None and scaler.busy_at is not None else 0.0
            for rid in active:
                rep = st.replicas[rid]
                leader = rep.shards.get(0)
                if (rep.phase != Phase.ACTIVE or rep.ready_since is None or leader is None or rep.displaced_by
                        or len(rep.shards) != 1 or now - rep.ready_since < rules.min_resident_s):
                    continue
                residents.append(Resident(rid, dep.model, leader.node_id, len(leader.gpus), bool(asleep(rep)),
                                          rules.priority, used, rep.created_at))
        chosen = choose(free, profile.gpus_per_shard, residents, spare)
        if chosen is None:
            return
        node_id, taken = chosen
        self.pending[want.model] = frozenset(r.id for r in taken)
        self.incoming.add(want.model)
        for r in taken:
            self.taken += 1
            idle = now - r.last_used
            out.event(SWAP, replica=r.id, node=node_id, reason=(
                f"model {r.model} (priority {r.priority}, {'asleep, ' if r.asleep else ''}no demand for "
                f"{idle:.0f}s) makes room for model {want.model} (priority {want.multiplex.priority}), "
                "whose requests wait"))
            lifecycle.retire(ctx, st.replicas[r.id], f"swapped out for {want.model}", now, out)
            lower = max(ctx.desired.get(r.model, 0) - 1, 0)
            ctx.desired[r.model] = lower
            scaler = scalers.get(r.model)
            if scaler is not None:
                scalers[r.model] = replace(scaler, desired=lower, below_since=None, peak=0)


def queue_limits(catalog: Catalog, room: Mapping[str, float]) -> dict[str, QueueLimits]:
    """
    The catalog's admission queue limits, with C{room_s} set for each
    model room is being made for (C{room}, as C{ctx.room}): what the
    routing table publishes to the gateways.
    """
    out = catalog.queue_limits()
    for model, seconds in room.items():
        out[model] = replace(out.get(model, QueueLimits()), room_s=seconds)
    return out
