"""
Tests for L{llmgw.tlsconf.options}: loading files, node identity from a
client certificate, and the agent's check of the control plane's names,
through in-memory mutual TLS (C{iosim} with a C{Clock}).
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from OpenSSL import SSL
from twisted.internet.protocol import Factory
from twisted.internet.task import Clock
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.test.iosim import connectedServerAndClient
from twisted.trial.unittest import SkipTest, SynchronousTestCase

from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.shell.agentsvc import AgentService
from llmgw.control.state.inventory import Inventory
from llmgw.testing.pki import issue_raw, make_pki
from llmgw.testing.sinks import RecordingSink
from llmgw.testing.stream import RecordingAgent, register
from llmgw.tlsconf.ca import CertificateAuthority
from llmgw.tlsconf.options import (
    AGENT_GROUPS,
    AGENT_GROUPS_CLASSICAL,
    AgentClientTLS,
    ServerIdentityError,
    ServerTLS,
    TLSConfigError,
    TLSFiles,
    agent_files,
    server_files,
    set_groups,
    verify_server_identity,
)


class FileTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.ca = make_pki(self.mktemp(), nodes=("node-a",))
        self.dir = self.ca.directory

    def test_load(self) -> None:
        """
        Matching files load.
        """
        files = agent_files(self.dir, "node-a")
        self.assertEqual(files.cert_path, self.dir / "agent-node-a.pem")
        server_files(self.dir)

    def test_missing_file(self) -> None:
        """
        A missing file is named.
        """
        with self.assertRaises(TLSConfigError) as e:
            agent_files(self.dir, "node-z")
        self.assertIn("agent-node-z.pem", str(e.exception))

    def test_mismatched_key(self) -> None:
        """
        A key that does not belong to the certificate is refused, naming both.
        """
        with self.assertRaises(TLSConfigError) as e:
            TLSFiles.load(self.dir / "ca.pem", self.dir / "agent-node-a.pem",
                          self.dir / "server.key")
        self.assertIn("does not belong", str(e.exception))

    def test_expired(self) -> None:
        """
        An expired certificate is refused with its expiry date.
        """
        past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=2)
        cert, key = issue_raw(self.ca, "old", "node-a", not_before=past,
                              not_after=past + datetime.timedelta(days=1))
        with self.assertRaises(TLSConfigError) as e:
            TLSFiles.load(self.dir / "ca.pem", cert, key)
        self.assertIn("expired", str(e.exception))

    def test_other_ca(self) -> None:
        """
        A certificate from another CA is refused.
        """
        other = make_pki(self.mktemp(), nodes=("node-a",))
        with self.assertRaises(TLSConfigError) as e:
            TLSFiles.load(self.dir / "ca.pem", other.directory / "agent-node-a.pem",
                          other.directory / "agent-node-a.key")
        self.assertIn("not issued by the CA", str(e.exception))

    def test_garbage(self) -> None:
        """
        A file that is not PEM is named.
        """
        bad = Path(self.mktemp())
        bad.write_text("nope")
        with self.assertRaises(TLSConfigError) as e:
            TLSFiles.load(bad, self.dir / "agent-node-a.pem", self.dir / "agent-node-a.key")
        self.assertIn(str(bad), str(e.exception))


class ServerNameTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.ca = CertificateAuthority.init(self.mktemp())

    def test_ip_needs_ip_san(self) -> None:
        """
        An IP is matched only by an IP SAN, never by the common name, and the
        error names the address and the SANs held.
        """
        cert = self.ca.issue_server(["control.example"]).certificate
        verify_server_identity(cert, "control.example")
        with self.assertRaises(ServerIdentityError) as e:
            verify_server_identity(cert, "10.0.0.5")
        self.assertIn("10.0.0.5", str(e.exception))
        self.assertIn("DNS:control.example", str(e.exception))

    def test_no_san_at_all(self) -> None:
        """
        A certificate without any SAN is refused even when its common name is
        the dialled address.
        """
        path, _ = issue_raw(self.ca, "nosan", "10.0.0.5", usage=ExtendedKeyUsageOID.SERVER_AUTH)
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        with self.assertRaises(ServerIdentityError) as e:
            verify_server_identity(cert, "10.0.0.5")
        self.assertIn("no subject alternative names", str(e.exception))

    def test_ip_san(self) -> None:
        """
        An IP SAN matches its address, IPv6 included.
        """
        path, _ = issue_raw(self.ca, "ip", "x", usage=ExtendedKeyUsageOID.SERVER_AUTH,
                            sans=[x509.IPAddress(ipaddress.ip_address("::1"))])
        verify_server_identity(x509.load_pem_x509_certificate(path.read_bytes()), "::1")


class InMemoryTLSTests(SynchronousTestCase):
    """
    The agent service over real mutual TLS in memory.
    """

    def setUp(self) -> None:
        self.ca = make_pki(self.mktemp(), nodes=("node-a", "node-b"))
        self.clock = Clock()
        self.inventory = Inventory()
        self.service = AgentService(self.inventory, RecordingSink(), self.clock, epoch=1)

    def connect(self, node: str, host: str = "127.0.0.1", ca: CertificateAuthority | None = None):  # type: ignore[no-untyped-def]
        ca = ca or self.ca
        server = TLSMemoryBIOFactory(ServerTLS(server_files(self.ca.directory)), False,
                                     self.service, clock=self.clock)
        client_tls = AgentClientTLS(host, agent_files(ca.directory, node))
        agent = RecordingAgent()
        client = TLSMemoryBIOFactory(client_tls, True, Factory.forProtocol(lambda: agent),
                                     clock=self.clock)
        s, c, pump = connectedServerAndClient(
            lambda: server.buildProtocol(None), lambda: client.buildProtocol(None),
            clock=self.clock,
        )
        return agent, pump, client_tls

    def test_register_over_mutual_tls(self) -> None:
        """
        The node id comes from the certificate presented in a real handshake.
        """
        agent, pump, _ = self.connect("node-a")
        agent.send(register("node-a"))
        pump.flush()
        self.assertTrue(agent.received[0].ack.ok)
        self.assertEqual(self.service.connected_nodes(), ["node-a"])

    def test_claiming_another_node(self) -> None:
        """
        node-a's certificate cannot register node-b.
        """
        agent, pump, _ = self.connect("node-a")
        agent.send(register("node-b"))
        pump.flush()
        self.assertEqual(agent.received[0].ack.code, pb.Ack.CODE_PERMISSION_DENIED)
        self.assertNotIn("node-b", self.inventory)

    def test_server_name_mismatch(self) -> None:
        """
        An agent dialling an address the server certificate does not name
        fails the connection with a ServerIdentityError naming it.
        """
        agent, pump, client_tls = self.connect("node-a", host="10.9.9.9")
        pump.flush()
        self.assertIsNotNone(agent.reason)
        assert agent.reason is not None
        self.assertTrue(agent.reason.check(ServerIdentityError))
        self.assertIn("10.9.9.9", str(agent.reason.value))
        self.assertIn("IP:127.0.0.1", str(agent.reason.value))
        self.assertEqual(self.service.connected_nodes(), [])


def _handshake(server: ServerTLS, client: AgentClientTLS) -> tuple[str | None, str]:
    """
    One handshake between the two sides' contexts over memory BIOs;
    returns the agreed group and protocol version (server side).
    """
    s = SSL.Connection(server._context, None)
    s.set_accept_state()
    c = SSL.Connection(client._context, None)
    c.set_app_data(None)
    c.set_connect_state()
    for _ in range(10):
        for conn in (c, s):
            try:
                conn.do_handshake()
            except SSL.WantReadError:
                pass
        for a, b in ((c, s), (s, c)):
            try:
                b.bio_write(a.bio_read(65536))
            except SSL.WantReadError:
                pass
    return s.get_group_name(), s.get_protocol_version_name()


class KeyExchangeTests(SynchronousTestCase):
    """
    The key-exchange groups: the agent chooses (the post-quantum hybrid by
    default), the control plane takes its choice without a retry, classical
    X25519 stays available.
    """

    def setUp(self) -> None:
        self.dir = make_pki(self.mktemp(), nodes=("node-a",)).directory
        self.server = ServerTLS(server_files(self.dir))

    def test_agent_default_is_post_quantum(self) -> None:
        """
        By default an agent and the control plane agree on the hybrid
        X25519MLKEM768 over TLS 1.3 (where OpenSSL has ML-KEM).
        """
        client = AgentClientTLS("127.0.0.1", agent_files(self.dir, "node-a"))
        self.assertEqual(client.groups, AGENT_GROUPS)
        if set_groups(SSL.Context(SSL.TLS_METHOD), AGENT_GROUPS) != AGENT_GROUPS:
            raise SkipTest("this OpenSSL has no X25519MLKEM768")
        group, version = _handshake(self.server, client)
        self.assertEqual(group, "X25519MLKEM768")
        self.assertEqual(version, "TLSv1.3")

    def test_classical_available(self) -> None:
        """
        An agent that puts X25519 first gets it from the same control plane.
        """
        client = AgentClientTLS(
            "127.0.0.1", agent_files(self.dir, "node-a"), groups=AGENT_GROUPS_CLASSICAL
        )
        group, _ = _handshake(self.server, client)
        self.assertEqual(group, "x25519")

    def test_unknown_group_falls_back(self) -> None:
        """
        A group list this OpenSSL cannot take falls back to the classical
        groups rather than failing.
        """
        ctx = SSL.Context(SSL.TLS_METHOD)
        self.assertEqual(set_groups(ctx, "NoSuchGroup:X25519"), "X25519:secp256r1:secp384r1")
