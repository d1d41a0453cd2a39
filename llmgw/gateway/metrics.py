"""
The gateway's Prometheus metrics.

They are registered in a registry the caller owns: the control plane's
(served by its admin API) or the standalone gateway's own.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import ClassVar, Final

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from twisted.logger import Logger

#: Label for the model of a request whose model the routing table does not
#: know, so that clients cannot grow the label set without bound.
UNKNOWN_MODEL: Final = "_unknown"
#: Most distinct model labels; past it every new model counts as unknown.
#: Callers label only models the routing table knows, so this is a
#: backstop, far above any catalog's size.
MAX_MODEL_LABELS: Final = 2000

# Not Final: compiled, mypyc (2.4) leaves a Final tuple of numbers unset
# for the module's own code that reads it below.
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)
LATENCY_BOUNDS: Final = tuple([float(b) for b in LATENCY_BUCKETS])


class _InFlightCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, int]]):
        self._snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily(
            "llmgw_gateway_in_flight",
            "Requests being proxied now, per replica",
            labels=["replica"],
        )
        for replica, n in sorted(self._snapshot().items()):
            g.add_metric([replica], n)
        yield g


class _RequestCounts(Collector):
    """
    C{llmgw_gateway_requests_total}, kept as plain integers per label set:
    a C{prometheus_client} counter takes a lock per increment, which shows
    at thousands of requests a second. Read by a scrape (in the web
    server's thread) from a copy.
    """

    def __init__(self, name: str, documentation: str, labels: list[str]):
        self.name = name
        self.documentation = documentation
        self.labels = labels
        #: label values -> count
        self.counts: dict[tuple[str, ...], int] = {}

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.documentation, labels=self.labels)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labels)
        for labels, n in sorted(list(self.counts.items())):
            family.add_metric(labels, n)
        yield family


class _Histograms(Collector):
    """
    A histogram per model label, kept as plain lists: per label, the count
    of each bucket (not cumulative; the last one is C{+Inf}) and then the
    sum. An observation (L{GatewayMetrics.observe}) is a bisection and two
    additions, where a
    C{prometheus_client} histogram takes a lock per bucket and per sum.
    """

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]):
        self.name = name
        self.documentation = documentation
        self.bounds = tuple(float(b) for b in buckets)
        self._le = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        #: model label -> bucket counts and the sum
        self.series: dict[str, list[float]] = {}

    def new_series(self, label: str) -> list[float]:
        series = self.series.get(label)
        if series is None:
            series = self.series[label] = [0] * (len(self.bounds) + 1) + [0.0]
        return series

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=["model"])

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model"])
        for label, series in sorted(list(self.series.items())):
            counts = list(series)
            cumulative = []
            total = 0.0
            for le, n in zip(self._le, counts[:-1], strict=True):
                total += n
                cumulative.append((le, total))
            family.add_metric([label], cumulative, counts[-1])
        yield family


class GatewayMetrics:
    """
    The gateway's metrics. Model labels are what callers pass, which must
    be models the routing table knows or L{UNKNOWN_MODEL}; at most
    C{max_models} distinct ones are kept, the rest count as unknown.
    """

    # Named, and a ClassVar (setup.py's rules for compiled classes).
    log: ClassVar[Logger] = Logger(namespace=f"{__name__}.GatewayMetrics")

    def __init__(
        self,
        registry: CollectorRegistry,
        in_flight: Callable[[], dict[str, int]],
        max_models: int = MAX_MODEL_LABELS,
    ):
        self.registry = registry
        self.max_models = max_models
        self._models: set[str] = {UNKNOWN_MODEL}
        self._full_warned = False
        # The three metrics every request touches are plain counts (see
        # _RequestCounts, _Histograms); the rarer ones are prometheus_client's.
        self.requests = _RequestCounts(
            "llmgw_gateway_requests",
            "Requests answered by the gateway, by model, path and HTTP status",
            ["model", "path", "status"],
        )
        self.latency = _Histograms(
            "llmgw_gateway_request_duration_seconds",
            "Time from a request's arrival to the end of its response, by model",
            LATENCY_BUCKETS,
        )
        self.ttfb = _Histograms(
            "llmgw_gateway_time_to_first_byte_seconds",
            "Time from a request's arrival to the response headers going out, by model",
            LATENCY_BUCKETS,
        )
        for collector in (self.requests, self.latency, self.ttfb):
            registry.register(collector)
        self.retries = Counter(
            "llmgw_gateway_retries",
            "Requests sent to another replica (or again) after a connection failure",
            ["model", "reason"],
            registry=registry,
        )
        self.cooldowns = Counter(
            "llmgw_gateway_replica_cooldowns",
            "Times a replica was taken out of rotation after repeated failures",
            ["replica"],
            registry=registry,
        )
        self.client_disconnects = Counter(
            "llmgw_gateway_client_disconnects",
            "Requests whose client went away before the response was complete",
            ["model"],
            registry=registry,
        )
        registry.register(_InFlightCollector(in_flight))
        #: (model, path, status) as the caller gave them -> the label values
        self._request_keys: dict[tuple[str, str, int], tuple[str, str, str]] = {}
        self._latency_children: dict[str, list[float]] = {}
        self._ttfb_children: dict[str, list[float]] = {}

    def model_label(self, model: str) -> str:
        """
        C{model} as a label: itself while fewer than C{max_models} models
        have labels, else L{UNKNOWN_MODEL} for a model not seen before.
        """
        if model in self._models:
            return model
        if len(self._models) > self.max_models:
            if not self._full_warned:
                self._full_warned = True
                self.log.warn(
                    "gateway metrics: {n} models already have labels; further models are "
                    "counted as {unknown}",
                    n=self.max_models,
                    unknown=UNKNOWN_MODEL,
                )
            return UNKNOWN_MODEL
        self._models.add(model)
        return model

    # Each caller's model maps to its series once (the label check, a
    # dictionary lookup on every later request).

    def _labels(self, key: tuple[str, str, int]) -> tuple[str, str, str]:
        # A request series' first sight: its labels, kept while they are few.
        model, path, status = key
        labels = (self.model_label(model), path, str(status))
        if len(self._request_keys) < 4 * self.max_models:
            self._request_keys[key] = labels
        return labels

    def _series(self, histogram: _Histograms, children: dict[str, list[float]], model: str) -> list[float]:
        # A model's series of C{histogram} at its first sight (kept in
        # C{children} unless it was counted as the unknown model).
        label = self.model_label(model)
        series = histogram.new_series(label)
        if label == model:
            children[model] = series
        return series

    def count(self, model: str, path: str, status: int) -> None:
        key = (model, path, status)
        labels = self._request_keys.get(key) or self._labels(key)
        counts = self.requests.counts
        counts[labels] = counts.get(labels, 0) + 1

    def observe(self, model: str, seconds: float) -> None:
        series = self._latency_children.get(model) or self._series(self.latency, self._latency_children, model)
        series[bisect_left(LATENCY_BOUNDS, seconds)] += 1
        series[-1] += seconds

    def answered(self, model: str, path: str, status: int, seconds: float) -> None:
        """
        L{count} and L{observe} in one call: a request answered with
        C{status} after C{seconds}.
        """
        key = (model, path, status)
        labels = self._request_keys.get(key) or self._labels(key)
        counts = self.requests.counts
        counts[labels] = counts.get(labels, 0) + 1
        series = self._latency_children.get(model) or self._series(self.latency, self._latency_children, model)
        series[bisect_left(LATENCY_BOUNDS, seconds)] += 1
        series[-1] += seconds

    def first_byte(self, model: str, seconds: float) -> None:
        series = self._ttfb_children.get(model) or self._series(self.ttfb, self._ttfb_children, model)
        series[bisect_left(LATENCY_BOUNDS, seconds)] += 1
        series[-1] += seconds

    def retry(self, model: str, reason: str) -> None:
        self.retries.labels(self.model_label(model), reason).inc()

    def client_disconnect(self, model: str) -> None:
        self.client_disconnects.labels(self.model_label(model)).inc()
