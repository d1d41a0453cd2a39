"""
The agent's own measure of a shard's standstill (requests running while its
progress counters stay flat), on a Clock with a fake fetch: what counts as
flat, when the scraper tells the agent, the early heartbeat it leads to, and
the threshold carried by StartShard.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.client import AgentConfig, AgentCore
from llmgw.agent.scrape import Scraper, Standstill
from llmgw.agent.shard import READY, Shard
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.engines import metric_names_for
from llmgw.routing import EngineSignals
from llmgw.shards import DEFAULT_STALL_AFTER_S, ShardSpec
from tests.test_scrape import FakeFetch, FakeSupervisor


def metrics(running: int, generated: int, prompt: int = 10) -> bytes:
    return (f"vllm:num_requests_running {running}\nvllm:num_requests_waiting 0\n"
            f"vllm:prefix_cache_queries_total {prompt}\n"
            f"vllm:generation_tokens_total {generated}\n").encode()


def signals(running: float, generated: float | None, prompt: float = 10.0) -> EngineSignals:
    return EngineSignals(sampled_at=0.0, running=running, generated_tokens=generated,
                         prefix_cache_queries=prompt)


class StandstillTests(SynchronousTestCase):
    def test_flat_from_the_first_scrape_at_the_present_values(self) -> None:
        """
        The standstill counts from the first scrape that saw the counters at
        their present values, to the latest scrape; a move restarts it.
        """
        s = Standstill()
        s.scraped(signals(2, 5), 10.0)
        self.assertEqual(s.flat_for_s, 0.0)
        s.scraped(signals(2, 5), 11.0)
        s.scraped(signals(2, 5), 12.0)
        self.assertEqual(s.flat_for_s, 2.0)
        s.scraped(signals(2, 6), 13.0)
        self.assertEqual(s.flat_for_s, 0.0)
        # The prompt-token counter moving (a long prefill) is progress too.
        s.scraped(signals(2, 6, prompt=500), 14.0)
        self.assertEqual(s.flat_for_s, 0.0)

    def test_idle_or_no_counter_is_not_watched(self) -> None:
        """
        Nothing running, or no generated-token counter: not watched (no
        figure), and a later standstill starts afresh.
        """
        s = Standstill()
        s.scraped(signals(2, 5), 0.0)
        s.scraped(signals(0, 5), 5.0)
        self.assertIsNone(s.flat_for_s)
        s.scraped(signals(2, None), 6.0)
        self.assertIsNone(s.flat_for_s)
        s.scraped(signals(1, 5), 7.0)
        self.assertEqual(s.flat_for_s, 0.0)

    def test_failed_scrapes_count_as_flat(self) -> None:
        """
        A scrape that fails while requests ran extends the standstill; one
        that fails with nothing watched gives no figure.
        """
        s = Standstill()
        s.failed(3.0)
        self.assertIsNone(s.flat_for_s)
        s.scraped(signals(1, 5), 4.0)
        s.failed(7.5)
        self.assertEqual(s.flat_for_s, 3.5)

    def test_reached_once_per_standstill(self) -> None:
        """
        The threshold is reported once per standstill, again after a move;
        0 never.
        """
        s = Standstill()
        s.scraped(signals(1, 5), 0.0)
        s.scraped(signals(1, 5), 2.0)
        self.assertFalse(s.reached(0))
        self.assertFalse(s.reached(3))
        self.assertTrue(s.reached(2))
        self.assertFalse(s.reached(2))
        s.scraped(signals(1, 6), 3.0)
        s.scraped(signals(1, 6), 5.0)
        self.assertTrue(s.reached(2))


class ScraperStallTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.sup = FakeSupervisor()
        self.fetch = FakeFetch()
        self.scraper = Scraper(self.clock, self.sup, self.fetch)  # type: ignore[arg-type]
        self.stalls: list[tuple[str, float]] = []
        self.scraper.on_stall = lambda sid: self.stalls.append((sid, self.clock.seconds()))
        self.scraper.startService()
        self.addCleanup(self.scraper.stopService)

    def add(self, shard_id: str, stall_after_s: float, port: int = 8001) -> Shard:
        shard = Shard(ShardSpec(shard_id=shard_id, replica_id="r", model="m", profile="p",
                                argv=["x"], gpu_indices=[], port=port, metrics_path="/metrics",
                                metric_names=metric_names_for("vllm"),
                                stall_after_s=stall_after_s), READY)
        self.sup.shards[shard_id] = shard
        return shard

    def answer_all(self, body: bytes | Exception) -> None:
        for url in list(self.fetch.pending):
            self.fetch.answer(url, body)

    def test_told_at_the_threshold_not_the_next_scrape(self) -> None:
        """
        A shard whose counters stay flat with requests running is reported
        when its standstill reaches stall_after_s (2.5 s here, between two
        scrapes: a scrape is made at that moment), once; its heartbeat entry
        carries the standstill.
        """
        self.add("a", 2.5)
        self.clock.advance(1)  # t=1: first scrape, the standstill starts
        self.answer_all(metrics(2, 40))
        for _ in range(2):  # t=2, t=3
            self.clock.advance(1)
            self.answer_all(metrics(2, 40))
        self.assertEqual(self.stalls, [])
        self.clock.advance(0.5)  # t=3.5: the check's own scrape
        self.assertEqual(len(self.fetch.pending), 1)
        self.answer_all(metrics(2, 40))
        self.assertEqual(self.stalls, [("a", 3.5)])
        [msg] = self.scraper.heartbeat_signals()
        self.assertEqual(msg.flat_for_s, 2.5)
        for _ in range(5):
            self.clock.advance(0.5)
            self.answer_all(metrics(2, 40))
        self.assertEqual(len(self.stalls), 1)

    def test_unanswered_scrapes_are_flat(self) -> None:
        """
        An engine that stops answering its scrapes while it had requests
        running is reported at its threshold without waiting for a scrape
        to answer.
        """
        self.add("a", 2.0)
        self.clock.advance(1)
        self.answer_all(metrics(1, 7))
        self.clock.advance(1)
        self.answer_all(RuntimeError("connection refused"))
        self.assertEqual(self.stalls, [])
        self.clock.advance(1)  # t=3: the threshold; the scrape under way does not answer
        self.assertEqual(self.stalls, [("a", 3.0)])
        [msg] = self.scraper.heartbeat_signals()
        self.assertEqual(msg.flat_for_s, 2.0)

    def test_moving_idle_or_off_never_told(self) -> None:
        """
        Counters that move, an idle engine, and a profile with
        stall_after_s 0 are never reported; an idle shard's heartbeat entry
        has no standstill.
        """
        self.add("moving", 2.0, port=1)
        self.add("idle", 2.0, port=2)
        self.add("off", 0, port=3)
        for n in range(10):
            self.clock.advance(1)
            self.fetch.answer("http://127.0.0.1:1/metrics", metrics(3, n))
            self.fetch.answer("http://127.0.0.1:2/metrics", metrics(0, 5))
            self.fetch.answer("http://127.0.0.1:3/metrics", metrics(3, 5))
        self.assertEqual(self.stalls, [])
        by_shard = {m.shard_id: m for m in self.scraper.heartbeat_signals()}
        self.assertFalse(by_shard["idle"].HasField("flat_for_s"))
        self.assertEqual(by_shard["moving"].flat_for_s, 0.0)
        self.assertEqual(by_shard["off"].flat_for_s, 9.0)


class EarlyHeartbeatTests(SynchronousTestCase):
    def test_stall_sends_a_heartbeat_now(self) -> None:
        """
        The agent core wires the scraper's report to a heartbeat sent at
        once on a registered stream; with no stream it sends nothing.
        """
        from llmgw.agent.gpus import GPUMonitor, SimulatedGPUs

        clock = Clock()
        sup = FakeSupervisor()
        scraper = Scraper(clock, sup, FakeFetch())  # type: ignore[arg-type]
        monitor = GPUMonitor(SimulatedGPUs(1, 1024), clock)
        core = AgentCore(AgentConfig(node_id="n"), sup, monitor, clock,  # type: ignore[arg-type]
                         scraper=scraper)
        scraper.on_stall("a")  # no stream: nothing to send on, no error

        class Stream:
            is_registered = True
            transport: Any = object()
            sent = 0

            def send_heartbeat(self) -> None:
                self.sent += 1

        stream = Stream()
        core.proto = stream  # type: ignore[assignment]
        scraper.on_stall("a")
        self.assertEqual(stream.sent, 1)
        stream.is_registered = False
        scraper.on_stall("a")
        self.assertEqual(stream.sent, 1)


class StartShardTests(SynchronousTestCase):
    def test_stall_after_s_travels(self) -> None:
        """
        StartShard carries the profile's stall_after_s (0 included); one
        from an older control plane, without it, reads as the default.
        """
        base = dict(shard_id="s", replica_id="r", model="m", profile="p", argv=["x"],
                    gpu_indices=[], port=1)
        for value in (2.0, 0.0):
            spec = ShardSpec(**base, stall_after_s=value)  # type: ignore[arg-type]
            self.assertEqual(ShardSpec.from_message(spec.to_message()), spec)
        old = ShardSpec(**base).to_message()  # type: ignore[arg-type]
        old.ClearField("stall_after_s")
        self.assertEqual(ShardSpec.from_message(old).stall_after_s, DEFAULT_STALL_AFTER_S)
        self.assertFalse(pb.StartShard().HasField("stall_after_s"))
