"""
CA rollover: C{ca.pem} with several roots, trusted at
both ends; agents of the old and the new root connected at once during a
rollover, with and without a CRL; after C{retire}, only the new root's.
Real TLS in memory (C{iosim}) with certificates made by llmgw's CA.
"""

from __future__ import annotations

import datetime
import shutil
import time
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.service import ControlPlane
from llmgw.testing.pki import agent_tls, connect_in_memory, make_pki
from llmgw.testing.sinks import RecordingSink
from llmgw.tlsconf.ca import RENEW, CertificateAuthority
from llmgw.tlsconf.crl import parse_crls, renew, revoke
from llmgw.tlsconf.options import (
    ClientTLSPolicy,
    ServerTLS,
    TLSConfigError,
    TLSFiles,
    admin_files,
    server_files,
)
from llmgw.tlsconf.pem import CAError, cert_pem
from llmgw.tlsconf.reload import ClientCertificateReload

from .test_tls_reload import ThreadCallReactor


class RolloverTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        make_pki(self.dir, ["node-a", "node-b"])
        self.clock = ThreadCallReactor()
        self.clock.advance(time.time())
        self.port = 42000

    def control_plane(self) -> ControlPlane:
        cp = ControlPlane(
            self.clock, RecordingSink(), ServerTLS(server_files(self.dir)), "127.0.0.1", 0
        )
        cp.startService()
        self.addCleanup(cp.stopService)
        return cp

    def machine(self, node: str, name: str | None = None) -> Path:
        """
        A copy of what C{node}'s machine holds now (the bundle and its
        certificate), in a directory of its own.
        """
        d = Path(self.mktemp()) / (name or node)
        d.mkdir(parents=True)
        for f in ("ca.pem", f"agent-{node}.pem", f"agent-{node}.key"):
            shutil.copy2(self.dir / f, d / f)
        return d

    def connect(self, cp: ControlPlane, node: str, machine: Path) -> Any:
        self.port += 1
        agent, _, pump = connect_in_memory(cp.limiter, agent_tls(machine, node), node, self.clock,
                                           port=self.port)
        return agent

    def rollover(self, with_crl: bool) -> None:
        if with_crl:
            renew(CertificateAuthority.load(self.dir))
        cp = self.control_plane()
        b_old = self.machine("node-b")
        b = self.connect(cp, "node-b", b_old)
        self.assertTrue(b.registered)

        ca = CertificateAuthority.load(self.dir)
        old_root = ca.certificate
        new_root = ca.rotate()
        if with_crl:
            renew(ca)
            self.assertEqual(len(parse_crls((self.dir / "crl.pem").read_bytes())), 2)
        self.assertEqual([r.serial_number for r in CertificateAuthority.load(self.dir).roots],
                         [new_root.serial_number, old_root.serial_number])
        self.assertTrue(cp.reload_tls()["ok"])
        # A node enrolled during the rollover gets a certificate of the new root.
        issued = ca.issue_agent("node-c")
        self.assertEqual(issued.certificate.issuer, new_root.subject)
        c = self.connect(cp, "node-c", self.machine("node-c"))
        self.assertTrue(c.registered)
        # The server moves to the new root once every machine has the bundle.
        a_machine = self.machine("node-a")
        ca.issue_server(["127.0.0.1"], replace=RENEW)
        self.assertTrue(cp.reload_tls()["ok"])
        a = self.connect(cp, "node-a", a_machine)
        self.assertTrue(a.registered, "an agent of the old root connects during the rollover")
        c2 = self.connect(cp, "node-c", self.machine("node-c", "c2"))
        self.assertTrue(c2.registered)
        self.assertEqual(cp.agents.connected_nodes(), ["node-a", "node-b", "node-c"])
        # The stream opened before the rollover began is still up: nothing dropped.
        self.assertTrue(b.connected)

        # Retiring is refused while certificates of the old root are in use.
        with self.assertRaises(CAError) as caught:
            ca.retire()
        self.assertIn("agent-node-a.pem", str(caught.exception))
        ca.issue_agent("node-a", replace=RENEW)
        ca.issue_agent("node-b", replace=RENEW)
        retired, stale = ca.retire()
        self.assertEqual((retired.serial_number, stale), (old_root.serial_number, []))
        self.assertTrue((self.dir / f"ca-retired-{old_root.serial_number:x}.pem").exists())
        self.assertFalse((self.dir / "ca-previous.key").exists())
        if with_crl:
            renew(ca)
            self.assertEqual(len(parse_crls((self.dir / "crl.pem").read_bytes())), 1)
        self.assertTrue(cp.reload_tls()["ok"])
        old_a = self.connect(cp, "node-a", a_machine)
        self.assertFalse(old_a.registered, "a certificate of the retired root is refused")
        new_a = self.connect(cp, "node-a", self.machine("node-a", "a-new"))
        self.assertTrue(new_a.registered)

    def test_rollover(self) -> None:
        """
        During a rollover agents of the old and of the new root are
        connected at once, and the stream opened before it stays up; after
        retire-ca only the new root's certificates connect.
        """
        self.rollover(with_crl=False)

    def test_rollover_with_crl(self) -> None:
        """
        The same with a CRL in force: each root gets its own CRL, so that
        revocation checking keeps working for the leaves of both.
        """
        self.rollover(with_crl=True)

    def test_revocation_during_rollover(self) -> None:
        """
        During a rollover a revoked certificate of the new root is refused
        while the old root's agents still connect.
        """
        ca = CertificateAuthority.load(self.dir)
        renew(ca)
        ca.rotate()
        ca.issue_agent("node-c")
        revoke(ca, node_id="node-c")
        cp = self.control_plane()
        self.assertFalse(self.connect(cp, "node-c", self.machine("node-c")).registered)
        self.assertTrue(self.connect(cp, "node-a", self.machine("node-a")).registered)

    def test_rotate_and_retire_refusals(self) -> None:
        """
        A second rotate-ca during a rollover, and retire-ca without one, are
        refused with what to do instead.
        """
        ca = CertificateAuthority.load(self.dir)
        with self.assertRaises(CAError) as caught:
            ca.retire()
        self.assertIn("rotate-ca", str(caught.exception))
        ca.rotate()
        with self.assertRaises(CAError) as caught:
            CertificateAuthority.load(self.dir).rotate()
        self.assertIn("retire-ca", str(caught.exception))
        self.assertEqual(len(CertificateAuthority.load(self.dir).roots), 2)


class BundleTests(SynchronousTestCase):
    def test_leaf_of_any_root_loads(self) -> None:
        """
        A certificate issued by the second root of the bundle loads, and
        names that root as its CA.
        """
        d = Path(self.mktemp())
        ca = make_pki(d, ["node-a"])
        old = ca.certificate
        ca.rotate()
        files = TLSFiles.load(d / "ca.pem", d / "agent-node-a.pem", d / "agent-node-a.key")
        self.assertEqual(files.ca, old)
        self.assertEqual(len(files.roots), 2)

    def test_expired_root_in_bundle_refused(self) -> None:
        """
        A bundle holding an expired root is refused, naming that root and
        saying to retire it.
        """
        d = Path(self.mktemp())
        make_pki(d, ["node-a"])
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dead root")])
        now = datetime.datetime.now(datetime.UTC)
        dead = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(5)
            .not_valid_before(now - datetime.timedelta(days=10))
            .not_valid_after(now - datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256())
        )
        with open(d / "ca.pem", "ab") as f:
            f.write(cert_pem(dead))
        with self.assertRaises(TLSConfigError) as caught:
            server_files(d)
        self.assertIn("CN=dead root", str(caught.exception))
        self.assertIn("retire-ca", str(caught.exception))


class ClientReloadTests(SynchronousTestCase):
    def test_gateway_certificate_reload(self) -> None:
        """
        The standalone gateway's admin certificate and CA bundle are re-read
        on reload: after rotate-ca it trusts both roots and presents its
        renewed certificate; a half-written file is refused and the running
        files stay.
        """
        d = Path(self.mktemp())
        ca = make_pki(d, [])
        ca.issue_admin("gw-1", "gateway")
        policy = ClientTLSPolicy(admin_files(d, "gw-1"))
        first = policy.creatorForNetloc(b"127.0.0.1", 7480)
        reload = ClientCertificateReload(Clock(), policy, "gateway", handle_sighup=False)
        ca.rotate()
        renewed = ca.issue_admin("gw-1", "gateway", replace=RENEW)
        self.assertTrue(reload.reload())
        self.assertEqual(len(policy.files.roots), 2)
        self.assertEqual(policy.files.cert.serial_number, renewed.certificate.serial_number)
        self.assertIsNot(policy.creatorForNetloc(b"127.0.0.1", 7480), first)
        (d / "admin-gw-1.pem").write_bytes(b"-----BEGIN CERT")
        self.assertFalse(reload.reload())
        self.flushLoggedErrors()
        self.assertEqual(policy.files.cert.serial_number, renewed.certificate.serial_number)
