"""
A deployment's fields for sharing few GPUs among many models (DESIGN §22):
when its idle replicas sleep (C{sleep_after_s}), whether the control plane
may take its replicas to make room for another model (C{evictable}), in
which order (C{priority}: higher is more important, evicted last, and
placed first when demand exceeds the fleet), and how long a replica stays
once ready before it may be taken (C{min_resident_s}, against thrashing).
Kept apart from L{llmgw.control.core.catalog} for size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmgw import sleepmodes

#: The fields and their TOML types, for the catalog's type check.
FIELDS: dict[str, type | tuple[type, ...]] = {
    "sleep_after_s": (int, float),
    "evictable": bool,
    "priority": int,
    "min_resident_s": (int, float),
}
#: The profile field naming how deep its engine sleeps (0: never).
PROFILE_FIELD = "sleep_level"

#: A swapped-in replica's stay when the deployment names none, in seconds.
DEFAULT_MIN_RESIDENT_S = 60.0


@dataclass(frozen=True)
class Multiplex:
    """
    A deployment's sleeping and eviction rules; the defaults are a
    deployment that never sleeps and is never evicted.
    """

    #: Seconds with nothing running or waiting before a replica sleeps; 0: never.
    sleep_after_s: float = 0.0
    evictable: bool = False
    priority: int = 0
    min_resident_s: float = DEFAULT_MIN_RESIDENT_S


def check_profile(where: str, engine: str, level: int) -> None:
    """
    @raise ValueError: C{level} is out of range, or C{engine} cannot sleep.
    """
    if level == 0:
        return
    if not 0 <= level <= sleepmodes.MAX_LEVEL:
        raise ValueError(f"{where}: field 'sleep_level' must be 0 (never sleeps) to "
                         f"{sleepmodes.MAX_LEVEL}, not {level}")
    if sleepmodes.mode(engine) is None:
        raise ValueError(f"{where}: field 'sleep_level' needs an engine that sleeps "
                         f"({', '.join(sorted(sleepmodes.MODES))}), not {engine!r}")
    if level > 1 and engine != "vllm":
        raise ValueError(f"{where}: field 'sleep_level' {level} is vLLM's alone; {engine} sleeps at level 1")


def parse(where: str, raw: Mapping[str, Any], levels: Sequence[int],
          scale_to_zero_after_s: float | None) -> Multiplex:
    """
    The type-checked deployment entry C{raw}'s rules, given the sleep
    levels of the profiles it may run on and its scale-to-zero idleness
    (C{None}: it does not scale to zero).

    @raise ValueError: a field is out of range, or C{sleep_after_s} is
        given for a profile that does not sleep or is not before the
        scale to zero; the message names the field.
    """
    sleep_after = float(raw.get("sleep_after_s", 0.0))
    resident = float(raw.get("min_resident_s", DEFAULT_MIN_RESIDENT_S))
    for name, value in (("sleep_after_s", sleep_after), ("min_resident_s", resident)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{where}: field {name!r} must be 0 or more seconds, not {value!r}")
    if sleep_after > 0 and not all(levels):
        raise ValueError(f"{where}: field 'sleep_after_s' needs a profile with 'sleep_level' above 0 "
                         "(an engine that sleeps)")
    if sleep_after > 0 and scale_to_zero_after_s is not None and sleep_after >= scale_to_zero_after_s:
        raise ValueError(f"{where}: field 'sleep_after_s' ({sleep_after:g}) must come before "
                         f"'scale_to_zero_after_s' ({scale_to_zero_after_s:g})")
    if raw.get("evictable") and "max_replicas" not in raw:
        raise ValueError(f"{where}: field 'evictable' needs an autoscaled deployment (min_replicas and "
                         "max_replicas): a fixed count would put a taken replica straight back")
    return Multiplex(sleep_after_s=sleep_after, evictable=bool(raw.get("evictable", False)),
                     priority=int(raw.get("priority", 0)), min_resident_s=resident)
