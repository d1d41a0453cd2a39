"""
Engine signals on the control plane's side: reading them
from heartbeats, keeping them per shard, and showing them with their age in
the routing table, the admin API's replicas view, C{/metrics} and C{llmgw
ctl replicas}; and the per-rank commands a multi-node engine profile sends.
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, generate_latest
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.state.signals import EngineSignalsCollector, SignalStore, from_message
from llmgw.ctl.fleet import render_replicas
from tests.reconciler_harness import Fleet, catalog

TWO_NODE_SGLANG = """
[profiles.sglang-2]
engine = "sglang"
shards = 2
gpus_per_shard = 8
fabric = "ib0"
command = ["python3", "-m", "sglang.launch_server", "--host", "{host}", "--port", "{port}",
           "--dist-init-addr", "{leader_host}:50000", "--nnodes", "{world_size}", "--node-rank", "{rank}"]
worker_command = ["python3", "-m", "sglang.launch_server", "--dist-init-addr", "{leader_host}:50000",
                  "--nnodes", "{world_size}", "--node-rank", "{rank}"]
"""


class FromMessageTests(SynchronousTestCase):
    def test_age_becomes_a_time(self) -> None:
        """
        The sample's age is read on the control plane's own clock.
        """
        entry = from_message(pb.ShardSignals(shard_id="s", running=2, age_s=1.5), now=100.0)
        assert entry.signals is not None
        self.assertEqual((entry.signals.sampled_at, entry.signals.running, entry.signals.waiting),
                         (98.5, 2.0, None))

    def test_bad_figures_dropped(self) -> None:
        """
        Negative or non-finite figures from an agent are dropped, a bad age
        is taken as fresh, and the error is cut to a bounded length.
        """
        entry = from_message(pb.ShardSignals(shard_id="s", running=-1, waiting=math.inf,
                                             kv_cache_usage=math.nan, age_s=math.nan,
                                             error="x" * 5000), now=10.0)
        assert entry.signals is not None
        self.assertEqual((entry.signals.running, entry.signals.waiting,
                          entry.signals.kv_cache_usage), (None, None, None))
        self.assertEqual(entry.signals.sampled_at, 10.0)
        self.assertEqual(len(entry.error), 500)

    def test_no_sample(self) -> None:
        """
        No age means the agent has no figures yet: only the error is kept.
        """
        entry = from_message(pb.ShardSignals(shard_id="s", error="no answer in time"), now=1.0)
        self.assertIsNone(entry.signals)
        self.assertEqual(entry.error, "no answer in time")


class StoreTests(SynchronousTestCase):
    def test_heartbeat_replaces_the_node(self) -> None:
        """
        A node's heartbeat replaces what it said before: a shard it no
        longer reports is gone; other nodes' shards stay.
        """
        store = SignalStore()
        a = from_message(pb.ShardSignals(shard_id="a", age_s=0), 0.0)
        store.record("n1", [("a", a), ("b", a)])
        store.record("n2", [("c", a)])
        store.record("n1", [("b", a)])
        self.assertIsNone(store.get("a"))
        self.assertIsNotNone(store.get("b"))
        self.assertIsNotNone(store.get("c"))
        store.forget_node("n2")
        self.assertEqual(len(store), 1)


class ReconcilerSignalsTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.fleet = Fleet({"m": ("one", 1)}, nodes=2)
        self.fleet.past_grace()
        self.fleet.make_ready()
        self.fleet.step()
        [self.cmd] = self.fleet.dispatcher.starts

    def test_shown_with_age(self) -> None:
        """
        Signals from the shard's own node reach the route, the replicas view
        (with their age growing on the clock) and /metrics.
        """
        rec = self.fleet.rec
        rec.record_engine_signals(self.cmd.node_id, [
            pb.ShardSignals(shard_id=self.cmd.shard_id, waiting=1, running=4, kv_cache_usage=0.5,
                            age_s=0.5)])
        [route] = rec.routes("m")
        assert route.signals is not None
        self.assertEqual(route.signals.running, 4.0)
        self.fleet.clock.advance(2)
        [replica] = rec.replicas()
        signals = replica["shards"][0]["signals"]
        self.assertEqual((signals["waiting"], signals["running"], signals["kv_cache_usage"]),
                         (1.0, 4.0, 0.5))
        self.assertEqual(signals["age_s"], 2.5)
        self.assertIsNone(signals["error"])

        registry = CollectorRegistry(auto_describe=False)
        registry.register(EngineSignalsCollector(rec.engine_signal_rows, self.fleet.clock.seconds))
        text = generate_latest(registry).decode()
        labels = f'model="m",replica="{self.cmd.replica_id}",shard="{self.cmd.shard_id}"'
        self.assertIn(f"llmgw_engine_requests_running{{{labels}}} 4.0", text)
        self.assertIn(f"llmgw_engine_signals_age_seconds{{{labels}}} 2.5", text)
        self.assertNotIn("llmgw_engine_prefix_cache_hits{", text)

        table = render_replicas(rec.replicas())
        self.assertIn("WAITING", table)
        self.assertIn("50%", table)
        self.assertIn("2.5s", table)

    def test_foreign_shards_dropped(self) -> None:
        """
        A node's signals for a shard on another node are not kept.
        """
        other = next(n for n in self.fleet.ids if n != self.cmd.node_id)
        self.fleet.rec.record_engine_signals(other, [
            pb.ShardSignals(shard_id=self.cmd.shard_id, running=9, age_s=0)])
        self.assertIsNone(self.fleet.rec.engine_signals.get(self.cmd.shard_id))
        [replica] = self.fleet.rec.replicas()
        self.assertIsNone(replica["shards"][0]["signals"])

    def test_stale_shows(self) -> None:
        """
        While scrapes fail the table says so, with the error.
        """
        self.fleet.rec.record_engine_signals(self.cmd.node_id, [
            pb.ShardSignals(shard_id=self.cmd.shard_id, running=1, age_s=30,
                            error="no answer in time")])
        table = render_replicas(self.fleet.rec.replicas())
        self.assertIn("30.0s (stale: no answer in time)", table)


class MultiNodeCommandTests(SynchronousTestCase):
    def test_leader_and_worker_commands(self) -> None:
        """
        A two-node SGLang replica: rank 0 runs command with {host} filled
        with its node's address, its health and metrics paths; rank 1 runs
        worker_command, is ready while alive, and is not scraped; both
        rendezvous at the leader's host.
        """
        fleet = Fleet({"big": ("sglang-2", 1)}, nodes=2,
                      cat=catalog({"big": ("sglang-2", 1)}, extra=TWO_NODE_SGLANG))
        fleet.past_grace()
        starts = sorted(fleet.dispatcher.starts, key=lambda c: c.rank)
        self.assertEqual([c.rank for c in starts], [0, 1])
        lead, work = starts
        lead_host = fleet.rec.shard_recs[lead.shard_id].host
        self.assertIn(lead_host, lead.argv[lead.argv.index("--host") + 1])
        self.assertEqual(lead.argv[lead.argv.index("--dist-init-addr") + 1], f"{lead_host}:50000")
        self.assertEqual(work.argv[work.argv.index("--dist-init-addr") + 1], f"{lead_host}:50000")
        self.assertEqual(work.argv[work.argv.index("--node-rank") + 1], "1")
        self.assertNotIn("--port", work.argv)
        self.assertEqual((lead.health_path, lead.metrics_path, lead.engine), ("/health", "/metrics", "sglang"))
        self.assertEqual((work.health_path, work.metrics_path), ("", ""))
        self.assertEqual(lead.metric_names["waiting"], "sglang:num_queue_reqs")
        self.assertEqual(lead.stop_grace_s, 30)
        self.assertEqual(lead.startup_timeout_s, 1800)


class CollectorTests(SynchronousTestCase):
    def test_collector_survives_errors(self) -> None:
        """
        A failing source leaves the engine metrics out of the scrape, not
        the scrape itself.
        """
        def boom() -> list[object]:
            raise RuntimeError("boom")

        registry = CollectorRegistry(auto_describe=False)
        registry.register(EngineSignalsCollector(boom, Clock().seconds))  # type: ignore[arg-type]
        self.assertEqual(generate_latest(registry), b"")
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
