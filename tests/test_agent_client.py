"""
Tests for L{llmgw.agent.client}: the agent's end of the stream, against a
C{StringTransport}, and against the real control-plane service over
in-memory mutual TLS.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from cryptography.x509.oid import ExtendedKeyUsageOID
from OpenSSL import SSL
from twisted.internet import defer, error
from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import globalLogPublisher
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.failure import Failure
from twisted.test.iosim import connectedServerAndClient
from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.client import (
    AgentConfig,
    AgentCore,
    AgentStreamClient,
    make_client_service,
)
from llmgw.agent.gpus import GPUMonitor, Problem, SimulatedGPUs
from llmgw.agent.state import ShardSpec
from llmgw.agent.supervisor import Supervisor
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.shell.agentsvc import AgentService
from llmgw.control.state.interfaces import ShardCommand
from llmgw.control.state.inventory import Inventory
from llmgw.testing.pki import issue_raw, make_pki
from llmgw.testing.sinks import RecordingSink
from llmgw.tlsconf.ca import CertificateAuthority
from llmgw.tlsconf.options import (
    AgentClientTLS,
    ServerIdentityError,
    ServerTLS,
    agent_files,
    server_files,
)
from llmgw.wire import ack
from tests.supervisor_harness import FakeOps, FakeProber, FakeSpawner


def frame(msg: Any) -> bytes:
    data = msg.SerializeToString()
    return struct.pack("!I", len(data)) + data


def read_frames(data: bytes) -> list[pb.AgentMessage]:
    out = []
    while data:
        (n,) = struct.unpack("!I", data[:4])
        m = pb.AgentMessage()
        m.ParseFromString(data[4 : 4 + n])
        out.append(m)
        data = data[4 + n :]
    return out


class Harness:
    """
    An agent core over a fake spawner and simulated GPUs.
    """

    def __init__(self, case: SynchronousTestCase, node_id: str = "node-1",
                 epoch_file: Path | None = None):
        self.clock = Clock()
        self.spawner = FakeSpawner()
        self.prober = FakeProber()
        self.supervisor = Supervisor(self.clock, self.spawner, None, gpu_indices=[0, 1],
                                     ops=FakeOps(), prober=self.prober, python="/py",
                                     base_env={})
        # Started, as in the agent (Service.running must not shadow anything).
        self.supervisor.startService()
        case.addCleanup(self.supervisor.stopService)
        self.source = SimulatedGPUs(2, 81920, salt=node_id)
        self.monitor = GPUMonitor(self.source, self.clock, interval=5)
        self.config = AgentConfig(node_id=node_id, control="127.0.0.1:7443",
                                  fabrics={"ib0": "10.1.0.5"}, heartbeat_interval=5,
                                  certificate_not_after=1900000000)
        self.core = AgentCore(self.config, self.supervisor, self.monitor, self.clock,
                              epoch_file=epoch_file, jitter=lambda: 0.0)

    def connect(self) -> tuple[AgentStreamClient, StringTransport]:
        proto = self.core.buildProtocol(None)
        transport = StringTransport()
        proto.makeConnection(transport)
        return proto, transport


def spec_msg(shard_id: str = "s1", epoch: int = 10, **kw: Any) -> pb.ControlMessage:
    kw.setdefault("argv", ["{python}", "-m", "x"])
    kw.setdefault("gpu_indices", [0])
    kw.setdefault("port", 8001)
    return pb.ControlMessage(start=pb.StartShard(shard_id=shard_id, replica_id="r1", model="m",
                                                 profile="p", epoch=epoch, **kw))


class ClientProtocolTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(self.events.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    def logged(self, fragment: str) -> list[dict[str, Any]]:
        from twisted.logger import formatEvent

        return [e for e in self.events if fragment in formatEvent(e)]

    def test_register_first(self) -> None:
        """
        On connect the agent sends a Register: protocol version 1, node id,
        agent version, GPUs, fabrics, running shards and certificate expiry.
        """
        h = Harness(self)
        h.supervisor.start(ShardSpec.from_message(spec_msg().start))
        proto, transport = h.connect()
        (msg,) = read_frames(transport.value())
        reg = msg.register
        self.assertEqual((reg.protocol_version, reg.node_id), (1, "node-1"))
        self.assertTrue(reg.agent_version)
        self.assertEqual([(g.index, g.memory_total_mb) for g in reg.gpus], [(0, 81920), (1, 81920)])
        self.assertEqual([(f.name, f.address) for f in reg.fabrics], [("ib0", "10.1.0.5")])
        self.assertEqual([(s.shard_id, s.state, s.port, list(s.gpu_indices), s.epoch)
                          for s in reg.running_shards],
                         [("s1", pb.ShardStatus.STATE_STARTING, 8001, [0], 10)])
        self.assertEqual(reg.certificate_not_after, 1900000000)
        self.assertNoResult(proto.registered)

    def test_ack_heartbeats(self) -> None:
        """
        After the Register Ack, heartbeats go out every interval with memory
        used per GPU, and a GPU problem goes out once, attributed.
        """
        h = Harness(self)
        proto, transport = h.connect()
        transport.clear()
        proto.dataReceived(frame(ack("register")))
        self.assertTrue(self.successResultOf(proto.registered))
        h.clock.advance(4.9)
        self.assertEqual(transport.value(), b"")
        h.monitor.apply(type(h.source.poll().result)({0: 100, 1: 200}, [Problem(1, "Xid 79")]))
        h.clock.advance(0.1)
        (hb,) = read_frames(transport.value())
        self.assertEqual(list(hb.heartbeat.gpu_memory_used_mb), [100, 200])
        self.assertEqual(list(hb.heartbeat.new_problems), ["Xid 79"])
        self.assertEqual([(p.gpu_index, p.problem) for p in hb.heartbeat.new_gpu_problems],
                         [(1, "Xid 79")])
        transport.clear()
        h.clock.advance(5)
        (hb,) = read_frames(transport.value())
        self.assertEqual(list(hb.heartbeat.new_problems), [])

    def test_commands_and_statuses(self) -> None:
        """
        Start, Drain and Stop reach the supervisor, and every transition goes
        out as a ShardStatus.
        """
        h = Harness(self)
        proto, transport = h.connect()
        proto.dataReceived(frame(ack("register")))
        transport.clear()
        proto.dataReceived(frame(spec_msg()))
        h.clock.advance(0)
        h.prober.answer(True)
        proto.dataReceived(frame(pb.ControlMessage(drain=pb.DrainShard(shard_id="s1", epoch=10))))
        proto.dataReceived(frame(pb.ControlMessage(stop=pb.StopShard(shard_id="s1", epoch=10))))
        h.spawner.processes[0].end(0)
        states = [m.shard.state for m in read_frames(transport.value())]
        S = pb.ShardStatus
        self.assertEqual(states, [S.STATE_STARTING, S.STATE_READY, S.STATE_DRAINING,
                                  S.STATE_STOPPING, S.STATE_STOPPED])

    def test_failed_status_carries_output(self) -> None:
        """
        A failed shard's status carries its error, exit code and last output.
        """
        h = Harness(self)
        proto, transport = h.connect()
        proto.dataReceived(frame(ack("register")))
        proto.dataReceived(frame(spec_msg()))
        transport.clear()
        shard = h.supervisor.get("s1")
        assert shard is not None
        shard._startup_output.append("boom")
        h.spawner.processes[0].end(4)
        (m,) = read_frames(transport.value())
        self.assertEqual((m.shard.state, m.shard.exit_code, m.shard.last_output),
                         (pb.ShardStatus.STATE_FAILED, 4, "boom"))
        self.assertIn("exit code 4", m.shard.error)
        self.assertEqual(m.shard.crash_class, "unknown")

    def test_register_lists_held_and_strays(self) -> None:
        """
        The Register lists stopping shards (their GPUs are held) with their
        process group, a shard whose record was lost (record_lost, profile
        unknown), and the stray processes the agent cannot account for that
        still run.
        """
        from llmgw.agent.adoption import Stray
        from llmgw.agent.shard import STOPPING, Shard

        h = Harness(self)
        h.supervisor.start(ShardSpec.from_message(spec_msg().start))
        h.supervisor.stop("s1")
        lost = Shard(ShardSpec(shard_id="lost", replica_id="r9", model="m", profile="",
                               argv=[], gpu_indices=[1], port=9001))
        lost.record_lost, lost.pid = True, 4321
        h.supervisor.shards["lost"] = lost
        h.supervisor.strays.append(Stray(pid=77, pgid=70, shard_id="", reason="no id",
                                         command="python x", start_time=4242 + 77))
        h.supervisor.strays.append(Stray(pid=78, pgid=70, shard_id="", reason="gone",
                                         command="python y", start_time=1))
        proto, transport = h.connect()
        (msg,) = read_frames(transport.value())
        reg = msg.register
        self.assertEqual([(s.shard_id, s.state, s.record_lost, s.profile, s.pgid)
                          for s in reg.running_shards],
                         [("s1", pb.ShardStatus.STATE_STOPPING, False, "p", 1001),
                          ("lost", pb.ShardStatus.STATE_STARTING, True, "", 4321)])
        self.assertEqual([(p.pid, p.pgid, p.reason, p.command) for p in reg.stray_processes],
                         [(77, 70, "no id", "python x")])
        self.assertEqual(h.supervisor.get("s1").state, STOPPING)  # type: ignore[union-attr]

    def test_stale_epoch_refused(self) -> None:
        """
        A command from an epoch older than the newest seen is refused and
        logged; the newest epoch is kept in the epoch file across restarts.
        """
        epoch_file = Path(self.mktemp())
        h = Harness(self, epoch_file=epoch_file)
        proto, _ = h.connect()
        proto.dataReceived(frame(ack("register")))
        proto.dataReceived(frame(spec_msg(epoch=20)))
        proto.dataReceived(frame(pb.ControlMessage(stop=pb.StopShard(shard_id="s1", epoch=19))))
        self.assertEqual(h.supervisor.get("s1").state, "starting")  # type: ignore[union-attr]
        self.assertEqual(len(self.logged("from control plane epoch 19")), 1)
        self.assertEqual(epoch_file.read_text().strip(), "20")
        h2 = Harness(self, epoch_file=epoch_file)
        proto2, _ = h2.connect()
        proto2.dataReceived(frame(spec_msg("s9", epoch=19)))
        self.assertIsNone(h2.supervisor.get("s9"))

    def test_identity_refusal(self) -> None:
        """
        A refusal for identity is a configuration error: logged as such, the
        registration fails, and the next retry is at the longest backoff.
        """
        h = Harness(self)
        proto, transport = h.connect()
        proto.dataReceived(frame(ack("register", ok=False, code=pb.Ack.CODE_PERMISSION_DENIED,
                                     error="certificate authorizes node 'a', not 'b'")))
        self.assertTrue(transport.disconnecting)
        proto.connectionLost(Failure(error.ConnectionDone()))
        self.assertFalse(self.successResultOf(proto.registered))
        self.assertIn("not 'b'", h.core.last_failure or "")
        self.assertEqual(len(self.logged("CONFIGURATION ERROR")), 1)
        self.assertEqual(h.core.retry_delay(1), 30.0)

    def test_other_refusal_normal_backoff(self) -> None:
        """
        A refusal that is not about identity or version (the control plane
        is full) keeps the normal backoff.
        """
        h = Harness(self)
        proto, _ = h.connect()
        proto.dataReceived(frame(ack("register", ok=False, code=pb.Ack.CODE_RESOURCE_EXHAUSTED,
                                     error="full")))
        proto.connectionLost(Failure(error.ConnectionDone()))
        self.assertFalse(self.successResultOf(proto.registered))
        self.assertEqual(h.core.retry_delay(1), 1.0)

    def test_tls13_alert(self) -> None:
        """
        Under TLS 1.3 a refused client certificate arrives as an alert on
        the first read; it is a configuration error too.
        """
        h = Harness(self)
        proto, _ = h.connect()
        alert = SSL.Error([("SSL routines", "", "tlsv13 alert certificate required")])
        proto.connectionLost(Failure(alert))
        self.assertFalse(self.successResultOf(proto.registered))
        self.assertEqual(h.core.retry_delay(1), 30.0)
        self.assertIn("does not accept this node's certificate", h.core.config_error or "")

    def test_shard_refusal_keeps_stream(self) -> None:
        """
        A refused ShardStatus (Ack ok=false, message_id shard:ID) is logged
        and the stream stays open.
        """
        h = Harness(self)
        proto, transport = h.connect()
        proto.dataReceived(frame(ack("register")))
        proto.dataReceived(frame(ack("shard:s7", ok=False, code=pb.Ack.CODE_PERMISSION_DENIED,
                                     error="shard 's7' is not on node 'node-1'")))
        self.assertFalse(transport.disconnecting)
        self.assertEqual(len(self.logged("refused our status for shard s7")), 1)

    def test_reregister_ack(self) -> None:
        """
        An Ack ok=true for a later Register changes nothing.
        """
        h = Harness(self)
        proto, transport = h.connect()
        proto.dataReceived(frame(ack("register")))
        proto.dataReceived(frame(ack("register")))
        self.assertFalse(transport.disconnecting)
        self.assertEqual(h.core.registrations, 1)

    def test_statuses_queued_while_away(self) -> None:
        """
        A shard that ends while no stream is open has its final status sent
        after the next Register is acknowledged.
        """
        h = Harness(self)
        h.supervisor.start(ShardSpec.from_message(spec_msg().start))
        h.spawner.processes[0].end(9)
        proto, transport = h.connect()
        (reg,) = read_frames(transport.value())
        self.assertEqual(list(reg.register.running_shards), [])
        transport.clear()
        proto.dataReceived(frame(ack("register")))
        (m,) = read_frames(transport.value())
        self.assertEqual((m.shard.shard_id, m.shard.exit_code), ("s1", 9))

    def test_ack_timeout(self) -> None:
        """
        A control plane that never acknowledges the Register is disconnected
        after the timeout.
        """
        h = Harness(self)
        proto, transport = h.connect()
        h.clock.advance(30)
        self.assertTrue(transport.disconnected)

    def test_bad_frame_ignored(self) -> None:
        """
        An undecodable frame from the control plane is logged and the stream
        goes on.
        """
        h = Harness(self)
        proto, transport = h.connect()
        proto.dataReceived(struct.pack("!I", 3) + b"\xff\xff\xff")
        proto.dataReceived(frame(ack("register")))
        self.assertTrue(self.successResultOf(proto.registered))
        self.assertEqual(len(self.logged("ignoring a frame")), 1)


class FakeEndpoint:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.attempts: list[float] = []
        self.succeed = False
        self.protos: list[Any] = []

    def connect(self, factory: Any) -> defer.Deferred[Any]:
        self.attempts.append(self.clock.seconds())
        if not self.succeed:
            return defer.fail(error.ConnectionRefusedError("refused"))
        proto = factory.buildProtocol(IPv4Address("TCP", "127.0.0.1", 7443))
        proto.makeConnection(StringTransport())
        self.protos.append(proto)
        return defer.succeed(proto)


class BackoffTests(SynchronousTestCase):
    def test_backoff_capped_and_reset_after_register(self) -> None:
        """
        Reconnects back off exponentially to a 30 s cap; a connection that
        never registers does not reset it; a registered one does.
        """
        h = Harness(self)
        h.supervisor.stopService()  # only the reconnect timer on the clock
        endpoint = FakeEndpoint(h.clock)
        service = make_client_service(h.core, endpoint)
        service.startService()
        self.addCleanup(service.stopService)
        gaps = []
        for _ in range(8):
            (call,) = h.clock.getDelayedCalls()
            gaps.append(call.getTime() - h.clock.seconds())
            h.clock.advance(gaps[-1])
        self.assertEqual(gaps, [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0])
        self.assertEqual(len(endpoint.attempts), 9)
        # Connected, but the stream closes before any Ack: still backing off.
        endpoint.succeed = True
        before = len(endpoint.attempts)
        h.clock.advance(30)
        self.assertEqual(len(endpoint.attempts), before + 1)
        endpoint.protos[-1].connectionLost(Failure(error.ConnectionLost()))
        h.clock.advance(29.9)
        self.assertEqual(len(endpoint.attempts), before + 1)
        h.clock.advance(0.1)
        self.assertEqual(len(endpoint.attempts), before + 2)
        # This one registers: the next reconnect comes after the first delay.
        endpoint.protos[-1].dataReceived(frame(ack("register")))
        endpoint.protos[-1].connectionLost(Failure(error.ConnectionLost()))
        h.clock.advance(1.0)
        self.assertEqual(len(endpoint.attempts), before + 3)


class InMemoryTLSTests(SynchronousTestCase):
    """
    The agent against the real control-plane agent service over mutual TLS
    in memory.
    """

    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        self.ca = make_pki(self.dir, nodes=["node-1"], server_hosts=["127.0.0.1"])
        self.sink = RecordingSink()
        self.events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(self.events.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    def connect(self, h: Harness, host: str = "127.0.0.1") -> tuple[Any, Any, Any, AgentService]:
        service = AgentService(Inventory(), self.sink, clock=h.clock, epoch=100)
        server_factory = TLSMemoryBIOFactory(ServerTLS(server_files(self.dir)), False, service,
                                             clock=h.clock)
        client_factory = TLSMemoryBIOFactory(
            AgentClientTLS(host, agent_files(self.dir, "node-1")), True, h.core, clock=h.clock
        )
        addr = IPv4Address("TCP", "127.0.0.1", 7443)
        client, server, pump = connectedServerAndClient(
            lambda: server_factory.buildProtocol(addr),
            lambda: client_factory.buildProtocol(addr),
            clock=h.clock,
            greet=False,
        )
        return client.wrappedProtocol, server.wrappedProtocol, pump, service

    def test_register_and_start(self) -> None:
        """
        The agent registers over mutual TLS, the control plane's StartShard
        reaches the supervisor, and the shard's statuses are accepted.
        """
        h = Harness(self)
        agent, server, pump, service = self.connect(h)
        pump.flush()
        self.assertTrue(self.successResultOf(agent.registered))
        self.assertEqual(service.connected_nodes(), ["node-1"])
        self.sink.place("s1", "node-1")
        service.start_shard(ShardCommand(node_id="node-1", shard_id="s1", replica_id="r1",
                                         model="m", profile="p", argv=("{python}",),
                                         gpu_indices=(1,), port=8001))
        pump.flush()
        h.clock.advance(0)
        h.prober.answer(True)
        pump.flush()
        self.assertEqual([(s.shard_id, s.state) for s in self.sink.statuses],
                         [("s1", "starting"), ("s1", "ready")])
        self.assertEqual(h.core.newest_epoch, 100)

    def test_unclaimed_stopped(self) -> None:
        """
        A shard the control plane does not claim on Register is stopped.
        """
        self.sink.claim = False
        h = Harness(self)
        h.supervisor.start(ShardSpec.from_message(spec_msg(epoch=1).start))
        agent, server, pump, service = self.connect(h)
        self.sink.dispatcher, self.sink.clock = service, h.clock
        pump.flush()
        h.clock.advance(0)
        pump.flush()
        self.assertTrue(self.successResultOf(agent.registered))
        self.assertEqual(h.spawner.processes and len(h.supervisor.held_shards()), 1)
        shard = h.supervisor.get("s1")
        assert shard is not None
        self.assertEqual(shard.state, "stopping")

    def test_wrong_node_id(self) -> None:
        """
        An agent whose claimed node id differs from its certificate is
        refused for permission: a configuration error.
        """
        h = Harness(self, node_id="node-2")
        agent, server, pump, service = self.connect(h)
        pump.flush()
        self.assertFalse(self.successResultOf(agent.registered))
        self.assertIn("PERMISSION_DENIED", h.core.last_failure or "")
        self.assertIsNotNone(h.core.config_error)

    def assertServerRefused(self, h: Harness, agent: Any, pump: Any, sans: str) -> None:
        pump.flush()
        self.assertFalse(self.successResultOf(agent.registered))
        self.assertIn("'127.0.0.1'", h.core.last_failure or "")
        self.assertIn(sans, h.core.last_failure or "")
        self.assertIsNotNone(h.core.config_error)

    def test_server_without_dialled_ip(self) -> None:
        """
        A control plane whose certificate does not name the dialled IP is
        refused, naming the address and the names it holds.
        """
        ca = CertificateAuthority.load(self.dir)
        ca.issue_server(["10.9.9.9", "cp.example"])
        h = Harness(self)
        agent, server, pump, service = self.connect(h)
        self.assertServerRefused(h, agent, pump, "DNS:cp.example, IP:10.9.9.9")
        self.assertEqual(service.connected_nodes(), [])

    def test_server_without_sans(self) -> None:
        """
        A control plane certificate with no SAN extension at all is refused
        even when its common name is the dialled IP.
        """
        issue_raw(CertificateAuthority.load(self.dir), "server", "127.0.0.1", usage=ExtendedKeyUsageOID.SERVER_AUTH)
        h = Harness(self)
        agent, server, pump, service = self.connect(h)
        self.assertServerRefused(h, agent, pump, "no subject alternative names at all")
        self.assertIsInstance(ServerIdentityError("h", []), Exception)
