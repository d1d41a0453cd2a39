"""
Integration: a real ``twistd -n llmgw agent`` against a control
plane in this process (127.0.0.1, mutual TLS), running fake engines whose
/metrics are shaped like vLLM's, SGLang's and llama.cpp's, garbage, or
hanging after a while; and a worker rank that serves no HTTP. Bounded:
every wait has a deadline, every process is killed in cleanup.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

import llmgw
from llmgw.agent.state import StateDir
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.service import ControlPlane
from llmgw.control.state.interfaces import ShardCommand
from llmgw.engines import metric_names_for
from llmgw.testing.pki import make_pki
from llmgw.testing.procs import ProcessOutput, free_port
from llmgw.testing.sinks import RecordingSink
from llmgw.tlsconf.options import ServerTLS, server_files

ROOT = str(Path(llmgw.__file__).resolve().parent.parent)
HEARTBEAT = 0.5


class SignalSink(RecordingSink):
    """
    Records every heartbeat's engine signals, newest per shard.
    """

    def __init__(self) -> None:
        super().__init__()
        self.signals: dict[str, pb.ShardSignals] = {}
        self.heartbeats = 0

    def record_engine_signals(self, node_id: str, msgs: Any) -> None:
        self.heartbeats += 1
        for m in msgs:
            copy = pb.ShardSignals()
            copy.CopyFrom(m)
            self.signals[m.shard_id] = copy


class EngineSignalsIntegrationTests(TestCase):
    timeout = 90

    def setUp(self) -> None:
        self.dir = Path(self.mktemp()).resolve()
        make_pki(self.dir, nodes=["node-1"], server_hosts=["127.0.0.1"])
        self.state = Path(self.mktemp()).resolve()
        self.port = free_port()
        self.sink = SignalSink()
        self.plane = ControlPlane(
            reactor, sink=self.sink, tls=ServerTLS(server_files(self.dir)),
            agents_host="127.0.0.1", agents_port=self.port, heartbeat_interval=HEARTBEAT,
        )
        self.plane.startService()
        self.agent: tuple[Any, ProcessOutput] | None = None
        self.addCleanup(self.cleanup)

    @defer.inlineCallbacks
    def cleanup(self) -> Any:
        if self.plane.running:
            yield self.plane.stopService()
        if self.agent is not None and not self.agent[1].ended.called:
            self.agent[0].signalProcess("KILL")
            yield self.agent[1].ended
        for record in StateDir(self.state).load_all() if self.state.exists() else []:
            try:
                os.killpg(record.pid, signal.SIGKILL)
            except OSError:
                pass

    def start_agent(self) -> ProcessOutput:
        out = ProcessOutput()
        args = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()",
                "-n", "--pidfile=", "llmgw", "agent",
                "--control", f"127.0.0.1:{self.port}", "--certs", str(self.dir),
                "--node", "node-1", "--gpus", "sim:8x24GiB", "--state-dir", str(self.state),
                "--heartbeat", str(HEARTBEAT)]
        proc = reactor.spawnProcess(out, sys.executable, args, env=dict(os.environ, PYTHONPATH=ROOT),
                                    path=ROOT)
        self.agent = (proc, out)
        return out

    @defer.inlineCallbacks
    def wait_for(self, what: str, check: Callable[[], Any], timeout: float = 30) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value:
                return value
            assert self.agent is not None
            if self.agent[1].ended.called:
                self.fail(f"the agent exited while waiting for {what}:\n{self.agent[1].text()[-3000:]}")
            if time.monotonic() > deadline:
                self.fail(f"timed out waiting for {what}; agent output:\n{self.agent[1].text()[-4000:]}")
            yield deferLater(reactor, 0.05, lambda: None)

    def states(self, shard_id: str) -> list[str]:
        return [s.state for s in self.sink.statuses if s.shard_id == shard_id]

    def start(self, shard_id: str, gpu: int, argv: tuple[str, ...], metrics: bool = True,
              health_path: str = "/health", replica: str = "", rank: int = 0,
              world_size: int = 1) -> None:
        self.sink.place(shard_id, "node-1")
        self.plane.agents.start_shard(ShardCommand(
            node_id="node-1", shard_id=shard_id, replica_id=replica or f"r-{shard_id}",
            model="tiny", profile="fake", gpu_indices=(gpu,), port=free_port(), argv=argv,
            env={"PYTHONPATH": ROOT}, startup_timeout_s=30, stop_grace_s=2,
            health_path=health_path, rank=rank, world_size=world_size,
            metrics_path="/metrics" if metrics else "", metric_names=metric_names_for("generic"),
        ))

    def fake(self, *extra: str) -> tuple[str, ...]:
        return ("{python}", "-m", "llmgw.testing.fakemodel", "--model", "tiny", "--host", "{host}",
                *extra)

    @defer.inlineCallbacks
    def test_scrapes_engines_and_survives_bad_ones(self) -> Any:
        """
        vLLM-, SGLang- and llama.cpp-shaped metrics arrive normalised in
        heartbeats; a garbage endpoint and one that hangs after a while are
        reported with their error (the hanging one's figures age), and every
        shard stays ready; a worker with no health path is ready while its
        process lives, beside a leader that is ready on its health check.
        """
        self.start_agent()
        yield self.wait_for("registration", lambda: "node-1" in self.plane.agents.connected_nodes())
        self.start("vllm", 0, self.fake("--metrics", "vllm"))
        self.start("sglang", 1, self.fake("--metrics", "sglang"))
        self.start("llamacpp", 2, self.fake("--metrics", "llamacpp"))
        self.start("garbage", 3, self.fake("--metrics", "garbage"))
        self.start("hangs", 4, self.fake("--metrics", "vllm", "--metrics-hang-after", "3"))
        self.start("lead", 5, self.fake(), metrics=False, replica="two", world_size=2)
        self.start("worker", 6, ("{python}", "-c", "import time; time.sleep(120)"), metrics=False,
                   health_path="", replica="two", rank=1, world_size=2)
        shards = ["vllm", "sglang", "llamacpp", "garbage", "hangs", "lead", "worker"]
        yield self.wait_for("every shard ready", lambda: all("ready" in self.states(s) for s in shards))

        def figures() -> bool:
            s = self.sink.signals
            return all(k in s and s[k].HasField("age_s") for k in ("vllm", "sglang", "llamacpp"))

        yield self.wait_for("signals from the three engine shapes", figures)
        for shard_id in ("vllm", "sglang", "llamacpp"):
            msg = self.sink.signals[shard_id]
            self.assertEqual((msg.running, msg.waiting, msg.error), (0.0, 0.0, ""), shard_id)
            self.assertTrue(msg.HasField("prefix_cache_queries"), shard_id)
        self.assertEqual(self.sink.signals["vllm"].kv_cache_usage, 0.0)
        self.assertFalse(self.sink.signals["llamacpp"].HasField("kv_cache_usage"))
        self.assertNotIn("lead", self.sink.signals)
        self.assertNotIn("worker", self.sink.signals)

        yield self.wait_for("the garbage endpoint's error",
                            lambda: "garbage" in self.sink.signals and self.sink.signals["garbage"].error)
        self.assertIn("could not be read", self.sink.signals["garbage"].error)
        self.assertFalse(self.sink.signals["garbage"].HasField("age_s"))

        yield self.wait_for(
            "the hanging endpoint's figures to age",
            lambda: self.sink.signals.get("hangs") is not None
            and self.sink.signals["hangs"].error == "no answer in time"
            and self.sink.signals["hangs"].age_s > 2.0, timeout=20)
        # Scrapes never change a shard's state.
        for shard_id in shards:
            self.assertEqual(self.states(shard_id)[-1], "ready", shard_id)
        self.assertEqual(self.states("worker"), ["starting", "ready"])
