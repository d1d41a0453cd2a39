"""
Tests for L{llmgw.gateway.metrics}: what a scrape shows of the counts and
histograms every request updates.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from twisted.trial.unittest import SynchronousTestCase

from llmgw.gateway.metrics import UNKNOWN_MODEL, GatewayMetrics


def make() -> tuple[CollectorRegistry, GatewayMetrics]:
    registry = CollectorRegistry()
    return registry, GatewayMetrics(registry, lambda: {"r1": 2})


class RequestCountTests(SynchronousTestCase):
    def test_counts_per_label_set(self) -> None:
        """
        Each (model, path, status) has its own
        C{llmgw_gateway_requests_total} series, counting its requests.
        """
        registry, m = make()
        for _ in range(3):
            m.count("demo", "/v1/chat/completions", 200)
        m.count("demo", "/v1/chat/completions", 502)
        m.count("other", "/v1/embeddings", 200)
        value = registry.get_sample_value
        labels = {"model": "demo", "path": "/v1/chat/completions", "status": "200"}
        self.assertEqual(value("llmgw_gateway_requests_total", labels), 3)
        self.assertEqual(value("llmgw_gateway_requests_total", dict(labels, status="502")), 1)
        self.assertEqual(
            value("llmgw_gateway_requests_total", {"model": "other", "path": "/v1/embeddings", "status": "200"}), 1
        )

    def test_answered_counts_and_observes(self) -> None:
        """
        L{GatewayMetrics.answered} is L{GatewayMetrics.count} and
        L{GatewayMetrics.observe} together: the same series, the same
        values, the model cap alike.
        """
        registry, m = make()
        other_registry, other = make()
        m.max_models = other.max_models = 2
        for model, seconds in (("demo", 0.2), ("demo", 3.0), ("b", 0.01), ("c", 1.0), ("d", 0.5)):
            m.answered(model, "/v1/completions", 200, seconds)
            other.count(model, "/v1/completions", 200)
            other.observe(model, seconds)
        self.assertEqual(generate_latest(registry), generate_latest(other_registry))
        value = registry.get_sample_value
        self.assertEqual(value("llmgw_gateway_request_duration_seconds_count", {"model": "demo"}), 2)
        self.assertEqual(
            value("llmgw_gateway_requests_total", {"model": UNKNOWN_MODEL, "path": "/v1/completions", "status": "200"}),
            2,
        )

    def test_model_cap(self) -> None:
        """
        Past C{max_models} labels, requests of further models count under
        the unknown label, and do not grow the series.
        """
        registry = CollectorRegistry()
        m = GatewayMetrics(registry, dict, max_models=2)
        for i in range(50):
            m.count(f"m{i}", "/v1/completions", 200)
            m.observe(f"m{i}", 0.01)
        families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
        models = {s.labels["model"] for s in families["llmgw_gateway_requests"].samples}
        self.assertEqual(len(models), 3)
        self.assertIn(UNKNOWN_MODEL, models)
        self.assertEqual(
            registry.get_sample_value(
                "llmgw_gateway_requests_total", {"model": UNKNOWN_MODEL, "path": "/v1/completions", "status": "200"}
            ),
            48,
        )
        self.assertEqual(
            registry.get_sample_value("llmgw_gateway_request_duration_seconds_count", {"model": UNKNOWN_MODEL}), 48
        )

    def test_name_taken(self) -> None:
        """
        Registering the gateway's metrics in a registry that already has a
        metric of the same name fails, as with prometheus_client's own.
        """
        registry = CollectorRegistry()
        Counter("llmgw_gateway_requests", "taken", registry=registry)
        self.assertRaises(ValueError, GatewayMetrics, registry, dict)


class HistogramTests(SynchronousTestCase):
    def test_buckets_sum_count(self) -> None:
        """
        An observation counts in every bucket whose bound is at least it
        (a value equal to a bound included), in C{+Inf}, the count and the
        sum, for latency and time to first byte alike.
        """
        registry, m = make()
        for seconds in (0.0002, 0.001, 0.003, 400.0):
            m.observe("demo", seconds)
        m.first_byte("demo", 0.02)
        value = registry.get_sample_value
        name = "llmgw_gateway_request_duration_seconds"
        self.assertEqual(value(name + "_bucket", {"model": "demo", "le": "0.0005"}), 1)
        self.assertEqual(value(name + "_bucket", {"model": "demo", "le": "0.001"}), 2)
        self.assertEqual(value(name + "_bucket", {"model": "demo", "le": "0.0025"}), 2)
        self.assertEqual(value(name + "_bucket", {"model": "demo", "le": "0.005"}), 3)
        self.assertEqual(value(name + "_bucket", {"model": "demo", "le": "300.0"}), 3)
        self.assertEqual(value(name + "_bucket", {"model": "demo", "le": "+Inf"}), 4)
        self.assertEqual(value(name + "_count", {"model": "demo"}), 4)
        self.assertAlmostEqual(value(name + "_sum", {"model": "demo"}), 400.0042)
        ttfb = "llmgw_gateway_time_to_first_byte_seconds"
        self.assertEqual(value(ttfb + "_bucket", {"model": "demo", "le": "0.01"}), 0)
        self.assertEqual(value(ttfb + "_bucket", {"model": "demo", "le": "0.025"}), 1)
        self.assertEqual(value(ttfb + "_count", {"model": "demo"}), 1)

    def test_exposition(self) -> None:
        """
        The text exposition parses, with the histogram typed as one and
        the in-flight gauge beside it.
        """
        registry, m = make()
        m.observe("demo", 0.01)
        m.count("demo", "/v1/completions", 200)
        families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
        self.assertEqual(families["llmgw_gateway_request_duration_seconds"].type, "histogram")
        self.assertEqual(families["llmgw_gateway_requests"].type, "counter")
        self.assertEqual(families["llmgw_gateway_in_flight"].samples[0].value, 2)
