"""
The demand the standalone gateways report (C{POST /api/v1/demand}), for
the autoscaler: each gateway's latest report per model, kept until it
expires, summed over the gateways.

A report replaces that gateway's previous one whole; a gateway that stops
reporting (gone, or cut off from the control plane) counts for nothing once
its report is older than C{expire_after} seconds. The number of gateways
held is bounded; past it the stalest report goes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from zope.interface import implementer

from llmgw.routing import Demand, IDemand

#: A report counts for this long after it arrived (gateways send one a second).
DEFAULT_EXPIRE_AFTER_S = 5.0
#: Most gateways whose reports are held at once.
MAX_GATEWAYS = 1024
#: Most models one report may carry.
MAX_MODELS = 10_000
#: Longest gateway id accepted.
MAX_GATEWAY_ID = 128
#: The most requests in flight or waiting one report may claim for a model
#: (a gateway holds at most its connection cap; this bounds a bad report).
MAX_FIGURE = 1_000_000


class DemandReportError(ValueError):
    """
    A demand report is malformed; the message says what was wrong.
    """


def parse_report(body: Any) -> tuple[str, dict[str, Demand]]:
    """
    The gateway id and figures of a C{POST /api/v1/demand} body,
    C{{"gateway_id": ID, "models": {MODEL: {"in_flight": N, "waiting": N}}}}.

    @raise DemandReportError: it is not that shape, or a figure is not a
        whole number of at least 0.
    """
    if not isinstance(body, dict):
        raise DemandReportError("the body must be a JSON object")
    unknown = sorted(set(body) - {"gateway_id", "models"})
    if unknown:
        raise DemandReportError(f"unknown field(s) {', '.join(map(repr, unknown[:5]))}; "
                                f'the body is {{"gateway_id": ID, "models": {{MODEL: {{"in_flight": N, '
                                f'"waiting": N}}}}}}')
    gateway = body.get("gateway_id")
    if not isinstance(gateway, str) or not gateway or len(gateway) > MAX_GATEWAY_ID or not gateway.isprintable():
        raise DemandReportError(f'"gateway_id" must be a printable string of 1 to {MAX_GATEWAY_ID} characters')
    models = body.get("models")
    if not isinstance(models, dict):
        raise DemandReportError('"models" must be an object of model -> {"in_flight": N, "waiting": N}')
    if len(models) > MAX_MODELS:
        raise DemandReportError(f'"models" holds {len(models)} models, more than {MAX_MODELS}')
    out: dict[str, Demand] = {}
    for model, figures in models.items():
        if not isinstance(figures, dict) or set(figures) - {"in_flight", "waiting"}:
            raise DemandReportError(f'model {model[:100]!r}: must be {{"in_flight": N, "waiting": N}}')
        values = []
        for key in ("in_flight", "waiting"):
            n = figures.get(key, 0)
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_FIGURE:
                raise DemandReportError(f"model {model[:100]!r}: {key!r} must be a whole number from 0 to "
                                        f"{MAX_FIGURE}, not {str(n)[:40]!r}")
            values.append(n)
        if values[0] or values[1]:
            out[model] = Demand(values[0], values[1])
    return gateway, out


@implementer(IDemand)
class InFlightDemand:
    """
    An L{IDemand} from a gateway router's in-flight counts (C{snapshot}:
    replica -> requests, only replicas with any) and C{model_of}, which
    names a replica's model (C{None} for one no longer known): what the
    embedded gateway offers until its router reports demand itself. Costs
    one step per busy replica, not one per replica.
    """

    def __init__(self, snapshot: Callable[[], Mapping[str, int]], model_of: Callable[[str], str | None]):
        self.snapshot = snapshot
        self.model_of = model_of

    def demand(self) -> dict[str, Demand]:
        sums: dict[str, int] = {}
        for rid, n in self.snapshot().items():
            model = self.model_of(rid)
            if model is not None and n > 0:
                sums[model] = sums.get(model, 0) + n
        return {m: Demand(n, 0) for m, n in sums.items()}


@dataclass(frozen=True)
class _Report:
    at: float
    models: Mapping[str, Demand]


class DemandBoard:
    """
    The gateways' latest reports. L{totals} is what the autoscaler reads.
    """

    def __init__(self, expire_after: float = DEFAULT_EXPIRE_AFTER_S, max_gateways: int = MAX_GATEWAYS):
        self.expire_after = expire_after
        self.max_gateways = max_gateways
        # Insertion order is report order: the first entry is the stalest.
        self._reports: dict[str, _Report] = {}

    def report(self, gateway_id: str, models: Mapping[str, Demand], now: float) -> None:
        """
        C{gateway_id}'s figures as of C{now}, replacing what it said before.
        """
        self._reports.pop(gateway_id, None)
        self._reports[gateway_id] = _Report(now, dict(models))
        while len(self._reports) > self.max_gateways:
            del self._reports[next(iter(self._reports))]

    def _expire(self, now: float) -> None:
        while self._reports:
            oldest = next(iter(self._reports))
            if now - self._reports[oldest].at <= self.expire_after:
                return
            del self._reports[oldest]

    def gateways(self, now: float) -> list[str]:
        """
        The gateways whose reports still count, sorted.
        """
        self._expire(now)
        return sorted(self._reports)

    def totals(self, now: float) -> dict[str, Demand]:
        """
        Each model's figures summed over the reports that still count.
        """
        self._expire(now)
        sums: dict[str, tuple[int, int]] = {}
        for rep in self._reports.values():
            for model, d in rep.models.items():
                f, w = sums.get(model, (0, 0))
                sums[model] = (f + d.in_flight, w + d.waiting)
        return {m: Demand(f, w) for m, (f, w) in sums.items()}
