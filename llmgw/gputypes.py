"""
GPU types (DESIGN §22): the labels a profile's C{gpu_types} and
C{prefer_gpu_types} name, matched against the model names nodes report
for their GPUs, and a deployment's C{variants} (profiles with a cost).

A GPU is of type T when T, ignoring case, is a run of whole words of its
name, words being split at spaces, C{-}, C{_} and C{/}: C{H100} is the
type of "NVIDIA H100 80GB HBM3", C{A100} of "NVIDIA A100-SXM4-80GB",
C{RTX 4090} of "NVIDIA GeForce RTX 4090"; C{L4} is not the type of
"NVIDIA L40S". Simulated GPUs take the name they are given
(C{--gpus sim:1x80GiB:H100}).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

_WORDS = re.compile(r"[\s\-_/]+")
#: What a type may be written with: letters, digits, and the separators
#: that split names into words.
_TYPE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._/\-]{0,63}$")
#: Most types one profile field may list, and variants one deployment.
MAX_TYPES = 16
MAX_VARIANTS = 16


def words(text: str) -> tuple[str, ...]:
    return tuple(w for w in _WORDS.split(text.strip().lower()) if w)


@functools.lru_cache(maxsize=4096)
def is_type(name: str, gpu_type: str) -> bool:
    """
    Whether a GPU called C{name} is of type C{gpu_type} (see the module's
    rule). Answers are cached: a fleet has few names and few types.
    """
    have, want = words(name), words(gpu_type)
    if not want or len(want) > len(have):
        return False
    n = len(want)
    return any(have[i:i + n] == want for i in range(len(have) - n + 1))


def matches(name: str, gpu_types: Iterable[str]) -> bool:
    """
    Whether a GPU called C{name} is of any of C{gpu_types}.
    """
    return any(is_type(name, t) for t in gpu_types)


def preference(name: str, prefer: Sequence[str]) -> int:
    """
    Where a GPU called C{name} stands in C{prefer}: the index of the first
    type it is of, or C{len(prefer)} when it is of none.
    """
    for i, t in enumerate(prefer):
        if is_type(name, t):
            return i
    return len(prefer)


def check_types(where: str, field: str, value: Any) -> tuple[str, ...]:
    """
    A profile's C{gpu_types} or C{prefer_gpu_types} as a tuple.

    @raise ValueError: not a list of up to L{MAX_TYPES} distinct type
        names; the message names C{where} and C{field}.
    """
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise ValueError(f"{where}: field {field!r} must be a list of GPU type names, not {value!r}")
    if field == "gpu_types" and not value:
        raise ValueError(f"{where}: field 'gpu_types' must name at least one GPU type (leave it out "
                         "for any type)")
    if len(value) > MAX_TYPES:
        raise ValueError(f"{where}: field {field!r} lists {len(value)} types; at most {MAX_TYPES}")
    seen: set[tuple[str, ...]] = set()
    for t in value:
        if not _TYPE.fullmatch(t):
            raise ValueError(f"{where}: field {field!r} has {t!r}, which is not a GPU type name "
                             "(letters, digits, spaces, '.', '-', '_', '/'; at most 64)")
        if words(t) in seen:
            raise ValueError(f"{where}: field {field!r} lists {t!r} twice")
        seen.add(words(t))
    return tuple(value)


@dataclass(frozen=True)
class Variant:
    """
    One way a deployment's replicas may run: a profile, and what a
    replica on it costs (any unit; only the order matters).
    """

    profile: str
    cost: float


def parse_variants(where: str, value: Any) -> tuple[Variant, ...]:
    """
    A deployment's C{variants} (a list of C{{profile = "...", cost = N}}
    tables), cheapest first; variants of equal cost keep their order.
    Whether each profile exists is the caller's to check.

    @raise ValueError: malformed; the message names C{where} and the
        variant.
    """
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: field 'variants' must be a non-empty list of "
                         "{profile = \"NAME\", cost = N} tables")
    if len(value) > MAX_VARIANTS:
        raise ValueError(f"{where}: field 'variants' lists {len(value)}; at most {MAX_VARIANTS}")
    out: list[Variant] = []
    for i, raw in enumerate(value):
        at = f"{where}: variants[{i}]"
        if not isinstance(raw, dict):
            raise ValueError(f"{at}: must be a table {{profile = \"NAME\", cost = N}}, not {raw!r}")
        unknown = set(raw) - {"profile", "cost"}
        if unknown:
            raise ValueError(f"{at}: unknown field {sorted(unknown)[0]!r} (known: cost, profile)")
        profile, cost = raw.get("profile"), raw.get("cost")
        if not isinstance(profile, str) or not profile:
            raise ValueError(f"{at}: field 'profile' is required (a profile's name)")
        if isinstance(cost, bool) or not isinstance(cost, int | float) or not (
                math.isfinite(cost) and cost >= 0):
            raise ValueError(f"{at}: field 'cost' must be a number of at least 0, not {cost!r}")
        if any(v.profile == profile for v in out):
            raise ValueError(f"{at}: profile {profile!r} is listed twice")
        out.append(Variant(profile, float(cost)))
    return tuple(sorted(out, key=lambda v: v.cost))
