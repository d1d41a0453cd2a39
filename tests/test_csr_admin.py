"""
The certificate requests an operator decides on: the admin API's C{GET
/api/v1/csr} and C{POST /api/v1/csr/NODE/approve|deny}
(L{llmgw.control.admin.csr}), and the signing C{llmgw ctl csr approve} does
where the CA's key is (L{llmgw.ctl.csr.sign_waiting}).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from cryptography import x509
from treq.testing import StubTreq
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.admin.api import AdminResource
from llmgw.control.admin.leader import local_path
from llmgw.control.core.jointokens import TokenFile
from llmgw.control.shell.joining import JoinAuthority
from llmgw.control.shell.metrics import make_registry
from llmgw.ctl.client import CtlError
from llmgw.ctl.csr import sign_waiting
from llmgw.testing.fleet import FakeAgents, sample_fleet
from llmgw.tlsconf.ca import CertificateAuthority
from llmgw.tlsconf.crl import revoke
from llmgw.tlsconf.csr import new_request, sign_request
from llmgw.tlsconf.pem import cert_pem

NOW = 1_700_000_000.0
BASE = "http://127.0.0.1:7480"


class _Control:
    def __init__(self, joining: Any):
        self.joining = joining


class CertificateRequestAPITests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        self.ca = CertificateAuthority.init(self.dir)
        self.clock = Clock()
        self.clock.advance(NOW)
        self.tokens = TokenFile(self.dir / "join-tokens.json")
        self.authority = JoinAuthority(self.clock, self.tokens, lambda: list(self.ca.roots), lambda n: False,
                                       lifetime=datetime.timedelta(minutes=1))
        self.token, self.secret = self.tokens.book.create(NOW, 3600, uses=5)
        self.treq: Any = StubTreq(AdminResource(sample_fleet(), make_registry(), FakeAgents(["gpu-1"]),
                                                control=_Control(self.authority)))

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": ["application/json"]} if method == "POST" else {}
        d = self.treq.request(method, BASE + path, headers=headers, data=data)
        self.treq.flush()
        response = self.successResultOf(d)
        return response.code, json.loads(self.successResultOf(self.treq.content(response)))

    def join(self, node: str) -> tuple[Any, pb.JoinRequest]:
        key, csr_pem = new_request(node)
        req = pb.JoinRequest(token_id=self.token.id, token_secret=self.secret, node_id=node, csr_pem=csr_pem)
        self.assertEqual(self.authority.join(req, "10.0.0.7:4000").status, pb.JoinResponse.STATUS_PENDING)
        return key, req

    def test_list(self) -> None:
        """The list names each waiting request's node, kind, key type, token, address and age, and its PEM."""
        self.join("n1")
        self.clock.advance(30)
        code, body = self.call("GET", "/api/v1/csr")
        self.assertEqual(code, 200)
        self.assertFalse(body["signer"])
        [row] = body["requests"]
        self.assertEqual(
            {k: row[k] for k in ("node", "kind", "key", "token", "address", "age", "state")},
            {"node": "n1", "kind": "join", "key": "ECDSA secp256r1", "token": self.token.id,
             "address": "10.0.0.7:4000", "age": 30.0, "state": "pending"})
        self.assertTrue(row["csr"].startswith("-----BEGIN CERTIFICATE REQUEST-----"))

    def test_approve_checked(self) -> None:
        """
        An approval carrying a certificate that is not for the request's key
        is a 409 and changes nothing; the right one is taken and the node
        collects it when it asks again.
        """
        _, req = self.join("n1")
        other = x509.load_pem_x509_csr(new_request("n1")[1])
        wrong = sign_request(other, "n1", self.ca.key, self.ca.certificate)
        code, body = self.call("POST", "/api/v1/csr/n1/approve",
                               {"certificate_pem": cert_pem(wrong).decode()})
        self.assertEqual(code, 409, body)
        self.assertIn("not for the request's key", body["error"])
        self.assertEqual(self.authority.join(req, "a").status, pb.JoinResponse.STATUS_PENDING)
        good = sign_request(x509.load_pem_x509_csr(req.csr_pem), "n1", self.ca.key, self.ca.certificate)
        code, body = self.call("POST", "/api/v1/csr/n1/approve",
                               {"certificate_pem": cert_pem(good).decode()})
        self.assertEqual((code, body["ok"]), (200, True))
        self.assertEqual(self.authority.join(req, "a").status, pb.JoinResponse.STATUS_ISSUED)

    def test_deny(self) -> None:
        """A denied join is refused with the operator's reason when the node asks again."""
        _, req = self.join("n1")
        code, _ = self.call("POST", "/api/v1/csr/n1/deny", {"reason": "not ours"})
        self.assertEqual(code, 200)
        answer = self.authority.join(req, "a")
        self.assertEqual(answer.status, pb.JoinResponse.STATUS_REFUSED)
        self.assertIn("not ours", answer.error)

    def test_refusals(self) -> None:
        """No such request is a 404; a malformed body or node id a 400; a GET of an action a 405."""
        self.join("n1")
        self.assertEqual(self.call("POST", "/api/v1/csr/n2/deny", {})[0], 404)
        self.assertEqual(self.call("POST", "/api/v1/csr/n1/approve", {"cert": "x"})[0], 400)
        self.assertEqual(self.call("POST", "/api/v1/csr/n1/deny", {"reason": 5})[0], 400)
        self.assertEqual(self.call("POST", "/api/v1/csr/N_1!/deny", {})[0], 400)
        self.assertEqual(self.call("GET", "/api/v1/csr/n1/approve")[0], 405)

    def test_none_without_tls(self) -> None:
        """A control plane without a join authority (no TLS) answers 404 with why."""
        self.treq = StubTreq(AdminResource(sample_fleet(), make_registry(), FakeAgents([]), control=_Control(None)))
        code, body = self.call("GET", "/api/v1/csr")
        self.assertEqual(code, 404)
        self.assertIn("no certificate requests", body["error"])

    def test_each_members_own(self) -> None:
        """On an HA control plane the requests are answered by the member asked, not sent to the leader."""
        self.assertTrue(local_path(["api", "v1", "csr"]))
        self.assertTrue(local_path(["api", "v1", "csr", "n1", "approve"]))
        self.assertFalse(local_path(["api", "v1", "nodes"]))


class SignWaitingTests(SynchronousTestCase):
    def test_signed_here_and_recorded(self) -> None:
        """
        C{ctl csr approve} signs the listed request with the CA here and
        notes it, so that C{ctl cert revoke NODE} finds the joined node.
        """
        directory = Path(self.mktemp())
        ca = CertificateAuthority.init(directory)
        _, csr_pem = new_request("n1")
        pem = sign_waiting({"csr": csr_pem.decode()}, "n1", str(directory), 2.0)
        cert = x509.load_pem_x509_certificate(pem)
        self.assertEqual(cert.subject.rfc4514_string(), "CN=n1")
        self.assertGreaterEqual(cert.not_valid_after_utc - cert.not_valid_before_utc, datetime.timedelta(days=2))
        self.assertLess(cert.not_valid_after_utc - cert.not_valid_before_utc, datetime.timedelta(days=2, hours=1))
        revoked = revoke(ca, node_id="n1")
        self.assertIn(cert.serial_number, {e.serial_number for e in revoked.crl})

    def test_refused_request_not_signed(self) -> None:
        """A request for another name is refused before anything is signed."""
        directory = Path(self.mktemp())
        CertificateAuthority.init(directory)
        _, csr_pem = new_request("n2")
        with self.assertRaises(CtlError) as e:
            sign_waiting({"csr": csr_pem.decode()}, "n1", str(directory), 2.0)
        self.assertIn("not for node 'n1'", e.exception.message)
        self.assertEqual([r["kind"] for r in CertificateAuthority.load(directory).issued()], ["ca"])
