"""
Certificate hygiene: leaves carry digitalSignature only,
a client identity must be able to sign, admin roles live in the certificate,
C{ctl cert} does not replace a key unless told, and oversized agent frames
are counted by cause.
"""

from __future__ import annotations

import io
import struct
from pathlib import Path
from typing import Any

from cryptography import x509
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.shell.agentsvc import AgentService
from llmgw.control.shell.metrics import make_registry, register_control_metrics
from llmgw.control.state.inventory import Inventory
from llmgw.ctl.main import build_parser
from llmgw.testing.pki import agent_tls, connect_in_memory, issue_raw, make_pki
from llmgw.testing.sinks import RecordingSink
from llmgw.testing.stream import PeerCertTransport
from llmgw.tlsconf.options import (
    AdminIdentity,
    IdentityError,
    ServerTLS,
    peer_admin,
    peer_node_id,
    server_files,
)
from llmgw.tlsconf.pem import load_certificate

KEY_AGREEMENT_ONLY = x509.KeyUsage(
    digital_signature=False, content_commitment=False, key_encipherment=False,
    data_encipherment=False, key_agreement=True, key_cert_sign=False,
    crl_sign=False, encipher_only=False, decipher_only=False,
)


def run_ctl(*argv: str) -> tuple[int, str, str]:
    args = build_parser().parse_args(["ctl", *argv])
    out, err = io.StringIO(), io.StringIO()
    code = int(args.func(args, out=out, err=err))
    return code, out.getvalue(), err.getvalue()


class PKITestCase(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        self.ca = make_pki(self.dir, ["node-a"])
        self.ca.issue_admin("olga", "operator")

    def cert(self, stem: str) -> x509.Certificate:
        return load_certificate(self.dir / f"{stem}.pem")


class KeyUsageTests(PKITestCase):
    def test_leaves_sign_only(self) -> None:
        """
        Server, agent and admin certificates carry a critical key usage of
        digitalSignature alone: no keyAgreement, no keyEncipherment.
        """
        for stem in ("server", "agent-node-a", "admin-olga"):
            ext = self.cert(stem).extensions.get_extension_for_class(x509.KeyUsage)
            self.assertTrue(ext.critical, stem)
            ku = ext.value
            self.assertTrue(ku.digital_signature, stem)
            self.assertFalse(ku.key_agreement, stem)
            self.assertFalse(ku.key_encipherment, stem)
            self.assertFalse(ku.key_cert_sign, stem)

    def test_key_agreement_only_is_no_identity(self) -> None:
        """
        A client certificate whose key usage is keyAgreement alone is
        refused as a node identity, saying it lacks digitalSignature.
        """
        path, _ = issue_raw(self.ca, "ka", "node-k", key_usage=KEY_AGREEMENT_ONLY)
        with self.assertRaises(IdentityError) as caught:
            peer_node_id(load_certificate(path))
        self.assertIn("digitalSignature", str(caught.exception))

    def test_key_agreement_only_agent_refused_on_the_stream(self) -> None:
        """
        Over real (in-memory) mutual TLS, an agent presenting a
        keyAgreement-only certificate from the CA is refused at Register as
        unauthenticated, with the reason.
        """
        issue_raw(self.ca, "agent-node-k", "node-k", key_usage=KEY_AGREEMENT_ONLY)
        clock = Clock()
        clock.advance(1e9)
        service = AgentService(Inventory(), RecordingSink(), clock, epoch=1, tls=True,
                               require_identity=True)
        factory = TLSMemoryBIOFactory(ServerTLS(server_files(self.dir)), False, service, clock=clock)
        agent, _, _ = connect_in_memory(factory, agent_tls(self.dir, "node-k"), "node-k", clock)
        acks = [m.ack for m in agent.received if m.WhichOneof("msg") == "ack"]
        self.assertEqual(len(acks), 1)
        self.assertFalse(acks[0].ok)
        self.assertIn("digitalSignature", acks[0].error)
        self.assertEqual(service.connected_nodes(), [])


class AdminIdentityTests(PKITestCase):
    def test_role_read_from_certificate(self) -> None:
        """
        An admin certificate proves its name and the role the CA put in it.
        """
        self.assertEqual(peer_admin(self.cert("admin-olga")), AdminIdentity("olga", "operator"))

    def test_admin_certificate_is_no_node(self) -> None:
        """
        An admin certificate is refused as a node identity, even when its
        name is a valid node id.
        """
        self.ca.issue_admin("node-a", "operator")
        with self.assertRaises(IdentityError) as caught:
            peer_node_id(self.cert("admin-node-a"))
        self.assertIn("admin certificate", str(caught.exception))

    def test_node_and_server_are_no_admins(self) -> None:
        """
        Node and server certificates are refused as admins, each saying
        what it is.
        """
        with self.assertRaises(IdentityError) as caught:
            peer_admin(self.cert("agent-node-a"))
        self.assertIn("node certificate", str(caught.exception))
        with self.assertRaises(IdentityError) as caught:
            peer_admin(self.cert("server"))
        self.assertIn("server certificate", str(caught.exception))

    def test_show_prints_role_and_key_usage(self) -> None:
        """
        C{ctl cert show} names the admin role and the key usages.
        """
        code, out, err = run_ctl("cert", "show", str(self.dir / "admin-olga.pem"), "--certs", str(self.dir))
        self.assertEqual(code, 0, err)
        self.assertIn("llmgw-admin-operator", out)
        self.assertIn("digitalSignature", out)
        self.assertNotIn("keyAgreement", out)


class ReplaceTests(PKITestCase):
    def attempt(self, *argv: str) -> tuple[int, str, str]:
        return run_ctl("cert", *argv, "--certs", str(self.dir))

    def test_refuses_to_replace_a_key(self) -> None:
        """
        C{ctl cert agent|server|admin} refuse to replace an existing key
        without --renew or --force, and leave it untouched.
        """
        for argv, stem in (
            (["agent", "node-a"], "agent-node-a"),
            (["server", "--host", "127.0.0.1"], "server"),
            (["admin", "olga", "--role", "operator"], "admin-olga"),
        ):
            before = (self.dir / f"{stem}.key").read_bytes()
            code, _, err = self.attempt(*argv)
            self.assertEqual(code, 1, argv)
            self.assertIn("--renew", err)
            self.assertEqual((self.dir / f"{stem}.key").read_bytes(), before)

    def test_renew_says_what_it_replaced(self) -> None:
        """
        --renew issues a new key and certificate and prints the serial and
        expiry of the one it replaced.
        """
        old = self.cert("agent-node-a")
        code, out, err = self.attempt("agent", "node-a", "--renew")
        self.assertEqual(code, 0, err)
        self.assertIn(f"replaced serial {old.serial_number:x}", out)
        self.assertNotEqual(self.cert("agent-node-a").serial_number, old.serial_number)

    def test_force_replaces(self) -> None:
        """
        --force replaces the key as well.
        """
        before = (self.dir / "admin-olga.key").read_bytes()
        code, _, err = self.attempt("admin", "olga", "--role", "viewer", "--force")
        self.assertEqual(code, 0, err)
        self.assertNotEqual((self.dir / "admin-olga.key").read_bytes(), before)
        self.assertEqual(peer_admin(self.cert("admin-olga")).role, "viewer")

    def test_new_files_need_no_flag(self) -> None:
        """
        A certificate for a new name is issued without any flag; a bad role
        or name is refused.
        """
        code, out, err = self.attempt("admin", "viktor", "--role", "viewer")
        self.assertEqual(code, 0, err)
        self.assertIn("admin-viktor.pem", out)
        self.assertEqual((self.dir / "admin-viktor.key").stat().st_mode & 0o777, 0o600)
        code, _, err = self.attempt("admin", "Bad Name", "--role", "viewer")
        self.assertEqual(code, 1)
        self.assertIn("admin name", err)

    def test_rotate_and_retire_from_the_cli(self) -> None:
        """
        C{ctl cert rotate-ca} writes a two-root bundle and C{retire-ca}
        refuses while certificates of the old root remain, then succeeds
        once they are renewed.
        """
        code, out, err = self.attempt("rotate-ca")
        self.assertEqual(code, 0, err)
        self.assertEqual(len(x509.load_pem_x509_certificates((self.dir / "ca.pem").read_bytes())), 2)
        code, _, err = self.attempt("retire-ca")
        self.assertEqual(code, 1)
        self.assertIn("agent-node-a.pem", err)
        for argv in (["agent", "node-a"], ["server", "--host", "127.0.0.1"],
                     ["admin", "olga", "--role", "operator"]):
            self.assertEqual(self.attempt(*argv, "--renew")[0], 0)
        code, out, err = self.attempt("retire-ca")
        self.assertEqual(code, 0, err)
        self.assertEqual(len(x509.load_pem_x509_certificates((self.dir / "ca.pem").read_bytes())), 1)


class FrameRefusalMetricTests(SynchronousTestCase):
    def test_oversized_frame_counted(self) -> None:
        """
        An agent frame over the limit increments
        C{llmgw_agent_frames_refused{cause="oversized"}}.
        """
        service = AgentService(Inventory(), RecordingSink(), Clock(), epoch=1, max_frame=1024)
        registry = make_registry()
        register_control_metrics(registry, service)

        def count() -> float:
            for family in text_string_to_metric_families(_scrape(registry)):
                for sample in family.samples:
                    if sample.name == "llmgw_agent_frames_refused_total" and sample.labels == {"cause": "oversized"}:
                        return sample.value
            raise AssertionError("no llmgw_agent_frames_refused sample")

        self.assertEqual(count(), 0)
        proto = service.buildProtocol(IPv4Address("TCP", "10.0.0.1", 1))
        transport = PeerCertTransport(None, peerAddress=IPv4Address("TCP", "10.0.0.1", 1))
        proto.makeConnection(transport)
        proto.dataReceived(struct.pack("!I", 5000))
        self.assertTrue(transport.aborted)
        self.assertEqual(count(), 1)


def _scrape(registry: Any) -> str:
    from prometheus_client import generate_latest

    return generate_latest(registry).decode()
