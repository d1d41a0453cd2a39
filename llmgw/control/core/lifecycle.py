"""
A replica's life as decisions (DESIGN §6.4, §6.6, §6.7): starting its
shards, taking their states, draining, evacuating (make-before-break),
tearing down, and the failure bookkeeping (crash backoff, holds) that a
failed shard brings its deployment.

Each function takes the L{Context}, its input and C{now}, changes the
fleet through L{FleetState}'s methods, and appends the commands to send
and the events to log to an L{Outcome}. None reads a clock, sends a
command or touches a transport.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from llmgw.control.core import rolling
from llmgw.control.core.catalog import Catalog, diff
from llmgw.control.core.commands import Drain, Start, Stop, start_command, weights_key
from llmgw.control.core.context import STOP_SLACK, Context, variants_of
from llmgw.control.core.failures import ShardFailure, on_failure
from llmgw.control.core.outcome import Outcome
from llmgw.control.core.rollout import LaunchSpec
from llmgw.control.state.fleetstate import Phase, ReplicaRec, ShardRec
from llmgw.control.state.placement import Slot
from llmgw.states import ENDED, ShardState


def set_state(ctx: Context, shard: ShardRec, rep: ReplicaRec, state: ShardState, now: float) -> None:
    """
    Take a shard's new state; one starting is looked at again at its
    startup timeout.
    """
    was = shard.state
    ctx.state.set_shard_state(shard, state, now)
    if state == ShardState.STARTING and was != ShardState.STARTING and not shard.stopping:
        ctx.state.check_at(shard.id, now + ctx.startup_timeout(rep.profile))


def update_ready(ctx: Context, rep: ReplicaRec, now: float, out: Outcome) -> None:
    if ctx.state.update_ready(rep, now):
        out.event("replica_ready", replica=rep.id, reason=f"model {rep.model}")


def send_start(ctx: Context, rep: ReplicaRec, shard: ShardRec, now: float, first: bool,
               out: Outcome) -> None:
    """
    Tell C{shard}'s node to start it; it is looked at again when nothing
    is heard within the pending timeout.
    """
    # A replica runs the spec it was placed from (a rollout's old one
    # after a failure or an undo), not necessarily the catalog's.
    spec = ctx.rollouts.spec_for(rep.id)
    profile = spec.profile_named(rep.profile) if spec is not None else None
    profile = profile or ctx.profile(rep.profile)
    shard.sends += 1
    shard.sent_at = now
    ctx.state.check_at(shard.id, now + ctx.rules.pending_timeout)
    if profile is not None:
        leader = rep.shards.get(0)
        node = ctx.inventory.peek(leader.node_id) if leader is not None else None
        fabrics = node.fabrics if node is not None else {}
        deployment = ctx.catalog.deployments.get(rep.model)
        if spec is not None and deployment is not None and (
                deployment.profile != rep.profile or deployment.source != spec.source
                or deployment.args != spec.args or deployment.adapters != spec.adapters):
            # Only when they differ (a variant, a rollout's other spec): a copy costs every field.
            deployment = replace(deployment, profile=rep.profile, source=spec.source, args=spec.args,
                                 adapters=spec.adapters)
        command = start_command(rep, shard, profile, fabrics, deployment)
        if deployment is not None and deployment.source is not None:
            peers = ctx.inventory.models.peers(weights_key(deployment.source), exclude=shard.node_id)
            if peers:
                command = replace(command, model_peers=tuple(peers))
        out.send(Start(command, first=first))


def create_replica(ctx: Context, model: str, profile_name: str, world_size: int,
                   slots: Sequence[Slot], now: float, out: Outcome,
                   spec: LaunchSpec | None = None, start: bool = True) -> ReplicaRec:
    """
    A new replica of C{model} on the placed C{slots}, its shards started
    from C{spec} (the catalog's profile C{profile_name} when C{None});
    without C{start}, pending and not sent until the caller sends them.
    """
    rep = ReplicaRec(id=ctx.new_replica_id(model), model=model, profile=profile_name,
                     world_size=world_size, created_at=now)
    st = ctx.state
    st.add_replica(rep)
    if spec is not None:
        ctx.rollouts.replica_specs[rep.id] = spec
    profile = spec.profile_named(profile_name) if spec is not None else None
    profile = profile or ctx.profile(profile_name)
    if profile is not None and profile.engine == "llamacpp":
        # Its engine's adapters are fixed at its start: routed from its
        # first ready, before any heartbeat names them.
        rep.lora_ids = True
        dep = ctx.catalog.deployments.get(model)
        adapters = spec.adapters if spec is not None else dep.adapters if dep is not None else ()
        rep.adapters = tuple(a.name for a in adapters)
    for slot in slots:
        st.add_shard(
            rep,
            ShardRec(id=f"{rep.id}-s{slot.rank}", replica_id=rep.id, node_id=slot.node_id,
                     rank=slot.rank, gpus=slot.gpu_indices, port=slot.port, host=slot.host,
                     state=ShardState.PENDING, since=now),
            port_taken=True,
        )
    out.event(
        "replica_placed",
        node=",".join(s.node_id for s in slots),
        replica=rep.id,
        reason=f"model {model} on "
        + ", ".join(f"{s.node_id} GPUs {list(s.gpu_indices)} port {s.port}" for s in slots),
    )
    for rank in sorted(rep.shards) if start else ():
        send_start(ctx, rep, rep.shards[rank], now, True, out)
    return rep


def teardown(ctx: Context, rep: ReplicaRec, reason: str, now: float, out: Outcome) -> None:
    """
    Stop every shard of C{rep}; it is forgotten once they confirm.
    """
    if rep.phase == Phase.STOPPING:
        return
    st = ctx.state
    st.set_phase(rep, Phase.STOPPING, now)
    out.event("replica_stopping", replica=rep.id, reason=reason)
    deadline = now + ctx.stop_grace(rep.profile) + STOP_SLACK
    for shard in list(rep.shards.values()):
        if shard.state in ENDED:
            st.drop_shard(shard, now)
            continue
        st.mark_stopping(shard, now)
        st.check_at(shard.id, deadline)
        out.send(Stop(shard.node_id, shard.id))
    if not rep.shards and rep.id in st.replicas:
        st.remove_replica(rep, now)


def start_drain(ctx: Context, rep: ReplicaRec, reason: str, now: float, out: Outcome,
                send: bool = True) -> None:
    if rep.phase != Phase.ACTIVE:
        return
    ctx.state.set_phase(rep, Phase.DRAINING, now)
    out.event("replica_draining", replica=rep.id, reason=reason)
    if send:
        for shard in rep.shards.values():
            out.send(Drain(shard.node_id, shard.id))


def retire(ctx: Context, rep: ReplicaRec, reason: str, now: float, out: Outcome) -> None:
    """
    Take a replica out of service: drain it if it serves, else stop it.
    """
    if rep.id in ctx.state.ready[rep.model]:
        start_drain(ctx, rep, reason, now, out)
    else:
        teardown(ctx, rep, reason, now, out)


def evacuate(ctx: Context, rep: ReplicaRec, reason: str, out: Outcome) -> None:
    """
    Move C{rep} off where it runs, make-before-break: it stays until
    enough fresh replicas of its deployment are ready.
    """
    if rep.phase != Phase.ACTIVE or rep.evacuating:
        return
    ctx.state.set_evacuating(rep, reason)
    out.event("replica_evacuating", replica=rep.id, reason=reason)


def record_failure(
    ctx: Context,
    model: str,
    node_id: str,
    replica_id: str,
    shard_id: str,
    now: float,
    out: Outcome,
    *,
    exit_code: int | None = None,
    signal: int | None = None,
    error: str = "",
    last_output: str = "",
    crash_class: str = "",
    backoff: bool = True,
) -> None:
    """
    The one place a L{ShardFailure} is built: it becomes the deployment's
    last failure, and C{backoff} counts it towards the deployment's crash
    backoff, or with variants its replica's variant's (or holds the
    deployment, for a configuration failure).
    """
    failure = ShardFailure(
        node=node_id, replica=replica_id, shard=shard_id, exit_code=exit_code, signal=signal,
        error=error, last_output=last_output, time=now, crash_class=crash_class,
    )
    if not backoff:
        if model in ctx.deps:
            ctx.deps[model].last_failure = failure
        return
    state = ctx.deps[model]
    state.last_failure = failure
    verdict = on_failure(failure, model, state.held, counts=True)
    state.held = verdict.hold
    if verdict.new_hold and verdict.hold is not None:
        out.event("deployment_held", level="error", replica=replica_id, shard=shard_id,
                  reason=verdict.hold.reason)
    if not verdict.backoff:
        return
    rep = ctx.state.replicas.get(replica_id)
    if rep is not None and served(rep, now):
        # It started and served: the deployment can run, and what ended it
        # (a node gone, a kill, an engine wedged) is no crash loop, so its
        # replacement is placed at once however many replicas went before.
        return
    # With variants the failure counts against the failed replica's own
    # variant: the others are placed meanwhile.
    profile = rep.profile if rep is not None else ""
    counter = state.backoff_of(profile, variants_of(ctx, model))
    delay = counter.failed(now)
    what = f"deployment {model}" if counter is state.backoff else f"deployment {model} variant {profile}"
    out.event(
        "backoff",
        level="warn",
        replica=replica_id,
        reason=f"{what}: failure {counter.failures}, next placement in {delay:g}s",
    )


#: A replica ready this long before it failed had started and served: its
#: failure is not counted towards its deployment's crash backoff.
SERVED_S = 10.0


def served(rep: ReplicaRec, now: float) -> bool:
    """
    Whether C{rep} was ready for L{SERVED_S} or more, now or before it last
    stopped being ready.
    """
    span = now - rep.ready_since if rep.ready_since is not None else rep.was_ready_for
    return span >= SERVED_S


def release(ctx: Context, model: str, why: str, out: Outcome) -> None:
    """
    Lift C{model}'s hold and crash backoff: the next pass places again.
    """
    state = ctx.deps[model]
    was = state.held
    state.held = None
    state.reset_backoff()
    if was is not None:
        out.event("deployment_released", reason=f"deployment {model}: {why}")


def new_catalog(ctx: Context, new: Catalog, desired: dict[str, int], now: float,
                out: Outcome) -> dict[str, list[str]]:
    """
    Make C{new} the running catalog, with C{desired} replica counts:
    deployments that went away are retired; replicas whose launch spec
    (profile, source, engine arguments) changed are replaced by a rollout
    (L{rolling}), and their deployment's hold and backoff lifted. Returns
    what changed (L{diff}).
    """
    st = ctx.state
    old = ctx.catalog
    changes = diff(old, new)
    before = {m: ctx.rollouts.effective(old, m) for m in changes["changed"]}
    ctx.catalog = new
    ctx.desired = desired
    st.ports.set_range(*new.port_range)
    for model in changes["removed"]:
        for rid in sorted(st.active.get(model, set()) | st.evacuating.get(model, set())):
            retire(ctx, st.replicas[rid], "its deployment left the catalog", now, out)
    for model in changes["removed"]:
        ctx.rollouts.rollouts.pop(model, None)
        ctx.rollouts.pinned.pop(model, None)
    for model in changes["changed"]:
        if rolling.new_catalog(ctx, model, before[model], now, out):
            release(ctx, model, "its launch spec changed", out)
    return changes
