"""
The agent's engine scraper, driven by a Clock and a fake
fetch: who is scraped, one scrape in flight per shard, what a failure
keeps, and what goes into heartbeats; then the real HTTP fetcher against
the fake model server on loopback, bounded in time and size.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmgw.agent.client import AgentConfig, AgentCore
from llmgw.agent.scrape import HttpFetcher, ResponseTooLarge, Scraper
from llmgw.agent.shard import READY, STARTING, Shard
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.engines import metric_names_for
from llmgw.testing.fakemodel import FakeModelConfig, listen

VLLM = (
    "vllm:num_requests_waiting 2\nvllm:num_requests_running 3\n"
    "vllm:kv_cache_usage_perc 0.5\nvllm:prefix_cache_queries_total 10\n"
)


class FakeSupervisor:
    def __init__(self) -> None:
        self.shards: dict[str, Shard] = {}
        self.probe_host = "127.0.0.1"

    def add(self, shard_id: str, state: str = READY, metrics_path: str = "/metrics",
            port: int = 8001) -> Shard:
        from llmgw.agent.state import ShardSpec

        shard = Shard(ShardSpec(shard_id=shard_id, replica_id="r", model="m", profile="p",
                                argv=["x"], gpu_indices=[], port=port,
                                metrics_path=metrics_path,
                                metric_names=metric_names_for("vllm")), state)
        self.shards[shard_id] = shard
        return shard

    def live_shards(self) -> list[Shard]:
        return [s for s in self.shards.values() if s.live]

    def fetch_progress(self) -> list[tuple[str, int, int, float]]:
        return []

    def add_listener(self, fn: Any) -> None:
        pass


class FakeFetch:
    def __init__(self) -> None:
        self.pending: dict[str, defer.Deferred[bytes]] = {}
        self.urls: list[str] = []

    def __call__(self, url: str) -> defer.Deferred[bytes]:
        d: defer.Deferred[bytes] = defer.Deferred()
        self.urls.append(url)
        self.pending[url] = d
        return d

    def answer(self, url: str, body: bytes | Exception) -> None:
        d = self.pending.pop(url)
        if isinstance(body, Exception):
            d.errback(body)
        else:
            d.callback(body)


class ScraperTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.sup = FakeSupervisor()
        self.fetch = FakeFetch()
        self.scraper = Scraper(self.clock, self.sup, self.fetch, host=lambda: "10.0.0.7")  # type: ignore[arg-type]

    def test_only_ready_shards_with_a_metrics_path(self) -> None:
        """
        Ready shards with a metrics path are scraped on the advertised host;
        starting shards, shards without a metrics path and ended ones are not.
        """
        self.sup.add("a", port=9001)
        self.sup.add("b", state=STARTING)
        self.sup.add("c", metrics_path="")
        self.sup.add("d", state="failed")
        self.scraper.tick()
        self.assertEqual(self.fetch.urls, ["http://10.0.0.7:9001/metrics"])

    def test_one_scrape_in_flight(self) -> None:
        """
        A shard whose scrape has not answered is not scraped again.
        """
        self.sup.add("a")
        self.scraper.tick()
        self.scraper.tick()
        self.assertEqual(len(self.fetch.urls), 1)
        self.fetch.answer(self.fetch.urls[0], VLLM.encode())
        self.scraper.tick()
        self.assertEqual(len(self.fetch.urls), 2)

    def test_sample_in_heartbeat_with_age(self) -> None:
        """
        A good scrape's figures go into the heartbeat with their age; a
        figure the engine lacks is left unset.
        """
        self.sup.add("a")
        self.scraper.tick()
        self.fetch.answer(self.fetch.urls[0], VLLM.encode())
        self.clock.advance(2.5)
        [msg] = self.scraper.heartbeat_signals()
        self.assertEqual((msg.shard_id, msg.waiting, msg.running, msg.kv_cache_usage),
                         ("a", 2.0, 3.0, 0.5))
        self.assertEqual(msg.prefix_cache_queries, 10.0)
        self.assertFalse(msg.HasField("prefix_cache_hits"))
        self.assertEqual(msg.age_s, 2.5)
        self.assertEqual(msg.error, "")

    def test_failure_keeps_figures_and_ages(self) -> None:
        """
        A failed scrape (timeout, garbage) keeps the last figures, says why,
        and their age keeps growing; the next good scrape clears the error.
        The shard's state is never touched.
        """
        shard = self.sup.add("a")
        self.scraper.tick()
        self.fetch.answer(self.fetch.urls[-1], VLLM.encode())
        self.clock.advance(1)
        self.scraper.tick()
        self.fetch.answer(self.fetch.urls[-1], defer.TimeoutError())
        self.clock.advance(1)
        self.scraper.tick()
        self.fetch.answer(self.fetch.urls[-1], b"<html>no</html>")
        [msg] = self.scraper.heartbeat_signals()
        self.assertEqual(msg.running, 3.0)
        self.assertEqual(msg.age_s, 2.0)
        self.assertIn("could not be read", msg.error)
        self.assertEqual(shard.state, READY)
        self.flushLoggedErrors()
        self.scraper.tick()
        self.fetch.answer(self.fetch.urls[-1], VLLM.encode())
        [msg] = self.scraper.heartbeat_signals()
        self.assertEqual((msg.age_s, msg.error), (0.0, ""))

    def test_never_sampled(self) -> None:
        """
        A shard whose first scrape failed is reported with its error and no
        age (no figures at all).
        """
        self.sup.add("a")
        self.scraper.tick()
        self.fetch.answer(self.fetch.urls[0], ValueError("HTTP 404"))
        [msg] = self.scraper.heartbeat_signals()
        self.assertFalse(msg.HasField("age_s"))
        self.assertEqual(msg.error, "HTTP 404")

    def test_ended_shards_are_forgotten(self) -> None:
        """
        Once a shard is no longer live its sample is dropped, and an answer
        arriving after that is not recorded.
        """
        shard = self.sup.add("a")
        self.scraper.tick()
        self.fetch.answer(self.fetch.urls[0], VLLM.encode())
        self.scraper.tick()
        shard.state = "stopped"
        self.fetch.answer(self.fetch.urls[1], VLLM.encode())
        self.scraper.tick()
        self.assertEqual(self.scraper.heartbeat_signals(), [])

    def test_loop_survives_errors(self) -> None:
        """
        A pass that raises is logged and the loop goes on.
        """
        calls = []

        def boom() -> list[Shard]:
            calls.append(1)
            raise RuntimeError("boom")

        self.sup.live_shards = boom  # type: ignore[method-assign]
        self.scraper.startService()
        self.clock.advance(1)
        self.clock.advance(1)
        self.assertEqual(len(calls), 2)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 2)
        self.scraper.stopService()

    def test_agent_heartbeat_carries_signals(self) -> None:
        """
        The agent's heartbeat carries the scraper's samples; without a
        scraper (or with nothing scraped) it carries none, as an older
        agent's does.
        """
        from llmgw.agent.gpus import GPUMonitor, SimulatedGPUs

        self.sup.add("a")
        self.scraper.tick()
        self.fetch.answer(self.fetch.urls[0], VLLM.encode())
        monitor = GPUMonitor(SimulatedGPUs(1, 1024), self.clock)
        core = AgentCore(AgentConfig(node_id="n"), self.sup, monitor, self.clock,  # type: ignore[arg-type]
                         scraper=self.scraper)
        hb = core.heartbeat_message()
        self.assertEqual([s.shard_id for s in hb.shard_signals], ["a"])
        bare = AgentCore(AgentConfig(node_id="n"), self.sup, monitor, self.clock)  # type: ignore[arg-type]
        self.assertEqual(list(bare.heartbeat_message().shard_signals), [])


class EndpointTests(SynchronousTestCase):
    def test_ip_literals_need_no_resolver(self) -> None:
        """
        A shard's IP address is dialled directly (no name resolution, which
        a loaded machine's thread pool can delay past the scrape's bound);
        a host name is resolved.
        """
        from twisted.internet.endpoints import (
            HostnameEndpoint,
            TCP4ClientEndpoint,
            TCP6ClientEndpoint,
        )
        from twisted.internet.testing import MemoryReactorClock
        from twisted.web.client import URI

        from llmgw.agent.scrape import _LiteralFirstEndpoints

        endpoints = _LiteralFirstEndpoints(MemoryReactorClock(), 0.8)
        for url, kind in ((b"http://127.0.0.1:9000/metrics", TCP4ClientEndpoint),
                          (b"http://[::1]:9000/metrics", TCP6ClientEndpoint),
                          (b"http://gpu-1.example:9000/metrics", HostnameEndpoint)):
            self.assertIsInstance(endpoints.endpointForURI(URI.fromBytes(url)), kind, url)


class FetcherTests(TestCase):
    """
    The real fetcher against the fake model server on 127.0.0.1.
    """

    timeout = 20

    def serve(self, **kw: Any) -> str:
        port = listen(reactor, FakeModelConfig(**kw), 0, "127.0.0.1")
        self.addCleanup(port.stopListening)
        return f"http://127.0.0.1:{port.getHost().port}/metrics"

    def fetcher(self, **kw: Any) -> HttpFetcher:
        f = HttpFetcher(reactor, **kw)
        self.addCleanup(f.close)
        return f

    @defer.inlineCallbacks
    def test_shapes(self) -> Any:
        """
        Each engine shape of the fake's /metrics comes back whole.
        """
        f = self.fetcher()
        for shape, name in (("vllm", b"vllm:num_requests_running"),
                            ("sglang", b"sglang:num_running_reqs"),
                            ("llamacpp", b"llamacpp:requests_processing")):
            body = yield f.get(self.serve(metrics=shape))
            self.assertIn(name, body)

    @defer.inlineCallbacks
    def test_hang_is_bounded(self) -> Any:
        """
        An endpoint that never answers fails with a timeout (the fetch's
        own bound, not the test's: the endpoint would hang for ever).
        """
        f = self.fetcher(timeout=0.3)
        with self.assertRaises(defer.TimeoutError):
            yield f.get(self.serve(metrics="hang"))

    @defer.inlineCallbacks
    def test_size_cap(self) -> Any:
        """
        A response over the size cap is abandoned with ResponseTooLarge.
        """
        f = self.fetcher(max_bytes=50)
        with self.assertRaises(ResponseTooLarge):
            yield f.get(self.serve(metrics="vllm"))

    @defer.inlineCallbacks
    def test_not_found(self) -> Any:
        """
        A server without /metrics gives an HTTP error, not a body.
        """
        f = self.fetcher()
        with self.assertRaises(ValueError):
            yield f.get(self.serve())


class WireCompatibilityTests(SynchronousTestCase):
    """
    New fields are optional both ways: an older agent's heartbeat (no
    signals) parses as before, and an older control plane parsing a new
    heartbeat, Register or StartShard keeps every field it knows.
    """

    def old_classes(self) -> Any:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

        fdp = descriptor_pb2.FileDescriptorProto()
        pb.DESCRIPTOR.CopyToProto(fdp)
        fdp.name = "old_agent.proto"
        fdp.package = "llmgw.old"
        new_fields = {"Heartbeat": {"shard_signals"}, "Register": {"advertise_address"},
                      "StartShard": {"engine", "metrics_path", "metric_names", "stop_signal",
                                     "ready_while_alive"}}
        for message in fdp.message_type:
            drop = new_fields.get(message.name, set())
            keep = [f for f in message.field if f.name not in drop]
            del message.field[:]
            message.field.extend(keep)
            if message.name == "StartShard":
                keep_nested = [n for n in message.nested_type if n.name != "MetricNamesEntry"]
                del message.nested_type[:]
                message.nested_type.extend(keep_nested)
        kept = [m for m in fdp.message_type if m.name != "ShardSignals"]
        del fdp.message_type[:]
        fdp.message_type.extend(kept)
        for message in fdp.message_type:
            for f in message.field:
                if f.type_name.startswith(".llmgw.v1."):
                    f.type_name = f.type_name.replace(".llmgw.v1.", ".llmgw.old.")
            for nested in message.nested_type:
                for f in nested.field:
                    if f.type_name.startswith(".llmgw.v1."):
                        f.type_name = f.type_name.replace(".llmgw.v1.", ".llmgw.old.")
        pool = descriptor_pool.DescriptorPool()
        pool.Add(fdp)
        return {n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"llmgw.old.{n}"))
                for n in ("Heartbeat", "Register", "StartShard")}

    def test_new_to_old(self) -> None:
        """
        An older control plane reads a new agent's messages (and an older
        agent a new StartShard) with every field it knows intact.
        """
        old = self.old_classes()
        hb = pb.Heartbeat(gpu_memory_used_mb=[5, 6], shard_signals=[
            pb.ShardSignals(shard_id="s", running=2, age_s=0.5)])
        parsed = old["Heartbeat"].FromString(hb.SerializeToString())
        self.assertEqual(list(parsed.gpu_memory_used_mb), [5, 6])
        reg = pb.Register(node_id="n", protocol_version=1, advertise_address="10.0.0.7")
        self.assertEqual(old["Register"].FromString(reg.SerializeToString()).node_id, "n")
        start = pb.StartShard(shard_id="s", port=9, health_path="/health", engine="vllm",
                              metric_names={"running": "x"}, ready_while_alive=True)
        old_start = old["StartShard"].FromString(start.SerializeToString())
        self.assertEqual((old_start.shard_id, old_start.port, old_start.health_path),
                         ("s", 9, "/health"))

    def test_old_to_new(self) -> None:
        """
        An older agent's heartbeat has no signals and an older control
        plane's StartShard no engine: both read as today's behaviour.
        """
        from llmgw.agent.state import ShardSpec

        old = self.old_classes()
        hb = pb.Heartbeat.FromString(old["Heartbeat"](gpu_memory_used_mb=[1]).SerializeToString())
        self.assertEqual(list(hb.shard_signals), [])
        start = pb.StartShard.FromString(
            old["StartShard"](shard_id="s", port=9, health_path="/health").SerializeToString())
        spec = ShardSpec.from_message(start)
        self.assertEqual((spec.engine, spec.health_path, spec.metrics_path, spec.stop_signal),
                         ("generic", "/health", "", "SIGTERM"))
        reg = pb.Register.FromString(old["Register"](node_id="n").SerializeToString())
        self.assertEqual(reg.advertise_address, "")
