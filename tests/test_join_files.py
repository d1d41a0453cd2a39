"""
What a joining node does with what it is issued, without reading it back:
the files it writes load as what it returns, and whatever L{TLSFiles.load}
would refuse is refused before anything is written. Its join TLS context is
made once, when the joiner is.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from OpenSSL import SSL
from twisted.application.service import MultiService
from twisted.internet.defer import Deferred
from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent import join
from llmgw.agent.join import Joiner, JoinRefused
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.core.jointokens import JoinToken, token_from_data, token_to_data
from llmgw.tlsconf.ca import CertificateAuthority
from llmgw.tlsconf.csr import check_request, new_request, sign_request, spki_hash
from llmgw.tlsconf.jointoken import parse_token, printable
from llmgw.tlsconf.options import (
    AgentClientTLS,
    ServerIdentityError,
    TLSConfigError,
    TLSFiles,
    verify_server_identity,
)
from llmgw.tlsconf.pem import cert_pem


def _spki(key: Any) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


class JoinerWriteTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.ca = CertificateAuthority.init(Path(self.mktemp()))
        token = parse_token(printable("0123abcd", "f" * 32, spki_hash(self.ca.certificate)))
        self.dir = Path(self.mktemp())
        self.joiner = Joiner(None, "127.0.0.1", 1, token, "n1", self.dir)

    def issued(self, csr_pem: bytes, ca: CertificateAuthority | None = None,
               now: datetime.datetime | None = None) -> pb.CertificateIssued:
        signer = ca or self.ca
        cert = sign_request(check_request(csr_pem, "n1"), "n1", signer.key, signer.certificate, now=now)
        return pb.CertificateIssued(certificate_pem=cert_pem(cert), ca_bundle_pem=cert_pem(self.ca.certificate))

    def test_written_files_load_as_returned(self) -> None:
        """The files written load (read back) as the node's files returned, key 0600, all without a second read."""
        req = self.joiner._request()
        files = self.joiner.write(self.issued(req.csr_pem))
        ca_path, cert_path, key_path = self.joiner.paths
        loaded = TLSFiles.load(ca_path, cert_path, key_path)
        self.assertEqual(files.cert, loaded.cert)
        self.assertEqual(files.ca, loaded.ca)
        self.assertEqual(files.roots, loaded.roots)
        self.assertEqual(_spki(files.key), _spki(loaded.key))
        self.assertEqual((files.ca_path, files.cert_path, files.key_path), (ca_path, cert_path, key_path))
        self.assertEqual(key_path.stat().st_mode & 0o777, 0o600)

    def test_certificate_for_another_key_refused_unwritten(self) -> None:
        """A certificate for a key the node did not make is refused, and neither it nor the bundle is written."""
        self.joiner._request()
        _, other = new_request("n1")
        with self.assertRaises(JoinRefused) as e:
            self.joiner.write(self.issued(other))
        self.assertIn("does not belong", str(e.exception))
        ca_path, cert_path, _ = self.joiner.paths
        self.assertFalse(cert_path.exists())
        self.assertFalse(ca_path.exists())

    def test_certificate_from_another_ca_refused(self) -> None:
        """A certificate no root of the bundle issued is refused (the bundle holds the token's CA)."""
        req = self.joiner._request()
        other = CertificateAuthority.init(Path(self.mktemp()))
        with self.assertRaises(JoinRefused) as e:
            self.joiner.write(self.issued(req.csr_pem, ca=other))
        self.assertIn("not issued by the CA", str(e.exception))
        self.assertFalse(self.joiner.paths[1].exists())

    def test_expired_certificate_refused(self) -> None:
        """A certificate that has already ended is refused, as loading it from its file would be."""
        req = self.joiner._request()
        long_ago = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=365)
        with self.assertRaises(JoinRefused) as e:
            self.joiner.write(self.issued(req.csr_pem, now=long_ago))
        self.assertIn("expired", str(e.exception))

    def test_not_pem_refused(self) -> None:
        """An answer whose certificate is not PEM is refused with a reason, not an unexpected error."""
        self.joiner._request()
        bad = pb.CertificateIssued(certificate_pem=b"nonsense", ca_bundle_pem=cert_pem(self.ca.certificate))
        with self.assertRaises(JoinRefused) as e:
            self.joiner.write(bad)
        self.assertIn("not PEM", str(e.exception))

    def test_asked_again_with_the_same_key(self) -> None:
        """A request asked again (it waited for an operator) carries the same key as the first."""
        first = check_request(self.joiner._request().csr_pem, "n1")
        again = check_request(self.joiner._request().csr_pem, "n1")
        self.assertEqual(_spki(first), _spki(again))


class JoinContextTests(SynchronousTestCase):
    def test_one_context_per_joiner(self) -> None:
        """Every ask of a joiner uses the TLS context made with it (TLS 1.2 at least), not a new one."""
        ca = CertificateAuthority.init(Path(self.mktemp()))
        token = parse_token(printable("0123abcd", "f" * 32, spki_hash(ca.certificate)))
        joiner = Joiner(None, "127.0.0.1", 1, token, "n1", Path(self.mktemp()))
        used: list[SSL.Context] = []

        def wrap(creator: Any, endpoint: Any) -> Any:
            used.append(creator.clientConnectionForTLS(None).get_context())
            return endpoint

        self.patch(join, "wrapClientTLS", wrap)
        self.patch(join, "connectProtocol", lambda endpoint, proto: Deferred())
        joiner.ask_once()
        joiner.ask_once()
        self.assertEqual(len(used), 2)
        self.assertIs(used[0], joiner.context)
        self.assertIs(used[1], joiner.context)


class AgentContextTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.ca = CertificateAuthority.init(Path(self.mktemp()))
        token = parse_token(printable("0123abcd", "f" * 32, spki_hash(self.ca.certificate)))
        self.joiner = Joiner(None, "127.0.0.1", 1, token, "n1", Path(self.mktemp()))

    def joined(self) -> TLSFiles:
        csr = check_request(self.joiner._request().csr_pem, "n1")
        cert = sign_request(csr, "n1", self.ca.key, self.ca.certificate)
        return self.joiner.write(pb.CertificateIssued(certificate_pem=cert_pem(cert),
                                                      ca_bundle_pem=cert_pem(self.ca.certificate)))

    def test_agent_context_made_with_the_joiner(self) -> None:
        """
        A joiner makes the agent stream's context when it is made, apart from
        the join's and with no identity yet; the agent built after the join
        presents the files issued in that context.
        """
        context = self.joiner.agent_context
        self.assertIsNot(context, self.joiner.context)
        self.assertEqual(context.get_verify_mode(), SSL.VERIFY_NONE)
        files = self.joined()
        tls = AgentClientTLS("127.0.0.1", files, context=context)
        self.assertIs(tls.clientConnectionForTLS(None).get_context(), context)
        self.assertEqual(context.get_verify_mode() & SSL.VERIFY_FAIL_IF_NO_PEER_CERT, SSL.VERIFY_FAIL_IF_NO_PEER_CERT)

    def test_joined_agent_is_built_with_it(self) -> None:
        """The agent a joining node builds once it has joined is given the joiner's agent context."""
        from llmgw.agent import service
        from llmgw.agent.joinoptions import joining_service

        built: list[dict[str, Any]] = []
        self.patch(service, "makeService", lambda options, reactor: built.append(dict(options)) or MultiService())
        options: dict[str, Any] = {"joiner": self.joiner, "given_control": True}
        agent = joining_service(options, None)
        agent.build(self.joined(), 0)
        self.assertIs(built[0]["tls_context"], self.joiner.agent_context)


class TLSFilesOfTests(SynchronousTestCase):
    def test_of_refuses_what_load_refuses(self) -> None:
        """L{TLSFiles.of} refuses a key that is not the certificate's, naming both files, as load does."""
        d = Path(self.mktemp())
        ca = CertificateAuthority.init(d)
        a, b = ca.issue_agent("a"), ca.issue_agent("b")
        files = TLSFiles.load(d / "ca.pem", a.cert_path, a.key_path)
        with self.assertRaises(TLSConfigError) as e:
            TLSFiles.of(list(files.roots), files.cert, TLSFiles.load(d / "ca.pem", b.cert_path, b.key_path).key,
                        files.ca_path, files.cert_path, files.key_path)
        self.assertIn("does not belong", str(e.exception))


class ServerIdentityTests(SynchronousTestCase):
    def test_refusal_names_the_certificates_names(self) -> None:
        """A control-plane certificate for other addresses is refused with the names it does hold."""
        ca = CertificateAuthority.init(Path(self.mktemp()))
        server = ca.issue_server(["10.0.0.9", "cp.example"]).certificate
        verify_server_identity(server, "10.0.0.9")
        with self.assertRaises(ServerIdentityError) as e:
            verify_server_identity(server, "127.0.0.1")
        self.assertEqual(e.exception.sans, ["DNS:cp.example", "IP:10.0.0.9"])


class TokenDataTests(SynchronousTestCase):
    def test_round_trip(self) -> None:
        """A token's data reads back as the same token, nodes included."""
        token = JoinToken("0123abcd", "h" * 64, 1.0, 2.0, 3000, 2, "join-", False, ("join-1", "join-2"))
        data = token_to_data(token)
        self.assertEqual(data["nodes"], ["join-1", "join-2"])
        self.assertEqual(token_from_data(data), token)
