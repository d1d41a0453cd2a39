"""
A node joining over a real loopback socket: the join listener's TLS sends
the CA roots, the node checks them against its token before it sends, and
writes what it is issued; a token naming another CA sends nothing.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from OpenSSL import SSL
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.trial.unittest import TestCase

from llmgw.agent.join import Joiner, WrongControlPlane
from llmgw.control.core.jointokens import TokenFile
from llmgw.control.shell.joining import JoinAuthority, JoinFactory
from llmgw.control.shell.joinlisten import JoinServerTLS
from llmgw.tlsconf.ca import CertificateAuthority
from llmgw.tlsconf.csr import spki_hash
from llmgw.tlsconf.jointoken import parse_token, printable
from llmgw.tlsconf.options import AGENT_GROUPS, ServerTLS, server_files, set_groups


class JoinLoopbackTests(TestCase):
    timeout = 30

    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        self.ca = CertificateAuthority.init(self.dir)
        self.ca.issue_server(["127.0.0.1"])
        tls = ServerTLS(server_files(self.dir))
        self.tokens = TokenFile(self.dir / "join-tokens.json")
        self.received: list[str] = []
        self.authority = JoinAuthority(reactor, self.tokens, lambda: list(tls.files.roots), lambda n: False,
                                       signer_dir=self.dir, lifetime=datetime.timedelta(minutes=1),
                                       agent_port=7443)
        original = self.authority.join

        def join(req, address):  # type: ignore[no-untyped-def]
            self.received.append(req.node_id)
            return original(req, address)

        self.authority.join = join  # type: ignore[method-assign]
        factory = TLSMemoryBIOFactory(JoinServerTLS(tls), False, JoinFactory(self.authority, reactor), clock=reactor)
        self.port = reactor.listenTCP(0, factory, interface="127.0.0.1")
        self.addCleanup(self.port.stopListening)

    def joiner(self, ca_hash: str, name: str) -> Joiner:
        token, secret = self.tokens.book.create(reactor.seconds(), 3600)
        self.tokens.save()
        parsed = parse_token(printable(token.id, secret, ca_hash))
        return Joiner(reactor, "127.0.0.1", self.port.getHost().port, parsed, name, Path(self.mktemp()))

    async def _joined(self) -> None:
        joiner = self.joiner(spki_hash(self.ca.certificate), "node-a")
        files = await joiner.run()
        self.assertEqual(files.cert.subject.rfc4514_string(), "CN=node-a")
        self.assertEqual(joiner.agent_port, 7443)
        self.assertEqual((joiner.paths[2].stat().st_mode & 0o777), 0o600)
        again = await joiner.run()
        self.assertEqual(again.cert.serial_number, files.cert.serial_number)

    def test_join_over_loopback(self) -> Deferred[None]:
        """A node joins, gets CN=its name with its key kept 0600, and a second run reuses its files."""
        return Deferred.fromCoroutine(self._joined())

    async def _wrong(self) -> None:
        joiner = self.joiner("sha256:" + "1" * 64, "node-b")
        with self.assertRaises(WrongControlPlane):
            await joiner.run()
        self.assertEqual(self.received, [])

    def test_wrong_ca_hash_sends_nothing(self) -> Deferred[None]:
        """A token naming another CA is refused at the handshake: the control plane receives no request."""
        return Deferred.fromCoroutine(self._wrong())

    async def _negotiated(self) -> None:
        joiner = self.joiner(spki_hash(self.ca.certificate), "node-c")
        seen: list[tuple[str | None, str]] = []

        def done(conn: SSL.Connection, where: int, ret: int) -> None:
            if where & SSL.SSL_CB_HANDSHAKE_DONE:
                seen.append((conn.get_group_name(), conn.get_protocol_version_name()))

        joiner.context.set_info_callback(done)
        await joiner.run()
        self.assertEqual(seen, [(AGENT_GROUPS.split(":")[0], "TLSv1.3")])

    def test_join_uses_the_agent_ports_key_exchange(self) -> Deferred[None]:
        """A join's handshake is TLS 1.3 with the agent stream's first key-exchange group (the post-quantum hybrid)."""
        return Deferred.fromCoroutine(self._negotiated())

    async def _weak_group(self) -> None:
        joiner = self.joiner(spki_hash(self.ca.certificate), "node-d")
        # A group OpenSSL would take by default, but the agent port does not.
        self.assertEqual(set_groups(joiner.context, "ffdhe2048"), "ffdhe2048")
        with self.assertRaises(ConnectionError):
            await joiner.ask_once()
        self.assertEqual(self.received, [])

    def test_listener_refuses_groups_the_agent_port_refuses(self) -> Deferred[None]:
        """The join listener takes only the agent port's key-exchange groups: a node offering another gets no handshake."""
        return Deferred.fromCoroutine(self._weak_group())
