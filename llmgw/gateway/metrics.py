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

#: Label for the model of a request whose model no deployment serves, so
#: that clients cannot grow the label set without bound.
UNKNOWN_MODEL = "_unknown"

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
    def __init__(self, registry: CollectorRegistry, in_flight: Callable[[], dict[str, int]]):
        self.registry = registry
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

    # The labelled children are cached: .labels() takes a lock and builds a
    # tuple each call, which shows at thousands of requests a second.

    def count(self, model: str, path: str, status: int) -> None:
        key = (model, path, str(status))
        child = self._requests_children.get(key)
        if child is None:
            child = self._requests_children[key] = self.requests.labels(*key)
        child.inc()

    def observe(self, model: str, seconds: float) -> None:
        child = self._latency_children.get(model)
        if child is None:
            child = self._latency_children[model] = self.latency.labels(model)
        child.observe(seconds)

    def first_byte(self, model: str, seconds: float) -> None:
        child = self._ttfb_children.get(model)
        if child is None:
            child = self._ttfb_children[model] = self.ttfb.labels(model)
        child.observe(seconds)
