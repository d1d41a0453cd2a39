"""
Tests for the supervisor's shards whose weights come through the node's
model cache (L{llmgw.agent.weights}): the C{fetching} state before
C{starting}, the startup timeout after the fetch, fetch failures and their
classes, stops while fetching, one fetch shared by two shards, and the
cache pins that keep a running shard's model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmgw.agent.client import AgentConfig, AgentCore
from llmgw.agent.gpus import GPUMonitor, SimulatedGPUs
from llmgw.agent.supervisor import Supervisor
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.models.cache import ModelCache
from llmgw.models.source import cache_key, from_spec
from llmgw.shards import ReportedShard, ShardReport
from llmgw.sourcespec import parse_source
from llmgw.states import ENDED, LIVE
from llmgw.testing.fakefetch import FakeFetcher, StepRunner
from llmgw.wire import state_name
from tests.supervisor_harness import SupervisorCase, spec

REPO = "hf://org/tiny"
MODEL = {"tiny.gguf": b"GGUF" + b"\0" * 60}


class FetchCase(SupervisorCase):
    """
    A supervisor whose cache fetches from a L{FakeFetcher}, its threads run
    by a L{StepRunner} the test steps.
    """

    capacity = 10_000

    def setUp(self) -> None:
        self.fetcher = FakeFetcher({"hf://org/tiny@main": dict(MODEL)})
        self.runner = StepRunner()
        self.cache_dir = Path(self.mktemp())
        super().setUp()

    def new_cache(self) -> ModelCache:
        """
        A cache on the test's directory, as an agent (re)started makes it.
        """
        self.cache = ModelCache(self.cache_dir, self.capacity, {"hf": self.fetcher}, self.clock,
                                self.runner)
        return self.cache

    def make(self) -> Supervisor:
        sup = Supervisor(self.clock, self.spawner, self.state, gpu_indices=[0, 1, 2, 3],
                         ops=self.ops, prober=self.prober, python="/usr/bin/python3",
                         base_env={"PATH": "/usr/bin"}, cache=self.new_cache())
        sup.weights.load()
        self.runner.drain()
        return sup

    def fetched_spec(self, shard_id: str = "s1", port: int = 8001, gpus: tuple[int, ...] = (0,),
                     **kw: Any) -> Any:
        # {python} is always there, so the program check passes.
        return spec(shard_id, gpus=gpus, port=port, source=parse_source(REPO, file="tiny.gguf"),
                    argv=["{python}", "-m", "server", "--model", "{weights}", "--port", "{port}"],
                    **kw)

    def pins(self) -> frozenset[str]:
        return frozenset().union(*(m.pinned_by for m in self.cache.models()))


class FetchingTests(FetchCase):
    def test_fetching_then_starting_then_ready(self) -> None:
        """
        A shard with an hf:// source is reported fetching, with no process,
        until its weights are in the cache; then it is spawned with their
        path as {weights}, is starting, and ready after a health probe.
        """
        shard = self.sup.start(self.fetched_spec())
        self.assertEqual(shard.state, "fetching")
        self.assertEqual(self.states(), ["fetching"])
        self.assertEqual(self.spawner.calls, [])
        self.assertTrue(shard.held)
        self.assertEqual(self.sup.fetch_progress(), [("s1", 0, 0, 0.0)])
        self.runner.drain()
        self.assertEqual(self.states(), ["fetching", "starting"])
        (call,) = self.spawner.calls
        weights = call["args"][call["args"].index("--model") + 1]
        # The fake's plan names no target: the weights are the entry's directory.
        self.assertEqual((Path(weights) / "tiny.gguf").read_bytes(), MODEL["tiny.gguf"])
        self.assertEqual(self.sup.fetch_progress(), [])
        self.clock.advance(0)
        self.prober.answer(True)
        self.assertEqual(shard.state, "ready")

    def test_fetch_given_the_peers(self) -> None:
        """
        The peers a start command names (StartShard.model_peers) are the
        ones the cache's fetch tries before the source.
        """
        asked: list[tuple[str, ...]] = []

        def peering(fetcher: Any, peers: tuple[str, ...]) -> Any:
            asked.append(tuple(peers))
            return fetcher

        self.cache = self.sup.weights.cache = ModelCache(self.cache_dir, self.capacity, {"hf": self.fetcher},
                                                          self.clock, self.runner, peering=peering)
        self.sup.start(self.fetched_spec(model_peers=("10.0.0.2:7000", "10.0.0.3:7000")))
        self.runner.drain()
        self.assertEqual(asked, [("10.0.0.2:7000", "10.0.0.3:7000")])

    def test_startup_timeout_after_fetch(self) -> None:
        """
        The startup timeout starts when the weights are there, not at the
        start command: a fetch longer than the timeout does not fail it.
        """
        shard = self.sup.start(self.fetched_spec(startup_timeout_s=10))
        self.clock.advance(30)
        self.assertEqual(shard.state, "fetching")
        self.runner.drain()
        self.assertEqual(shard.state, "starting")
        self.clock.advance(9)
        self.assertEqual(shard.state, "starting")
        self.clock.advance(2)
        self.assertEqual(shard.state, "stopping")
        self.assertIn("startup timeout", shard.stop_error)

    def test_progress(self) -> None:
        """
        The fetch's progress (bytes done, total, rate) is the shard's, for
        heartbeats, while it fetches.
        """
        self.sup.start(self.fetched_spec())
        # plan, make room (disk room, entry write), then the fetch itself.
        while self.runner.queue[0][1] != self.fetcher.fetch:
            self.runner.step()
        self.runner.step()  # the fetch: all bytes written
        self.clock.advance(1)
        (row,) = self.sup.fetch_progress()
        self.assertEqual(row[:3], ("s1", len(MODEL["tiny.gguf"]), len(MODEL["tiny.gguf"])))
        self.assertGreater(row[3], 0)

    def test_not_found(self) -> None:
        """
        A source the hub does not have fails the shard as not_found, with
        an error naming the model and source; nothing is spawned, its pin
        is released and its record removed.
        """
        s = spec("s1", source=parse_source("hf://org/other"), argv=["{python}", "{weights}"])
        shard = self.sup.start(s)
        self.runner.drain()
        self.assertEqual((shard.state, shard.crash_class), ("failed", "not_found"))
        self.assertIn("could not put the weights of m (hf://org/other) on this node", shard.error)
        self.assertEqual(self.states(), ["fetching", "failed"])
        self.assertEqual(self.spawner.calls, [])
        self.assertEqual(shard.pinned, "")
        self.assertEqual(self.state.load_all(), [])
        self.flushLoggedErrors()

    def test_checksum(self) -> None:
        """
        Damaged bytes fail the shard as checksum.
        """
        self.fetcher.corrupt.add("tiny.gguf")
        shard = self.sup.start(self.fetched_spec())
        self.runner.drain()
        self.assertEqual((shard.state, shard.crash_class), ("failed", "checksum"))

    def test_stop_while_fetching(self) -> None:
        """
        A stop while fetching stops the shard at once (no process to end),
        drops its interest in the fetch, which stops with no one waiting,
        and its pin; its GPUs and port are free for another shard.
        """
        shard = self.sup.start(self.fetched_spec())
        self.runner.step()  # the plan
        self.sup.stop("s1")
        self.assertEqual(shard.state, "stopped")
        self.assertEqual(self.states(), ["fetching", "stopped"])
        self.runner.drain()
        self.assertEqual(self.spawner.calls, [])
        self.assertEqual(self.pins(), frozenset())
        self.assertEqual(self.states(), ["fetching", "stopped"])
        again = self.sup.start(spec("s2", port=8001))
        self.assertEqual(again.state, "starting")

    def test_drain_while_fetching(self) -> None:
        """
        A drain while fetching stops the shard at once: it serves nothing.
        """
        shard = self.sup.start(self.fetched_spec())
        self.sup.drain("s1")
        self.assertEqual(shard.state, "stopped")
        self.runner.drain()
        self.assertEqual(self.spawner.calls, [])

    def test_shared_fetch(self) -> None:
        """
        Two shards needing one model share one fetch and one copy; stopping
        one while both fetch leaves the other's fetch going.
        """
        a = self.sup.start(self.fetched_spec("a", port=8001, gpus=(0,)))
        b = self.sup.start(self.fetched_spec("b", port=8002, gpus=(1,)))
        c = self.sup.start(self.fetched_spec("c", port=8003, gpus=(2,)))
        self.sup.stop("c")
        self.runner.drain()
        self.assertEqual((a.state, b.state, c.state), ("starting", "starting", "stopped"))
        self.assertEqual(len(self.fetcher.plans), 1)
        self.assertEqual(self.fetcher.written, ["tiny.gguf"])
        paths = {call["args"][call["args"].index("--model") + 1] for call in self.spawner.calls}
        self.assertEqual(len(paths), 1)
        self.assertEqual(self.pins(), frozenset({"a", "b"}))

    def test_pin_released_when_ended(self) -> None:
        """
        A running shard's model stays pinned until its process group is
        empty; then it is released.
        """
        shard = self.sup.start(self.fetched_spec())
        self.runner.drain()
        self.assertEqual(self.pins(), frozenset({"s1"}))
        self.sup.stop("s1")
        self.assertEqual(self.pins(), frozenset({"s1"}))
        shard.process.end(0)
        self.assertEqual(shard.state, "stopped")
        self.assertEqual(self.pins(), frozenset())


class TooSmallTests(FetchCase):
    capacity = 10

    def test_disk_full(self) -> None:
        """
        A model that cannot fit in the cache fails the shard as disk_full
        before a byte is written.
        """
        shard = self.sup.start(self.fetched_spec())
        self.runner.drain()
        self.assertEqual((shard.state, shard.crash_class), ("failed", "disk_full"))
        self.assertEqual(self.fetcher.written, [])


class RestartTests(FetchCase):
    def test_fetch_resumed_after_restart(self) -> None:
        """
        A shard fetching when the agent stopped is recorded, and the
        restarted agent lists it as fetching and fetches on; once fetched it
        starts as usual. A stop while fetching forgets its record.
        """
        s = self.fetched_spec()
        self.sup.start(s)
        self.assertEqual([r.state for r in self.state.load_all()], ["fetching"])
        self.runner.step()  # the plan
        self.sup.stopService()
        self.runner.drain()  # the fetch, cancelled with no one waiting
        sup = self.make()
        sup.add_listener(self.record)
        sup.recover()
        shard = sup.get("s1")
        assert shard is not None
        self.assertEqual(shard.state, "fetching")
        self.assertEqual([s.shard_id for s in sup.held_shards()], ["s1"])
        self.runner.drain()
        self.assertEqual(shard.state, "starting")
        self.assertEqual(len(self.spawner.calls), 1)
        self.assertEqual([r.state for r in self.state.load_all()], ["starting"])
        other = sup.start(self.fetched_spec("s2", port=8002, gpus=(1,)))
        sup.stop("s2")
        self.assertEqual(other.state, "stopped")
        self.assertEqual([r.spec.shard_id for r in self.state.load_all()], ["s1"])


class AdoptedPinTests(FetchCase):
    def test_readopted_shard_pinned(self) -> None:
        """
        After a restart, a re-adopted shard whose record keeps its source
        has its model pinned again in the cache read back from disk,
        before any fetch could evict it.
        """
        s = self.fetched_spec("a")
        self.sup.start(s)
        self.runner.drain()
        self.assertEqual(self.spawner.calls[0]["args"][-1], "8001")
        self.sup.stopService()
        sup = self.make()  # a new agent: a new cache on the same directory
        self.assertEqual(self.pins(), frozenset())
        sup.recover()
        shard = sup.get("a")
        assert shard is not None
        self.assertEqual((shard.adopted, shard.pinned), (True, cache_key(from_spec(s.source))))
        self.assertEqual(self.pins(), frozenset({"a"}))


class ReportTests(FetchCase):
    def core(self) -> AgentCore:
        monitor = GPUMonitor(SimulatedGPUs(4, 81920, salt="n1"), self.clock, interval=5)
        return AgentCore(AgentConfig(node_id="n1", control="127.0.0.1:7443"), self.sup, monitor,
                         self.clock, jitter=lambda: 0.0)

    def test_heartbeat_and_register(self) -> None:
        """
        A heartbeat carries each fetching shard's progress, and a Register
        lists a fetching shard (its GPUs and port are held) as fetching;
        both survive the wire.
        """
        core = self.core()
        self.sup.start(self.fetched_spec())
        while self.runner.queue[0][1] != self.fetcher.fetch:
            self.runner.step()
        self.runner.step()
        self.clock.advance(1)
        hb = pb.Heartbeat.FromString(core.heartbeat_message().SerializeToString())
        (fp,) = hb.fetches
        size = len(MODEL["tiny.gguf"])
        self.assertEqual((fp.shard_id, fp.done, fp.total), ("s1", size, size))
        self.assertEqual(fp.rate, size)
        reg = pb.Register.FromString(core.register_message().SerializeToString())
        (running,) = reg.running_shards
        self.assertEqual(running.state, pb.ShardStatus.STATE_FETCHING)
        self.assertEqual(ReportedShard.from_message("n1", running).state, "fetching")
        self.runner.drain()
        self.assertEqual(list(core.heartbeat_message().fetches), [])

    def test_status_on_the_wire(self) -> None:
        """
        STATE_FETCHING goes to the wire and back as "fetching"; an older
        reader that lacks the value keeps the number (proto3 enums are
        open) and names it unknown, which no state set holds, so an older
        control plane ignores the status rather than fail on it.
        """
        report = ShardReport(node_id="n1", replica_id="r1", shard_id="s1", state="fetching")
        data = report.to_message().SerializeToString()
        self.assertEqual(ShardReport.from_message("n1", pb.ShardStatus.FromString(data)).state,
                         "fetching")
        old = pb.ShardStatus.FromString(data)
        self.assertEqual(int(old.state), 7)
        self.assertEqual(state_name(8), "unknown(8)")
        self.assertNotIn(state_name(8), LIVE | ENDED)
