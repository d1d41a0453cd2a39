"""
A failed shard, as the control plane keeps it (DESIGN §6.4): the
deployment's last failure, shown by the admin API; and what a failure
makes of its deployment (L{on_failure}), decided from data alone.

A failure of class C{config} (the engine refused its arguments, the model
was not found) would fail the same way on every retry, so its
deployment is held: nothing is placed for it until its profile changes on
a catalog reload or an operator asks for a retry. Every other class backs
off as before.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ShardFailure:
    node: str
    replica: str
    shard: str
    #: C{None} when no process exit was seen (a timeout, say).
    exit_code: int | None
    signal: int | None
    error: str
    last_output: str
    time: float
    #: What kind of crash this was, when a classifier has said (for example
    #: "oom"); "" when none has.
    crash_class: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


#: The crash class that holds its deployment instead of backing off.
HOLDING_CLASS = "config"


@dataclass(frozen=True, slots=True)
class Hold:
    """
    A deployment nothing is placed for, why, and since when.
    """

    reason: str
    crash_class: str
    since: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class FailureOutcome:
    """
    What to do with a deployment after one of its shards failed.

    C{hold}: the deployment's hold from now on (the one it had, a new one,
    or C{None}); C{new_hold}: whether it is new (worth an event);
    C{backoff}: whether the failure counts towards the crash backoff.
    """

    hold: Hold | None
    new_hold: bool
    backoff: bool


def on_failure(failure: ShardFailure, model: str, held: Hold | None, counts: bool) -> FailureOutcome:
    """
    Decide what C{failure} of a shard of C{model} (held already when
    C{held}) does to the deployment. C{counts}: the failure is the
    deployment's own (not, say, of a replica already on its way out), so
    it may back off or hold it.
    """
    if not counts:
        return FailureOutcome(held, False, False)
    if failure.crash_class == HOLDING_CLASS and held is None:
        detail = failure.error or (failure.last_output.strip().splitlines() or [""])[-1]
        reason = (f"deployment {model}: shard {failure.shard} failed with a configuration error"
                  + (f" ({detail})" if detail else "")
                  + "; nothing is placed until its profile changes or an operator retries")
        return FailureOutcome(Hold(reason, failure.crash_class, failure.time), True, True)
    return FailureOutcome(held, False, True)
