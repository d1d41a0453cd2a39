"""
Tests for L{llmgw.control.shell.metrics}: the control plane's Prometheus metrics,
read at scrape time.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from twisted.logger import Logger
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.shell.metrics import (
    NODE_STATES,
    SHARD_STATES,
    ControlCollector,
    make_registry,
    register_control_metrics,
)
from llmgw.control.state.inventory import Node, StrayProcess
from llmgw.control.state.modelindex import CachedCopy
from llmgw.testing.fleet import FakeAgents, FakeFleet, sample_fleet


def scrape(registry: Any) -> dict[str, Any]:
    """
    The registry's text exposition, parsed back: family name to family.
    """
    text = generate_latest(registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def by_label(family: Any, label: str, suffix: str = "") -> dict[str, float]:
    return {
        s.labels[label]: s.value for s in family.samples if s.name == family.name + suffix
    }


class SnapshotFleet:
    """
    A fleet whose C{metrics_snapshot()} answers whatever the test sets.
    """

    def __init__(self, snapshot: Any) -> None:
        self.snapshot = snapshot

    def metrics_snapshot(self) -> Any:
        if isinstance(self.snapshot, Exception):
            raise self.snapshot
        return self.snapshot


class AgentMetricsTests(SynchronousTestCase):
    def test_read_at_scrape_time(self) -> None:
        """
        The agent service's counters and connected nodes are read when
        scraped: a change after registration shows in the next scrape.
        """
        agents = FakeAgents(["a"])
        registry = make_registry()
        register_control_metrics(registry, agents)
        self.assertEqual(registry.get_sample_value("llmgw_agents_connected"), 1)
        agents.nodes.append("b")
        agents.registrations["ok"] += 2
        agents.registrations["bad_identity"] += 1
        agents.dispatch_refusals["not_connected"] += 4
        families = scrape(registry)
        self.assertEqual(families["llmgw_agents_connected"].samples[0].value, 2)
        self.assertEqual(families["llmgw_agent_connections_open"].samples[0].value, 2)
        self.assertEqual(
            by_label(families["llmgw_agent_registrations"], "outcome", "_total"),
            {"ok": 2, "bad_identity": 1},
        )
        self.assertEqual(
            by_label(families["llmgw_dispatch_refusals"], "reason", "_total"), {"not_connected": 4}
        )

    def test_without_fleet(self) -> None:
        """
        Without a reconciler only the agent metrics (the strays among them)
        are served.
        """
        registry = make_registry()
        register_control_metrics(registry, FakeAgents(), lambda: None)
        names = set(scrape(registry))
        self.assertEqual(
            names,
            {"llmgw_agents_connected", "llmgw_agent_connections_open",
             "llmgw_agent_registrations", "llmgw_dispatch_refusals", "llmgw_node_stray_processes",
             "llmgw_model_cache_bytes", "llmgw_model_cached", "llmgw_node_gpu_memory_used_bytes",
             "llmgw_node_gpu_memory_total_bytes"},
        )


class FleetMetricsTests(SynchronousTestCase):
    def test_states_and_events(self) -> None:
        """
        Nodes, shards and replicas by state come from the snapshot, with a
        zero sample for every known state that is empty; events by kind are
        a counter.
        """
        fleet = sample_fleet()
        registry = make_registry()
        register_control_metrics(registry, FakeAgents(), lambda: fleet)
        families = scrape(registry)
        nodes = by_label(families["llmgw_nodes"], "state")
        self.assertEqual(set(nodes), set(NODE_STATES))
        self.assertEqual(nodes, {"ready": 1, "suspect": 1, "lost": 0})
        shards = by_label(families["llmgw_shards"], "state")
        self.assertEqual(set(shards), set(SHARD_STATES))
        self.assertEqual(shards["ready"], 1)
        self.assertEqual(by_label(families["llmgw_replicas"], "state")["ready"], 1)
        self.assertEqual(
            by_label(families["llmgw_events"], "kind", "_total"), {"placed": 1, "shard_failed": 1}
        )
        self.assertEqual(families["llmgw_replacements_frozen"].samples[0].value, 0)

    def test_pass_duration(self) -> None:
        """
        The last pass's duration is a gauge, and passes with their summed
        duration are a summary.
        """
        registry = make_registry()
        fleet = SnapshotFleet({"last_pass_seconds": 0.004, "passes": 10, "pass_seconds_total": 0.05})
        register_control_metrics(registry, FakeAgents(), lambda: fleet)
        self.assertEqual(registry.get_sample_value("llmgw_reconcile_last_pass_seconds"), 0.004)
        self.assertEqual(registry.get_sample_value("llmgw_reconcile_pass_seconds_count"), 10)
        self.assertEqual(registry.get_sample_value("llmgw_reconcile_pass_seconds_sum"), 0.05)
        fleet.snapshot = {"last_pass_seconds": None, "passes": 0}
        self.assertIsNone(registry.get_sample_value("llmgw_reconcile_last_pass_seconds"))
        self.assertEqual(registry.get_sample_value("llmgw_reconcile_passes_total"), 0)

    def test_fleet_attached_later(self) -> None:
        """
        The fleet is looked up at each scrape, so one attached after the
        collector is seen.
        """
        holder: dict[str, Any] = {}
        registry = make_registry()
        register_control_metrics(registry, FakeAgents(), lambda: holder.get("fleet"))
        self.assertIsNone(registry.get_sample_value("llmgw_nodes", {"state": "ready"}))
        holder["fleet"] = sample_fleet()
        self.assertEqual(registry.get_sample_value("llmgw_nodes", {"state": "ready"}), 1)

    def test_broken_entries_dropped(self) -> None:
        """
        Counts that are not finite numbers are left out; the rest of the
        scrape goes on.
        """
        fleet = SnapshotFleet({
            "nodes": {"ready": 2, "suspect": float("nan"), "lost": "many", "weird": True},
            "shards": ["not", "a", "mapping"],
            "last_pass_seconds": float("inf"),
            "replacements_frozen": "yes",
        })
        registry = make_registry()
        register_control_metrics(registry, FakeAgents(), lambda: fleet)
        families = scrape(registry)
        self.assertEqual(by_label(families["llmgw_nodes"], "state"), {"ready": 2, "suspect": 0, "lost": 0})
        self.assertEqual(set(by_label(families["llmgw_shards"], "state").values()), {0})
        self.assertNotIn("llmgw_reconcile_last_pass_seconds", families)
        self.assertNotIn("llmgw_replacements_frozen", families)

    def test_snapshot_failure(self) -> None:
        """
        A snapshot that raises, or is not a mapping, leaves the fleet
        metrics out of that scrape (logged) and the agent metrics in.
        """
        fleet = SnapshotFleet(RuntimeError("boom"))
        collector = ControlCollector(FakeAgents(["a"]), lambda: fleet)
        logged: list[dict[str, Any]] = []
        collector.log = Logger(observer=logged.append)  # type: ignore[arg-type]
        registry = make_registry()
        registry.register(collector)
        families = scrape(registry)
        self.assertIn("llmgw_agents_connected", families)
        self.assertNotIn("llmgw_nodes", families)
        self.assertIsInstance(logged[0]["log_failure"].value, RuntimeError)
        fleet.snapshot = ["nodes"]
        families = scrape(registry)
        self.assertIn("llmgw_agents_connected", families)
        self.assertIn("not a mapping", logged[-1]["log_format"])

    def test_frozen(self) -> None:
        """
        Frozen replacements show as 1.
        """
        fleet = FakeFleet()
        fleet.frozen = True
        registry = make_registry()
        register_control_metrics(registry, FakeAgents(), lambda: fleet)
        self.assertEqual(registry.get_sample_value("llmgw_replacements_frozen"), 1)


class RegistryTests(SynchronousTestCase):
    def test_registries_are_separate(self) -> None:
        """
        Two control planes' registries do not share samples, and a metric
        another part adds to one registry (as the gateway will) appears only
        there, beside the control plane's.
        """
        a, b = make_registry(), make_registry()
        register_control_metrics(a, FakeAgents(["x"]))
        register_control_metrics(b, FakeAgents(["x", "y"]))
        requests = Counter("llmgw_gateway_requests", "Gateway requests", ["model"], registry=a)
        requests.labels("demo").inc()
        self.assertEqual(a.get_sample_value("llmgw_agents_connected"), 1)
        self.assertEqual(b.get_sample_value("llmgw_agents_connected"), 2)
        self.assertEqual(a.get_sample_value("llmgw_gateway_requests_total", {"model": "demo"}), 1)
        self.assertIsNone(b.get_sample_value("llmgw_gateway_requests_total", {"model": "demo"}))


class TLSMetricsTests(SynchronousTestCase):
    def test_expiry(self) -> None:
        """
        Expiry dates of the CA, server certificate, CRL and the earliest agent
        certificate are gauges; agents expiring within 30 days are counted.
        """
        now = 1_800_000_000.0
        snap = {
            "ca_not_after": now + 3650 * 86400,
            "server_not_after": now + 365 * 86400,
            "crl_next_update": None,
            "earliest_agent_not_after": now + 86400,
            "agents_not_after": {"a": now + 86400, "b": now + 100 * 86400},
        }
        registry = make_registry()
        registry.register(ControlCollector(FakeAgents([]), None, lambda: snap, clock=lambda: now))
        families = scrape(registry)
        expiry = by_label(families["llmgw_tls_expiry_timestamp_seconds"], "certificate")
        self.assertEqual(expiry, {
            "ca": now + 3650 * 86400, "server": now + 365 * 86400,
            "earliest_agent": now + 86400,
        })
        soon = families["llmgw_agent_certificates_expiring_soon"].samples[0].value
        self.assertEqual(soon, 1)

    def test_no_tls(self) -> None:
        """
        Without TLS there are no expiry metrics.
        """
        registry = make_registry()
        registry.register(ControlCollector(FakeAgents([]), None, lambda: {}))
        self.assertNotIn("llmgw_tls_expiry_timestamp_seconds", scrape(registry))


class LimitMetricsTests(SynchronousTestCase):
    def test_limiter(self) -> None:
        """
        The agent port's refusals before TLS, connections registering, and
        the admission gate's state are exported.
        """
        import collections

        class Limiter:
            refused = collections.Counter({"per_address": 3})
            registering = 7
            paused = True
            pauses = 2

        registry = make_registry()
        registry.register(ControlCollector(FakeAgents([]), None, None, limiter=lambda: Limiter()))
        families = scrape(registry)
        self.assertEqual(by_label(families["llmgw_agent_connections_refused"], "cap", "_total"),
                         {"per_address": 3, "total": 0})
        self.assertEqual(families["llmgw_agent_connections_registering"].samples[0].value, 7)
        self.assertEqual(families["llmgw_agent_admission_paused"].samples[0].value, 1)
        self.assertEqual(families["llmgw_agent_admission_pauses"].samples[0].value, 2)


class CrashMetricsTests(SynchronousTestCase):
    def test_failures_by_class_and_held(self) -> None:
        """
        Each deployment with a last failure has a C{llmgw_deployment_failures}
        sample (its consecutive failures) labelled with that failure's
        class; C{llmgw_deployments_held} counts held deployments by class,
        every class present; a class outside the fixed set (or none, from
        an older agent) is C{unknown}.
        """
        fleet = sample_fleet()
        fleet.add_deployment("cfg", held={"reason": "unknown argument", "crash_class": "config",
                                          "since": 5.0},
                             last_failure={"crash_class": "config", "time": 5.0})
        fleet.deployment_views["cfg"]["failures"] = 1
        fleet.deployment_views["demo"].update(failures=3, last_failure={"crash_class": "oom", "time": 9.0})
        fleet.deployment_views["org/big"].update(failures=2, last_failure={"crash_class": "made-up"})
        registry = make_registry()
        register_control_metrics(registry, FakeAgents(), lambda: fleet)
        families = scrape(registry)
        failures = {(s.labels["model"], s.labels["crash_class"]): s.value
                    for s in families["llmgw_deployment_failures"].samples}
        self.assertEqual(failures, {("cfg", "config"): 1.0, ("demo", "oom"): 3.0, ("org/big", "unknown"): 2.0})
        held = by_label(families["llmgw_deployments_held"], "crash_class")
        self.assertEqual(held, {"oom": 0.0, "config": 1.0, "port_in_use": 0.0, "engine_crash": 0.0,
                                "killed": 0.0, "hung": 0.0, "disk_full": 0.0, "checksum": 0.0, "not_found": 0.0,
                                "denied": 0.0, "fetch": 0.0, "unknown": 0.0})

    def test_views_without_the_fields(self) -> None:
        """
        Deployment views without C{held}, C{failures} or a failure's class
        (a reconciler from before the hold) give no failure samples and
        zero held, and do not break the scrape.
        """
        fleet = FakeFleet()
        fleet.add_deployment("a")
        del fleet.deployment_views["a"]["held"]
        del fleet.deployment_views["a"]["failures"]
        fleet.add_deployment("b", last_failure={"node": "n1"})
        del fleet.deployment_views["b"]["failures"]
        registry = make_registry()
        register_control_metrics(registry, FakeAgents(), lambda: fleet)
        families = scrape(registry)
        failures = {(s.labels["model"], s.labels["crash_class"]): s.value
                    for s in families["llmgw_deployment_failures"].samples}
        self.assertEqual(failures, {("b", "unknown"): 1.0})
        self.assertEqual(sum(by_label(families["llmgw_deployments_held"], "crash_class").values()), 0.0)

    def test_deployments_view_failure(self) -> None:
        """
        A deployments view that raises leaves the deployment metrics out
        of that scrape, logged; the others still go out.
        """
        fleet = sample_fleet()

        def broken() -> Any:
            raise RuntimeError("view broke")

        fleet.deployments = broken  # type: ignore[method-assign]
        registry = make_registry()
        collector = register_control_metrics(registry, FakeAgents(), lambda: fleet)
        logged: list[dict[str, Any]] = []
        collector.log = Logger(observer=logged.append)  # type: ignore[arg-type]
        families = scrape(registry)
        self.assertNotIn("llmgw_deployments_held", families)
        self.assertIn("llmgw_nodes", families)
        self.assertEqual(len(logged), 1)
        self.assertIn("deployments view failed", logged[0]["log_format"])

    def test_model_cache_per_node(self) -> None:
        """
        C{llmgw_model_cache_bytes{node}} is what each node's cache report
        holds, and C{llmgw_model_cached{model,node,state}} is 1 per copy.
        """
        agents = FakeAgents(["gpu-1"])
        agents.inventory.upsert(Node(id="gpu-1"))
        agents.inventory.apply_cache("gpu-1", [CachedCopy("k", size=7, state="complete"),
                                               CachedCopy("p", size=3, state="partial")])
        registry = make_registry()
        register_control_metrics(registry, agents, lambda: None)
        families = scrape(registry)
        self.assertEqual(by_label(families["llmgw_model_cache_bytes"], "node"), {"gpu-1": 10.0})
        self.assertEqual(by_label(families["llmgw_model_cached"], "state"), {"complete": 1.0, "partial": 1.0})

    def test_strays_per_node(self) -> None:
        """
        C{llmgw_node_stray_processes{node}} is the number of strays each
        node's latest Register listed; a node whose next Register lists
        none has no sample any more.
        """
        agents = FakeAgents(["gpu-1", "gpu-2"])
        agents.inventory.upsert(Node(id="gpu-1", stray_processes=[StrayProcess(pid=1), StrayProcess(pid=2)]))
        agents.inventory.upsert(Node(id="gpu-2"))
        registry = make_registry()
        register_control_metrics(registry, agents, lambda: None)
        self.assertEqual(by_label(scrape(registry)["llmgw_node_stray_processes"], "node"), {"gpu-1": 2.0})
        agents.inventory.upsert(Node(id="gpu-1"))
        self.assertEqual(by_label(scrape(registry)["llmgw_node_stray_processes"], "node"), {})
