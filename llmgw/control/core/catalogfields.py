"""
Parts of the catalog's validation (L{llmgw.control.core.catalog}) kept
apart for size: the error it raises, a deployment's autoscaling fields
and its C{variants} (profiles with a cost, L{llmgw.gputypes}).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from llmgw import gputypes
from llmgw.control.core.autoscale import (
    DEFAULT_SCALE_TO_ZERO_AFTER_S,
    DEFAULT_STABILIZATION_S,
    DEFAULT_TARGET_IN_FLIGHT,
    AutoscalePolicy,
)

#: The fields that make a deployment autoscaled.
AUTOSCALE_FIELDS = ("min_replicas", "max_replicas", "target_in_flight", "target_waiting",
                    "scale_to_zero_after_s", "stabilization_s")


class CatalogError(ValueError):
    """
    A catalog was refused. The message names the entry and the field.
    """


def positive(where: str, name: str, value: int, minimum: int = 1) -> None:
    if value < minimum:
        raise CatalogError(f"{where}: field {name!r} must be at least {minimum}, not {value}")


def parse_variant_fields(where: str, raw: Mapping[str, Any], profiles: Mapping[str, object]
                         ) -> tuple[gputypes.Variant, ...]:
    """
    A type-checked deployment entry's C{variants} (empty when it gives
    C{profile}), each naming a profile of C{profiles}.

    @raise CatalogError: neither or both of C{profile} and C{variants}, or
        a variant or profile that is malformed or names no profile.
    """
    known = f"profiles: {', '.join(sorted(profiles)) or 'none'}"
    if "variants" not in raw:
        if not raw.get("profile"):
            raise CatalogError(f"{where}: field 'profile' is required (or 'variants')")
        if raw["profile"] not in profiles:
            raise CatalogError(f"{where}: field 'profile' names {raw['profile']!r}, which is not a profile ({known})")
        return ()
    if "profile" in raw:
        raise CatalogError(f"{where}: fields 'profile' and 'variants' exclude each other (a variant "
                           "names its profile)")
    try:
        variants = gputypes.parse_variants(where, raw["variants"])
    except ValueError as e:
        raise CatalogError(str(e)) from None
    for v in variants:
        if v.profile not in profiles:
            raise CatalogError(f"{where}: field 'variants' names {v.profile!r}, which is not a profile ({known})")
    return variants


def parse_autoscale(where: str, raw: Mapping[str, Any]) -> AutoscalePolicy | None:
    """
    The autoscaling policy of a deployment entry whose fields were
    type-checked, or C{None} when it names none of L{AUTOSCALE_FIELDS}.
    An entry that names no target gets C{target_in_flight =}
    L{DEFAULT_TARGET_IN_FLIGHT}.

    @raise CatalogError: the fields contradict each other or are out of
        range; the message names the field.
    """
    given = [k for k in AUTOSCALE_FIELDS if k in raw]
    if not given:
        return None
    if "replicas" in raw:
        raise CatalogError(
            f"{where}: field 'replicas' fixes the replica count, but {', '.join(map(repr, given))} "
            f"make the deployment autoscaled; give 'min_replicas' and 'max_replicas' instead of 'replicas'"
        )
    if "max_replicas" not in raw:
        raise CatalogError(f"{where}: field 'max_replicas' is required when the deployment autoscales")
    low, high = raw.get("min_replicas", 1), raw["max_replicas"]
    positive(where, "min_replicas", low, 0)
    positive(where, "max_replicas", high, 1)
    if high < low:
        raise CatalogError(f"{where}: field 'max_replicas' ({high}) is below 'min_replicas' ({low})")
    for key in ("target_in_flight", "target_waiting"):
        value = raw.get(key)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise CatalogError(f"{where}: field {key!r} must be a number above 0, not {value!r}")
    if "scale_to_zero_after_s" in raw and low != 0:
        raise CatalogError(
            f"{where}: field 'scale_to_zero_after_s' applies only with min_replicas = 0 "
            f"(min_replicas is {low})"
        )
    idle = raw.get("scale_to_zero_after_s", DEFAULT_SCALE_TO_ZERO_AFTER_S)
    window = raw.get("stabilization_s", DEFAULT_STABILIZATION_S)
    for key, value, least in (("scale_to_zero_after_s", idle, 1), ("stabilization_s", window, 0)):
        if not (math.isfinite(value) and value >= least):
            raise CatalogError(f"{where}: field {key!r} must be a number of seconds of at least {least}, "
                               f"not {value!r}")
    # Without a target, DEFAULT_TARGET_IN_FLIGHT requests in flight per replica.
    in_flight = raw.get("target_in_flight", None if "target_waiting" in raw else DEFAULT_TARGET_IN_FLIGHT)
    return AutoscalePolicy(
        min_replicas=low, max_replicas=high,
        target_in_flight=float(in_flight) if in_flight is not None else None,
        target_waiting=float(raw["target_waiting"]) if "target_waiting" in raw else None,
        scale_to_zero_after_s=float(idle), stabilization_s=float(window),
    )
