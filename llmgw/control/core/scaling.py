"""
Scale decisions (DESIGN §6.6) as functions of plain data: how far a
deployment is from its desired count, whether the replicas being moved off
(evacuating) may go, and which replicas a scale down takes. The reconciler
feeds them counts and, only when something is to be retired, the
candidates; they never touch the fleet state, a clock or a dispatcher.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Candidate:
    """
    A replica a scale down might take: whether it is ready, the most
    shards on any of its nodes, when it was made, and what its variant
    costs.
    """

    id: str
    ready: bool
    load: int
    created_at: float
    cost: float = 0.0


@dataclass(frozen=True, slots=True)
class ScaleStep:
    """
    What one pass does about one deployment's count.

    C{retire_evacuated}: the replicas being moved off are replaced (enough
    fresh ones are ready), so they all go. C{retire}: how many surplus
    replicas go (L{victims} picks them). C{place}: how many to place now
    (0 while placing is not allowed).
    """

    retire_evacuated: bool
    retire: int
    place: int
    #: Why nothing is placed although some are missing ("" when placing).
    blocked: str = ""


#: The step of a deployment at its count with nothing moved off: most
#: deployments, most passes (a step is immutable, so one serves them all).
AT_COUNT = ScaleStep(False, 0, 0)


def scale_step(
    desired: int,
    active: int,
    fresh_ready: int,
    evacuating: int,
    *,
    placing: bool,
    held: bool,
    backing_off: bool,
) -> ScaleStep:
    """
    @param desired: the deployment's desired replica count.
    @param active: its replicas that count towards it (not draining, not
        being moved off).
    @param fresh_ready: of those, how many are ready (the caller may pass 0
        when nothing is evacuating: only then does it matter).
    @param evacuating: its replicas being moved off.
    @param placing: placing is allowed at all (past the adoption grace, no
        bulk-loss freeze).
    @param held: the deployment is held (a configuration failure).
    @param backing_off: its crash backoff has not run out.
    """
    retire_evacuated = evacuating > 0 and fresh_ready >= desired
    surplus = active - desired
    if surplus >= 0:
        return ScaleStep(retire_evacuated, surplus, 0) if surplus or retire_evacuated else AT_COUNT
    why = ("" if placing and not held and not backing_off
           else "held" if held else "backing off" if backing_off else "not placing")
    return ScaleStep(retire_evacuated, 0, 0 if why else -surplus, why)


def victims(candidates: Iterable[Candidate], count: int) -> list[str]:
    """
    The C{count} replicas a scale down takes: not ready first, then the
    dearest variant's, then those on the most loaded nodes, then the
    newest; ties by id, so the same candidates in any order give the same
    answer.
    """
    if count <= 0:
        return []
    ordered = sorted(candidates, key=lambda c: (c.ready, -c.cost, -c.load, -c.created_at, c.id))
    return [c.id for c in ordered[:count]]
