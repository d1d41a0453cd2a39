"""
Tests for L{llmgw.tlsconf.contexts}: a context made without an identity
(L{bare_context}) and given one later (L{present}) is what
L{TLSFiles.context} makes at once, in a real handshake; and an agent given
such a context (a node that joined) uses it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from OpenSSL import SSL
from twisted.internet.protocol import Factory
from twisted.internet.task import Clock
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.test.iosim import connectedServerAndClient
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.shell.agentsvc import AgentService
from llmgw.control.state.inventory import Inventory
from llmgw.testing.pki import make_pki
from llmgw.testing.sinks import RecordingSink
from llmgw.testing.stream import RecordingAgent, register
from llmgw.tlsconf.ca import CertificateAuthority
from llmgw.tlsconf.contexts import AGENT_GROUPS, bare_context
from llmgw.tlsconf.options import AgentClientTLS, ServerTLS, agent_files, server_files

#: What L{TLSFiles.context} asks of a peer.
VERIFY_PEER_ONCE = SSL.VERIFY_PEER | SSL.VERIFY_FAIL_IF_NO_PEER_CERT | SSL.VERIFY_CLIENT_ONCE


class PresentTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.ca = make_pki(self.mktemp(), nodes=("node-a", "node-b"))
        self.clock = Clock()
        self.inventory = Inventory()
        self.service = AgentService(self.inventory, RecordingSink(), self.clock, epoch=1)

    def connect(self, client_tls: AgentClientTLS) -> tuple[RecordingAgent, Any]:
        server = TLSMemoryBIOFactory(ServerTLS(server_files(self.ca.directory)), False,
                                     self.service, clock=self.clock)
        agent = RecordingAgent()
        client = TLSMemoryBIOFactory(client_tls, True, Factory.forProtocol(lambda: agent), clock=self.clock)
        _, _, pump = connectedServerAndClient(
            lambda: server.buildProtocol(None), lambda: client.buildProtocol(None), clock=self.clock)
        return agent, pump

    def test_bare_context_trusts_and_presents_nothing(self) -> None:
        """A bare context verifies no peer; present makes it require one, as TLSFiles.context does."""
        files = agent_files(self.ca.directory, "node-a")
        context = bare_context(AGENT_GROUPS)
        self.assertEqual(context.get_verify_mode(), SSL.VERIFY_NONE)
        self.assertIs(files.present(context), context)
        self.assertEqual(context.get_verify_mode(), VERIFY_PEER_ONCE)
        self.assertEqual(files.context(AGENT_GROUPS).get_verify_mode(), VERIFY_PEER_ONCE)

    def test_agent_given_a_context_registers_with_it(self) -> None:
        """An agent given a context made before its files registers over mutual TLS through that very context."""
        context = bare_context(AGENT_GROUPS)
        client_tls = AgentClientTLS("127.0.0.1", agent_files(self.ca.directory, "node-a"), context=context)
        self.assertIs(client_tls.clientConnectionForTLS(None).get_context(), context)
        agent, pump = self.connect(client_tls)
        agent.send(register("node-a"))
        pump.flush()
        self.assertTrue(agent.received[0].ack.ok)
        self.assertEqual(self.service.connected_nodes(), ["node-a"])

    def test_presented_context_refuses_another_ca(self) -> None:
        """A context given its files trusts only their roots: a control plane of another CA fails the handshake."""
        other = CertificateAuthority.init(Path(self.mktemp()))
        other.issue_server(["127.0.0.1"])
        self.ca = other  # the server side of connect
        mine = make_pki(self.mktemp(), nodes=("node-a",))
        client_tls = AgentClientTLS("127.0.0.1", agent_files(mine.directory, "node-a"), context=bare_context())
        agent, pump = self.connect(client_tls)
        agent.send(register("node-a"))
        pump.flush()
        self.assertEqual(agent.received, [])
        self.assertIsNotNone(agent.reason)
        self.assertEqual(self.service.connected_nodes(), [])

    def test_key_of_another_certificate_refused(self) -> None:
        """present refuses a key that is not the certificate's."""
        a = agent_files(self.ca.directory, "node-a")
        b = agent_files(self.ca.directory, "node-b")
        from llmgw.tlsconf.contexts import present

        self.assertRaises(SSL.Error, present, bare_context(), a.cert, b.key, a.roots)
