"""
The gateway's Prometheus metrics.

They are registered in a registry the caller owns: the control plane's
(served by its admin API) or the standalone gateway's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from twisted.logger import Logger

#: Label for the model of a request whose model the routing table does not
#: know, so that clients cannot grow the label set without bound.
UNKNOWN_MODEL = "_unknown"
#: Most distinct model labels; past it every new model counts as unknown.
#: Callers label only models the routing table knows, so this is a
#: backstop, far above any catalog's size.
MAX_MODEL_LABELS = 2000

LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)


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


class GatewayMetrics:
    """
    The gateway's metrics. Model labels are what callers pass, which must
    be models the routing table knows or L{UNKNOWN_MODEL}; at most
    C{max_models} distinct ones are kept, the rest count as unknown.
    """

    log = Logger()

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
        self.requests = Counter(
            "llmgw_gateway_requests",
            "Requests answered by the gateway, by model, path and HTTP status",
            ["model", "path", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "llmgw_gateway_request_duration_seconds",
            "Time from a request's arrival to the end of its response, by model",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.ttfb = Histogram(
            "llmgw_gateway_time_to_first_byte_seconds",
            "Time from a request's arrival to the response headers going out, by model",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
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
        self._requests_children: dict[tuple[str, str, str], Counter] = {}
        self._latency_children: dict[str, Histogram] = {}
        self._ttfb_children: dict[str, Histogram] = {}

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

    # The labelled children are cached: .labels() takes a lock and builds a
    # tuple each call, which shows at thousands of requests a second.

    def count(self, model: str, path: str, status: int) -> None:
        key = (model, path, str(status))
        child = self._requests_children.get(key)
        if child is None:
            key = (self.model_label(model), path, key[2])
            child = self._requests_children.get(key)
            if child is None:
                child = self._requests_children[key] = self.requests.labels(*key)
        child.inc()

    def observe(self, model: str, seconds: float) -> None:
        child = self._latency_children.get(model)
        if child is None:
            label = self.model_label(model)
            child = self._latency_children.get(label)
            if child is None:
                child = self._latency_children[label] = self.latency.labels(label)
        child.observe(seconds)

    def first_byte(self, model: str, seconds: float) -> None:
        child = self._ttfb_children.get(model)
        if child is None:
            label = self.model_label(model)
            child = self._ttfb_children.get(label)
            if child is None:
                child = self._ttfb_children[label] = self.ttfb.labels(label)
        child.observe(seconds)

    def retry(self, model: str, reason: str) -> None:
        self.retries.labels(self.model_label(model), reason).inc()

    def client_disconnect(self, model: str) -> None:
        self.client_disconnects.labels(self.model_label(model)).inc()
