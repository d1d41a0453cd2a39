"""
Integration tests: a real ``twistd -n llmgw agent`` process against a real
control plane (in this process, on 127.0.0.1, with mutual TLS), running the
fake model server as its shard. Bounded: every wait has a deadline, and
every process started is killed in cleanup, even on failure.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.x509.oid import ExtendedKeyUsageOID
from twisted.internet import defer, reactor
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

import llmgw
from llmgw.agent.state import StateDir
from llmgw.control.service import ControlPlane
from llmgw.control.state.interfaces import ShardCommand
from llmgw.testing.pki import issue_raw, make_pki
from llmgw.testing.procs import ProcessOutput, free_port, process_alive
from llmgw.testing.sinks import RecordingSink
from llmgw.tlsconf.ca import CertificateAuthority
from llmgw.tlsconf.options import ServerTLS, server_files

ROOT = str(Path(llmgw.__file__).resolve().parent.parent)
HEARTBEAT = 0.5






class AgentIntegrationTests(TestCase):
    timeout = 60

    def setUp(self) -> None:
        self.dir = Path(self.mktemp()).resolve()
        make_pki(self.dir, nodes=["node-1"], server_hosts=["127.0.0.1"])
        self.state = Path(self.mktemp()).resolve()
        self.port = free_port()
        self.sink = RecordingSink()
        self.planes: list[ControlPlane] = []
        self.agents: list[tuple[Any, ProcessOutput]] = []
        #: Shard process groups to KILL in cleanup that no record names.
        self.lost_pids: list[int] = []
        self.addCleanup(self.cleanup)

    @defer.inlineCallbacks
    def cleanup(self) -> Any:
        for plane in self.planes:
            if plane.running:
                yield plane.stopService()
        for proc, out in self.agents:
            if out.ended.called:
                continue
            proc.signalProcess("KILL")
            yield out.ended
        # Shards outlive agents by design: kill what the state dir records.
        shards = self.state / "shards"
        pids = list(self.lost_pids)
        for record in shards.glob("*.json") if shards.exists() else []:
            try:
                pids.append(int(__import__("json").loads(record.read_text())["pid"]))
            except ValueError:
                pass
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass

    def control_plane(self, certs: Path | None = None) -> ControlPlane:
        plane = ControlPlane(
            reactor, sink=self.sink, tls=ServerTLS(server_files(certs or self.dir)),
            agents_host="127.0.0.1", agents_port=self.port, heartbeat_interval=HEARTBEAT,
        )
        plane.startService()
        self.planes.append(plane)
        # The sink stops what it does not claim, as the reconciler does.
        self.sink.dispatcher, self.sink.clock = plane.agents, reactor
        return plane

    def start_agent(self) -> ProcessOutput:
        out = ProcessOutput()
        args = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()",
                "-n", "--pidfile=", "llmgw", "agent",
                "--control", f"127.0.0.1:{self.port}", "--certs", str(self.dir),
                "--node", "node-1", "--gpus", "sim:2x24GiB", "--state-dir", str(self.state),
                "--heartbeat", str(HEARTBEAT)]
        env = dict(os.environ, PYTHONPATH=ROOT)
        proc = reactor.spawnProcess(out, sys.executable, args, env=env, path=ROOT)
        self.agents.append((proc, out))
        return out

    @defer.inlineCallbacks
    def wait_for(self, what: str, check: Callable[[], Any], timeout: float = 15) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value:
                return value
            if self.agents and self.agents[-1][1].ended.called:
                self.fail(f"the agent exited while waiting for {what}:\n"
                          f"{self.agents[-1][1].text()[-3000:]}")
            if time.monotonic() > deadline:
                logs = "\n".join(out.text()[-3000:] for _, out in self.agents)
                self.fail(f"timed out waiting for {what}; agent output:\n{logs}")
            yield deferLater(reactor, 0.05, lambda: None)

    def states(self, shard_id: str) -> list[str]:
        return [s.state for s in self.sink.statuses if s.shard_id == shard_id]

    def start_shard(self, plane: ControlPlane, shard_id: str, port: int, *extra: str,
                    grace: int = 5) -> None:
        self.sink.place(shard_id, "node-1")
        plane.agents.start_shard(ShardCommand(
            node_id="node-1", shard_id=shard_id, replica_id=f"r-{shard_id}", model="tiny",
            profile="fake", gpu_indices=(0,) if shard_id.endswith("a") else (1,), port=port,
            argv=("{python}", "-m", "llmgw.testing.fakemodel", "--model", "tiny", *extra),
            env={"PYTHONPATH": ROOT}, startup_timeout_s=20, stop_grace_s=grace,
        ))

    def record_pid(self, shard_id: str) -> int:
        for record in StateDir(self.state).load_all():
            if record.spec.shard_id == shard_id:
                return record.pid
        self.fail(f"no state record for {shard_id}")

    @defer.inlineCallbacks
    def test_start_kill_stop(self) -> Any:
        """
        A real agent registers over mutual TLS, runs the fake model server
        for a StartShard (starting, then ready); killing the process gives
        failed with its signal and last output; Stop gives stopped, by KILL
        after the grace for a shard that ignores TERM.
        """
        plane = self.control_plane()
        self.start_agent()
        yield self.wait_for("registration", lambda: "node-1" in plane.agents.connected_nodes())
        self.start_shard(plane, "s-a", free_port())
        yield self.wait_for("s-a ready", lambda: "ready" in self.states("s-a"))
        self.assertEqual(self.states("s-a"), ["starting", "ready"])
        pid = self.record_pid("s-a")
        self.assertEqual(os.getpgid(pid), pid, "the shard leads its own process group")
        os.kill(pid, signal.SIGKILL)
        yield self.wait_for("s-a failed", lambda: "failed" in self.states("s-a"))
        failed = [s for s in self.sink.statuses if s.shard_id == "s-a"][-1]
        self.assertEqual(failed.signal, signal.SIGKILL)
        self.assertIn("fakemodel: serving model 'tiny'", failed.last_output)

        self.start_shard(plane, "s-b", free_port(), "--ignore-term", grace=1)
        yield self.wait_for("s-b ready", lambda: "ready" in self.states("s-b"))
        plane.agents.stop_shard("node-1", "s-b")
        yield self.wait_for("s-b stopped", lambda: "stopped" in self.states("s-b"))
        stopped = [s for s in self.sink.statuses if s.shard_id == "s-b"][-1]
        self.assertEqual(stopped.signal, signal.SIGKILL, "a shard that ignores TERM is KILLed after the grace")

    @defer.inlineCallbacks
    def test_shards_outlive_control_plane_and_agent(self) -> Any:
        """
        Restarting the control plane leaves the shard running and the next
        Register lists it; restarting the agent leaves it running with the
        same pid, and the new agent lists it again.
        """
        plane = self.control_plane()
        self.start_agent()
        yield self.wait_for("registration", lambda: "node-1" in plane.agents.connected_nodes())
        self.start_shard(plane, "s-a", free_port())
        yield self.wait_for("ready", lambda: "ready" in self.states("s-a"))
        pid = self.record_pid("s-a")

        yield plane.stopService()
        # ControlPlane.stopService stops listening but leaves open streams
        # open; a process restart would close them.
        plane.agents.close_streams(plane.agents.connected_nodes(), "control plane restart")
        plane2 = self.control_plane()
        yield self.wait_for("re-registration", lambda: "node-1" in plane2.agents.connected_nodes())
        (node, listed), = self.sink.adopted
        self.assertEqual((node, [(s.shard_id, s.state) for s in listed]), ("node-1", [("s-a", "ready")]))
        os.kill(pid, 0)

        proc, out = self.agents[0]
        proc.signalProcess("TERM")
        yield out.ended
        os.kill(pid, 0)  # still alive without its agent
        self.start_agent()
        yield self.wait_for("second adoption", lambda: len(self.sink.adopted) == 2, timeout=20)
        (node, listed) = self.sink.adopted[1]
        self.assertEqual([s.shard_id for s in listed], ["s-a"])
        self.assertEqual(self.record_pid("s-a"), pid)
        self.assertIn("re-adopted shard s-a", self.agents[1][1].text())
        # Still supervised: its exit is noticed by polling.
        os.kill(pid, signal.SIGKILL)
        yield self.wait_for("failure after re-adoption", lambda: "failed" in self.states("s-a"))

    @defer.inlineCallbacks
    def test_truncated_record_still_reported(self) -> Any:
        """
        A running shard whose record the agent finds truncated after a
        restart is still listed in its Register (found by the marker in its
        environment, profile unknown), is stopped when the control plane
        hands it back, and no process of it is left.
        """
        plane = self.control_plane()
        self.start_agent()
        yield self.wait_for("registration", lambda: "node-1" in plane.agents.connected_nodes())
        self.start_shard(plane, "s-a", free_port())
        yield self.wait_for("ready", lambda: "ready" in self.states("s-a"))
        pid = self.record_pid("s-a")
        self.lost_pids.append(pid)
        proc, out = self.agents[0]
        proc.signalProcess("TERM")
        yield out.ended
        record = self.state / "shards" / "s-a.json"
        record.write_bytes(record.read_bytes()[:50])
        self.sink.claim = False
        self.start_agent()
        yield self.wait_for("adoption", lambda: len(self.sink.adopted) == 1, timeout=20)
        (node, listed) = self.sink.adopted[0]
        self.assertEqual([(s.shard_id, s.replica_id, s.model, s.profile, s.gpu_indices)
                          for s in listed], [("s-a", "r-s-a", "tiny", "", (0,))])
        self.assertIn("FOUND SHARD s-a RUNNING WITHOUT A RECORD", self.agents[1][1].text())
        yield self.wait_for("stopped", lambda: "stopped" in self.states("s-a"))
        # Its parent (the first agent) is gone: an init that does not reap
        # may keep it as a zombie, which is no live process.
        self.assertFalse(process_alive(pid))

    @defer.inlineCallbacks
    def test_server_certificate_refused(self) -> Any:
        """
        A control plane certificate without the dialled IP, or with no SAN
        extension at all, is refused by the agent, which names the address
        and the names the certificate holds.
        """
        other = Path(self.mktemp()).resolve()
        other.mkdir()
        for name in ("ca.pem", "ca.key", "agent-node-1.pem", "agent-node-1.key"):
            (other / name).write_bytes((self.dir / name).read_bytes())
        ca = CertificateAuthority.load(other)
        ca.issue_server(["10.1.2.3"])
        plane = self.control_plane(other)
        out = self.start_agent()
        yield self.wait_for("refusal", lambda: "CONFIGURATION ERROR" in out.text())
        self.assertIn("does not name '127.0.0.1'", out.text())
        self.assertIn("IP:10.1.2.3", out.text())
        self.assertEqual(plane.agents.connected_nodes(), [])
        yield plane.stopService()
        self.agents[0][0].signalProcess("KILL")
        yield out.ended

        issue_raw(ca, "server", "127.0.0.1", usage=ExtendedKeyUsageOID.SERVER_AUTH)
        plane = self.control_plane(other)
        out = self.start_agent()
        yield self.wait_for("refusal", lambda: "CONFIGURATION ERROR" in out.text())
        self.assertIn("no subject alternative names at all", out.text())
        self.assertEqual(plane.agents.connected_nodes(), [])
