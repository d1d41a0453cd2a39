"""
Integration test with real processes: a control plane (in this process, on
127.0.0.1, mutual TLS, the real reconciler and the demo catalog) and two
real C{twistd llmgw agent} processes with simulated GPUs running the fake
model server. Bounded: every wait has a deadline, and every process started
is killed in cleanup, even on failure.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.task import deferLater
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial.unittest import TestCase

import llmgw
from llmgw.agent.state import StateDir
from llmgw.control.core.backoff import Backoff
from llmgw.control.service import ControlPlane, Options, makeService
from llmgw.testing.pki import make_pki
from llmgw.testing.procs import ProcessOutput, free_port

ROOT = str(Path(llmgw.__file__).resolve().parent.parent)
EXAMPLE = Path(ROOT) / "llmgw" / "demo-catalog.toml"
HEARTBEAT = 0.5
NODES = ("node-1", "node-2")






class ReconcilerIntegrationTests(TestCase):
    timeout = 90

    def setUp(self) -> None:
        self.dir = Path(self.mktemp()).resolve()
        make_pki(self.dir, NODES, ["127.0.0.1"])
        self.port = free_port()
        self.states = {n: Path(self.mktemp()).resolve() for n in NODES}
        self.agents: list[tuple[Any, ProcessOutput]] = []
        self.plane: ControlPlane | None = None
        self.addCleanup(self.cleanup)

    @defer.inlineCallbacks
    def cleanup(self) -> Any:
        if self.plane is not None and self.plane.running:
            yield self.plane.stopService()
        for proc, out in self.agents:
            if not out.ended.called:
                proc.signalProcess("KILL")
                yield out.ended
        # Shards outlive agents by design: kill what the state dirs record.
        for state in self.states.values():
            if not state.exists():
                continue
            for record in StateDir(state).load_all():
                try:
                    os.killpg(record.pid, signal.SIGKILL)
                except OSError:
                    pass

    def start_plane(self) -> ControlPlane:
        catalog = Path(self.mktemp())
        # A port range of its own, so a server left on the demo's ports by
        # something else on this machine does not fail the test; below
        # Linux's ephemeral range (32768 up), where this test's own
        # connections and listeners take ports the shards would be refused.
        first = random.randrange(21000, 32000, 1000)
        text = EXAMPLE.read_text().replace("env = {}", f'env = {{ PYTHONPATH = "{ROOT}" }}')
        text = text.replace("first = 20000", f"first = {first}").replace(
            "last = 20999", f"last = {first + 999}")
        # Nothing is placed until both agents are up (see the test), so that
        # a slow agent start does not put both replicas on the first node.
        text = text.replace("replicas = 2", "replicas = 0")
        catalog.write_text(text)
        opts = Options()
        opts.parseOptions([
            "--certs", str(self.dir), "--agent-listen", f"127.0.0.1:{self.port}", "--admin", "127.0.0.1:0",
            "--gateway", "127.0.0.1:0",
            "--catalog", str(catalog), "--heartbeat", str(HEARTBEAT),
            "--pass-interval", "0.2", "--adoption-grace", "1",
        ])
        plane = makeService(opts, reactor=reactor)
        assert plane.reconciler is not None
        # A short crash backoff keeps the test brief; its growth is unit-tested.
        plane.reconciler.backoff = Backoff(base=0.5, cap=2.0)
        plane.startService()
        self.plane = plane
        return plane

    def start_agent(self, node: str) -> None:
        out = ProcessOutput()
        args = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()",
                "-n", "--pidfile=", "llmgw", "agent",
                "--control", f"127.0.0.1:{self.port}", "--certs", str(self.dir),
                "--node", node, "--gpus", "sim:2x24GiB", "--state-dir", str(self.states[node]),
                "--heartbeat", str(HEARTBEAT)]
        env = dict(os.environ, PYTHONPATH=ROOT)
        proc = reactor.spawnProcess(out, sys.executable, args, env=env, path=ROOT)
        self.agents.append((proc, out))

    @defer.inlineCallbacks
    def wait_for(self, what: str, check: Callable[[], Any], timeout: float = 30) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value:
                return value
            for _, out in self.agents:
                if out.ended.called:
                    self.fail(f"an agent exited while waiting for {what}:\n{out.text()[-3000:]}")
            if time.monotonic() > deadline:
                logs = "\n".join(out.text()[-3000:] for _, out in self.agents)
                events = self.plane.reconciler.events() if self.plane and self.plane.reconciler else []
                self.fail(f"timed out waiting for {what}; events: {events[-20:]}\nagents:\n{logs}")
            yield deferLater(reactor, 0.1, lambda: None)

    def ready(self) -> list[dict[str, Any]]:
        assert self.plane is not None and self.plane.reconciler is not None
        reps = [r for r in self.plane.reconciler.replicas() if r["state"] == "ready" and not r["draining"]]
        return reps if len(reps) == 2 else []

    @defer.inlineCallbacks
    def test_replace_killed_shard(self) -> Any:
        """
        Two agents and the demo catalog give two ready replicas on two
        different nodes; killing one shard's process gets that replica
        replaced and ready again, and C{llmgw ctl replicas} shows it.
        """
        plane = self.start_plane()
        for node in NODES:
            self.start_agent(node)
        yield self.wait_for("both agents connected",
                            lambda: plane.agents.connected_nodes() == sorted(NODES))
        assert plane.reconciler is not None
        plane.reconciler.scale("demo", 2)
        first = yield self.wait_for("two ready replicas", self.ready)
        nodes = {r["shards"][0]["node"] for r in first}
        self.assertEqual(nodes, set(NODES))

        victim = first[0]
        shard = victim["shards"][0]
        [record] = [r for r in StateDir(self.states[shard["node"]]).load_all() if r.spec.shard_id == shard["id"]]
        os.kill(record.pid, signal.SIGKILL)

        def replaced() -> list[dict[str, Any]]:
            reps = self.ready()
            return reps if reps and victim["id"] not in {r["id"] for r in reps} else []

        second = yield self.wait_for("the replica replaced and ready", replaced)
        assert plane.reconciler is not None
        kinds = [e["kind"] for e in plane.reconciler.events()]
        self.assertIn("shard_failed", kinds)
        failure = [d for d in plane.reconciler.deployments() if d["model"] == "demo"][0]["last_failure"]
        self.assertEqual(failure["shard"], shard["id"])

        assert plane.admin_listener is not None
        host, port = plane.admin_listener.address()
        out, err, code = yield getProcessOutputAndValue(
            sys.executable, ["-m", "llmgw.ctl.main", "ctl", "replicas", "--admin-url", f"http://{host}:{port}"],
            env=dict(os.environ, PYTHONPATH=ROOT), path=ROOT,
        )
        self.assertEqual(code, 0, err)
        text = out.decode()
        for rep in second:
            self.assertIn(rep["id"], text)
        self.assertNotIn(victim["id"], text)
