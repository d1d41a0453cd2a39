"""
Rollouts as decisions (DESIGN §23): a change of what launches a
deployment's replicas (profile, command, source, engine arguments)
replaces them one at a time.

Where there is room, a replica of the new version is placed beside the
old ones (up to the deployment's C{max_surge} extra) and one old replica
drains once it is ready. Where there is none (a full fleet), one old
replica is drained and stopped first (within C{max_unavailable} below the
deployment's count; the gateway's admission queue holds requests while
capacity dips) and its replacement placed on the GPUs it freed. A new
replica that fails before it is ready stops the rollout: the old replicas
left are kept, and a slot taken down for it is placed back with the old
version.

While a rollout is not done it decides its deployment's replicas; the
scaler (L{placing.reconcile}) leaves them alone. Like the other
decisions, these take the L{Context} and append to an L{Outcome}.
"""

from __future__ import annotations

from collections.abc import Callable

from llmgw.control.core import lifecycle
from llmgw.control.core.context import Context
from llmgw.control.core.outcome import Outcome
from llmgw.control.core.rollout import (
    DEFAULT_MAX_SURGE,
    DEFAULT_MAX_UNAVAILABLE,
    LaunchSpec,
    Rollout,
    RolloutState,
    spec_of,
)
from llmgw.control.state.fleetstate import Phase
from llmgw.control.state.interfaces import AdminError

#: Places one replica of the deployment from a spec: its id, False when
#: there is no room, None when the pass's time ran out first.
PlaceOne = Callable[[LaunchSpec], "str | bool | None"]


def limits(ctx: Context, model: str) -> tuple[int, int]:
    """
    C{model}'s deployment's C{max_surge} and C{max_unavailable}.
    """
    dep = ctx.catalog.deployments.get(model)
    surge = dep.max_surge if dep is not None and dep.max_surge is not None else DEFAULT_MAX_SURGE
    down = (dep.max_unavailable if dep is not None and dep.max_unavailable is not None
            else DEFAULT_MAX_UNAVAILABLE)
    return surge, down


def start(ctx: Context, model: str, old: LaunchSpec, new: LaunchSpec, now: float, out: Outcome,
          undo: bool = False) -> Rollout | None:
    """
    Roll C{model}'s replicas from C{old} to C{new}: those placed from
    another spec than C{new} (a replica placed before any rollout runs
    C{old}) are replaced. Returns the rollout, or C{None} when no replica
    needs replacing. A rollout of a deployment an operator paused starts
    paused.
    """
    book, st = ctx.rollouts, ctx.state
    live = sorted(r for r in st.by_model.get(model, ()) if st.replicas[r].phase == Phase.ACTIVE)
    for rid in live:
        book.replica_specs.setdefault(rid, old)
    # A replica is judged by its own variant's profile.
    stale = {r for r in live if not book.replica_specs[r].runs_as(new, st.replicas[r].profile)}
    if not stale:
        book.rollouts.pop(model, None)
        return None
    ro = Rollout(model, old, new, total=len(stale), started=now, old_ids=stale, undo=undo)
    if model in book.paused:
        ro.state, ro.reason = RolloutState.PAUSED, "paused by an operator"
    book.rollouts[model] = ro
    out.event("rollout_started", reason=f"deployment {model}: {len(stale)} replica(s) from "
              f"{old.version} to {new.version}" + (" (undo)" if undo else "")
              + (", paused" if ro.state == RolloutState.PAUSED else ""))
    return ro


def new_catalog(ctx: Context, model: str, old: LaunchSpec | None, now: float, out: Outcome) -> bool:
    """
    Start a rollout of C{model} if the running catalog's spec for it
    differs from C{old}, the one its replicas were placed from; an undo's
    pin is dropped (the catalog is the newer intent). Returns whether the
    spec changed.
    """
    new = spec_of(ctx.catalog, model)
    if old is None or new is None or old == new:
        return False
    ctx.rollouts.pinned.pop(model, None)
    start(ctx, model, old, new, now, out)
    return True


def step(ctx: Context, ro: Rollout, desired: int, now: float, placing: bool, backing_off: bool,
         place: PlaceOne, out: Outcome) -> bool:
    """
    One pass's move of rollout C{ro}; returns whether it stopped at the
    pass's budget. C{placing}: placement is allowed at all (past the
    adoption grace, no freeze); C{backing_off}: the deployment's crash
    backoff has not run out.
    """
    st = ctx.state
    model = ro.model
    live, ready = st.active[model], st.ready[model]
    ro.old_ids &= st.replicas.keys()
    _pending(ctx, ro, out)
    # A surge's new replica is ready: an old one makes way.
    if len(live - ro.pending) > desired and ro.old_ids & live:
        _take_down(ctx, ro, "replaced", now, out)
        return False
    # Done once nothing old serves and the count is back: on a full fleet
    # the last old replica goes before its replacement is placed, and that
    # replacement is still this rollout's to place and to wait for.
    if (ro.state == RolloutState.PROGRESSING and not ro.old_ids & live and not ro.pending
            and len(live) >= desired):
        ro.state, ro.updated, ro.reason = RolloutState.DONE, ro.total, ""
        out.event("rollout_done", reason=f"deployment {model}: {ro.total} replica(s) on {ro.new.version}")
        return False
    if ro.pending or not placing:
        return False
    if ro.state != RolloutState.PROGRESSING:
        # Paused or failed: the count is kept with the old version (the
        # slot a failed step took down goes back to it).
        if len(live) < desired and (ro.state == RolloutState.FAILED or not backing_off):
            got = place(ro.old)
            if got is None:
                return True
            if got:
                ro.old_ids.add(str(got))
                out.event("rollout_slot_restored", replica=str(got),
                          reason=f"deployment {model}: back on {ro.old.version}")
        return False
    if backing_off:
        return False
    surge, down = limits(ctx, model)
    freeing = any(st.replicas[r].phase != Phase.ACTIVE for r in ro.old_ids if r in st.replicas)
    if len(live) < desired + surge:
        got = place(ro.new)
        if got is None:
            return True
        if got:
            ro.pending.add(str(got))
            ro.waiting = ""
            return False
    # No room for the new version: one old replica goes first, if the
    # deployment may be that far down and none is on its way out already.
    if not freeing and desired - len(ready & live) < down and ro.old_ids & live:
        _take_down(ctx, ro, "making room on a full fleet", now, out)
        return False
    why = ("waiting for a replacement's GPUs to be freed" if freeing
           else f"no room for a replica of {ro.new.version} and max_unavailable = {down}")
    if ro.waiting != why:
        ro.waiting = why
        out.event("rollout_waiting", level="warn", reason=f"deployment {model}: {why}")
    return False


def _pending(ctx: Context, ro: Rollout, out: Outcome) -> None:
    """
    Count the new replicas that became ready; one that went before it
    was ready fails the rollout.
    """
    st = ctx.state
    for rid in sorted(ro.pending):
        rep = st.replicas.get(rid)
        if rep is not None and rep.phase == Phase.ACTIVE and rid in st.ready[ro.model]:
            ro.pending.discard(rid)
            ro.updated = min(ro.total, ro.updated + 1)
            out.event("rollout_step", replica=rid,
                      reason=f"deployment {ro.model}: {ro.updated}/{ro.total} on {ro.new.version}")
        elif rep is None or rep.phase != Phase.ACTIVE:
            ro.pending.discard(rid)
            last = ctx.deps[ro.model].last_failure
            cause = ""
            if last is not None and last.replica == rid:
                cause = last.error or (f"exit code {last.exit_code}" if last.exit_code is not None else "")
                cause = cause or (f"signal {last.signal}" if last.signal is not None else "")
            fail(ctx, ro, f"new replica {rid} failed before it was ready" + (f": {cause}" if cause else ""),
                 out)


def fail(ctx: Context, ro: Rollout, reason: str, out: Outcome) -> None:
    if ro.state == RolloutState.FAILED:
        return
    ro.state, ro.reason = RolloutState.FAILED, reason
    out.event("rollout_failed", level="error", reason=f"deployment {ro.model}: {reason}; "
              f"{len(ro.old_ids)} replica(s) of {ro.old.version} kept")


def _take_down(ctx: Context, ro: Rollout, why: str, now: float, out: Outcome) -> None:
    """
    Retire one old replica: one not ready first, then the oldest.
    """
    st = ctx.state
    live = ro.old_ids & st.active[ro.model]
    ready = st.ready[ro.model]
    rid = min(live, key=lambda r: (r in ready, st.replicas[r].created_at, r))
    lifecycle.retire(ctx, st.replicas[rid], f"rollout of {ro.model} to {ro.new.version}: {why}", now, out)


# -- an operator's control ------------------------------------------------------------------


def _rollout(ctx: Context, model: str) -> Rollout:
    ro = ctx.rollouts.rollouts.get(model)
    if ro is None:
        err = AdminError(f"deployment {model} has had no rollout since the control plane started")
        err.status = 409
        raise err
    return ro


def pause(ctx: Context, model: str, out: Outcome) -> None:
    """
    Stop starting steps of C{model}'s rollout (one under way finishes);
    kept across restarts (L{RolloutBook.paused}).

    @raise AdminError: no rollout of C{model} is under way (409).
    """
    ro = _rollout(ctx, model)
    if ro.state != RolloutState.PROGRESSING:
        err = AdminError(f"the rollout of {model} is {ro.state}, not progressing: nothing to pause")
        err.status = 409
        raise err
    ro.state, ro.reason = RolloutState.PAUSED, "paused by an operator"
    ctx.rollouts.paused.add(model)
    out.event("rollout_paused", reason=f"deployment {model}: {ro.updated}/{ro.total} on {ro.new.version}")


def resume(ctx: Context, model: str, out: Outcome) -> None:
    """
    Go on with a paused rollout, or try a failed one again (its
    deployment's crash backoff and hold lifted).

    @raise AdminError: the rollout is neither paused nor failed (409).
    """
    ro = _rollout(ctx, model)
    ctx.rollouts.paused.discard(model)
    if ro.state not in (RolloutState.PAUSED, RolloutState.FAILED):
        err = AdminError(f"the rollout of {model} is {ro.state}: only a paused or failed one resumes")
        err.status = 409
        raise err
    if ro.state == RolloutState.FAILED:
        lifecycle.release(ctx, model, "its rollout was resumed", out)
    ro.state, ro.reason, ro.waiting = RolloutState.PROGRESSING, "", ""
    out.event("rollout_resumed", reason=f"deployment {model}: {ro.updated}/{ro.total} on {ro.new.version}")


def undo(ctx: Context, model: str, now: float, out: Outcome) -> Rollout | None:
    """
    Return C{model} to the spec its last rollout replaced, rolled the same
    way; new replicas are placed from it (pinned) until the catalog
    changes the deployment again.

    @raise AdminError: C{model} has had no rollout (409).
    """
    ro = _rollout(ctx, model)
    book = ctx.rollouts
    book.paused.discard(model)
    if ro.old == spec_of(ctx.catalog, model):
        book.pinned.pop(model, None)
    else:
        book.pinned[model] = ro.old
    lifecycle.release(ctx, model, "its rollout was undone", out)
    new = start(ctx, model, ro.new, ro.old, now, out, undo=not ro.undo)
    if new is None:
        # Nothing runs the version undone: keep the record, done.
        back = Rollout(model, ro.new, ro.old, total=0, started=now, state=RolloutState.DONE,
                       undo=not ro.undo)
        book.rollouts[model] = back
        out.event("rollout_done", reason=f"deployment {model}: nothing to replace, on {ro.old.version}")
        return back
    return new
