"""
The admin API's listener against slow and greedy clients: the TLS
handshake within 10 s of accept, a per-address connection cap (below
TLS, beyond loopback only), each request in time (the admin channel is a
L{llmgw.httpdeadline.DeadlineChannel}); and the same request deadline on
the standalone gateway's /metrics listener.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IHandshakeListener
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import Logger, formatEvent
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control import service as control_service
from llmgw.control.admin.site import AdminChannel, admin_service, admin_site
from llmgw.control.shell.limits import ConnectionLimiter
from llmgw.control.shell.metrics import make_registry
from llmgw.gateway.service import StandaloneGateway
from llmgw.testing.fleet import sample_fleet
from llmgw.testing.pki import make_pki
from llmgw.tlsconf.handshake import HANDSHAKE_TIMEOUT
from llmgw.tlsconf.options import ServerTLS, server_files

PEER = IPv4Address("TCP", "192.0.2.7", 40000)


class TCPTransport(StringTransport):
    """
    A C{StringTransport} that takes the TCP option twisted.web sets.
    """

    def setTcpNoDelay(self, enabled: bool) -> None:
        pass


def connect(factory: Any, peer: IPv4Address = PEER) -> tuple[Any, StringTransport]:
    proto = factory.buildProtocol(peer)
    transport = TCPTransport(peerAddress=peer)
    proto.makeConnection(transport)
    return proto, transport


class AdminHandshakeTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.logged: list[dict[str, Any]] = []
        self.patch(AdminChannel, "log", Logger(observer=self.logged.append))  # type: ignore[arg-type]
        certs = Path(self.mktemp())
        make_pki(certs)
        self.tls = ServerTLS(server_files(certs))

    def test_stalled_handshake_aborted(self) -> None:
        """
        Over TLS, a connection that has not completed its handshake 10 s
        after accept is aborted and logged with its address; before that
        it stays.
        """
        svc = admin_service(self.clock, "0.0.0.0", 0, sample_fleet(), make_registry(), tls=self.tls)
        _proto, transport = connect(svc.factory)
        self.clock.advance(HANDSHAKE_TIMEOUT - 0.5)
        self.assertFalse(transport.disconnected)
        self.clock.advance(0.5)
        self.assertTrue(transport.disconnected)
        text = [formatEvent(e) for e in self.logged]
        self.assertTrue(any("192.0.2.7" in t and "handshake not done within 10" in t for t in text), text)

    def test_completed_handshake_stops_deadline(self) -> None:
        """
        The admin connection hears of a completed handshake (the site's
        protocol is the channel itself, which says it listens, so the TLS
        layer tells it), and that ends the deadline.
        """
        site = admin_site(sample_fleet(), make_registry(), reactor=self.clock)
        site.handshake_timeout = HANDSHAKE_TIMEOUT
        proto, transport = connect(site)
        self.assertTrue(IHandshakeListener.providedBy(proto))
        proto.handshakeCompleted()
        self.clock.advance(HANDSHAKE_TIMEOUT * 3)
        self.assertFalse(transport.disconnected)

    def test_no_handshake_deadline_without_tls(self) -> None:
        """
        Plain HTTP (loopback) has no handshake to wait for.
        """
        site = admin_site(sample_fleet(), make_registry(), reactor=self.clock)
        _proto, transport = connect(site)
        self.clock.advance(HANDSHAKE_TIMEOUT * 3)
        self.assertFalse(transport.disconnected)


class AdminConnectionCapTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        certs = Path(self.mktemp())
        make_pki(certs)
        self.tls = ServerTLS(server_files(certs))
        self.logged: list[dict[str, Any]] = []
        self.patch(ConnectionLimiter, "log", Logger(observer=self.logged.append))  # type: ignore[arg-type]

    def test_cap_per_address_below_tls(self) -> None:
        """
        Beyond loopback, the admin port admits 64 connections from one
        address; the 65th is closed at accept (no protocol, so no TLS
        object and no handshake), the refusal logged with the address;
        another address is still admitted, and a closed connection frees
        its place.
        """
        svc = admin_service(self.clock, "0.0.0.0", 0, sample_fleet(), make_registry(), tls=self.tls)
        factory = svc.factory
        self.assertIsInstance(factory, ConnectionLimiter)
        held = [factory.buildProtocol(PEER) for _ in range(64)]
        self.assertNotIn(None, held)
        self.assertIsNone(factory.buildProtocol(PEER))
        text = [formatEvent(e) for e in self.logged]
        self.assertTrue(any("the admin API" in t and "192.0.2.7" in t for t in text), text)
        self.assertIsNotNone(factory.buildProtocol(IPv4Address("TCP", "192.0.2.8", 1)))
        held[0].makeConnection(TCPTransport(peerAddress=PEER))
        held[0].connectionLost(Failure(ConnectionDone()))
        self.assertIsNotNone(factory.buildProtocol(PEER))

    def test_cap_option(self) -> None:
        """
        C{--admin-max-connections-per-address} sets the cap (64 by
        default); 0 lifts it.
        """
        certs = Path(self.mktemp())
        make_pki(certs)
        args = ["--certs", str(certs), "--agent-listen", "127.0.0.1:0", "--admin", "0.0.0.0:0"]
        o = control_service.Options()
        o.parseOptions(args)
        self.assertEqual(o["admin-max-connections-per-address"], 64)
        cp = control_service.makeService(o, self.clock)
        assert cp.admin_listener is not None
        self.assertEqual(cp.admin_listener.factory.max_per_address, 64)
        o = control_service.Options()
        o.parseOptions([*args, "--admin-max-connections-per-address", "3"])
        cp = control_service.makeService(o, self.clock)
        assert cp.admin_listener is not None
        self.assertEqual(cp.admin_listener.factory.max_per_address, 3)
        o = control_service.Options()
        o.parseOptions([*args, "--admin-max-connections-per-address", "0"])
        cp = control_service.makeService(o, self.clock)
        assert cp.admin_listener is not None
        self.assertNotIsInstance(cp.admin_listener.factory, ConnectionLimiter)

    def test_loopback_not_capped(self) -> None:
        """
        On loopback every client is this host's (a watch benchmark holds
        a thousand there): no cap.
        """
        svc = admin_service(self.clock, "127.0.0.1", 0, sample_fleet(), make_registry())
        self.assertNotIsInstance(svc.factory, ConnectionLimiter)

    def test_loopback_tls_capped(self) -> None:
        """
        Over TLS the cap holds on loopback too: each pending handshake holds
        its buffers, and a flood of handshakes from one address must not
        grow the control plane without bound.
        """
        svc = admin_service(self.clock, "127.0.0.1", 0, sample_fleet(), make_registry(), tls=self.tls)
        factory = svc.factory
        self.assertIsInstance(factory, ConnectionLimiter)
        peer = IPv4Address("TCP", "127.0.0.2", 4000)
        held = [factory.buildProtocol(peer) for _ in range(64)]
        self.assertNotIn(None, held)
        self.assertIsNone(factory.buildProtocol(peer))


class AdminRequestDeadlineTests(SynchronousTestCase):
    def test_admin_head_trickled(self) -> None:
        """
        An admin request head trickled a byte a second gets a 408 10 s
        after its first byte.
        """
        clock = Clock()
        site = admin_site(sample_fleet(), make_registry(), reactor=clock)
        proto, transport = connect(site)
        for b in b"GET /api/v1/nodes HTTP/1.1\r\nHost: 127.0.0.1\r\nX: aaaaaaaaa":
            proto.dataReceived(bytes([b]))
            clock.advance(1)
        self.assertIn(b"408 Request Timeout", transport.value())
        self.assertTrue(transport.disconnecting)

    def test_gateway_metrics_head_trickled(self) -> None:
        """
        The standalone gateway's /metrics listener bounds a request's
        arrival too.
        """
        clock = Clock()
        gw = StandaloneGateway(clock, "http://127.0.0.1:7480", "127.0.0.1", 0,
                               metrics_address=("127.0.0.1", 0))
        assert gw.metrics_listener is not None
        proto, transport = connect(gw.metrics_listener.factory)
        for b in b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa":
            proto.dataReceived(bytes([b]))
            clock.advance(1)
        self.assertIn(b"408 Request Timeout", transport.value())
        self.assertTrue(transport.disconnecting)
