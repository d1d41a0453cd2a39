"""
Autoscaling (DESIGN §16) as a pure decision: (policy, memory, what is seen,
now) -> the desired replica count, the new memory, and the events that say
why. It never reads a clock, never touches the fleet state or a gateway;
the reconciler feeds it on every pass and applies the count it returns
through its ordinary scale path (placing up, draining down, DESIGN §6.6).

The rules, per autoscaled deployment:

  - The recommendation is C{ceil(load / target)}: with C{target_in_flight},
    load is the requests in flight plus those held in the gateways'
    admission queues; with C{target_waiting}, load is the queued requests
    plus the engines' own waiting figures. With both targets, the larger
    recommendation wins. While anything is in flight or waiting it is at
    least 1; it is always within C{[max(min_replicas, 1), max_replicas]}.
  - Up is at once: a recommendation over the count raises it in the same
    pass, from zero too (the first request held for a model at zero
    replicas asks for one).
  - Down is slow: only after the recommendation has stayed below the count
    for C{stabilization_s}, and never within C{stabilization_s} of the last
    scale up; it goes to the highest recommendation seen over that window.
  - To zero (only with C{min_replicas = 0}): after C{scale_to_zero_after_s}
    with nothing in flight and nothing waiting. That idleness is its own
    stabilization: it can only begin after the demand that caused the
    last scale up has gone.
  - Bounded by room: while replicas it asked for could not be placed (no
    free GPUs), the count is not raised further; one C{autoscale_capacity}
    event says so, not one per pass, and the count asked for stays so that
    the reconciler places the rest as soon as room frees.
  - Replicas found running over the count (adopted after a control plane
    restart, or left by a catalog reload) raise the count to them, within
    C{max_replicas}, and start the window afresh: autoscaling never drops
    capacity it did not decide to drop.
  - While the control plane settles (its adoption grace), nothing is
    scaled down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

#: Requests in flight (and queued) per replica when a deployment names no
#: target: a replica of a batching engine serves several requests at once,
#: and eight keeps each well inside its batch while one more replica is
#: asked for per eight concurrent requests.
DEFAULT_TARGET_IN_FLIGHT = 8.0
#: The stabilization window when a deployment names none, in seconds.
DEFAULT_STABILIZATION_S = 300.0
#: Idleness before scaling to zero when C{min_replicas = 0} names none.
DEFAULT_SCALE_TO_ZERO_AFTER_S = 300.0
#: Engine signals older than this are left out of the waiting figure (a
#: heartbeat carries them every 5 s; three missed and they are stale).
SIGNALS_STALE_AFTER_S = 15.0

#: The event kinds the decision emits.
UP, DOWN, TO_ZERO, CAPACITY, ADOPTED, BOUNDS = (
    "autoscale_up", "autoscale_down", "autoscale_to_zero", "autoscale_capacity",
    "autoscale_adopted", "autoscale_bounds",
)


@dataclass(frozen=True)
class AutoscalePolicy:
    """
    A deployment's autoscaling knobs (validated by the catalog): counts
    within C{[min_replicas, max_replicas]}, at least one target, seconds.
    """

    min_replicas: int
    max_replicas: int
    target_in_flight: float | None = None
    target_waiting: float | None = None
    scale_to_zero_after_s: float = DEFAULT_SCALE_TO_ZERO_AFTER_S
    stabilization_s: float = DEFAULT_STABILIZATION_S

    def bounded(self, min_replicas: int, max_replicas: int) -> AutoscalePolicy:
        """
        The same policy with other bounds (an operator's C{ctl scale}).
        """
        return replace(self, min_replicas=min_replicas, max_replicas=max_replicas)


@dataclass(frozen=True)
class Observed:
    """
    What the reconciler sees of one deployment on a pass.

    @ivar active: its replicas that count towards the desired count
        (placed, starting or ready; not draining).
    @ivar in_flight: requests being proxied to its replicas, all gateways.
    @ivar waiting: requests held in the gateways' admission queues.
    @ivar engine_waiting: the engines' own waiting figures summed over its
        replicas with fresh signals (0 when none export one).
    @ivar short: replicas of the count that could not be placed for want
        of room in the last pass (0 when all were, or none were missing).
    @ivar settling: the control plane is in its adoption grace.
    """

    active: int
    in_flight: int = 0
    waiting: int = 0
    engine_waiting: float = 0.0
    short: int = 0
    settling: bool = False

    @property
    def busy(self) -> bool:
        return self.in_flight > 0 or self.waiting > 0 or self.engine_waiting > 0


@dataclass(frozen=True)
class ScalerState:
    """
    What the decision remembers of a deployment between passes.

    @ivar desired: the count it holds.
    @ivar last_up_at: when it last scaled up (or adopted replicas).
    @ivar busy_at: the last time anything was in flight or waiting (or when
        it first looked).
    @ivar below_since: since when the recommendation has stayed below the
        count; C{None} when it is not below.
    @ivar peak: the highest recommendation since C{below_since}.
    @ivar capacity_noted: the want of room has been said (an event) and is
        not said again until it clears.
    """

    desired: int
    last_up_at: float | None = None
    busy_at: float | None = None
    below_since: float | None = None
    peak: int = 0
    capacity_noted: bool = False


@dataclass(frozen=True)
class ScaleEvent:
    """
    One decision and its reason, for the event log.
    """

    kind: str
    reason: str


@dataclass(frozen=True)
class Decision:
    desired: int
    state: ScalerState
    events: tuple[ScaleEvent, ...] = ()


def recommend(policy: AutoscalePolicy, seen: Observed) -> int:
    """
    How many replicas the load asks for now, within
    C{[max(min_replicas, 1), max_replicas]} (zero is decided by idleness,
    never recommended).
    """
    want = 1 if seen.busy else 0
    if policy.target_in_flight:
        want = max(want, math.ceil((seen.in_flight + seen.waiting) / policy.target_in_flight))
    if policy.target_waiting:
        want = max(want, math.ceil((seen.waiting + seen.engine_waiting) / policy.target_waiting))
    return max(max(policy.min_replicas, 1), min(policy.max_replicas, want))


def _load(seen: Observed) -> str:
    text = f"{seen.in_flight} in flight, {seen.waiting} queued"
    if seen.engine_waiting:
        text += f", {seen.engine_waiting:g} waiting in engines"
    return text


def _targets(policy: AutoscalePolicy) -> str:
    parts = []
    if policy.target_in_flight:
        parts.append(f"target {policy.target_in_flight:g} in flight per replica")
    if policy.target_waiting:
        parts.append(f"target {policy.target_waiting:g} waiting per replica")
    return " and ".join(parts)


def decide(policy: AutoscalePolicy, state: ScalerState, seen: Observed, now: float) -> Decision:
    """
    One pass's decision for one deployment. The caller keeps
    C{Decision.state} for the next pass and sets the desired count to
    C{Decision.desired}; every change of the count comes with an event.
    """
    events: list[ScaleEvent] = []
    cur = state.desired
    last_up = state.last_up_at
    busy_at = now if seen.busy or state.busy_at is None else state.busy_at
    below_since, peak = state.below_since, state.peak
    capacity_noted = state.capacity_noted and seen.short > 0

    if seen.active > cur:
        adopted = min(seen.active, policy.max_replicas)
        if adopted > cur:
            events.append(ScaleEvent(ADOPTED, f"{seen.active} replicas running, more than the {cur} "
                                              f"held; holding {adopted} (max {policy.max_replicas})"))
            cur, last_up, below_since, peak = adopted, now, None, 0
    if cur > policy.max_replicas:
        events.append(ScaleEvent(BOUNDS, f"from {cur} to {policy.max_replicas}: max_replicas is "
                                         f"{policy.max_replicas}"))
        cur, below_since, peak = policy.max_replicas, None, 0
    elif cur < policy.min_replicas:
        events.append(ScaleEvent(BOUNDS, f"from {cur} to {policy.min_replicas}: min_replicas is "
                                         f"{policy.min_replicas}"))
        cur, last_up, below_since, peak = policy.min_replicas, now, None, 0

    rec = recommend(policy, seen)
    if cur == 0:
        below_since, peak = None, 0
        if seen.busy:
            events.append(ScaleEvent(UP, f"from 0 to {rec}: {_load(seen)} with no replica"))
            cur, last_up = rec, now
    elif rec > cur:
        below_since, peak = None, 0
        if seen.short > 0:
            if not capacity_noted:
                events.append(ScaleEvent(CAPACITY, f"wants {rec} replicas ({_load(seen)}), holding "
                                                   f"{cur}: {seen.short} of them could not be placed "
                                                   f"for want of free GPUs"))
                capacity_noted = True
        else:
            events.append(ScaleEvent(UP, f"from {cur} to {rec}: {_load(seen)}, {_targets(policy)}"))
            cur, last_up = rec, now
    elif rec < cur and seen.short > 0 and max(rec, seen.active) < cur:
        # Lowering the count towards what runs takes nothing away: at once.
        new = max(rec, seen.active)
        events.append(ScaleEvent(DOWN, f"from {cur} to {new}: wants {rec} ({_load(seen)}); "
                                       f"the rest were never placed"))
        cur, below_since, peak = new, None, 0
    elif rec < cur and not seen.settling:
        if below_since is None:
            below_since, peak = now, rec
        peak = max(peak, rec)
        window = policy.stabilization_s
        if now - below_since >= window and (last_up is None or now - last_up >= window):
            new = max(peak, policy.min_replicas, 1)
            events.append(ScaleEvent(DOWN, f"from {cur} to {new}: {_load(seen)}, {_targets(policy)}, "
                                           f"below {cur} for {now - below_since:g}s"))
            cur, below_since, peak = new, None, 0
    else:
        below_since, peak = None, 0

    if (policy.min_replicas == 0 and cur > 0 and not seen.busy and not seen.settling
            and now - busy_at >= policy.scale_to_zero_after_s):
        events.append(ScaleEvent(TO_ZERO, f"from {cur} to 0: nothing in flight or queued for "
                                          f"{now - busy_at:g}s (scale_to_zero_after_s "
                                          f"{policy.scale_to_zero_after_s:g})"))
        cur, below_since, peak = 0, None, 0

    new_state = ScalerState(cur, last_up, busy_at, below_since, peak, capacity_noted)
    return Decision(cur, new_state, tuple(events))
