"""
Lending a sleeping replica's GPUs to another model (DESIGN §22): many
models on few GPUs, each sleeper keeping its process while another model
uses its GPU.

  - Placement first gives free GPUs; when a replica of an evictable
    (autoscaled) deployment fits on none, it may borrow GPUs whose every
    holder is a ready replica whose engine sleeps (all of a sleeping
    replica's shards' GPUs, not only its leader's), of a deployment at
    least as important, so that the lender can always have them back
    (L{llmgw.control.state.lendable}). A C{gpu_lent} event says so.
  - The lender stays, its process kept, but is displaced
    (C{replica_displaced}): out of the routes the gateways get, so no
    request wakes it and no gateway calls its wake path, since its memory
    is someone else's now. Of two replicas that hold one GPU the older is
    the lender, so this can be read from the fleet again after a restart.
  - The borrower's start waits L{LEND_GRACE_S} (L{start_lent}): long
    enough for every gateway to hold the routes without its lender, and
    for a wake one sent just before to be heard. A lender heard awake
    meanwhile cancels the lend (C{lend_cancelled}): the borrower, never
    started, is forgotten (its deployment placed again, elsewhere or
    later), the lender routed again (C{replica_restored}). The lender's
    agent also asks its engine before it starts the borrower
    (L{llmgw.agent.sleep.Sleeper.confirm}).
  - Requests for a model whose only replicas are displaced take the
    borrowers back (L{reclaim}, a C{swap} event each) by the swap rules:
    an evictable deployment no more important than the lender's, never
    below its C{min_replicas}, never before its C{min_resident_s}. Once
    the borrowers are gone the lender is restored (C{replica_restored}),
    routed again, and the gateway wakes it as any sleeping replica. Until
    it is heard awake (at most its drains and startup timeout) it lends
    nothing again, or the pass that restores it would lend it again
    before any gateway could wake it.

The memory check is conservative: a lent GPU gives a borrower its memory
total, less the memory its node last reported in use, less a residual for
each sleeping holder of L{RESIDUAL_SHARE} of the GPU (at least
L{RESIDUAL_MIN_MB}). A sleeping vLLM keeps its CUDA context, allocator
pools and NCCL buffers (level 1 keeps its weights in host memory, not on
the GPU); llama.cpp's sleep keeps its context. Simulated GPUs report
nothing in use, so the residual stands alone there; real ones report the
residual itself as well, counted twice, never too little.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from llmgw.control.core import lifecycle
from llmgw.control.core.autoscale import ScalerState
from llmgw.control.core.catalog import Deployment, Profile
from llmgw.control.core.context import Context
from llmgw.control.core.outcome import Outcome
from llmgw.control.core.rollout import LaunchSpec
from llmgw.control.state.fleetstate import Phase, ReplicaRec
from llmgw.control.state.lendable import Lender, LentGPU, choose
from llmgw.control.state.placement import NoPortFree, Placer, Request, Slot
from llmgw.routing import MAX_QUEUE_TIMEOUT_S

#: The events lending makes.
GPU_LENT = "gpu_lent"
DISPLACED = "replica_displaced"
RESTORED = "replica_restored"
LEND_CANCELLED = "lend_cancelled"
DISPLACED_AWAKE = "displaced_awake"
#: What a borrower taken back makes (as swapping's).
SWAP = "swap"

#: Seconds a borrower's start waits after its lend. The routes without
#: the lender go out as the pass that lends ends, and a gateway following
#: them has them at once (its long-poll or watch stream answers); one
#: whose last read just failed reads again after its follower's retry
#: (L{llmgw.gateway.follower_service.FollowerService}: 2 s, plus up to a
#: fifth of it as jitter). A wake sent just before is seen by the lender's
#: agent within its sleep look (1 s) and heard here at once.
LEND_GRACE_S = 3.0
#: A borrower's start is sent by the first pass (once a second) no more
#: than this before its grace ends: a pass may run a little late, and the
#: one that lent as well, so an exact comparison would often wait a whole
#: pass more. What is left of the grace still covers the routes' spread.
PASS_SLACK_S = 0.25

#: A sleeping engine's memory kept on each GPU, as a share of the GPU's
#: memory, and at least this many MiB.
RESIDUAL_SHARE = 0.1
RESIDUAL_MIN_MB = 1024


def residual_mb(total_mb: int) -> int:
    """The memory a sleeping holder is counted to keep on a GPU of C{total_mb}."""
    return max(RESIDUAL_MIN_MB, math.ceil(total_mb * RESIDUAL_SHARE))


def asleep(rep: ReplicaRec) -> bool | None:
    """
    Whether C{rep}'s engine sleeps, by its leader's newest signals
    (L{llmgw.control.core.sleeping.asleep}, which imports this module).
    """
    leader = rep.shards.get(0)
    sig = leader.signals if leader is not None else None
    return sig.sleeping if sig is not None else None


def sleeper(ctx: Context, rep: ReplicaRec, now: float = 0.0) -> bool:
    """
    Whether C{rep} may lend its GPUs: active, ready, its engine asleep, and
    not called back for its own requests (L{reclaim}) as of C{now}.
    """
    return (rep.phase == Phase.ACTIVE and asleep(rep) is True and rep.id in ctx.state.ready.get(rep.model, ())
            and ctx.state.called_back.get(rep.id, -math.inf) <= now)


def borrower_allowed(dep: Deployment) -> bool:
    """Whether C{dep}'s replicas may borrow: only those that can be taken back."""
    return dep.multiplex.evictable and dep.autoscale is not None


def lenders(ctx: Context, eligible: set[str], priority: int, weights: str = "", model: str = "",
            now: float = 0.0) -> list[Lender]:
    """
    The eligible nodes with GPUs held only by sleeping replicas of
    deployments of at least C{priority}, and those GPUs (see the module),
    as of C{now}. Replicas of C{model} lend it nothing: a request wakes
    them instead.
    """
    st, deps = ctx.state, ctx.catalog.deployments
    wanted: dict[str, set[int]] = {}
    for rid in sorted(ctx.sleeping_since):
        rep = st.replicas.get(rid)
        leader = rep.shards.get(0) if rep is not None else None
        if rep is None or rep.model == model or not sleeper(ctx, rep, now):
            continue
        if leader is None or leader.node_id not in eligible:
            # Only the leader's node can say the engine sleeps: with it away,
            # its followers' GPUs are not lent on old news.
            continue
        for shard in rep.shards.values():
            if shard.node_id in eligible:
                wanted.setdefault(shard.node_id, set()).update(shard.gpus)
    out = []
    for node_id, gpus in sorted(wanted.items()):
        node = ctx.inventory.peek(node_id)
        cap = st.node_capacity(ctx.inventory, node_id)
        if node is None or cap is None or (weights and ctx.inventory.models.too_small(weights, node_id)):
            continue
        holders: dict[int, dict[str, ReplicaRec]] = {}
        for sid in st.node_shards.get(node_id, ()):
            shard = st.shards[sid]
            for g in shard.gpus:
                if g in gpus:
                    holders.setdefault(g, {})[shard.replica_id] = st.replicas[shard.replica_id]
        info = {g.index: g for g in node.gpus}
        lent = []
        for g in sorted(gpus):
            reps = list(holders.get(g, {}).values())
            gpu = info.get(g)
            if gpu is None or gpu.problems or not reps or not all(
                    sleeper(ctx, r, now) and r.model in deps and r.model != model for r in reps):
                continue
            least = min(deps[r.model].multiplex.priority for r in reps)
            if least < priority:
                continue
            free = gpu.memory_total_mb - gpu.memory_used_mb - len(reps) * residual_mb(gpu.memory_total_mb)
            since = max(ctx.sleeping_since.get(r.id, 0.0) for r in reps)
            lent.append(LentGPU(g, free, least, since, tuple(sorted(r.id for r in reps))))
        if lent:
            out.append(Lender(cap, tuple(lent)))
    return out


def lend(ctx: Context, dep: Deployment, profile: Profile, spec: LaunchSpec, req: Request, placer: Placer,
         now: float, out: Outcome) -> str | None:
    """
    Place one replica of C{dep} on C{profile} with borrowed GPUs: its id,
    or C{None} when it may not borrow or nothing fits. The lenders are
    displaced at once; its shards' starts wait L{LEND_GRACE_S}
    (L{start_lent}).
    """
    if not borrower_allowed(dep):
        return None
    priority = dep.multiplex.priority
    chosen = choose(lenders(ctx, placer.eligible, priority, req.weights, dep.model, now), req, priority,
                    ctx.state.spread.get(req.group, {}))
    if chosen is None:
        return None
    slots: list[Slot] = []
    try:
        for rank, b in enumerate(chosen):
            slots.append(Slot(b.node_id, rank, b.gpus, placer.ports.allocate(b.host), b.host))
    except NoPortFree:
        for s in slots:
            placer.ports.release(s.host, s.port)
        return None
    st = ctx.state
    rep = lifecycle.create_replica(ctx, dep.model, profile.name, profile.shards, slots, now, out, spec,
                                   start=False)
    st.lend_starts[rep.id] = now + LEND_GRACE_S
    lent_by: dict[str, None] = {}
    for b in chosen:
        # The free GPUs it took are placement's no more this pass.
        placer.update(b.node_id, st.node_capacity(ctx.inventory, b.node_id))
        holders = sorted({h for g in b.lent for h in g.holders})
        lent_by.update(dict.fromkeys(holders))
        out.event(GPU_LENT, replica=rep.id, node=b.node_id, reason=(
            f"model {dep.model} (priority {priority}) found no free GPU: "
            f"GPU {','.join(str(g.index) for g in b.lent)} lent by sleeping replica(s) {', '.join(holders)} "
            f"(at least {min(g.free_mb for g in b.lent)} MiB left each, {profile.gpu_memory_mb} MiB needed); "
            f"started in {LEND_GRACE_S:g}s unless a lender wakes first"))
    for lender in lent_by:
        lrep = st.replicas[lender]
        st.set_displaced(lrep, tuple(sorted({*lrep.displaced_by, rep.id})))
        out.event(DISPLACED, replica=lender, reason=(
            f"model {lrep.model}: its sleeping engine's GPU memory is lent to replica {rep.id} of {dep.model}; "
            "not routed or woken until that replica is gone"))
    return rep.id


def borrowers(ctx: Context, rep: ReplicaRec) -> tuple[str, ...]:
    """
    The replicas that hold one of C{rep}'s GPUs and are newer or not
    asleep: those it lent them to. (Replicas adopted after a restart are
    all as new as each other: the awake one is the borrower then.)
    """
    st = ctx.state
    found: set[str] = set()
    mine = (rep.created_at, rep.id)
    for shard in rep.shards.values():
        gpus = set(shard.gpus)
        for sid in st.node_shards.get(shard.node_id, ()):
            other = st.shards[sid]
            if other.replica_id == rep.id or gpus.isdisjoint(other.gpus):
                continue
            orep = st.replicas.get(other.replica_id)
            if orep is not None and ((orep.created_at, orep.id) > mine or asleep(orep) is not True):
                found.add(orep.id)
    return tuple(sorted(found))


def lenders_of(ctx: Context, borrower: str) -> list[ReplicaRec]:
    """The replicas displaced by C{borrower}: those that lent it GPUs."""
    st = ctx.state
    return [st.replicas[r] for r in sorted(st.displaced) if borrower in st.replicas[r].displaced_by]


def start_lent(ctx: Context, now: float, out: Outcome) -> None:
    """
    Send the starts of each borrower whose lend's grace is over, its
    lenders all still asleep; cancel the lend of one with a lender not
    heard asleep (L{cancel}). A lender being stopped holds its GPUs until
    it is gone: the start waits for that. A borrower stopped meanwhile is
    not started.
    """
    st = ctx.state
    for rid, at in sorted(st.lend_starts.items()):
        rep = st.replicas[rid]
        lent_by = lenders_of(ctx, rid)
        awake = [r.id for r in lent_by if r.phase == Phase.ACTIVE and asleep(r) is not True]
        if awake:
            cancel(ctx, rep, awake, now, out)
        elif now + PASS_SLACK_S >= at and all(r.phase == Phase.ACTIVE for r in lent_by):
            del st.lend_starts[rid]
            for rank in sorted(rep.shards) if rep.phase == Phase.ACTIVE else ():
                lifecycle.send_start(ctx, rep, rep.shards[rank], now, True, out)


def cancel(ctx: Context, rep: ReplicaRec, awake: list[str], now: float, out: Outcome) -> None:
    """
    Cancel the lend to C{rep}, a borrower not started yet, whose lenders
    C{awake} woke: it is forgotten (nothing was sent for it; its
    deployment is placed again), its lenders routed again unless another
    borrower holds their GPUs.
    """
    lent_by = lenders_of(ctx, rep.id)
    out.event(LEND_CANCELLED, replica=rep.id, reason=(
        f"model {rep.model}: sleeping replica(s) {', '.join(awake)} that lent it their GPUs woke before "
        "its start went out; it was not started, and is placed again"))
    ctx.state.remove_replica(rep, now)
    for lender in lent_by:
        restore(ctx, lender, out)


def restore(ctx: Context, rep: ReplicaRec, out: Outcome) -> None:
    """
    Route displaced C{rep} again (an event) if its borrowers are gone, or
    keep it displaced by those left.
    """
    st = ctx.state
    left = borrowers(ctx, rep)
    if left:
        st.set_displaced(rep, left)
        return
    gone = ", ".join(rep.displaced_by)
    st.set_displaced(rep, ())
    out.event(RESTORED, replica=rep.id, reason=(
        f"model {rep.model}: the replica(s) that borrowed its GPUs ({gone}) are gone; routed again, "
        "woken on demand"))


def heard_awake(ctx: Context, rep: ReplicaRec, node_id: str, now: float, out: Outcome) -> None:
    """
    Displaced C{rep} was heard awake: the lends to its borrowers not
    started yet are cancelled; while a started one holds its GPUs, a
    warning (two engines may be loaded on one GPU).
    """
    st = ctx.state
    for b in [b for b in rep.displaced_by if b in st.lend_starts]:
        cancel(ctx, st.replicas[b], [rep.id], now, out)
    if rep.displaced_by:
        out.event(DISPLACED_AWAKE, level="warn", replica=rep.id, node=node_id, reason=(
            f"model {rep.model}: its engine says it is awake while its GPU memory is lent to "
            f"{', '.join(rep.displaced_by)}; it stays out of the routes until they are gone"))


def refresh(ctx: Context, now: float, out: Outcome) -> None:
    """
    Start or cancel the borrowers waiting out their lend's grace
    (L{start_lent}), restore each displaced replica whose borrowers are
    gone, and find sleeping replicas that share a GPU with a newer one (as
    after a restart), each change an event.
    """
    st = ctx.state
    start_lent(ctx, now, out)
    for rid in [r for r, until in st.called_back.items() if until <= now or asleep(st.replicas[r]) is False]:
        # Its requests' wake came, or the bound on it passed.
        del st.called_back[rid]
    for rid in sorted(st.displaced):
        restore(ctx, st.replicas[rid], out)
    for rid in sorted(ctx.sleeping_since):
        sleeping = st.replicas.get(rid)
        if sleeping is not None:
            check(ctx, sleeping, out)


def check(ctx: Context, rep: ReplicaRec, out: Outcome) -> None:
    """
    C{rep} was heard asleep: displace it at once if another replica holds
    one of its GPUs (as when both were adopted after a restart), before
    its route can reach a gateway.
    """
    if rep.displaced_by:
        return
    found = borrowers(ctx, rep)
    if found:
        ctx.state.set_displaced(rep, found)
        out.event(DISPLACED, replica=rep.id, reason=(
            f"model {rep.model}: its GPUs are held by replica(s) {', '.join(found)}; "
            "not routed or woken until they are gone"))


def _takeable(ctx: Context, b: ReplicaRec, lender: Deployment, now: float) -> bool:
    dep = ctx.catalog.deployments.get(b.model)
    if dep is None or not borrower_allowed(dep) or dep.multiplex.priority > lender.multiplex.priority:
        return False
    return (b.phase == Phase.ACTIVE and b.ready_since is not None
            and now - b.ready_since >= dep.multiplex.min_resident_s)


def reclaim(ctx: Context, scalers: dict[str, ScalerState], now: float, out: Outcome) -> int:
    """
    For each model with requests held this pass whose only replicas are
    displaced, take one displaced replica's borrowers (see the module);
    returns how many replicas were taken.
    """
    st, deps = ctx.state, ctx.catalog.deployments
    taken = 0
    served: set[str] = set()
    for rid in sorted(st.displaced):
        rep = st.replicas[rid]
        model, dep = rep.model, deps.get(rep.model)
        scaler = scalers.get(model)
        if (dep is None or model in served or rep.phase != Phase.ACTIVE or scaler is None
                or scaler.busy_at != now):
            continue
        if any(not st.replicas[r].displaced_by and st.replicas[r].phase == Phase.ACTIVE
               for r in st.ready.get(model, ())):
            continue
        held = [st.replicas[b] for b in rep.displaced_by if b in st.replicas]
        if any(b.phase != Phase.ACTIVE for b in held):
            # Already being taken back.
            served.add(model)
            continue
        if not held or not all(_takeable(ctx, b, dep, now) for b in held):
            continue
        need: dict[str, int] = {}
        for b in held:
            need[b.model] = need.get(b.model, 0) + 1
        if any(len(st.active.get(m, ())) - n < _min(deps[m]) for m, n in need.items()):
            continue
        served.add(model)
        st.called_back[rid] = now + max(ctx.drain_timeout(b.profile) for b in held) + ctx.startup_timeout(rep.profile)
        for b in held:
            taken += 1
            bdep = deps[b.model]
            out.event(SWAP, replica=b.id, reason=(
                f"model {b.model} (priority {bdep.multiplex.priority}) gives back the GPUs it borrowed from "
                f"sleeping replica {rid} of model {model} (priority {dep.multiplex.priority}), whose requests wait"))
            lifecycle.retire(ctx, b, f"gives its GPUs back to {rid} of {model}", now, out)
            lower = max(ctx.desired.get(b.model, 0) - 1, 0)
            ctx.desired[b.model] = lower
            s = scalers.get(b.model)
            if s is not None:
                scalers[b.model] = replace(s, desired=lower, below_since=None, peak=0)
    return taken


def _min(dep: Deployment) -> int:
    return dep.autoscale.min_replicas if dep.autoscale is not None else dep.replicas


def room(ctx: Context, now: float) -> Mapping[str, float]:
    """
    Models with a displaced replica that its borrowers may give back, with
    how long their requests may need past the queue timeout: what is left
    of the borrowers' C{min_resident_s}, their longest drain, and the
    lender's startup timeout (bounding its wake).
    """
    st, deps = ctx.state, ctx.catalog.deployments
    out: dict[str, float] = {}
    for rid in sorted(st.displaced):
        rep = st.replicas[rid]
        dep = deps.get(rep.model)
        held = [st.replicas[b] for b in rep.displaced_by if b in st.replicas]
        if dep is None or rep.phase != Phase.ACTIVE or not held:
            continue
        stays, drains = [], []
        for b in held:
            bdep = deps.get(b.model)
            if b.phase == Phase.ACTIVE:
                if (bdep is None or not borrower_allowed(bdep)
                        or bdep.multiplex.priority > dep.multiplex.priority):
                    break
                since = b.ready_since if b.ready_since is not None else now
                stays.append(max(since + bdep.multiplex.min_resident_s - now, 0.0))
            drains.append(ctx.drain_timeout(b.profile))
        else:
            seconds = max(stays, default=0.0) + max(drains) + ctx.startup_timeout(rep.profile)
            out[rep.model] = max(out.get(rep.model, 0.0), min(seconds, MAX_QUEUE_TIMEOUT_S))
    return out
