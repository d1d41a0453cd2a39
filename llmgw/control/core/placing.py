"""
The scale-and-place step of a pass (DESIGN §6.2, §6.4, §6.6, §6.7): for
each deployment, reset its crash backoff once a replica stayed ready long
enough, retire what is surplus or replaced, and place what is missing,
all-or-nothing per replica and in a deterministic order, within the
pass's budget.

L{reconcile} takes the L{Context}, C{now}, the placer and two callables
from the shell: C{sync} brings the placer up to date with the nodes that
changed (False when the budget ran out first) and C{over_budget} says
whether the pass's time is up. It changes the fleet through
L{FleetState}'s methods and appends what to send and log to an
L{Outcome}; it reads no clock, sends no command, touches no transport.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from llmgw.control.core import lending, lifecycle, rolling
from llmgw.control.core.catalog import Deployment, Profile
from llmgw.control.core.commands import weights_key
from llmgw.control.core.context import Context, variants_of
from llmgw.control.core.outcome import Outcome
from llmgw.control.core.rollout import LaunchSpec
from llmgw.control.core.scaling import Candidate, scale_step, victims
from llmgw.control.state.interfaces import AdminError, UnknownDeployment
from llmgw.control.state.placement import BUSY, Placer, Request


class Placing:
    """
    Placement's state kept from pass to pass: the L{Placer}, told of each
    node that changed before a pass places, and the nodes it last knew
    connected.
    """

    def __init__(self, ctx: Context):
        st = ctx.state
        self.placer = Placer((), st.spread, st.ports, live_spread=True, weights=ctx.inventory.models)
        self._connected: set[str] = set()

    def sync(self, ctx: Context, connected: set[str], over_budget: Callable[[], bool]) -> bool:
        """
        Bring the placer up to date with the nodes that changed since it
        last looked (those that connected or went away included), within
        the pass's budget; True when it is.
        """
        ctx.state.eligibility_changed(connected ^ self._connected)
        self._connected = connected
        return ctx.state.sync_placer(self.placer, ctx.inventory, connected, over_budget)


def reconcile(ctx: Context, now: float, placer: Placer, sync: Callable[[], bool],
              over_budget: Callable[[], bool], out: Outcome) -> bool:
    """
    One pass's scale and placement; returns whether it stopped at its
    budget with placements left (the next pass goes on). Every pass places
    at least one replica, whatever it cost to get there.
    """
    st = ctx.state
    synced = unfinished = False
    placed_this_pass = 0
    # Lenders whose borrowers are gone are routed again before anything
    # is placed.
    lending.refresh(ctx, now, out)
    placing = now >= ctx.grace_end and not ctx.frozen

    def _place_synced(spec: LaunchSpec) -> str | bool | None:
        nonlocal synced
        if unfinished:
            return None
        if not synced:
            if not sync():
                return None
            synced = True
        return place(ctx, dep, spec, placer, over_budget, now, out)

    deps = ctx.catalog.deployments
    # The more important first where room is short (DESIGN §22), then
    # the one that has found no room for longest.
    for model in in_waiting_order(ctx, now):
        dep = deps[model]
        desired = ctx.desired.get(model, dep.replicas)
        state = ctx.deps[model]
        active = st.active[model]
        ready = st.ready[model]
        variants = variants_of(ctx, model) if dep.variants else ()
        if (state.backoff.failures or state.variant_backoff) and state.failures(variants):
            forgive(ctx, model, variants, now, out)
        blocked = state.blocked(now, variants) if variants else state.backoff.blocked(now)
        if ctx.rollouts.rollouts and ctx.rollouts.owns(model):
            # A rollout decides its deployment's replicas until it is done.
            unfinished = rolling.step(
                ctx, ctx.rollouts.rollouts[model], desired, now, placing, blocked,
                lambda spec: _place_synced(spec), out) or unfinished
            continue
        evac = st.evacuating.get(model)
        step = scale_step(
            # Fresh ready replicas are counted only where some are being moved off.
            desired, len(active), len(ready & active) if evac else 0, len(evac) if evac else 0,
            placing=placing, held=state.held is not None, backing_off=blocked,
        )
        if step.retire_evacuated and evac:
            for rid in sorted(evac):
                rep = st.replicas[rid]
                lifecycle.retire(ctx, rep, f"replaced ({rep.evacuating})", now, out)
        if step.retire:
            for rid in victims(candidates(ctx, model, active), step.retire):
                lifecycle.retire(ctx, st.replicas[rid], f"scale down of {model} to {desired}", now, out)
            continue
        if not step.place and not unfinished:
            state.unplaceable_since = None
        if not step.place or unfinished:
            continue
        if not synced:
            # Placement hears of every node that changed first; at the
            # budget the rest is the next pass's, which runs at once.
            if not sync():
                unfinished = True
                continue
            synced = True
        missing = step.place
        spec = ctx.rollouts.effective(ctx.catalog, model)
        assert spec is not None
        placed = 0
        for _ in range(missing):
            if placed_this_pass and over_budget():
                unfinished = True
                break
            got = place(ctx, dep, spec, placer, over_budget, now, out)
            if got is None:
                # Still gathering candidates, and the time is up.
                unfinished = True
                break
            if not got:
                break
            placed += 1
            placed_this_pass += 1
        if unfinished:
            continue
        if placed < missing:
            tried = [p for p in spec.choices() if not (dep.variants and state.variant_blocked(p.name, now))]
            why = f"no room for {missing - placed} replica(s) of " + " or ".join(map(describe, tried))
            if len(tried) < len(spec.choices()):
                why += " (the other variants in backoff)"
            if state.unplaceable_since is None:
                state.unplaceable_since = now
            if state.unplaceable != why:
                state.unplaceable = why
                ctx.unplaceable.add(model)
                out.event("unplaceable", level="warn", reason=f"deployment {model}: {why}")
        else:
            state.unplaceable = ""
            state.unplaceable_since = None
            ctx.unplaceable.discard(model)
    return unfinished


def forgive(ctx: Context, model: str, variants: tuple[str, ...], now: float, out: Outcome) -> None:
    """
    Reset the count of each backoff of C{model} (the deployment's own, or
    with variants each variant's) that one of its replicas has now been
    ready long enough to forgive.
    """
    st = ctx.state
    state = ctx.deps[model]
    for rid in sorted(st.ready[model]):
        rep = st.replicas[rid]
        backoff = state.backoff_of(rep.profile, variants)
        rs = rep.ready_since
        if rs is not None and backoff.ready_for(now - rs):
            backoff.reset()
            what = f"deployment {model}" if backoff is state.backoff else f"variant {rep.profile} of {model}"
            out.event("backoff_reset", replica=rid, reason=f"{what} ready long enough")


def waiting_order(ctx: Context, model: str, now: float) -> tuple[int, float, str]:
    """
    The order in which deployments get room where it is short: the higher
    C{priority} first, then the one that has found none for longest, then
    by name.
    """
    since = ctx.deps[model].unplaceable_since
    return (-ctx.catalog.deployments[model].multiplex.priority, now if since is None else since, model)


def in_waiting_order(ctx: Context, now: float) -> Sequence[str]:
    """
    The catalog's deployments in L{waiting_order}.
    """
    if not ctx.short_of_room():
        # None has waited for room: by priority then name, as the catalog
        # gives them until it changes.
        return ctx.by_priority()
    return sorted(ctx.catalog.deployments, key=lambda m: waiting_order(ctx, m, now))


def deployment(ctx: Context, model: str) -> Deployment:
    """
    The deployment that serves C{model}; L{UnknownDeployment} if none.
    """
    dep = ctx.catalog.deployments.get(model)
    if dep is None:
        raise UnknownDeployment(f"no deployment serves model {model!r}")
    return dep


def check_scale(ctx: Context, model: str, replicas: object) -> Deployment:
    """
    The deployment an operator may scale to C{replicas}: L{UnknownDeployment}
    for a model none serves, L{AdminError} for a count that is not a whole
    number of at least 0.
    """
    dep = deployment(ctx, model)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise AdminError(f"replicas must be a whole number of at least 0, not {replicas!r}")
    return dep


def candidates(ctx: Context, model: str, active: set[str]) -> list[Candidate]:
    """
    What a scale down of C{model} chooses from (DESIGN §6.6), each with
    the cost of its variant (0 without variants).
    """
    st = ctx.state
    ready = st.ready[model]
    dep = ctx.catalog.deployments.get(model)
    costs = {v.profile: v.cost for v in dep.variants} if dep is not None else {}
    result = []
    for rid in active:
        rep = st.replicas[rid]
        load = max((len(st.node_shards.get(s.node_id, ())) for s in rep.shards.values()), default=0)
        result.append(Candidate(rid, rid in ready, load, rep.created_at, costs.get(rep.profile, 0.0)))
    return result


def describe(profile: Profile) -> str:
    """
    A profile as an unplaceable event names it, with the GPU types it needs.
    """
    types = f" (GPU types {', '.join(profile.gpu_types)})" if profile.gpu_types else ""
    return f"profile {profile.name}{types}"


def place(ctx: Context, dep: Deployment, spec: LaunchSpec, placer: Placer,
          over_budget: Callable[[], bool], now: float, out: Outcome) -> str | bool | None:
    """
    Place one replica of C{dep} from C{spec}, on the first of its
    profiles (the cheapest variant first) that has room and is not in its
    variant's backoff: its id, False when none has, or C{None} when the
    pass's time ran out first.
    """
    state = ctx.deps[dep.model]
    tried: list[tuple[Profile, Request]] = []
    for profile in spec.choices():
        if dep.variants and state.variant_blocked(profile.name, now):
            # A variant in backoff is passed over as one without room is.
            continue
        req = Request(group=dep.model, shards=profile.shards, gpus_per_shard=profile.gpus_per_shard,
                      gpu_memory_mb=profile.gpu_memory_mb, fabric=profile.fabric,
                      weights=weights_key(dep.source), gpu_types=profile.gpu_types,
                      prefer_gpu_types=profile.prefer_gpu_types)
        slots = placer.place(req, over_budget)
        if slots is BUSY:
            return None
        if slots is not None:
            return lifecycle.create_replica(ctx, dep.model, profile.name, profile.shards, slots, now,
                                            out, spec).id
        tried.append((profile, req))
    # Free GPUs first, on every variant; then a sleeping replica's, lent.
    for profile, req in tried:
        rid = lending.lend(ctx, dep, profile, spec, req, placer, now, out)
        if rid is not None:
            return rid
    return False
