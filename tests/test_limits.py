"""
Tests for L{llmgw.control.shell.limits}: connection caps below TLS and the
per-agent message rate.
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from pathlib import Path
from typing import Any

from OpenSSL import SSL
from twisted.internet import defer, reactor, task
from twisted.internet.address import IPv4Address
from twisted.internet.protocol import ClientFactory, Protocol, ServerFactory
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import capturedLogs
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python import usage
from twisted.python.failure import Failure
from twisted.trial.unittest import SkipTest, SynchronousTestCase, TestCase

from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.service import ControlPlane, Options, makeService
from llmgw.control.shell.agentsvc import AgentService
from llmgw.control.shell.limits import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_REGISTERING,
    REFUSAL_LOG_INTERVAL,
    ConnectionLimiter,
    LimitsConfig,
    MessageRate,
    backlog_problem,
    connection_registered,
    pause_reading,
)
from llmgw.control.state.inventory import Inventory
from llmgw.testing.pki import AgentFactory, agent_tls, connect_in_memory, make_pki
from llmgw.testing.sinks import RecordingSink
from llmgw.tlsconf.options import ServerTLS, server_files
from llmgw.wire import PROTOCOL_VERSION

A = IPv4Address("TCP", "10.0.0.1", 5000)
B = IPv4Address("TCP", "10.0.0.2", 5000)


class Counting(ServerFactory):
    protocol = Protocol

    def __init__(self) -> None:
        self.built = 0

    def buildProtocol(self, addr: Any) -> Protocol:
        self.built += 1
        return super().buildProtocol(addr)  # type: ignore[return-value]


class ConnectionLimiterTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.inner = Counting()

    def open(self, limiter: ConnectionLimiter, addr: IPv4Address) -> Any:
        proto = limiter.buildProtocol(addr)
        if proto is not None:
            proto.makeConnection(StringTransport(peerAddress=addr))
        return proto

    def test_per_address_cap(self) -> None:
        """
        Past the per-address cap, C{buildProtocol} returns C{None} (Twisted
        closes the socket at accept) without building the wrapped (TLS)
        protocol; other addresses are unaffected.
        """
        limiter = ConnectionLimiter(self.inner, self.clock, max_connections=0, max_per_address=2)
        self.assertIsNotNone(self.open(limiter, A))
        self.assertIsNotNone(self.open(limiter, A))
        self.assertIsNone(self.open(limiter, A))
        self.assertEqual(self.inner.built, 2)
        self.assertIsNotNone(self.open(limiter, B))
        self.assertEqual(limiter.refused["per_address"], 1)
        self.assertEqual(limiter.connections_from("10.0.0.1"), 2)

    def test_closed_connection_frees_its_slot(self) -> None:
        """
        A connection that ends gives its slot back, to its address and to
        the total.
        """
        limiter = ConnectionLimiter(self.inner, self.clock, max_connections=0, max_per_address=1)
        first = self.open(limiter, A)
        self.assertIsNone(self.open(limiter, A))
        first.connectionLost(Failure(ConnectionError()))
        self.assertEqual(limiter.total, 0)
        self.assertEqual(limiter.connections_from("10.0.0.1"), 0)
        self.assertIsNotNone(self.open(limiter, A))

    def test_total_cap(self) -> None:
        """
        Past the total cap, every address is refused.
        """
        limiter = ConnectionLimiter(self.inner, self.clock, max_connections=2, max_per_address=0)
        self.open(limiter, A)
        self.open(limiter, B)
        self.assertIsNone(self.open(limiter, IPv4Address("TCP", "10.0.0.3", 1)))
        self.assertEqual(limiter.refused["total"], 1)

    def test_zero_means_no_cap(self) -> None:
        """
        Caps of 0 admit everything.
        """
        limiter = ConnectionLimiter(self.inner, self.clock, max_connections=0, max_per_address=0)
        for _ in range(100):
            self.assertIsNotNone(self.open(limiter, A))

    def test_refusals_logged_sparingly(self) -> None:
        """
        A flood of refusals logs one line per interval, counting the rest,
        and names the address.
        """
        limiter = ConnectionLimiter(self.inner, self.clock, max_connections=0, max_per_address=1)
        self.open(limiter, A)
        with capturedLogs() as events:
            for _ in range(50):
                self.open(limiter, A)
            self.clock.advance(REFUSAL_LOG_INTERVAL)
            self.open(limiter, A)
        refusals = [e for e in events if "refusing connections" in e["log_format"]]
        self.assertEqual(len(refusals), 2)
        self.assertEqual(refusals[0]["peer"], "10.0.0.1")
        self.assertEqual(refusals[1]["count"], 50)
        self.assertEqual(limiter.refused["per_address"], 51)

    def test_defaults_fit_a_large_fleet(self) -> None:
        """
        The default caps hold 10,000 nodes with room for reconnects.
        """
        self.assertGreaterEqual(LimitsConfig().max_connections, 10_000 * 1.25)
        self.assertGreater(LimitsConfig().message_rate * 5, 10)


class FakePort:
    """
    The parts of a listening C{tcp.Port} the admission gate uses.
    """

    def __init__(self) -> None:
        self.reading = True
        self.connected = True
        self.disconnecting = False
        self.numberAccepts = 100
        self.calls: list[str] = []

    def stopReading(self) -> None:
        self.calls.append("stop")
        self.reading = False

    def startReading(self) -> None:
        self.calls.append("start")
        self.reading = True


class AdmissionGateTests(SynchronousTestCase):
    """
    The gate: connections between their first byte and their Register.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.port = FakePort()
        self.limiter = ConnectionLimiter(
            Counting(), self.clock, max_connections=0, max_per_address=0, max_registering=4
        )
        self.limiter.attach_port(self.port)

    def open(self, speak: bool = True) -> Any:
        proto = self.limiter.buildProtocol(A)
        assert proto is not None
        proto.makeConnection(StringTransport(peerAddress=A))
        if speak:
            proto.dataReceived(b"\x16")
        return proto

    def test_pauses_at_limit_and_resumes_at_low_water(self) -> None:
        """
        The port stops being read when the fourth connection sends its first
        byte, stays stopped while more than half are still registering, and
        is read again at half; the next accept batch is cut to the room
        left.
        """
        conns = [self.open() for _ in range(3)]
        self.assertTrue(self.port.reading)
        conns.append(self.open())
        self.assertFalse(self.port.reading)
        self.assertTrue(self.limiter.paused)
        self.assertEqual(self.limiter.registering, 4)
        connection_registered(conns[0])
        self.assertFalse(self.port.reading)
        conns[1].connectionLost(Failure(ConnectionError()))
        self.assertTrue(self.port.reading)
        self.assertFalse(self.limiter.paused)
        self.assertEqual(self.limiter.registering, 2)
        self.assertEqual(self.port.numberAccepts, 2)
        self.assertEqual(self.port.calls, ["stop", "start"])
        self.assertEqual((self.limiter.pauses, self.limiter.registering_peak), (1, 4))

    def test_time_paused_is_counted(self) -> None:
        """
        How long the gate was shut is added up on the injected clock.
        """
        conns = [self.open() for _ in range(4)]
        self.clock.advance(2.5)
        for c in conns[:2]:
            connection_registered(c)
        self.assertEqual(self.limiter.paused_seconds, 2.5)

    def test_silent_connections_do_not_count(self) -> None:
        """
        Sockets that never send a byte hold no place in the gate (they cost
        no CPU, and must not shut out real agents); they still count against
        the connection caps.
        """
        silent = [self.open(speak=False) for _ in range(10)]
        self.assertEqual(self.limiter.registering, 0)
        self.assertTrue(self.port.reading)
        self.assertEqual(self.limiter.total, 10)
        for c in silent:
            c.connectionLost(Failure(ConnectionError()))
        self.assertEqual((self.limiter.registering, self.limiter.total), (0, 0))

    def test_each_connection_leaves_once(self) -> None:
        """
        Registering, registering again, and closing after registering take a
        connection out of the gate once; more bytes do not count it again.
        """
        c = self.open()
        c.dataReceived(b"more")
        self.assertEqual(self.limiter.registering, 1)
        connection_registered(c)
        connection_registered(c)
        c.dataReceived(b"a heartbeat")
        c.connectionLost(Failure(ConnectionError()))
        self.assertEqual(self.limiter.registering, 0)
        self.assertEqual(self.limiter.total, 0)

    def test_no_leak_on_refusals_or_aborts(self) -> None:
        """
        Connections refused at accept never enter the gate; connections
        closed or aborted before registering leave it; afterwards the gate
        is open and empty.
        """
        limiter = ConnectionLimiter(
            Counting(), self.clock, max_connections=0, max_per_address=3, max_registering=2
        )
        limiter.attach_port(self.port)
        conns = []
        for _ in range(5):
            proto = limiter.buildProtocol(A)
            if proto is not None:
                proto.makeConnection(StringTransport(peerAddress=A))
                proto.dataReceived(b"\x16")
                conns.append(proto)
        self.assertEqual(len(conns), 3)
        self.assertEqual(limiter.refused["per_address"], 2)
        self.assertEqual(limiter.registering, 3)
        self.assertFalse(self.port.reading)
        for c in conns:
            c.connectionLost(Failure(ConnectionError()))
        self.assertEqual((limiter.registering, limiter.total), (0, 0))
        self.assertTrue(self.port.reading)
        self.assertFalse(limiter.paused)

    def test_stopping_port_is_not_restarted(self) -> None:
        """
        A pause before the port is attached applies when it is; a port that
        is stopping (or detached) is never read again by the gate.
        """
        limiter = ConnectionLimiter(Counting(), self.clock, 0, 0, max_registering=1)
        proto = limiter.buildProtocol(A)
        assert proto is not None
        proto.makeConnection(StringTransport(peerAddress=A))
        proto.dataReceived(b"\x16")
        port = FakePort()
        limiter.attach_port(port)
        self.assertFalse(port.reading)
        port.disconnecting = True
        proto.connectionLost(Failure(ConnectionError()))
        self.assertFalse(port.reading)
        self.assertEqual(port.calls, ["stop"])

    def test_zero_means_no_gate(self) -> None:
        """
        C{max_registering} 0 never stops the port.
        """
        limiter = ConnectionLimiter(Counting(), self.clock, 0, 0, max_registering=0)
        limiter.attach_port(self.port)
        for _ in range(50):
            proto = limiter.buildProtocol(A)
            assert proto is not None
            proto.makeConnection(StringTransport(peerAddress=A))
            proto.dataReceived(b"\x16")
        self.assertEqual(self.port.calls, [])

    def test_stallers_cannot_hold_the_gate(self) -> None:
        """
        Connections that sent a byte and then stall hold the gate shut only
        for the hold: then they are no longer counted (each once: closing
        them later changes nothing) and the port is read again; no timer is
        left behind.
        """
        stallers = [self.open() for _ in range(4)]
        self.assertFalse(self.port.reading)
        self.clock.advance(self.limiter.registering_hold - 0.1)
        self.assertFalse(self.port.reading)
        with capturedLogs() as events:
            self.clock.advance(0.1)
        self.assertTrue(self.port.reading)
        self.assertEqual((self.limiter.registering, self.limiter.registering_expired), (0, 4))
        self.assertEqual([e["count"] for e in events if "no longer counted" in e["log_format"]], [4])
        fresh = self.open()
        for c in stallers:
            c.connectionLost(Failure(ConnectionError()))
        self.assertEqual(self.limiter.registering, 1)
        connection_registered(fresh)
        self.assertEqual(self.limiter.registering, 0)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_hold_counts_from_each_first_byte(self) -> None:
        """
        Only the connections older than the hold stop being counted; the
        gate opens once that leaves no more than the low-water mark.
        """
        old = [self.open() for _ in range(2)]
        self.clock.advance(2.0)
        [self.open() for _ in range(2)]
        self.assertFalse(self.port.reading)
        self.clock.advance(1.0)
        self.assertTrue(self.port.reading)
        self.assertEqual((self.limiter.registering, self.limiter.registering_expired), (2, 2))
        connection_registered(old[0])
        self.assertEqual(self.limiter.registering, 2)

    def test_no_hold_timer_while_open_or_detached(self) -> None:
        """
        While the gate is open no timer runs; detaching the port (the
        listener stopping) cancels a pending one.
        """
        [self.open() for _ in range(3)]
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.open()
        self.assertEqual(len(self.clock.getDelayedCalls()), 1)
        self.limiter.attach_port(None)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_pauses_are_logged_sparingly(self) -> None:
        """
        A storm that shuts the gate many times logs one line per interval,
        with how many pauses it stands for.
        """
        with capturedLogs() as events:
            for _ in range(5):
                conns = [self.open() for _ in range(4)]
                for c in conns:
                    c.connectionLost(Failure(ConnectionError()))
            self.clock.advance(REFUSAL_LOG_INTERVAL)
            [self.open() for _ in range(4)]
        lines = [e for e in events if "listen backlog" in e["log_format"]]
        self.assertEqual([e["pauses"] for e in lines], [1, 5])


class AgentAdmissionTests(SynchronousTestCase):
    """
    The agent service tells the gate when a connection registers.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.factory = AgentService(
            Inventory(), RecordingSink(), self.clock, epoch=1, tls=False, require_identity=False
        )

    def test_register_leaves_the_gate(self) -> None:
        """
        Without TLS, the Register frame is the first byte and the
        registration: the connection enters and leaves the gate in one read.
        """
        limiter = ConnectionLimiter(self.factory, self.clock, 0, 0, max_registering=4)
        wrapper = limiter.buildProtocol(A)
        assert wrapper is not None
        wrapper.makeConnection(StringTransport(peerAddress=A))
        register = pb.AgentMessage(register=pb.Register(
            protocol_version=PROTOCOL_VERSION, node_id="node-a"))
        wrapper.dataReceived(frame(register))
        self.assertEqual(self.factory.connected_nodes(), ["node-a"])
        self.assertEqual((limiter.registering, limiter.registering_peak), (0, 1))

    def test_refused_register_stays_until_closed(self) -> None:
        """
        A refused Register is no registration: the connection holds its
        place until it is closed (at the latest when the refusal's linger
        aborts it).
        """
        limiter = ConnectionLimiter(self.factory, self.clock, 0, 0, max_registering=4)
        wrapper = limiter.buildProtocol(A)
        assert wrapper is not None
        transport = StringTransport(peerAddress=A)
        wrapper.makeConnection(transport)
        register = pb.AgentMessage(register=pb.Register(
            protocol_version=PROTOCOL_VERSION, node_id="Not A Node"))
        wrapper.dataReceived(frame(register))
        self.assertEqual(limiter.registering, 1)
        wrapper.connectionLost(Failure(ConnectionError()))
        self.assertEqual(limiter.registering, 0)

    def test_tls_registration_leaves_the_gate(self) -> None:
        """
        Under mutual TLS, the connection is in the gate from its ClientHello
        until its Register is taken.
        """
        certs = Path(self.mktemp())
        make_pki(certs, ["node-a"])
        self.factory.tls = self.factory.require_identity = True
        tls = TLSMemoryBIOFactory(ServerTLS(server_files(certs)), False, self.factory, clock=self.clock)
        limiter = ConnectionLimiter(tls, self.clock, 0, 0, max_registering=4)
        seen: list[int] = []
        original = limiter.registering_started

        def started(proto: Any) -> None:
            original(proto)
            seen.append(limiter.registering)

        limiter.registering_started = started  # type: ignore[method-assign]
        agent, _, pump = connect_in_memory(limiter, agent_tls(certs, "node-a"), "node-a", self.clock)
        self.assertTrue(agent.registered)
        self.assertEqual(seen, [1])
        self.assertEqual(limiter.registering, 0)


class OptionsTests(SynchronousTestCase):
    def test_limit_options(self) -> None:
        """
        The limits are options of C{twistd llmgw control}, checked and
        handed to the control plane; a negative or non-numeric one is
        refused naming the option.
        """
        opts = Options()
        opts.parseOptions([
            "--insecure", "--agent-listen", "127.0.0.1:0", "--max-connections", "100",
            "--max-connections-per-address", "5", "--agent-message-rate", "2.5",
            "--agent-message-burst", "7",
        ])
        self.assertEqual(opts["limits"], LimitsConfig(100, 5, 2.5, 7))
        cp = makeService(opts, reactor=MemoryReactorClock())
        self.assertEqual(cp.limiter.max_per_address, 5)
        self.assertEqual(cp.agents.message_rate, 2.5)
        for bad in (["--max-connections", "-1"], ["--agent-message-rate", "fast"]):
            e = self.assertRaises(
                usage.UsageError, Options().parseOptions, ["--insecure", "--agent-listen", "127.0.0.1:0", *bad]
            )
            self.assertIn(bad[0], str(e))
        self.assertEqual(Options()["max-connections"], DEFAULT_MAX_CONNECTIONS)

    def test_admission_options(self) -> None:
        """
        C{--max-registering} reaches the gate (128 by default, half of it
        to resume); the listen backlog defaults to 4096, the most Linux
        allows by default, and at least the 1024 the design asks.
        """
        opts = Options()
        opts.parseOptions(["--insecure", "--agent-listen", "127.0.0.1:0", "--max-registering", "32"])
        cp = makeService(opts, reactor=MemoryReactorClock())
        self.assertEqual((cp.limiter.max_registering, cp.limiter.resume_registering), (32, 16))
        opts = Options()
        opts.parseOptions(["--insecure", "--agent-listen", "127.0.0.1:0"])
        self.assertEqual(opts["limits"].max_registering, DEFAULT_MAX_REGISTERING)
        self.assertEqual(DEFAULT_MAX_REGISTERING, 128)
        self.assertGreaterEqual(opts["backlog"], 1024)
        e = self.assertRaises(
            usage.UsageError, Options().parseOptions,
            ["--insecure", "--agent-listen", "127.0.0.1:0", "--max-registering", "-5"],
        )
        self.assertIn("--max-registering", str(e))

    def test_backlog_over_somaxconn_reported(self) -> None:
        """
        A backlog the kernel would cut is reported with the kernel's cap
        and the fix; one that fits, or an unreadable setting, is not.
        """
        path = Path(self.mktemp())
        path.write_text("512\n")
        problem = backlog_problem(4096, str(path))
        assert problem is not None
        self.assertIn("somaxconn = 512", problem)
        self.assertIsNone(backlog_problem(512, str(path)))
        self.assertIsNone(backlog_problem(4096, str(path) + ".missing"))


class MessageRateTests(SynchronousTestCase):
    def test_pause_and_resume(self) -> None:
        """
        The bucket allows its burst, then pauses; one token later it resumes.
        """
        clock = Clock()
        calls: list[str] = []
        rate = MessageRate(clock, 2.0, 3, lambda: calls.append("pause"), lambda: calls.append("resume"))
        rate.taken()
        rate.taken()
        self.assertEqual(calls, [])
        rate.taken()
        self.assertEqual(calls, ["pause"])
        self.assertTrue(rate.paused)
        clock.advance(0.49)
        self.assertEqual(calls, ["pause"])
        clock.advance(0.01)
        self.assertEqual(calls, ["pause", "resume"])
        rate.taken()
        self.assertEqual(calls, ["pause", "resume", "pause"])

    def test_stop_cancels_resume(self) -> None:
        """
        A closed connection leaves no pending resume.
        """
        clock = Clock()
        rate = MessageRate(clock, 1.0, 1, lambda: None, lambda: self.fail("resumed"))
        rate.taken()
        rate.stop()
        self.assertEqual(clock.getDelayedCalls(), [])


def frame(msg: Any) -> bytes:
    data = msg.SerializeToString()
    return len(data).to_bytes(4, "big") + data


class AgentRateLimitTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.sink = RecordingSink()
        self.factory = AgentService(
            Inventory(), self.sink, self.clock, epoch=1, tls=False, require_identity=False,
            message_rate=2.0, message_burst=3,
        )

    def test_agent_over_its_rate_is_not_read(self) -> None:
        """
        An agent that sends faster than its rate is paused: its transport
        stops producing (no more socket reads) and the frames already read
        wait unparsed, to be handled as the bucket refills.
        """
        proto = self.factory.buildProtocol(A)
        transport = StringTransport(peerAddress=A)
        proto.makeConnection(transport)
        register = pb.AgentMessage(register=pb.Register(
            protocol_version=PROTOCOL_VERSION, node_id="node-a",
            running_shards=[pb.RunningShard(shard_id="s1", replica_id="r1")],
        ))
        status = pb.AgentMessage(shard=pb.ShardStatus(
            shard_id="s1", replica_id="r1", state=pb.ShardStatus.STATE_READY,
        ))
        with capturedLogs() as events:
            proto.dataReceived(frame(register) + frame(status) * 10)
        warned = [e for e in events if "over its rate" in e["log_format"]]
        self.assertEqual(len(warned), 1)
        self.assertIn("10.0.0.1", warned[0]["peer"])
        self.assertEqual(len(self.sink.statuses), 2)
        self.assertEqual(transport.producerState, "paused")
        self.clock.advance(0.5)
        self.assertEqual(len(self.sink.statuses), 3)
        self.assertEqual(transport.producerState, "paused")
        for _ in range(20):
            self.clock.advance(0.5)
        self.assertEqual(len(self.sink.statuses), 10)
        self.assertEqual(transport.producerState, "producing")
        self.assertEqual(self.factory.connected_nodes(), ["node-a"])

    def test_pause_reaches_tcp_under_tls(self) -> None:
        """
        Under TLS and the connection limiter, pausing an agent's reading
        pauses the TCP transport at the bottom.
        """
        certs = Path(self.mktemp())
        make_pki(certs)
        self.factory.tls = True
        tls = TLSMemoryBIOFactory(ServerTLS(server_files(certs)), False, self.factory, clock=self.clock)
        limiter = ConnectionLimiter(tls, self.clock)
        wrapper = limiter.buildProtocol(A)
        assert wrapper is not None
        tcp = StringTransport(peerAddress=A)
        wrapper.makeConnection(tcp)
        stream = wrapper.wrappedProtocol.wrappedProtocol  # type: ignore[attr-defined]
        pause_reading(stream)
        self.assertEqual(tcp.producerState, "paused")


# -- integration: real sockets on 127.0.0.1 --------------------------------


def client_hello() -> bytes:
    """
    The first flight of a TLS client, to show what a refused socket does
    (and does not) answer.
    """
    conn = SSL.Connection(SSL.Context(SSL.TLS_CLIENT_METHOD), None)
    conn.set_connect_state()
    try:
        conn.do_handshake()
    except SSL.WantReadError:
        pass
    return conn.bio_read(65536)


class RawClient(Protocol):
    def __init__(self, greeting: bytes = b"") -> None:
        self.greeting = greeting
        self.data = b""
        self.made: defer.Deferred[None] = defer.Deferred()
        self.closed: defer.Deferred[None] = defer.Deferred()
        self.got_data: defer.Deferred[None] = defer.Deferred()
        self.open = False

    def connectionMade(self) -> None:
        self.open = True
        if self.greeting:
            self.transport.write(self.greeting)  # type: ignore[union-attr]
        self.made.callback(None)

    def dataReceived(self, data: bytes) -> None:
        self.data += data
        if not self.got_data.called:
            self.got_data.callback(None)

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:  # noqa: B008
        self.open = False
        self.closed.callback(None)


class RawFactory(ClientFactory):
    def __init__(self, greeting: bytes = b"") -> None:
        self.greeting = greeting
        self.clients: list[RawClient] = []
        self.on_client: Callable[[RawClient], None] | None = None

    def buildProtocol(self, addr: Any) -> RawClient:
        p = RawClient(self.greeting)
        self.clients.append(p)
        if self.on_client is not None:
            self.on_client(p)
        return p


def within(d: defer.Deferred[Any], seconds: float) -> defer.Deferred[Any]:
    return d.addTimeout(seconds, reactor)


class AgentPortIntegrationTests(TestCase):
    """
    Bounded tests on 127.0.0.1 with the real reactor.
    """

    timeout = 30

    def setUp(self) -> None:
        self.certs = Path(self.mktemp())
        make_pki(self.certs, ["node-a"])
        self.connectors: list[Any] = []
        self.closings: list[defer.Deferred[Any]] = []

    def control_plane(self, limits: LimitsConfig) -> ControlPlane:
        cp = ControlPlane(
            reactor, RecordingSink(), ServerTLS(server_files(self.certs)), "127.0.0.1", 0,
            limits=limits, handle_sighup=False,
        )
        cp.startService()
        self.addCleanup(cp.stopService)
        self.port = cp.agent_listener.address()[1]
        return cp

    def dial(self, factory: RawFactory) -> Any:
        factory.on_client = lambda c: self.closings.append(c.closed)
        connector = reactor.connectTCP("127.0.0.1", self.port, factory, timeout=5)
        self.connectors.append(connector)
        return connector

    def tearDown(self) -> defer.Deferred[Any]:  # type: ignore[override]
        # Close every client socket and wait until each is gone, so the
        # reactor is clean whatever the test did.
        for c in self.connectors:
            c.disconnect()
        waits = [within(d, 5) for d in self.closings]
        return defer.gatherResults(waits, consumeErrors=True)

    @defer.inlineCallbacks
    def test_per_address_cap_refuses_before_any_tls_byte(self) -> Any:
        """
        With a cap of 2 per address, a third socket from 127.0.0.1 is closed
        at accept: its ClientHello gets no byte back and no TLS protocol is
        built for it, while the first two get a ServerHello.
        """
        cp = self.control_plane(LimitsConfig(max_per_address=2))
        hello = client_hello()
        factories = [RawFactory(hello) for _ in range(3)]
        for f in factories[:2]:
            self.dial(f)
            yield within(self.wait_made(f), 5)
        self.dial(factories[2])
        refused = yield within(self.wait_made(factories[2]), 5)
        yield within(refused.closed, 5)
        for f in factories[:2]:
            yield within(f.clients[0].got_data, 5)
            self.assertTrue(f.clients[0].data)
        self.assertEqual(refused.data, b"")
        self.assertEqual(cp.limiter.refused["per_address"], 1)
        self.assertEqual(cp.agents.open_connections(), 2)

    @defer.inlineCallbacks
    def wait_made(self, factory: RawFactory) -> Any:
        while not factory.clients:
            yield task.deferLater(reactor, 0.01, lambda: None)
        client = factory.clients[0]
        yield client.made
        return client

    @defer.inlineCallbacks
    def test_idle_flood_does_not_stop_a_real_agent(self) -> Any:
        """
        500 idle TCP sockets to the agent port do not stop a real agent from
        registering over mutual TLS meanwhile, and every one of them is
        closed by the handshake deadline; 20 connections that finish the
        handshake and then say nothing are closed by the Register deadline;
        the agent's stream stays.
        """
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 1500
        if soft < want:
            if hard != resource.RLIM_INFINITY and hard < want:
                raise SkipTest(f"needs {want} file descriptors, the hard limit is {hard}")
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            self.addCleanup(resource.setrlimit, resource.RLIMIT_NOFILE, (soft, hard))
        cp = self.control_plane(LimitsConfig(max_connections=1000, max_per_address=1000))
        deadline = 2.0
        cp.agents.handshake_timeout = deadline
        cp.agents.register_timeout = deadline
        flood = RawFactory()
        silent = RawFactory()
        silent.on_client = lambda c: self.closings.append(c.closed)
        for _ in range(20):
            self.connectors.append(reactor.connectTCP(
                "127.0.0.1", self.port,
                TLSMemoryBIOFactory(agent_tls(self.certs, "node-a"), True, silent), timeout=5,
            ))
        for _ in range(500):
            self.dial(flood)
        while len(flood.clients) < 500:
            yield task.deferLater(reactor, 0.01, lambda: None)
        yield within(defer.gatherResults([c.made for c in flood.clients]), 5)
        agent = AgentFactory("node-a")
        connector = reactor.connectTCP(
            "127.0.0.1", self.port,
            TLSMemoryBIOFactory(agent_tls(self.certs, "node-a"), True, agent), timeout=5,
        )
        self.connectors.append(connector)
        while not agent.protocols:
            yield task.deferLater(reactor, 0.01, lambda: None)
        self.closings.append(agent.protocols[0].closed)
        ack = yield within(agent.protocols[0].acked, 5)
        self.assertTrue(ack.ok)
        still_open = sum(c.open for c in flood.clients)
        self.assertEqual(still_open, 500, "the agent registered while the flood was held")
        yield within(
            defer.gatherResults([c.closed for c in flood.clients + silent.clients]), deadline + 5
        )
        self.assertEqual(len(silent.clients), 20)
        self.assertEqual(cp.agents.registrations["handshake_timeout"], 500)
        self.assertEqual(cp.agents.registrations["register_timeout"], 20)
        self.assertEqual(cp.agents.connected_nodes(), ["node-a"])
        self.assertTrue(agent.protocols[0].connected)

    @defer.inlineCallbacks
    def test_gate_holds_new_connections_in_the_backlog(self) -> Any:
        """
        With the gate at 2, two sockets that sent a byte and stalled shut
        it: a real agent that dials meanwhile is not accepted (its TCP
        handshake is done by the kernel; no TLS protocol, no deadline of
        ours) until one of them closes, then it registers.
        """
        cp = self.control_plane(LimitsConfig(max_per_address=0, max_registering=2))
        stallers = [RawFactory(b"\x16") for _ in range(2)]
        for f in stallers:
            self.dial(f)
            yield within(self.wait_made(f), 5)
        while cp.limiter.registering < 2:
            yield task.deferLater(reactor, 0.01, lambda: None)
        self.assertTrue(cp.limiter.paused)
        agent = AgentFactory("node-a")
        self.connectors.append(reactor.connectTCP(
            "127.0.0.1", self.port,
            TLSMemoryBIOFactory(agent_tls(self.certs, "node-a"), True, agent), timeout=5,
        ))
        while not agent.protocols:
            yield task.deferLater(reactor, 0.01, lambda: None)
        self.closings.append(agent.protocols[0].closed)
        # Connected as far as the agent can tell (the kernel did the TCP
        # handshake). The control plane cannot accept it: its listening
        # port is not among what the reactor reads, so no wait proves more.
        self.assertNotIn(cp.limiter.port, reactor.getReaders())
        self.assertEqual(cp.agents.open_connections(), 2)
        self.assertFalse(agent.protocols[0].acked.called)
        stallers[0].clients[0].transport.loseConnection()  # type: ignore[union-attr]
        ack = yield within(agent.protocols[0].acked, 5)
        self.assertTrue(ack.ok)
        self.assertEqual(cp.agents.connected_nodes(), ["node-a"])
        self.assertEqual(cp.agents.registrations["handshake_timeout"], 0)
        # The agent's own ClientHello shut the gate again, beside the
        # remaining staller, until its Register.
        self.assertEqual(cp.limiter.pauses, 2)
        self.assertFalse(cp.limiter.paused)
        self.assertIn(cp.limiter.port, reactor.getReaders())
