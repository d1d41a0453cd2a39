"""
Tests for llmgw's private CA (L{llmgw.tlsconf.ca}) and `llmgw ctl cert`.
"""

from __future__ import annotations

import io
import ipaddress
import json
import os
import stat
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from twisted.trial.unittest import SynchronousTestCase

from llmgw.ctl.main import main
from llmgw.tlsconf.ca import CertificateAuthority
from llmgw.tlsconf.describe import describe


def run(*argv: str) -> tuple[int, str, str]:
    import contextlib

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as e:
            rc = int(e.code or 0)
    return rc, out.getvalue(), err.getvalue()


class CLITests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = self.mktemp()

    def test_init(self) -> None:
        """
        `cert init` writes ca.pem and a 0600 ca.key: an ECDSA P-256 CA.
        """
        rc, out, _ = run("ctl", "cert", "init", "--certs", self.dir)
        self.assertEqual(rc, 0)
        key = Path(self.dir, "ca.key")
        self.assertEqual(stat.S_IMODE(os.stat(key).st_mode), 0o600)
        cert = x509.load_pem_x509_certificate(Path(self.dir, "ca.pem").read_bytes())
        self.assertTrue(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
        self.assertEqual(cert.public_key().curve.name, "secp256r1")  # type: ignore[union-attr]

    def test_init_refuses_overwrite(self) -> None:
        """
        A second init without --force fails and leaves the CA as it was;
        with --force it is replaced.
        """
        run("ctl", "cert", "init", "--certs", self.dir)
        before = Path(self.dir, "ca.pem").read_bytes()
        rc, _, err = run("ctl", "cert", "init", "--certs", self.dir)
        self.assertEqual(rc, 1)
        self.assertIn("already exists", err)
        self.assertEqual(Path(self.dir, "ca.pem").read_bytes(), before)
        rc, _, _ = run("ctl", "cert", "init", "--certs", self.dir, "--force")
        self.assertEqual(rc, 0)
        self.assertNotEqual(Path(self.dir, "ca.pem").read_bytes(), before)

    def test_server_sans(self) -> None:
        """
        Every --host goes into the SANs: an IP as an IP entry, a name as a
        DNS entry; the usage is serverAuth only.
        """
        run("ctl", "cert", "init", "--certs", self.dir)
        rc, _, _ = run("ctl", "cert", "server", "--certs", self.dir, "--host", "10.0.0.5",
                       "--host", "control.example", "--host", "[::1]")
        self.assertEqual(rc, 0)
        cert = x509.load_pem_x509_certificate(Path(self.dir, "server.pem").read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        self.assertEqual(san.get_values_for_type(x509.DNSName), ["control.example"])
        self.assertEqual(
            san.get_values_for_type(x509.IPAddress),
            [ipaddress.ip_address("10.0.0.5"), ipaddress.ip_address("::1")],
        )
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        self.assertEqual(list(eku), [ExtendedKeyUsageOID.SERVER_AUTH])
        self.assertEqual(stat.S_IMODE(os.stat(Path(self.dir, "server.key")).st_mode), 0o600)

    def test_server_needs_host(self) -> None:
        """
        A server certificate without --host is refused.
        """
        run("ctl", "cert", "init", "--certs", self.dir)
        rc, _, err = run("ctl", "cert", "server", "--certs", self.dir)
        self.assertEqual(rc, 1)
        self.assertIn("--host", err)
        self.assertFalse(Path(self.dir, "server.pem").exists())

    def test_agent(self) -> None:
        """
        An agent certificate has CN = node id, clientAuth only, 0600 key,
        validity starting a few minutes in the past.
        """
        run("ctl", "cert", "init", "--certs", self.dir)
        rc, _, _ = run("ctl", "cert", "agent", "gpu-07", "--certs", self.dir, "--days", "30")
        self.assertEqual(rc, 0)
        cert = x509.load_pem_x509_certificate(Path(self.dir, "agent-gpu-07.pem").read_bytes())
        self.assertEqual(
            [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)], ["gpu-07"]
        )
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        self.assertEqual(list(eku), [ExtendedKeyUsageOID.CLIENT_AUTH])
        skew = cert.not_valid_after_utc - cert.not_valid_before_utc
        self.assertGreater(skew.total_seconds(), 30 * 86400)
        self.assertEqual(
            stat.S_IMODE(os.stat(Path(self.dir, "agent-gpu-07.key")).st_mode), 0o600
        )

    def test_etcd(self) -> None:
        """
        An etcd certificate is both server and client (etcd members
        are both to their peers), names the hosts given as SANs, has a 0600
        key, and refuses a name outside the node-id grammar.
        """
        run("ctl", "cert", "init", "--certs", self.dir)
        rc, out, err = run("ctl", "cert", "etcd", "etcd1", "--host", "10.0.0.1", "--host", "etcd1.example",
                           "--certs", self.dir)
        self.assertEqual((rc, err), (0, ""), out)
        cert = x509.load_pem_x509_certificate(Path(self.dir, "etcd-etcd1.pem").read_bytes())
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        self.assertEqual(set(eku), {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH})
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        self.assertEqual(sans.get_values_for_type(x509.IPAddress), [ipaddress.ip_address("10.0.0.1")])
        self.assertEqual(sans.get_values_for_type(x509.DNSName), ["etcd1.example"])
        self.assertEqual(stat.S_IMODE(os.stat(Path(self.dir, "etcd-etcd1.key")).st_mode), 0o600)
        rc, _, _ = run("ctl", "cert", "etcd", "cp1", "--certs", self.dir)
        self.assertEqual(rc, 0)
        rc, _, err = run("ctl", "cert", "etcd", "Bad_Name", "--certs", self.dir)
        self.assertEqual(rc, 1)
        self.assertIn("etcd certificate name", err)

    def test_etcd_ca_kept_apart(self) -> None:
        """
        Security: `cert etcd` refuses a CA directory that issued node or
        admin certificates (an etcd trusting it would take each as a
        client), and `cert agent`/`cert admin` refuse one that issued etcd
        certificates; --shared-ca overrides, and a refusal writes nothing.
        """
        fleet, etcd = self.dir, self.mktemp()
        run("ctl", "cert", "init", "--certs", fleet)
        run("ctl", "cert", "init", "--certs", etcd)
        self.assertEqual(run("ctl", "cert", "agent", "gpu-01", "--certs", fleet)[0], 0)
        rc, _, err = run("ctl", "cert", "etcd", "cp1", "--certs", fleet)
        self.assertEqual(rc, 1)
        self.assertIn("issued agent certificates", err)
        self.assertIn("--shared-ca", err)
        self.assertFalse(Path(fleet, "etcd-cp1.pem").exists())
        self.assertEqual(run("ctl", "cert", "etcd", "cp1", "--certs", etcd)[0], 0)
        for argv in (("agent", "gpu-02"), ("admin", "olga", "--role", "viewer")):
            rc, _, err = run("ctl", "cert", *argv, "--certs", etcd)
            self.assertEqual(rc, 1, argv)
            self.assertIn("issued etcd certificates", err)
        self.assertEqual(run("ctl", "cert", "etcd", "cp1", "--certs", fleet, "--shared-ca")[0], 0)

    def test_etcd_certificate_is_no_identity(self) -> None:
        """
        Security: an etcd certificate (client authentication, a name that is
        a valid node id) is refused as a node's and as an admin's.
        """
        from llmgw.tlsconf.options import IdentityError, peer_admin, peer_node_id

        run("ctl", "cert", "init", "--certs", self.dir)
        run("ctl", "cert", "etcd", "gpu-01", "--certs", self.dir)
        cert = x509.load_pem_x509_certificate(Path(self.dir, "etcd-gpu-01.pem").read_bytes())
        with self.assertRaises(IdentityError) as caught:
            peer_node_id(cert)
        self.assertIn("etcd's own TLS", str(caught.exception))
        self.assertRaises(IdentityError, peer_admin, cert)

    def test_agent_bad_node_id(self) -> None:
        """
        A node id outside the grammar is refused at issue time.
        """
        run("ctl", "cert", "init", "--certs", self.dir)
        rc, _, err = run("ctl", "cert", "agent", "GPU_07", "--certs", self.dir)
        self.assertEqual(rc, 1)
        self.assertIn("GPU_07", err)
        self.assertFalse(Path(self.dir, "agent-GPU_07.pem").exists())

    def test_missing_ca(self) -> None:
        """
        Issuing without a CA says how to make one.
        """
        rc, _, err = run("ctl", "cert", "agent", "a", "--certs", self.dir)
        self.assertEqual(rc, 1)
        self.assertIn("cert init", err)

    def test_serials_unique(self) -> None:
        """
        Serials are random and never repeat.
        """
        ca = CertificateAuthority.init(self.dir)
        serials = {ca.issue_agent(f"n{i}").certificate.serial_number for i in range(20)}
        self.assertEqual(len(serials), 20)

    def test_show(self) -> None:
        """
        `cert show` prints subject, SANs, usages, validity, serial and
        whether the certificate chains to the CA; a certificate from another
        CA does not.
        """
        run("ctl", "cert", "init", "--certs", self.dir)
        run("ctl", "cert", "server", "--certs", self.dir, "--host", "127.0.0.1")
        rc, out, _ = run("ctl", "cert", "show", str(Path(self.dir, "server.pem")),
                         "--certs", self.dir)
        self.assertEqual(rc, 0)
        for word in ("subject", "IP:127.0.0.1", "serverAuth", "not after", "serial",
                     "chains to CA  yes"):
            self.assertIn(word, out)
        other = self.mktemp()
        run("ctl", "cert", "init", "--certs", other)
        info = describe(Path(self.dir, "server.pem"), other)
        self.assertIs(info["chains_to_ca"], False)
        rc, out, _ = run("ctl", "cert", "show", str(Path(self.dir, "server.pem")),
                         "--certs", self.dir, "--json")
        self.assertEqual(json.loads(out)["sans"], ["IP:127.0.0.1"])

    def test_show_not_a_certificate(self) -> None:
        """
        `cert show` on a file that is not a certificate fails clearly.
        """
        path = Path(self.mktemp())
        path.write_text("hello")
        rc, _, err = run("ctl", "cert", "show", str(path))
        self.assertEqual(rc, 1)
        self.assertIn("not a PEM certificate", err)
