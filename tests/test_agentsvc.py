"""
Tests for L{llmgw.control.shell.agentsvc}: the control plane's side of the agent
stream, driven through C{StringTransport} and a C{Clock}.
"""

from __future__ import annotations

import struct

from cryptography import x509
from OpenSSL import crypto
from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.logger import Logger, LogLevel, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.shell.agentsvc import AgentService, AgentStreamProtocol
from llmgw.control.state.interfaces import NotConnected, NotKeepingUp, ShardCommand
from llmgw.control.state.inventory import (
    MAX_STRAY_TEXT,
    MAX_STRAYS_PER_NODE,
    Inventory,
    Node,
    StrayProcess,
)
from llmgw.testing.pki import issue_raw, make_pki
from llmgw.testing.sinks import RecordingSink
from llmgw.testing.stream import PeerCertTransport, frame, register

_PKI: dict[str, object] = {}


def peer_cert(test: SynchronousTestCase, name: str) -> crypto.X509:
    """
    The pyOpenSSL certificate for C{name} (a node id, "server", or a raw
    stem), from one CA made per test run.
    """
    if "ca" not in _PKI:
        _PKI["ca"] = make_pki(test.mktemp(), nodes=("node-a", "node-b"))
    ca = _PKI["ca"]
    path = ca.directory / ("server.pem" if name == "server" else f"agent-{name}.pem")  # type: ignore[attr-defined]
    if not path.exists():
        path, _ = issue_raw(ca, name, name)  # type: ignore[arg-type]
    return crypto.X509.from_cryptography(x509.load_pem_x509_certificate(path.read_bytes()))


class Harness:
    """
    One agent service with a clock, an inventory and a recording sink.
    """

    def __init__(self, test: SynchronousTestCase, tls: bool = True, **kw: object):
        self.test = test
        self.clock = Clock()
        self.inventory = Inventory()
        self.sink = RecordingSink(claim=kw.pop("claim", True))  # type: ignore[arg-type]
        self.service = AgentService(
            self.inventory, self.sink, self.clock, epoch=42, tls=tls, require_identity=tls, **kw
        )

    def connect(
        self, cert_name: str | None = "node-a", handshake: bool = True, port: int = 40000
    ) -> tuple[AgentStreamProtocol, PeerCertTransport]:
        proto = self.service.buildProtocol(IPv4Address("TCP", "10.0.0.1", port))
        cert = peer_cert(self.test, cert_name) if cert_name else None
        transport = PeerCertTransport(
            cert, peerAddress=IPv4Address("TCP", "10.0.0.1", port)
        )
        proto.makeConnection(transport)
        if handshake and self.service.tls:
            proto.handshakeCompleted()
        return proto, transport

    def registered(
        self, node: str = "node-a", **kw: object
    ) -> tuple[AgentStreamProtocol, PeerCertTransport]:
        proto, transport = self.connect(node)
        proto.dataReceived(frame(register(node, **kw)))  # type: ignore[arg-type]
        acks = transport.frames()
        self.test.assertTrue(acks and acks[0].ack.ok, acks)
        transport.clear()
        return proto, transport


class IterationClock(Clock):
    """
    A clock that, like the reactor, runs in one C{advance} only the calls
    that were due when it began: a call scheduled by one of them waits for
    the next iteration, after the reactor has read its sockets.
    """

    def advance(self, amount: float) -> None:
        self.rightNow += amount
        self._sortCalls()
        due = [c for c in self.calls if c.getTime() <= self.seconds()]
        for call in due:
            if call in self.calls:
                self.calls.remove(call)
                call.called = 1
                call.func(*call.args, **call.kw)


def only_ack(test: SynchronousTestCase, transport: PeerCertTransport) -> pb.Ack:
    frames = transport.frames()
    test.assertEqual(len(frames), 1, frames)
    test.assertEqual(frames[0].WhichOneof("msg"), "ack")
    return frames[0].ack


class RegisterTests(SynchronousTestCase):
    def test_register_ack(self) -> None:
        """
        A Register from the node its certificate names is acknowledged, and
        the node enters the inventory and the connection map.
        """
        h = Harness(self)
        proto, transport = h.connect("node-a")
        proto.dataReceived(frame(register("node-a", gpus=4, fabrics={"ib0": "10.1.0.1"})))
        ack = only_ack(self, transport)
        self.assertTrue(ack.ok)
        self.assertEqual(ack.message_id, "register")
        node = h.inventory.get("node-a")
        assert node is not None
        self.assertEqual(len(node.gpus), 4)
        self.assertEqual(node.fabrics, {"ib0": "10.1.0.1"})
        self.assertEqual(node.address, "10.0.0.1")
        self.assertEqual(h.service.connected_nodes(), ["node-a"])
        self.assertEqual(h.sink.registered, ["node-a"])
        self.assertFalse(transport.disconnecting)

    def test_first_message_must_be_register(self) -> None:
        """
        Anything before a Register is refused as an invalid argument, the
        connection is closed and nobody is registered.
        """
        h = Harness(self)
        proto, transport = h.connect("node-a")
        proto.dataReceived(frame(pb.AgentMessage(heartbeat=pb.Heartbeat())))
        ack = only_ack(self, transport)
        self.assertFalse(ack.ok)
        self.assertEqual(ack.code, pb.Ack.CODE_INVALID_ARGUMENT)
        self.assertIn("first message must be a Register", ack.error)
        self.assertTrue(transport.disconnecting)
        self.assertEqual(len(h.inventory), 0)

    def test_missing_or_malformed_node_id(self) -> None:
        """
        An empty node id, or one outside the DNS-label grammar, is refused.
        """
        h = Harness(self, tls=False)
        for bad in ("", "Node_A", "-a", "a" * 64):
            proto, transport = h.connect(None)
            proto.dataReceived(frame(register(bad)))
            ack = only_ack(self, transport)
            self.assertEqual(ack.code, pb.Ack.CODE_INVALID_ARGUMENT, bad)
            self.assertTrue(transport.disconnecting)
        self.assertEqual(len(h.inventory), 0)

    def test_protocol_version(self) -> None:
        """
        A Register with another protocol version fails its precondition.
        """
        h = Harness(self)
        proto, transport = h.connect("node-a")
        proto.dataReceived(frame(register("node-a", version=2)))
        ack = only_ack(self, transport)
        self.assertEqual(ack.code, pb.Ack.CODE_FAILED_PRECONDITION)
        self.assertIn("protocol version 2", ack.error)

    def test_identity_mismatch(self) -> None:
        """
        A certificate for node-a claiming node-b is refused with permission
        denied naming both, and node-b's record and stream are untouched.
        """
        h = Harness(self)
        b_proto, b_transport = h.registered("node-b", gpus=8)
        before = h.inventory.get("node-b")
        proto, transport = h.connect("node-a")
        proto.dataReceived(frame(register("node-b", gpus=1)))
        ack = only_ack(self, transport)
        self.assertEqual(ack.code, pb.Ack.CODE_PERMISSION_DENIED)
        self.assertIn("'node-a'", ack.error)
        self.assertIn("'node-b'", ack.error)
        self.assertTrue(transport.disconnecting)
        self.assertEqual(h.inventory.get("node-b"), before)
        self.assertIs(h.service.stream("node-b"), b_proto)
        self.assertFalse(b_transport.disconnecting)

    def test_no_identity(self) -> None:
        """
        With identity required, a stream without a verified certificate is
        unauthenticated.
        """
        h = Harness(self)
        proto, transport = h.connect(None)
        proto.dataReceived(frame(register("node-a")))
        ack = only_ack(self, transport)
        self.assertEqual(ack.code, pb.Ack.CODE_UNAUTHENTICATED)
        self.assertNotIn("node-a", h.inventory)

    def test_server_certificate_is_no_identity(self) -> None:
        """
        A certificate issued for server authentication is not a node
        identity, even with a matching name.
        """
        h = Harness(self)
        proto, transport = h.connect("server")
        proto.dataReceived(frame(register("127.0.0.1")))
        ack = only_ack(self, transport)
        self.assertEqual(ack.code, pb.Ack.CODE_UNAUTHENTICATED)
        self.assertIn("client authentication", ack.error)

    def test_certificate_with_bad_common_name(self) -> None:
        """
        A client certificate whose common name is not a node id proves no
        identity.
        """
        h = Harness(self)
        proto, transport = h.connect("Bad_Name")
        proto.dataReceived(frame(register("bad-name")))
        ack = only_ack(self, transport)
        self.assertEqual(ack.code, pb.Ack.CODE_UNAUTHENTICATED)

    def test_reregister_taken(self) -> None:
        """
        A second Register on a live stream replaces the node's hardware
        view; the stream stays open.
        """
        h = Harness(self)
        proto, transport = h.registered("node-a", gpus=4)
        proto.dataReceived(frame(register("node-a", gpus=3)))
        node = h.inventory.get("node-a")
        assert node is not None
        self.assertEqual(len(node.gpus), 3)
        self.assertFalse(transport.disconnecting)
        self.assertIs(h.service.stream("node-a"), proto)

    def test_reregister_as_other_node(self) -> None:
        """
        A live stream cannot register again as another node.
        """
        h = Harness(self, tls=False)
        proto, transport = h.registered("node-a")
        proto.dataReceived(frame(register("node-b")))
        self.assertEqual(only_ack(self, transport).code, pb.Ack.CODE_PERMISSION_DENIED)
        self.assertNotIn("node-b", h.inventory)

    def test_duplicate_gpu_indices(self) -> None:
        """
        A Register whose GPUs repeat an index is refused as invalid.
        """
        h = Harness(self)
        proto, transport = h.connect("node-a")
        msg = register("node-a", gpus=2)
        msg.register.gpus[1].index = 0
        proto.dataReceived(frame(msg))
        self.assertEqual(only_ack(self, transport).code, pb.Ack.CODE_INVALID_ARGUMENT)


class AdoptionTests(SynchronousTestCase):
    def running(self, *ids: str) -> list[pb.RunningShard]:
        return [
            pb.RunningShard(shard_id=i, replica_id=f"r-{i}", model="m", profile="p",
                            gpu_indices=[0], port=9000, state=pb.ShardStatus.STATE_READY)
            for i in ids
        ]

    def test_unclaimed_left_to_the_sink(self) -> None:
        """
        Reported shards go to the sink right after the Ack; the agent
        service sends no Stop of its own for those the sink hands back (the
        reconciler is the one place that stops unclaimed shards, after this
        handler returns), so a later command is the next frame.
        """
        h = Harness(self, claim=False)
        proto, transport = h.connect("node-a")
        proto.dataReceived(frame(register("node-a", running=self.running("s1", "s2"))))
        h.service.start_shard(
            ShardCommand(node_id="node-a", shard_id="s3", replica_id="r3", model="m",
                         profile="p", argv=("x",), gpu_indices=(1,), port=9001)
        )
        kinds = [(f.WhichOneof("msg"), getattr(f, f.WhichOneof("msg")).ListFields()[0][1])
                 for f in transport.frames()]
        self.assertEqual(kinds, [("ack", "register"), ("start", "s3")])
        self.assertEqual([s.shard_id for s in h.sink.adopted[0][1]], ["s1", "s2"])
        self.assertEqual(h.sink.adopted[0][1][0].state, "ready")

    def test_claimed_not_stopped(self) -> None:
        """
        Claimed shards are not stopped.
        """
        h = Harness(self, claim=True)
        proto, transport = h.connect("node-a")
        proto.dataReceived(frame(register("node-a", running=self.running("s1"))))
        self.assertEqual([f.WhichOneof("msg") for f in transport.frames()], ["ack"])


class MessageTests(SynchronousTestCase):
    def test_heartbeat(self) -> None:
        """
        A heartbeat touches the node, folds in memory used, and attaches new
        problems to their GPU (or the first GPU when unattributed).
        """
        h = Harness(self)
        proto, _ = h.registered("node-a", gpus=3)
        h.clock.advance(4)
        proto.dataReceived(frame(pb.AgentMessage(heartbeat=pb.Heartbeat(
            gpu_memory_used_mb=[100, 200, 300],
            new_gpu_problems=[pb.GPUProblem(gpu_index=2, problem="xid 79")],
            new_problems=["xid 79", "ecc uncorrectable"],
        ))))
        node = h.inventory.get("node-a")
        assert node is not None
        self.assertEqual(node.last_seen, 4)
        self.assertEqual([g.memory_used_mb for g in node.gpus], [100, 200, 300])
        self.assertEqual(node.gpus[2].problems, ["xid 79"])
        self.assertEqual(node.gpus[0].problems, ["ecc uncorrectable"])
        self.assertEqual(node.gpus[1].problems, [])

    def test_shard_status_to_sink(self) -> None:
        """
        A status for a shard placed on this node reaches the sink; a failure
        carries exit code and last output.
        """
        h = Harness(self)
        h.sink.place("s1", "node-a")
        proto, transport = h.registered("node-a")
        proto.dataReceived(frame(pb.AgentMessage(shard=pb.ShardStatus(
            replica_id="r1", shard_id="s1", state=pb.ShardStatus.STATE_FAILED,
            error="exited", exit_code=3, last_output="Traceback...",
        ))))
        [report] = h.sink.statuses
        self.assertEqual((report.node_id, report.shard_id, report.state), ("node-a", "s1", "failed"))
        self.assertEqual((report.exit_code, report.last_output), (3, "Traceback..."))
        self.assertEqual(transport.frames(), [])

    def test_shard_status_of_other_node_refused(self) -> None:
        """
        A stream speaks only for its node: a status about a shard placed
        elsewhere (or unknown) is refused and not passed on; the stream stays.
        """
        h = Harness(self)
        h.sink.place("s-b", "node-b")
        proto, transport = h.registered("node-a")
        for shard in ("s-b", "unknown"):
            proto.dataReceived(frame(pb.AgentMessage(shard=pb.ShardStatus(
                replica_id="r", shard_id=shard, state=pb.ShardStatus.STATE_READY))))
        self.assertEqual(h.sink.statuses, [])
        frames = transport.frames()
        self.assertEqual([f.ack.code for f in frames], [pb.Ack.CODE_PERMISSION_DENIED] * 2)
        self.assertFalse(transport.disconnecting)

    def test_refusals_not_buffered_for_a_peer_that_does_not_read(self) -> None:
        """
        While the transport is paused, refused statuses get no answer, so a
        peer that keeps sending them and never reads cannot grow the buffer.
        """
        h = Harness(self)
        proto, transport = h.registered("node-a")
        proto.pauseProducing()
        for i in range(50):
            proto.dataReceived(frame(pb.AgentMessage(shard=pb.ShardStatus(
                replica_id="r", shard_id=f"not-mine-{i}", state=pb.ShardStatus.STATE_READY))))
        self.assertEqual(transport.value(), b"")
        self.assertEqual(h.sink.statuses, [])

    def test_status_of_reported_shard_accepted(self) -> None:
        """
        A shard the node itself reported running may be reported on, even if
        unclaimed (its Stop produces a final status).
        """
        h = Harness(self, claim=False)
        proto, transport = h.connect("node-a")
        proto.dataReceived(frame(register("node-a", running=[pb.RunningShard(
            shard_id="old", replica_id="r", model="gone", profile="p")])))
        proto.dataReceived(frame(pb.AgentMessage(shard=pb.ShardStatus(
            replica_id="r", shard_id="old", state=pb.ShardStatus.STATE_STOPPED))))
        self.assertEqual([s.state for s in h.sink.statuses], ["stopped"])

    def test_garbage_frame(self) -> None:
        """
        A frame that does not decode is refused and closes the stream.
        """
        h = Harness(self)
        proto, transport = h.connect("node-a")
        proto.dataReceived(frame(b"\xff\xff\xff\xff"))
        self.assertEqual(only_ack(self, transport).code, pb.Ack.CODE_INVALID_ARGUMENT)
        self.assertTrue(transport.disconnecting)

    def test_empty_message(self) -> None:
        """
        An AgentMessage with nothing in its oneof is refused.
        """
        h = Harness(self)
        proto, transport = h.connect("node-a")
        proto.dataReceived(frame(b""))
        ack = only_ack(self, transport)
        self.assertIn("empty or unknown", ack.error)

    def test_oversized_frame(self) -> None:
        """
        A frame prefix over the limit aborts the connection at once, before
        the body arrives.
        """
        h = Harness(self, max_frame=1024)
        proto, transport = h.connect("node-a")
        proto.dataReceived(struct.pack("!I", 1025) + b"x" * 10)
        self.assertTrue(transport.aborted)
        for _ in range(100):
            proto.dataReceived(b"x" * 1000)
        self.assertLess(len(proto._unprocessed), 1025)

    def test_refused_peer_that_never_reads_is_aborted(self) -> None:
        """
        A refused connection is closed gracefully, and aborted if it is still
        there a few seconds later.
        """
        h = Harness(self)
        proto, transport = h.connect(None)
        proto.dataReceived(frame(register("node-a")))
        self.assertFalse(transport.aborted)
        h.clock.advance(5)
        self.assertTrue(transport.aborted)


class StreamLifetimeTests(SynchronousTestCase):
    def test_newest_stream_wins(self) -> None:
        """
        A second stream for a node replaces the first, which is aborted; the
        old stream's late connectionLost does not detach the new one.
        """
        h = Harness(self)
        old, old_t = h.registered("node-a")
        new, new_t = h.registered("node-a")
        self.assertTrue(old_t.aborted)
        self.assertIs(h.service.stream("node-a"), new)
        old.connectionLost()
        self.assertIs(h.service.stream("node-a"), new)
        self.assertEqual(h.service.connected_nodes(), ["node-a"])

    def test_closed_stream_keeps_node(self) -> None:
        """
        A closed stream detaches the connection but leaves the node in the
        inventory: silence, not a closed socket, makes a node lost.
        """
        h = Harness(self)
        proto, _ = h.registered("node-a")
        proto.connectionLost()
        self.assertEqual(h.service.connected_nodes(), [])
        self.assertIn("node-a", h.inventory)

    def test_handshake_deadline(self) -> None:
        """
        A TLS handshake not done within 10 s is aborted.
        """
        h = Harness(self)
        proto, transport = h.connect("node-a", handshake=False)
        h.clock.advance(9.9)
        self.assertFalse(transport.aborted)
        h.clock.advance(0.2)
        self.assertTrue(transport.aborted)
        self.assertEqual(h.service.registrations["handshake_timeout"], 1)

    def test_register_deadline(self) -> None:
        """
        A connection that has not registered within 10 s of its handshake is
        closed; one that registered in time is not.
        """
        h = Harness(self)
        proto, transport = h.connect("node-a")
        ok, ok_t = h.registered("node-b")
        h.clock.advance(10.1)
        self.assertTrue(transport.aborted)
        self.assertFalse(ok_t.aborted)

    def test_silent_stream_closed(self) -> None:
        """
        A registered stream silent for three heartbeat intervals is closed;
        any message resets the deadline; the node stays in the inventory.
        """
        h = Harness(self, heartbeat_interval=5.0)
        proto, transport = h.registered("node-a")
        h.clock.advance(14)
        proto.dataReceived(frame(pb.AgentMessage(heartbeat=pb.Heartbeat())))
        h.clock.advance(14)
        self.assertFalse(transport.aborted)
        h.clock.advance(1.1)
        self.assertTrue(transport.aborted)
        self.assertIn("node-a", h.inventory)

    def test_reads_before_judging_silence(self) -> None:
        """
        After a pause of the control plane's own (SIGSTOP), the silence
        timer comes due before the heartbeats waiting in the socket are
        read: the stream is judged only after the next read, so a heartbeat
        read there keeps it open; with nothing read it is closed.
        """
        for heard in (True, False):
            h = Harness(self, heartbeat_interval=5.0)
            h.clock = IterationClock()
            h.service.clock = h.clock
            proto, transport = h.registered("node-a")
            h.clock.advance(25)  # the whole pause at once: the timer fires late
            self.assertFalse(transport.aborted)
            if heard:
                proto.dataReceived(frame(pb.AgentMessage(heartbeat=pb.Heartbeat())))
            h.clock.advance(0)  # the next reactor iteration
            self.assertEqual(transport.aborted, not heard)

    def test_connection_lost_cancels_timers(self) -> None:
        """
        Nothing is left on the clock after a stream closes.
        """
        h = Harness(self)
        proto, _ = h.registered("node-a")
        proto.connectionLost()
        self.assertEqual(h.clock.getDelayedCalls(), [])


class DispatcherTests(SynchronousTestCase):
    cmd = ShardCommand(node_id="node-a", shard_id="s1", replica_id="r1", model="m",
                       profile="p", argv=("serve", "--port", "9000"), gpu_indices=(0, 1),
                       port=9000, env={"A": "1"}, world_size=2, leader_address="10.0.0.1:9000")

    def test_not_connected(self) -> None:
        """
        A command for a node without a stream raises NotConnected.
        """
        h = Harness(self)
        self.assertRaises(NotConnected, h.service.start_shard, self.cmd)
        self.assertRaises(NotConnected, h.service.stop_shard, "node-x", "s")
        self.assertRaises(NotConnected, h.service.drain_shard, "node-x", "s")
        self.assertEqual(h.service.dispatch_refusals["not_connected"], 3)

    def test_commands_carry_epoch(self) -> None:
        """
        Start, Stop, Drain and Sleep reach the node with every field and
        the control plane's epoch.
        """
        h = Harness(self)
        proto, transport = h.registered("node-a")
        h.service.start_shard(self.cmd)
        h.service.drain_shard("node-a", "s1")
        h.service.stop_shard("node-a", "s1")
        h.service.sleep_shard("node-a", "s1")
        start, drain, stop, sleep = transport.frames()
        self.assertEqual((sleep.sleep.shard_id, sleep.sleep.epoch), ("s1", 42))
        self.assertEqual(start.start.shard_id, "s1")
        self.assertEqual(list(start.start.argv), ["serve", "--port", "9000"])
        self.assertEqual(list(start.start.gpu_indices), [0, 1])
        self.assertEqual(dict(start.start.env), {"A": "1"})
        self.assertEqual(start.start.leader_address, "10.0.0.1:9000")
        self.assertEqual(
            [start.start.epoch, drain.drain.epoch, stop.stop.epoch], [42, 42, 42]
        )

    def test_paused_transport_bounded(self) -> None:
        """
        While the transport is paused, 64 commands wait; the next is refused
        with NotKeepingUp; resuming sends the waiting ones in order.
        """
        h = Harness(self)
        proto, transport = h.registered("node-a")
        proto.pauseProducing()
        for i in range(64):
            h.service.stop_shard("node-a", f"s{i}")
        self.assertEqual(transport.value(), b"")
        self.assertRaises(NotKeepingUp, h.service.stop_shard, "node-a", "one-too-many")
        self.assertEqual(h.service.dispatch_refusals["not_keeping_up"], 1)
        proto.resumeProducing()
        self.assertEqual([f.stop.shard_id for f in transport.frames()],
                         [f"s{i}" for i in range(64)])
        h.service.stop_shard("node-a", "after")
        self.assertEqual(transport.frames()[-1].stop.shard_id, "after")

    def test_other_nodes_unaffected_by_slow_one(self) -> None:
        """
        One node not keeping up does not stop commands to another.
        """
        h = Harness(self)
        slow, _ = h.registered("node-a")
        fast, fast_t = h.registered("node-b")
        slow.pauseProducing()
        for i in range(64):
            h.service.stop_shard("node-a", f"s{i}")
        self.assertRaises(NotKeepingUp, h.service.stop_shard, "node-a", "x")
        h.service.stop_shard("node-b", "y")
        self.assertEqual(fast_t.frames()[0].stop.shard_id, "y")

    def test_registers_as_streaming_producer(self) -> None:
        """
        The protocol registers itself with its transport as a streaming
        producer once the handshake is done.
        """
        h = Harness(self)
        proto, transport = h.connect("node-a", handshake=False)
        self.assertIsNone(transport.producer)
        proto.handshakeCompleted()
        self.assertIs(transport.producer, proto)
        self.assertTrue(transport.streaming)


class CloseAllTests(SynchronousTestCase):
    def test_close_all(self) -> None:
        """
        close_all aborts registered and unregistered connections alike.
        """
        h = Harness(self)
        _, registered = h.registered("node-a")
        _, pending = h.connect("node-b")
        self.assertEqual(h.service.close_all("stopping"), 2)
        self.assertTrue(registered.aborted)
        self.assertTrue(pending.aborted)


class InventoryProblemTests(SynchronousTestCase):
    def test_problems_bounded(self) -> None:
        """
        A GPU keeps at most 32 problems however many new texts arrive; it is
        out of placement from the first.
        """
        from llmgw.control.state.inventory import MAX_PROBLEMS_PER_GPU, GPUInfo, Inventory, Node

        inventory = Inventory()
        inventory.upsert(Node(id="n", gpus=[GPUInfo(index=0)]))
        for i in range(100):
            inventory.apply_heartbeat("n", [], [(0, f"xid 79 at {i}")])
        node = inventory.get("n")
        assert node is not None
        self.assertEqual(len(node.gpus[0].problems), MAX_PROBLEMS_PER_GPU)


class StrayTests(SynchronousTestCase):
    """
    What a Register says runs unaccounted for is kept and said out loud.
    """

    def setUp(self) -> None:
        self.h = Harness(self)
        self.logged: list[dict[str, object]] = []
        self.addCleanup(setattr, AgentStreamProtocol, "log", AgentStreamProtocol.__dict__["log"])
        AgentStreamProtocol.log = Logger(observer=self.logged.append)  # type: ignore[arg-type]

    def warnings(self) -> list[str]:
        return [formatEvent(e) for e in self.logged if e["log_level"] == LogLevel.warn]

    def test_strays_kept_and_warned(self) -> None:
        """
        The strays of a Register are kept on the node in the inventory
        (pid, group, marker, reason, command) and logged as a warning
        naming the node and pids; a later Register on the live stream
        replaces the list, and one without strays clears it.
        """
        msg = register("node-a")
        msg.register.stray_processes.add(pid=4242, pgid=4240, shard_id="r7-s0", reason="no record",
                                         command="python -m vllm.entrypoints.openai.api_server")
        msg.register.stray_processes.add(pid=4243, pgid=4240, shard_id="r7-s0")
        proto, transport = self.h.connect("node-a")
        proto.dataReceived(frame(msg))
        self.assertTrue(only_ack(self, transport).ok)
        strays = self.h.inventory.strays("node-a")
        self.assertEqual([(s.pid, s.pgid, s.shard_id) for s in strays], [(4242, 4240, "r7-s0"), (4243, 4240, "r7-s0")])
        self.assertEqual(strays[0].command, "python -m vllm.entrypoints.openai.api_server")
        warned = [w for w in self.warnings() if "stray" in w]
        self.assertEqual(len(warned), 1)
        self.assertIn("node-a", warned[0])
        self.assertIn("4242 (group 4240, shard r7-s0), 4243 (group 4240, shard r7-s0)", warned[0])
        proto.dataReceived(frame(register("node-a")))
        self.assertEqual(self.h.inventory.strays("node-a"), [])
        self.assertEqual(len([w for w in self.warnings() if "stray" in w]), 1)

    def test_strays_bounded(self) -> None:
        """
        However many strays an agent lists, the inventory keeps at most
        L{MAX_STRAYS_PER_NODE}, with their texts cut, and the warning says
        how many more there were.
        """
        msg = register("node-a")
        for i in range(MAX_STRAYS_PER_NODE + 10):
            msg.register.stray_processes.add(pid=1000 + i, pgid=1000, command="x" * 10_000)
        proto, transport = self.h.connect("node-a")
        proto.dataReceived(frame(msg))
        strays = self.h.inventory.strays("node-a")
        self.assertEqual(len(strays), MAX_STRAYS_PER_NODE)
        self.assertEqual(len(strays[0].command), MAX_STRAY_TEXT)
        self.assertIn("and 10 more", [w for w in self.warnings() if "stray" in w][0])

    def test_inventory_stray_index(self) -> None:
        """
        The inventory's stray counts follow each node's latest record and
        forget a removed node; copies handed out do not change it.
        """
        inv = Inventory()
        inv.upsert(Node(id="a", stray_processes=[StrayProcess(pid=1)]))
        inv.upsert(Node(id="b", stray_processes=[StrayProcess(pid=2), StrayProcess(pid=3)]))
        inv.upsert(Node(id="c"))
        self.assertEqual(inv.stray_counts(), {"a": 1, "b": 2})
        copy = inv.get("b")
        assert copy is not None
        copy.stray_processes.clear()
        inv.strays("b").clear()
        self.assertEqual(len(inv.strays("b")), 2)
        inv.remove("b")
        self.assertEqual(inv.stray_counts(), {"a": 1})
        self.assertEqual(inv.strays("b"), [])

    def test_record_lost_shard_named(self) -> None:
        """
        A running shard whose record the agent lost is named in a warning
        with its node, shard id and process group, and is still reported
        to the sink like any running shard.
        """
        running = [
            pb.RunningShard(shard_id="r3-s0", pgid=5150, record_lost=True, state=pb.ShardStatus.STATE_READY),
            pb.RunningShard(shard_id="r4-s0", replica_id="r4", model="m", profile="p", pgid=6000,
                            state=pb.ShardStatus.STATE_READY),
        ]
        self.h.registered("node-a", running=running)
        lost = [w for w in self.warnings() if "lost the record" in w]
        self.assertEqual(len(lost), 1)
        self.assertIn("agent node-a lost the record of shard r3-s0 (process group 5150", lost[0])
        self.assertEqual([s.shard_id for s in self.h.sink.adopted[0][1]], ["r3-s0", "r4-s0"])
