"""
Integration tests: the control plane's agent listener over real mutual TLS
on loopback, with certificates made per run by llmgw's CA code.
"""

from __future__ import annotations

import datetime
import struct
from pathlib import Path
from typing import Any

from twisted.internet import reactor as _reactor
from twisted.internet import ssl
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol, wrapClientTLS
from twisted.internet.protocol import Protocol
from twisted.trial.unittest import TestCase

from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.service import ControlPlane
from llmgw.control.state.interfaces import NotKeepingUp
from llmgw.testing.pki import issue_raw, make_pki
from llmgw.testing.sinks import RecordingSink
from llmgw.testing.stream import RecordingAgent, frame, register
from llmgw.tlsconf.ca import CertificateAuthority
from llmgw.tlsconf.options import (
    AgentClientTLS,
    ServerIdentityError,
    ServerTLS,
    agent_files,
    server_files,
)

reactor: Any = _reactor


def raw_client_options(ca_dir: Path, cert: Path | None, key: Path | None) -> Any:
    """
    Client TLS options that present any certificate at all (or none), for
    the cases the project's own loader refuses to build.
    """
    trust = ssl.Certificate.loadPEM((ca_dir / "ca.pem").read_bytes())
    client = None
    if cert is not None and key is not None:
        client = ssl.PrivateCertificate.loadPEM(cert.read_bytes() + key.read_bytes())
    return ssl.optionsForClientTLS("127.0.0.1", trustRoot=trust, clientCertificate=client)


def sleep(seconds: float) -> Deferred[None]:
    d: Deferred[None] = Deferred()
    reactor.callLater(seconds, d.callback, None)
    return d


class Plain(Protocol):
    def __init__(self) -> None:
        self.lost: Deferred[None] = Deferred()

    def connectionLost(self, reason: Any = None) -> None:
        self.lost.callback(None)


class LoopbackTLSTests(TestCase):
    timeout = 30

    def setUp(self) -> None:
        self.ca = make_pki(self.mktemp(), nodes=("node-a", "node-b"))
        self.control = self.start_control(self.ca.directory)
        self.port = self.control.agent_listener.address()[1]

    def start_control(self, certs: Path) -> ControlPlane:
        control = ControlPlane(reactor, RecordingSink(), ServerTLS(server_files(certs)),
                               "127.0.0.1", 0)
        control.startService()
        self.addCleanup(control.stopService)
        return control

    @inlineCallbacks
    def dial(self, endpoint_tls: Any, port: int | None = None) -> Any:
        agent = RecordingAgent()
        ep = TCP4ClientEndpoint(reactor, "127.0.0.1", port or self.port, timeout=5)
        yield connectProtocol(wrapClientTLS(endpoint_tls, ep), agent)
        self.addCleanup(self.close, agent)
        return agent

    def close(self, agent: RecordingAgent) -> Deferred[Any] | None:
        if agent.reason is None and agent.transport is not None:
            agent.transport.abortConnection()
            return agent.lost
        return None

    def agent_tls(self, node: str, host: str = "127.0.0.1") -> AgentClientTLS:
        return AgentClientTLS(host, agent_files(self.ca.directory, node))

    @inlineCallbacks
    def registered(self, node: str) -> Any:
        agent = yield self.dial(self.agent_tls(node))
        agent.send(register(node))
        [ack] = yield agent.wait_for(1)
        self.assertTrue(ack.ack.ok, ack)
        return agent

    @inlineCallbacks
    def test_valid_agent_registers(self) -> Any:
        """
        An agent with its own certificate registers and gets its Ack.
        """
        agent = yield self.registered("node-a")
        self.assertEqual(agent.received[0].ack.message_id, "register")
        self.assertEqual(self.control.agents.connected_nodes(), ["node-a"])
        self.assertIn("node-a", self.control.inventory)

    @inlineCallbacks
    def test_claiming_another_node(self) -> Any:
        """
        node-a's certificate registering as node-b is refused with
        permission denied; the real node-b keeps its stream and its record.
        """
        b = yield self.registered("node-b")
        before = self.control.inventory.get("node-b")
        a = yield self.dial(self.agent_tls("node-a"))
        a.send(register("node-b", gpus=1))
        yield a.lost
        self.assertEqual(a.received[0].ack.code, pb.Ack.CODE_PERMISSION_DENIED)
        self.assertEqual(self.control.inventory.get("node-b"), before)
        self.assertIsNone(b.reason)
        self.assertEqual(self.control.agents.connected_nodes(), ["node-b"])

    @inlineCallbacks
    def refused_at_handshake(self, options: Any) -> Any:
        agent = yield self.dial(options)
        agent.send(register("node-a"))
        yield agent.lost
        self.assertFalse(any(m.ack.ok for m in agent.received))
        self.assertEqual(self.control.agents.connected_nodes(), [])
        self.assertNotIn("node-a", self.control.inventory)

    def test_no_client_certificate(self) -> Any:
        """
        A client without a certificate never gets to register.
        """
        return self.refused_at_handshake(raw_client_options(self.ca.directory, None, None))

    def test_certificate_from_another_ca(self) -> Any:
        """
        A certificate from another CA is refused.
        """
        other = make_pki(self.mktemp(), nodes=("node-a",))
        return self.refused_at_handshake(raw_client_options(
            self.ca.directory, other.directory / "agent-node-a.pem",
            other.directory / "agent-node-a.key"))

    def test_expired_certificate(self) -> Any:
        """
        An expired certificate from the right CA is refused.
        """
        past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=3)
        cert, key = issue_raw(self.ca, "expired", "node-a", not_before=past,
                              not_after=past + datetime.timedelta(days=1))
        return self.refused_at_handshake(raw_client_options(self.ca.directory, cert, key))

    @inlineCallbacks
    def test_server_certificate_without_dialled_ip(self) -> Any:
        """
        A control plane whose certificate names only 'localhost' is refused
        by an agent that dialled 127.0.0.1, with an error naming the address
        and the SANs.
        """
        certs = Path(self.mktemp())
        make_pki(certs, nodes=("node-a",), server_hosts=("localhost",))
        other = self.start_control(certs)
        tls = AgentClientTLS("127.0.0.1", agent_files(certs, "node-a"))
        agent = yield self.dial(tls, port=other.agent_listener.address()[1])
        agent.send(register("node-a"))
        yield agent.lost
        reason = agent.reason
        self.assertTrue(reason.check(ServerIdentityError), reason)
        self.assertIn("'127.0.0.1'", str(reason.value))
        self.assertIn("DNS:localhost", str(reason.value))
        self.assertEqual(other.agents.connected_nodes(), [])

    @inlineCallbacks
    def test_second_connection_replaces_first(self) -> Any:
        """
        A second stream for the same node replaces the first, which is
        closed; the node stays connected through the new one.
        """
        first = yield self.registered("node-a")
        second = yield self.registered("node-a")
        yield first.lost
        self.assertIsNone(second.reason)
        self.assertEqual(self.control.agents.connected_nodes(), ["node-a"])
        self.control.agents.stop_shard("node-a", "s1")
        msgs = yield second.wait_for(2)
        self.assertEqual(msgs[1].stop.shard_id, "s1")

    @inlineCallbacks
    def test_peer_that_stops_reading(self) -> Any:
        """
        A node that stops reading is refused with NotKeepingUp once the bound
        of waiting commands is reached; another node is served all along.
        """
        slow = yield self.registered("node-a")
        fast = yield self.registered("node-b")
        slow.transport.pauseProducing()
        big = {"PAD": "x" * 256 * 1024}
        sent = 0
        from llmgw.control.state.interfaces import ShardCommand

        with self.assertRaises(NotKeepingUp):
            for i in range(2000):
                self.control.agents.start_shard(ShardCommand(
                    node_id="node-a", shard_id=f"s{i}", replica_id="r", model="m", profile="p",
                    argv=("x",), gpu_indices=(0,), port=9000, env=big))
                sent += 1
                if i % 16 == 0:
                    yield sleep(0)
        self.assertGreaterEqual(sent, 64)
        self.control.agents.stop_shard("node-b", "fast")
        msgs = yield fast.wait_for(2)
        self.assertEqual(msgs[1].stop.shard_id, "fast")

    @inlineCallbacks
    def test_bad_peers_do_not_disturb_others(self) -> Any:
        """
        An oversized frame, garbage bytes and a plain-TCP client on the TLS
        port are each dropped; a registered node keeps its stream.
        """
        good = yield self.registered("node-b")

        big = yield self.dial(self.agent_tls("node-a"))
        big.transport.write(struct.pack("!I", 5 * 1024 * 1024) + b"x" * 100)
        yield big.lost

        garbage = yield self.dial(self.agent_tls("node-a"))
        garbage.transport.write(frame(b"\xff\xfe\xfd\xfc\xfb"))
        yield garbage.lost
        self.assertEqual(garbage.received[0].ack.code, pb.Ack.CODE_INVALID_ARGUMENT)

        plain = Plain()
        yield connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", self.port), plain)
        plain.transport.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        yield plain.lost

        self.assertIsNone(good.reason)
        self.assertEqual(self.control.agents.connected_nodes(), ["node-b"])
        self.control.agents.stop_shard("node-b", "still-here")
        msgs = yield good.wait_for(2)
        self.assertEqual(msgs[1].stop.shard_id, "still-here")


class ExpiredCATests(TestCase):
    def test_ca_class_refuses_missing(self) -> None:
        """
        Loading a CA from an empty directory says how to make one.
        """
        from llmgw.tlsconf.pem import CAError

        with self.assertRaises(CAError) as e:
            CertificateAuthority.load(self.mktemp())
        self.assertIn("llmgw ctl cert init", str(e.exception))
