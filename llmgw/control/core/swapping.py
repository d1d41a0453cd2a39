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
  - on as many distinct nodes as W's profile has shards (those sharing
    its fabric where it has several), each with its C{gpus_per_shard}
    GPUs that fit once the taken replicas are gone: a replica spread over
    several nodes frees its GPUs on every one of them. Of the choices
    found, the one whose most important replica taken is least important,
    then that takes the fewest, then the least recently used; none at all
    (nothing taken) when no choice frees enough nodes (L{choose});
  - taken replicas drain (their requests in flight finish) and stop, and
    their deployments' counts go down by one each, so the autoscaler does
    not place them again until their own demand asks; W is placed as soon
    as the GPUs are free, and its queued requests go as soon as it is
    ready (the routing table's change pumps the gateways' queues);
  - before any is taken, idle replicas may be put to sleep instead
    (C{swap_sleep}, a C{SleepShard} to each leader's agent) when their
    GPUs, once asleep, fit W by lending's rules
    (L{llmgw.control.core.lending}): W may borrow (evictable), each is
    of W's priority exactly (no more important, as for taking; no less,
    as for lending), ready and past its C{min_resident_s}, its engine
    one llmgw puts to sleep (vLLM, SGLang: C{sleep_level} and
    C{sleep_after_s} set), awake with nothing running or waiting by its
    leader's figures, and its deployment without demand this pass. Each
    stays a replica (its count is kept), one wake away from its next
    request; when its heartbeat says it sleeps, placement lends its GPUs
    to W. Replicas not heard asleep, or whose GPUs were not lent, within
    L{SLEEP_BOUND_S} give way to taking (C{swap_sleep_failed}), and those
    not asleep are not asked again; so does a replica whose agent says
    at once that it will not sleep it (busy, say) or that its engine's
    sleep call failed, without waiting for the bound;
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
timeout plus the longest drain of the replicas that may be taken (and
L{SLEEP_BOUND_S} more once replicas were put to sleep for it, in case that
gives way to taking); none for a model no set of replicas could make room
for even once every stay is over (a two-node model with only one node's
worth of takeable replicas, say). The
gateways learn it with the queue limits (L{queue_limits}) and keep such
requests waiting that much longer, so a request is not refused only
because a drain and a cold start took longer than its queue timeout.

L{choose} is the pure choice; L{Swapping.tick} reads the context, applies
it and says why in a C{swap} event per replica taken.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from llmgw import gputypes, sleepmodes
from llmgw.control.core import lending, lifecycle
from llmgw.control.core.autoscale import ScalerState
from llmgw.control.core.catalog import Catalog, Deployment, Profile
from llmgw.control.core.commands import Sleep
from llmgw.control.core.context import Context
from llmgw.control.core.outcome import Outcome
from llmgw.control.core.placing import waiting_order
from llmgw.control.core.sleeping import asleep
from llmgw.control.state.fleetstate import Phase, ReplicaRec
from llmgw.routing import MAX_QUEUE_TIMEOUT_S, QueueLimits

#: The event a replica taken for another model makes.
SWAP = "swap"
#: The events of a replica put to sleep to make room, and of one that was
#: not heard asleep in time (a replica is taken instead).
SWAP_SLEEP = "swap_sleep"
SWAP_SLEEP_FAILED = "swap_sleep_failed"
#: Seconds a replica put to sleep to make room has to be heard asleep and
#: its GPUs lent, before swapping takes a replica instead.
SLEEP_BOUND_S = 30.0


@dataclass(frozen=True, slots=True)
class Resident:
    """
    A replica that may be taken: where its leader runs, how many GPUs that
    fit the wanted profile it frees on each node (every shard's, so a
    replica spread over several nodes frees GPUs on each), and what orders
    it (see the module).
    """

    id: str
    model: str
    node_id: str
    gpus: Mapping[str, int]
    asleep: bool
    priority: int
    last_used: float
    created_at: float

    def key(self) -> tuple[int, float, int, float, str]:
        return (self.priority, self.last_used, 0 if self.asleep else 1, -self.created_at, self.id)


#: Work (plans made, choices copied node by node) past which L{choose}
#: tries nothing but its greedy path: a small fleet is searched through, a
#: large one costs a pass little more than the greedy choice.
SEARCH_LIMIT = 5_000

#: What orders complete choices: the highest priority taken, how many are
#: taken, then the last of them by the order replicas go in (the most
#: recently used, awake, oldest).
Cost = tuple[int, int, tuple[int, float, int, float]]


def choose(free: Mapping[str, int], need: int, residents: Iterable[Resident],
           spare: Mapping[str, int], shards: int = 1) -> tuple[tuple[str, ...], list[Resident]] | None:
    """
    The nodes for the wanted replica's C{shards} shards and the replicas to
    take so that each of those distinct nodes has C{need} GPUs free, or
    C{None} when no choice found gets there (or none needs taking
    anything).

    The choice taken is the one whose highest priority taken is the lowest,
    then that takes the fewest replicas, then whose last replica by the
    order they go in (L{Resident.key}: least recently used, asleep, newest)
    comes earliest. It is searched node by node, the node cheapest to
    complete first: the lowest priority taken, then the fewest replicas
    taken for each node it completes (a replica spread over nodes may
    complete several at once), then by that order. The first
    complete choice is the greedy one; other orders are tried after it
    while they may still do better and the work stays within
    L{SEARCH_LIMIT}.
    In each complete choice, a replica that later takings made needless is
    given back, the most valuable first. The nodes answered are those the
    taken replicas made room on, then those already free, C{shards} in
    all, each in id order.

    @param free: each eligible node's free GPUs that fit; only these nodes
        may hold a shard.
    @param residents: the replicas that may be taken, sorted or not.
    @param spare: per model, how many of its replicas may go (above its
        C{min_replicas}).
    """
    search = _Search(free, need, shards, residents)
    search.fill(dict(free), dict(spare), [])
    if search.best is None:
        return None
    _, got, taken = search.best
    freed = {node_id for r in taken for node_id in r.gpus}
    room = sorted((node_id not in freed or free[node_id] >= need, node_id)
                  for node_id, n in got.items() if n >= need)
    return tuple(sorted(node_id for _, node_id in room[:shards])), taken


class _Search:
    """
    The bounded search of L{choose}: the best complete choice so far, and
    the plans left to try.
    """

    def __init__(self, free: Mapping[str, int], need: int, shards: int, residents: Iterable[Resident]):
        self.free, self.need, self.shards = free, need, shards
        # On each node, the replicas that free GPUs there, in the order they go.
        self.on: dict[str, list[Resident]] = {}
        for r in sorted(residents, key=Resident.key):
            for node_id, n in r.gpus.items():
                if node_id in free and n > 0:
                    self.on.setdefault(node_id, []).append(r)
        #: Work done: plans made and choices copied.
        self.work = 0
        self.best: tuple[Cost, dict[str, int], list[Resident]] | None = None

    def ready(self, got: Mapping[str, int]) -> int:
        return sum(1 for n in got.values() if n >= self.need)

    def fill(self, got: dict[str, int], left: dict[str, int], taken: list[Resident], greedy: bool = True) -> None:
        """
        Complete nodes from C{got} (GPUs per node with C{taken} gone),
        C{left} giving how many more each model may give. The C{greedy}
        path (the cheapest plan at each step) is always followed to its
        end; any other only within L{SEARCH_LIMIT}.
        """
        need = self.need
        missing = self.shards - self.ready(got)
        if missing <= 0:
            self.done(got, taken)
            return
        if not greedy and self.work >= SEARCH_LIMIT:
            return
        ids = {r.id for r in taken}
        plans: dict[frozenset[str], tuple[tuple[object, ...], list[Resident]]] = {}
        for node_id in sorted(self.on):
            if got[node_id] >= need:
                continue
            here = [r for r in self.on[node_id] if r.id not in ids] if ids else self.on[node_id]
            plain = _complete(node_id, got[node_id], need, here, left)
            self.work += 1
            # Besides the plain order, each replica first that may do
            # better: one spread over nodes may complete several at once,
            # one that frees more here may need fewer taken, and any may
            # complete a node where the plain order runs out of spares.
            least = min((r.gpus[node_id] for r in plain), default=0) if plain is not None else 0
            firsts = [r for r in here if plain is None or len(r.gpus) > 1 or r.gpus[node_id] > least]
            for plan in (plain, *(_complete(node_id, got[node_id], need, here, left, r) for r in firsts)):
                if plan is None:
                    continue
                same = frozenset(r.id for r in plan)
                if same in plans:
                    # The same takings from an earlier node cost no more.
                    continue
                completed = 1
                if any(len(r.gpus) > 1 for r in plan):
                    touched = {m for r in plan for m in r.gpus if m in got}
                    completed = sum(1 for m in touched
                                    if got[m] < need <= got[m] + sum(r.gpus.get(m, 0) for r in plan))
                # Past a first replica, a plan keeps the order of the replicas
                # here: the most recently used is its first or its last. A
                # float is exact enough: ratios of small counts that differ
                # differ by far more than its precision.
                cost = (max(r.priority for r in plan), len(plan) / min(completed, missing),
                        max(plan[0].key()[:4], plan[-1].key()[:4]), node_id)
                plans[same] = (cost, plan)
            self.work += len(firsts)
        for i, (_, plan) in enumerate(sorted(plans.values(), key=lambda p: p[0])):
            path = greedy and i == 0
            top = max(r.priority for r in (*taken, *plan))
            if (not path and self.work >= SEARCH_LIMIT) or (self.best is not None and top > self.best[0][0]):
                # Sorted by priority first: no later plan does better.
                return
            self.work += len(got)
            after, rest = dict(got), dict(left)
            for r in plan:
                rest[r.model] -= 1
                for node_id, n in r.gpus.items():
                    if node_id in after:
                        after[node_id] += n
            self.fill(after, rest, [*taken, *plan], path)

    def done(self, got: dict[str, int], taken: list[Resident]) -> None:
        """
        A complete choice: give back what is needless, keep it if best.
        """
        need, ready = self.need, self.ready(got)
        for r in sorted(taken, key=Resident.key, reverse=True):
            lost = sum(1 for node_id, n in r.gpus.items() if node_id in got and got[node_id] >= need > got[node_id] - n)
            if ready - lost >= self.shards:
                got = {**got, **{node_id: got[node_id] - n for node_id, n in r.gpus.items() if node_id in got}}
                ready -= lost
                taken = [t for t in taken if t is not r]
        if not taken:
            return
        cost = (max(r.priority for r in taken), len(taken), max(r.key()[:4] for r in taken))
        if self.best is None or cost < self.best[0]:
            self.best = (cost, got, sorted(taken, key=Resident.key))


def _complete(node_id: str, have: int, need: int, here: list[Resident], left: Mapping[str, int],
              first: Resident | None = None) -> list[Resident] | None:
    """
    The replicas to take, in order, for C{node_id} to have C{need} GPUs
    free: C{first} (when given), then C{here} in their order, within what
    each model may give (C{left}); C{None} when it cannot.
    """
    plan: list[Resident] = []
    use: dict[str, int] = {}
    for r in (here if first is None else [first, *(r for r in here if r is not first)]):
        if left.get(r.model, 0) - use.get(r.model, 0) <= 0:
            continue
        use[r.model] = use.get(r.model, 0) + 1
        plan.append(r)
        have += r.gpus[node_id]
        if have >= need:
            return plan
    return None


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
        #: Per wanting model whose C{pending} replicas were put to sleep
        #: rather than taken: when that gives way to taking.
        self.sleeping: dict[str, float] = {}
        #: Replicas not heard asleep in time when asked: taken, not asked
        #: again, while they last.
        self.unslept: set[str] = set()
        #: Models room was made for by sleep, until their replica is ready
        #: or nothing of theirs is left to wait for.
        self.slept_for: set[str] = set()
        #: Wanting models no set of replicas could make room for, even once
        #: every stay is over: their requests gain nothing by waiting longer.
        self.no_set: set[str] = set()

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
        for model, deadline in list(self.sleeping.items()):
            if model not in self.pending:
                del self.sleeping[model]
            elif now >= deadline or not ctx.sleep_refused.keys().isdisjoint(self.pending[model]):
                self._sleep_failed(ctx, model, out)
        # A refusal heard for no sleep still waited for (one that came after
        # the bound) says nothing of the next ask.
        ctx.sleep_refused.clear()
        self.unslept &= st.replicas.keys()
        self.no_set = {m for m in self.no_set if m in ctx.catalog.deployments and ctx.deps[m].unplaceable}
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
                self.slept_for.discard(model)
                continue
            profile = ctx.profile(dep.profile)
            drains = [drain for priority, drain in givers if priority <= dep.multiplex.priority]
            waiting = (ctx.deps[model].unplaceable_since is not None and bool(drains)
                       and model not in self.no_set
                       and profile is not None and (profile.shards == 1 or bool(profile.fabric))
                       and len(active) < ctx.desired.get(model, dep.replicas))
            if model in self.incoming and not (active or waiting or model in self.pending):
                self.incoming.discard(model)
                self.slept_for.discard(model)
            seconds = ctx.startup_timeout(dep.profile) + max(drains, default=ctx.drain_timeout(dep.profile))
            if model in self.slept_for:
                # Its requests may have waited for a sleep that gave way to taking.
                seconds += SLEEP_BOUND_S
            if (waiting or model in self.pending or model in self.incoming) and seconds > 0:
                room[model] = min(seconds, MAX_QUEUE_TIMEOUT_S)
        ctx.room = room

    def _make_room(self, ctx: Context, want: Deployment, scalers: dict[str, ScalerState],
                   connected: set[str], now: float, out: Outcome) -> None:
        st = ctx.state
        profile = ctx.profile(want.profile)
        if profile is None or (profile.shards > 1 and not profile.fabric):
            # Placement puts no multi-shard replica anywhere without a fabric.
            return
        free: dict[str, int] = {}
        for node_id in sorted(connected):
            cap = st.node_capacity(ctx.inventory, node_id) if st.eligible(node_id, connected) else None
            if cap is None or (profile.shards > 1 and profile.fabric not in cap.fabrics):
                continue
            free[node_id] = sum(1 for mb, i in cap.free if mb >= profile.gpu_memory_mb and (
                not profile.gpu_types or gputypes.matches(cap.names.get(i, ""), profile.gpu_types)))
        if sum(1 for n in free.values() if n >= profile.gpus_per_shard) >= profile.shards:
            # Room by GPU count: what failed was something a swap cannot fix.
            return
        # A borrower shares its GPUs with a sleeping lender that keeps them:
        # taking it would give them back to the lender, not to this model.
        borrowing = {b for d in st.displaced for b in st.replicas[d].displaced_by}
        if self._sleep_room(ctx, want, profile, free, scalers, borrowing, now, out):
            return
        # residents: those that may be taken now; later: those too, and
        # those that may be once ready and past their stay.
        residents: list[Resident] = []
        later: list[Resident] = []
        spare = {}
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
                # One called back from lending for its own waiting requests
                # (L{lending.reclaim}) is about to be woken for them.
                if (rep.phase != Phase.ACTIVE or leader is None or rep.displaced_by
                        or rid in borrowing or rid in st.called_back):
                    continue
                gpus: dict[str, int] = {}
                for shard in rep.shards.values():
                    if shard.node_id in free:
                        gpus[shard.node_id] = gpus.get(shard.node_id, 0) + _fitting(ctx, shard.node_id, shard.gpus,
                                                                                    profile)
                resident = Resident(rid, dep.model, leader.node_id, gpus, bool(asleep(rep)),
                                    rules.priority, used, rep.created_at)
                later.append(resident)
                if rep.ready_since is not None and now - rep.ready_since >= rules.min_resident_s:
                    residents.append(resident)
        chosen = choose(free, profile.gpus_per_shard, residents, spare, profile.shards)
        if chosen is None:
            if len(later) == len(residents) or choose(free, profile.gpus_per_shard, later, spare,
                                                      profile.shards) is None:
                # No room_s for it (L{_note_room}): waiting would not help.
                self.no_set.add(want.model)
            else:
                self.no_set.discard(want.model)
            return
        self.no_set.discard(want.model)
        nodes, taken = chosen
        where = f"node{'s' if len(nodes) > 1 else ''} {', '.join(nodes)}"
        self.pending[want.model] = frozenset(r.id for r in taken)
        self.incoming.add(want.model)
        for r in taken:
            self.taken += 1
            idle = now - r.last_used
            out.event(SWAP, replica=r.id, node=r.node_id, reason=(
                f"model {r.model} (priority {r.priority}, {'asleep, ' if r.asleep else ''}no demand for "
                f"{idle:.0f}s) makes room for model {want.model} (priority {want.multiplex.priority}) "
                f"on {where}, whose requests wait"))
            lifecycle.retire(ctx, st.replicas[r.id], f"swapped out for {want.model}", now, out)
            lower = max(ctx.desired.get(r.model, 0) - 1, 0)
            ctx.desired[r.model] = lower
            scaler = scalers.get(r.model)
            if scaler is not None:
                scalers[r.model] = replace(scaler, desired=lower, below_since=None, peak=0)

    def _sleep_room(self, ctx: Context, want: Deployment, profile: Profile, free: Mapping[str, int],
                    scalers: Mapping[str, ScalerState], borrowing: set[str], now: float, out: Outcome) -> bool:
        """
        Make room for C{want} by putting idle replicas to sleep, so that
        lending places it on their GPUs, rather than by taking replicas;
        whether it did. A replica slept stays one (its count is kept), one
        wake away from its next request.
        """
        if not lending.borrower_allowed(want):
            return False
        st, priority = ctx.state, want.multiplex.priority
        asked = borrowing.union(*self.pending.values())
        residents: list[Resident] = []
        for dep in ctx.catalog.deployments.values():
            rules = dep.multiplex
            scaler = scalers.get(dep.model)
            # As for taking, no more important than the wanting model; as
            # for lending, at least as important as its borrower.
            if (dep.model == want.model or not rules.evictable or dep.autoscale is None
                    or rules.priority != priority or rules.sleep_after_s <= 0
                    or (scaler is not None and scaler.busy_at == now)):
                continue
            used = scaler.busy_at if scaler is not None and scaler.busy_at is not None else 0.0
            for rid in sorted(st.ready.get(dep.model, ())):
                rep = st.replicas[rid]
                if (rid in self.unslept or rid in asked or not _may_sleep(ctx, rep, now)
                        or now - (rep.ready_since or now) < rules.min_resident_s):
                    continue
                gpus = _lendable(ctx, rep, free, profile, want)
                if gpus:
                    residents.append(Resident(rid, dep.model, rep.shards[0].node_id, gpus, False,
                                              rules.priority, used, rep.created_at))
        spare = {r.model: len(residents) for r in residents}
        chosen = choose(free, profile.gpus_per_shard, residents, spare, profile.shards)
        if chosen is None:
            return False
        nodes, slept = chosen
        where = f"node{'s' if len(nodes) > 1 else ''} {', '.join(nodes)}"
        self.pending[want.model] = frozenset(r.id for r in slept)
        self.sleeping[want.model] = now + SLEEP_BOUND_S
        self.incoming.add(want.model)
        self.slept_for.add(want.model)
        for r in slept:
            leader = st.replicas[r.id].shards[0]
            out.event(SWAP_SLEEP, replica=r.id, node=r.node_id, reason=(
                f"model {r.model} (priority {r.priority}, idle, no demand for {now - r.last_used:.0f}s) "
                f"is put to sleep to lend its GPUs to model {want.model} (priority {priority}) on {where}, "
                "whose requests wait; it stays a replica, woken by its next request once they are back"))
            out.send(Sleep(leader.node_id, leader.id))
        return True

    def _sleep_failed(self, ctx: Context, model: str, out: Outcome) -> None:
        """
        The replicas put to sleep for C{model} were not heard asleep, or
        their GPUs not lent, within L{SLEEP_BOUND_S}, or an agent said it
        would not sleep one (C{ctx.sleep_refused}): take replicas instead
        (those not asleep are not asked to sleep again).
        """
        rids = sorted(self.pending.pop(model, frozenset()))
        del self.sleeping[model]
        awake = [r for r in rids if r in ctx.state.replicas and asleep(ctx.state.replicas[r]) is not True]
        self.unslept.update(awake)
        refused = [f"{r}: {ctx.sleep_refused[r]}" for r in rids if r in ctx.sleep_refused]
        if refused:
            what = f"were not put to sleep by their agents ({'; '.join(refused)})"
        else:
            what = (f"{'were not heard asleep' if awake else 'did not lend their GPUs'} "
                    f"within {SLEEP_BOUND_S:.0f}s")
        out.event(SWAP_SLEEP_FAILED, level="warn", reason=(
            f"model {model}: the replica(s) put to sleep to make room for it ({', '.join(rids)}) "
            f"{what}; replicas are taken instead"))


def _may_sleep(ctx: Context, rep: ReplicaRec, now: float) -> bool:
    """
    Whether C{rep} may be put to sleep to make room: ready, awake by its
    leader's newest figures with nothing running or waiting, not lent
    out, and of a profile whose engine llmgw puts to sleep.
    """
    leader = rep.shards.get(0)
    sig = leader.signals if leader is not None else None
    profile = ctx.profile(rep.profile)
    mode = sleepmodes.mode(profile.engine) if profile is not None else None
    return (rep.phase == Phase.ACTIVE and rep.ready_since is not None and not rep.displaced_by
            and profile is not None and profile.sleep_level > 0 and mode is not None and bool(mode.sleep_path)
            and sig is not None and sig.sleeping is False and sig.running is not None
            and sig.running <= 0 and (sig.waiting or 0) <= 0)


def _lendable(ctx: Context, rep: ReplicaRec, free: Mapping[str, int], profile: Profile,
              want: Deployment) -> dict[str, int]:
    """
    How many of C{rep}'s GPUs lending would give a replica of C{profile}
    (for C{want}) once C{rep} sleeps, by node (of those in C{free}): of a
    type and memory it takes, counting each holder's residual
    (L{lending.residual_mb}), and held otherwise only by sleepers at least
    as important as C{want}.
    """
    st, deps = ctx.state, ctx.catalog.deployments
    out: dict[str, int] = {}
    for shard in rep.shards.values():
        node = ctx.inventory.peek(shard.node_id)
        if shard.node_id not in free or node is None:
            continue
        info = {g.index: g for g in node.gpus}
        for index in shard.gpus:
            gpu = info.get(index)
            holders = {st.shards[sid].replica_id for sid in st.node_shards.get(shard.node_id, ())
                       if index in st.shards[sid].gpus} - {rep.id}
            others = [st.replicas[h] for h in holders if h in st.replicas]
            if (gpu is None or gpu.problems
                    or (profile.gpu_types and not gputypes.matches(gpu.name, profile.gpu_types))
                    or gpu.memory_total_mb - (1 + len(others)) * lending.residual_mb(gpu.memory_total_mb)
                    < profile.gpu_memory_mb
                    or not all(lending.sleeper(ctx, o) and o.model in deps and o.model != want.model
                               and deps[o.model].multiplex.priority >= want.multiplex.priority for o in others)):
                continue
            out[shard.node_id] = out.get(shard.node_id, 0) + 1
    return out


def _fitting(ctx: Context, node_id: str, indices: Iterable[int], profile: Profile) -> int:
    """
    How many of C{node_id}'s GPUs C{indices} would fit a shard of
    C{profile} once free: enough memory in all, no problems, of a type it
    takes.
    """
    node = ctx.inventory.peek(node_id)
    if node is None:
        return 0
    wanted = set(indices)
    return sum(1 for g in node.gpus if g.index in wanted and not g.problems
               and g.memory_total_mb >= profile.gpu_memory_mb
               and (not profile.gpu_types or gputypes.matches(g.name, profile.gpu_types)))


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
