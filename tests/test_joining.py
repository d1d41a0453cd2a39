"""
Joining with tokens and renewing: the token book, the checks a certificate
request passes, the authority's decisions (signer and operator), and the
node's check of the control plane against its token's CA hash.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.join import Joiner, WrongControlPlane, check_chain
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.core.jointokens import TokenBook, TokenFile, TokenRefused
from llmgw.control.shell.joining import JoinAuthority
from llmgw.tlsconf.ca import CertificateAuthority
from llmgw.tlsconf.csr import RequestRefused, check_request, new_request, sign_request, spki_hash
from llmgw.tlsconf.jointoken import MalformedToken, parse_token, printable
from llmgw.tlsconf.pem import cert_pem

NOW = 1_700_000_000.0


def _csr(name: str, key: object = None, san: bool = False) -> bytes:
    key = key or ec.generate_private_key(ec.SECP256R1())
    b = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
    if san:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("evil")]), critical=False)
    return b.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)  # type: ignore[arg-type]


class TokenBookTests(SynchronousTestCase):
    def test_uses_ttl_prefix_revoke(self) -> None:
        """A token admits as many joins as its uses, until its end, names in its prefix, and none once revoked."""
        book = TokenBook()
        token, secret = book.create(NOW, 3600, uses=2, node_prefix="gpu-")
        book.check(token.id, secret, "gpu-1", NOW)
        book.use(token.id, "gpu-1")
        self.assertRaises(TokenRefused, book.check, token.id, secret, "cpu-1", NOW)
        self.assertRaises(TokenRefused, book.check, token.id, "0" * 32, "gpu-2", NOW)
        self.assertRaises(TokenRefused, book.check, token.id, secret, "gpu-2", NOW + 3600)
        book.use(token.id, "gpu-2")
        with self.assertRaises(TokenRefused) as e:
            book.check(token.id, secret, "gpu-3", NOW)
        self.assertIn("used up", str(e.exception))
        t2, s2 = book.create(NOW, 60)
        book.revoke(t2.id)
        self.assertRaises(TokenRefused, book.check, t2.id, s2, "n", NOW)

    def test_printable_round_trip(self) -> None:
        """The printed token parses back to its id, secret and CA hash; a mangled one is refused."""
        text = printable("0123abcd", "f" * 32, "sha256:" + "a" * 64)
        p = parse_token(text)
        self.assertEqual((p.id, p.secret, p.ca_hash), ("0123abcd", "f" * 32, "sha256:" + "a" * 64))
        self.assertRaises(MalformedToken, parse_token, text[:-1])

    def test_file_keeps_hash_only_and_survives_restart(self) -> None:
        """Tokens persist in their file, which holds no secret, and load again after a restart."""
        path = Path(self.mktemp())
        path.parent.mkdir(parents=True, exist_ok=True)
        f = TokenFile(path)
        token, secret = f.book.create(NOW, 3600, uses=5)
        f.save()
        self.assertNotIn(secret, path.read_text())
        g = TokenFile(path)
        g.load()
        g.book.check(token.id, secret, "n1", NOW)


class RequestTests(SynchronousTestCase):
    def test_refusals(self) -> None:
        """A request for another name, with extensions, with a weak key, or unparseable is refused."""
        check_request(_csr("n1"), "n1")
        self.assertRaises(RequestRefused, check_request, _csr("n2"), "n1")
        self.assertRaises(RequestRefused, check_request, _csr("n1", san=True), "n1")
        weak = rsa.generate_private_key(public_exponent=65537, key_size=1024)
        self.assertRaises(RequestRefused, check_request, _csr("n1", weak), "n1")
        self.assertRaises(RequestRefused, check_request, b"junk", "n1")


class AuthorityTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        self.ca = CertificateAuthority.init(self.dir)
        self.ca.issue_server(["127.0.0.1"])
        self.clock = Clock()
        self.clock.advance(NOW)
        self.tokens = TokenFile(self.dir / "join-tokens.json")
        self.connected: set[str] = set()
        self.delivered: list[tuple[str, pb.CertificateIssued]] = []

    def authority(self, signer: bool = True, **kw: object) -> JoinAuthority:
        return JoinAuthority(
            self.clock, self.tokens, lambda: list(CertificateAuthority.load(self.dir).roots),
            self.connected.__contains__, signer_dir=self.dir if signer else None,
            lifetime=datetime.timedelta(minutes=1),
            deliver=lambda n, i: self.delivered.append((n, i)), agent_port=7443, **kw)  # type: ignore[arg-type]

    def request(self, tid: str, secret: str, name: str) -> pb.JoinRequest:
        return pb.JoinRequest(token_id=tid, token_secret=secret, node_id=name, csr_pem=new_request(name)[1])

    def test_ten_uses_then_refused(self) -> None:
        """With a signer, ten nodes join on a token of ten uses, each CN its name and clientAuth only; the eleventh is refused."""
        auth = self.authority()
        token, secret = self.tokens.book.create(NOW, 3600, uses=10)
        for i in range(10):
            r = auth.join(self.request(token.id, secret, f"n{i}"), "10.0.0.1:5")
            self.assertEqual(r.status, pb.JoinResponse.STATUS_ISSUED, r.error)
            cert = x509.load_pem_x509_certificate(r.issued.certificate_pem)
            self.assertEqual(cert.subject.rfc4514_string(), f"CN=n{i}")
            eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
            self.assertEqual(list(eku), [ExtendedKeyUsageOID.CLIENT_AUTH])
            self.assertEqual(r.agent_port, 7443)
        r = auth.join(self.request(token.id, secret, "n10"), "10.0.0.1:5")
        self.assertEqual(r.status, pb.JoinResponse.STATUS_REFUSED)
        self.assertIn("used up", r.error)

    def test_signed_joins_recorded(self) -> None:
        """What the signer issues is noted in the CA's record, so `ctl cert revoke NODE` finds a joined node."""
        auth = self.authority()
        token, secret = self.tokens.book.create(NOW, 3600)
        r = auth.join(self.request(token.id, secret, "n1"), "10.0.0.1:5")
        serial = format(x509.load_pem_x509_certificate(r.issued.certificate_pem).serial_number, "x")
        rows = [e for e in CertificateAuthority.load(self.dir).issued() if e["serial"] == serial]
        self.assertEqual([(e["kind"], e["subject"]) for e in rows], [("agent", "CN=n1")])

    def test_name_held_by_connected_node(self) -> None:
        """A join for a name a connected node holds is refused."""
        auth = self.authority()
        token, secret = self.tokens.book.create(NOW, 3600, uses=2)
        self.connected.add("n1")
        r = auth.join(self.request(token.id, secret, "n1"), "10.0.0.1:5")
        self.assertEqual(r.status, pb.JoinResponse.STATUS_REFUSED)
        self.assertIn("another node holds that name", r.error)

    def test_manual_approval(self) -> None:
        """Without a signer a join waits; asked again with the same key it stays pending until an operator's certificate is taken."""
        auth = self.authority(signer=False)
        token, secret = self.tokens.book.create(NOW, 3600)
        key, csr_pem = new_request("n1")
        req = pb.JoinRequest(token_id=token.id, token_secret=secret, node_id="n1", csr_pem=csr_pem)
        self.assertEqual(auth.join(req, "a").status, pb.JoinResponse.STATUS_PENDING)
        self.assertEqual(auth.join(req, "a").status, pb.JoinResponse.STATUS_PENDING)
        self.assertEqual([p["node"] for p in auth.listing()], ["n1"])
        csr = x509.load_pem_x509_csr(csr_pem)
        wrong = sign_request(check_request(_csr("n1"), "n1"), "n1", self.ca.key, self.ca.certificate)
        self.assertRaises(RequestRefused, auth.approve, "n1", cert_pem(wrong), "op")
        good = sign_request(csr, "n1", self.ca.key, self.ca.certificate)
        auth.approve("n1", cert_pem(good), "op")
        r = auth.join(req, "a")
        self.assertEqual(r.status, pb.JoinResponse.STATUS_ISSUED)
        self.assertEqual(auth.listing(), [])

    def test_pending_bounded(self) -> None:
        """Past the bound on pending requests, a new one is refused."""
        auth = self.authority(signer=False, max_pending=1)
        token, secret = self.tokens.book.create(NOW, 3600, uses=5)
        self.assertEqual(auth.join(self.request(token.id, secret, "n1"), "a").status, pb.JoinResponse.STATUS_PENDING)
        r = auth.join(self.request(token.id, secret, "n2"), "a")
        self.assertEqual(r.status, pb.JoinResponse.STATUS_REFUSED)
        self.assertIn("already wait", r.error)

    def test_renewal_revoked_refused_and_rollover(self) -> None:
        """A revoked certificate cannot renew; during a CA rollover a renewal is issued by the new root with both roots in the bundle."""
        auth = self.authority(revoked=lambda: frozenset({42}))
        self.assertRaises(RequestRefused, auth.renew, "n1", 42, new_request("n1")[1], "a")
        old = self.ca.certificate
        self.ca.rotate()
        issued = auth.renew("n1", 7, new_request("n1")[1], "a")
        assert issued is not None
        cert = x509.load_pem_x509_certificate(issued.certificate_pem)
        self.assertEqual(cert.issuer, self.ca.certificate.subject)
        roots = x509.load_pem_x509_certificates(issued.ca_bundle_pem)
        self.assertEqual({spki_hash(r) for r in roots}, {spki_hash(old), spki_hash(self.ca.certificate)})

    def test_renewal_waits_for_operator(self) -> None:
        """Without a signer a renewal waits; the approved certificate is delivered to the node's stream."""
        auth = self.authority(signer=False)
        key, csr_pem = new_request("n1")
        self.assertIsNone(auth.renew("n1", 7, csr_pem, "a"))
        good = sign_request(x509.load_pem_x509_csr(csr_pem), "n1", self.ca.key, self.ca.certificate)
        auth.approve("n1", cert_pem(good), "op")
        self.assertEqual([n for n, _ in self.delivered], ["n1"])


class ChainCheckTests(SynchronousTestCase):
    def test_wrong_hash_refused_naming_both(self) -> None:
        """A control plane whose chain has no root with the token's hash is refused, both hashes named."""
        d = Path(self.mktemp())
        ca = CertificateAuthority.init(d)
        server = ca.issue_server(["127.0.0.1"]).certificate
        self.assertEqual(check_chain([server, ca.certificate], "127.0.0.1", spki_hash(ca.certificate)),
                         ca.certificate)
        wrong = "sha256:" + "0" * 64
        with self.assertRaises(WrongControlPlane) as e:
            check_chain([server, ca.certificate], "127.0.0.1", wrong)
        self.assertIn(wrong, str(e.exception))
        self.assertIn(spki_hash(ca.certificate), str(e.exception))

    def test_existing_files_not_joined_again(self) -> None:
        """A node whose files from an earlier join load does not join again."""
        d = Path(self.mktemp())
        ca = CertificateAuthority.init(d)
        ca.issue_agent("n1")
        token = parse_token(printable("0123abcd", "f" * 32, spki_hash(ca.certificate)))
        joiner = Joiner(None, "127.0.0.1", 1, token, "n1", d)
        self.assertIsNotNone(joiner.existing())
