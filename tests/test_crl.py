"""
Tests for L{llmgw.tlsconf.crl}, C{llmgw ctl cert revoke|crl}, and the control
plane's use of the CRL.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import time
from pathlib import Path

from cryptography import x509
from twisted.internet.testing import MemoryReactorClock
from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.service import ControlPlane, Options
from llmgw.ctl.main import build_parser
from llmgw.testing.pki import agent_tls, connect_in_memory, make_pki
from llmgw.testing.sinks import RecordingSink
from llmgw.tlsconf.ca import CertificateAuthority
from llmgw.tlsconf.crl import (
    CRL_FILE,
    STATE_FILE,
    CRLError,
    crl_number,
    load_crl,
    parse_reason,
    parse_serial,
    renew,
    revoke,
    revoked_serials,
)
from llmgw.tlsconf.options import ServerTLS, TLSConfigError, server_files

UTC = datetime.UTC


def serials_of(ca: CertificateAuthority, node: str) -> set[int]:
    return {
        int(str(r["serial"]), 16) for r in ca.issued() if r["subject"] == f"CN={node}"
    }


def run_cli(*argv: str) -> tuple[int, str, str]:
    args: argparse.Namespace = build_parser().parse_args(list(argv))
    out, err = io.StringIO(), io.StringIO()
    rc = args.func(args, out=out, err=err)
    return rc, out.getvalue(), err.getvalue()


class RevokeTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        self.ca = make_pki(self.dir, ["node-a", "node-b"])

    def test_revoke_by_node_lists_every_serial_of_that_node(self) -> None:
        """
        Revoking a node id lists every certificate the CA recorded issuing
        to it (a renewed one too), and nobody else's.
        """
        self.ca.issue_agent("node-a")
        result = revoke(self.ca, node_id="node-a")
        crl = load_crl(self.dir / CRL_FILE, self.ca.certificate)
        self.assertEqual(set(revoked_serials(crl)), serials_of(self.ca, "node-a"))
        self.assertEqual(len(result.revoked), 2)
        self.assertFalse(revoked_serials(crl) & serials_of(self.ca, "node-b"))

    def test_crl_is_signed_numbered_and_has_next_update(self) -> None:
        """
        The CRL is signed by the CA, carries CRL number 1 first, and its
        next-update is 30 days away by default.
        """
        now = datetime.datetime.now(UTC)
        revoke(self.ca, node_id="node-b", now=now)
        crl = load_crl(self.dir / CRL_FILE, self.ca.certificate)
        self.assertTrue(crl.is_signature_valid(self.ca.key.public_key()))
        self.assertEqual(crl_number(crl), 1)
        assert crl.next_update_utc is not None
        delta = crl.next_update_utc - now
        self.assertLess(abs(delta.total_seconds() - 30 * 86400), 5)

    def test_number_and_issue_time_always_increase(self) -> None:
        """
        Each revoke or renew gets a larger CRL number and a later issue
        time, even when signed within the same second (or with a clock that
        went back).
        """
        now = datetime.datetime.now(UTC)
        revoke(self.ca, node_id="node-a", now=now)
        first = load_crl(self.dir / CRL_FILE, self.ca.certificate)
        renew(self.ca, now=now - datetime.timedelta(hours=1))
        second = x509.load_pem_x509_crl((self.dir / CRL_FILE).read_bytes())
        revoke(self.ca, node_id="node-b", now=now)
        third = load_crl(self.dir / CRL_FILE, self.ca.certificate)
        self.assertEqual([crl_number(c) for c in (first, second, third)], [1, 2, 3])
        self.assertLess(first.last_update_utc, second.last_update_utc)
        self.assertLess(second.last_update_utc, third.last_update_utc)
        self.assertEqual(len(revoked_serials(third)), 2)

    def test_lost_record_does_not_reset_the_crl(self) -> None:
        """
        With C{revoked.json} lost, the next CRL still continues the number
        sequence and keeps every serial the current CRL lists.
        """
        revoke(self.ca, node_id="node-a")
        revoke(self.ca, node_id="node-b")
        (self.dir / STATE_FILE).unlink()
        renew(self.ca)
        crl = load_crl(self.dir / CRL_FILE, self.ca.certificate)
        self.assertEqual(crl_number(crl), 3)
        self.assertEqual(
            set(revoked_serials(crl)), serials_of(self.ca, "node-a") | serials_of(self.ca, "node-b")
        )

    def test_revoke_by_serial(self) -> None:
        """
        A serial written as C{show} prints it (hex, optionally with C{0x} or
        colons) revokes exactly that certificate.
        """
        serial = next(iter(serials_of(self.ca, "node-b")))
        text = format(serial, "x")
        self.assertEqual(parse_serial("0x" + text.upper()), serial)
        revoke(self.ca, serials=[parse_serial(text)])
        crl = load_crl(self.dir / CRL_FILE, self.ca.certificate)
        self.assertEqual(set(revoked_serials(crl)), {serial})

    def test_refusals(self) -> None:
        """
        An unknown node, an unknown serial, the CA's own serial and an
        unknown reason are refused with a message that says which.
        """
        e = self.assertRaises(CRLError, revoke, self.ca, node_id="node-z")
        self.assertIn("node-z", str(e))
        e = self.assertRaises(CRLError, revoke, self.ca, serials=[12345])
        self.assertIn("3039", str(e))
        e = self.assertRaises(CRLError, revoke, self.ca, serials=[self.ca.certificate.serial_number])
        self.assertIn("CA's own", str(e))
        e = self.assertRaises(CRLError, revoke, self.ca, node_id="node-a", reason="because")
        self.assertIn("keyCompromise", str(e))
        self.assertRaises(CRLError, parse_serial, "xyz")
        self.assertFalse((self.dir / CRL_FILE).exists())

    def test_reason_names(self) -> None:
        """
        Reasons are accepted in RFC 5280 spelling or kebab/snake case, and
        recorded on the CRL entry.
        """
        self.assertIs(parse_reason("key-compromise"), x509.ReasonFlags.key_compromise)
        self.assertIs(parse_reason("cessation_of_operation"), x509.ReasonFlags.cessation_of_operation)
        revoke(self.ca, node_id="node-a", reason="superseded")
        crl = load_crl(self.dir / CRL_FILE, self.ca.certificate)
        entry = next(iter(crl))
        self.assertIs(
            entry.extensions.get_extension_for_class(x509.CRLReason).value.reason,
            x509.ReasonFlags.superseded,
        )


class LoadCRLTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        self.ca = make_pki(self.dir, ["node-a"])
        revoke(self.ca, node_id="node-a")
        self.path = self.dir / CRL_FILE

    def test_damaged(self) -> None:
        """
        A truncated CRL is refused, naming the file.
        """
        self.path.write_bytes(self.path.read_bytes()[:120])
        e = self.assertRaises(CRLError, load_crl, self.path, self.ca.certificate)
        self.assertIn("not a PEM certificate revocation list", str(e))
        self.assertIn(str(self.path), str(e))

    def test_foreign(self) -> None:
        """
        A CRL signed by another CA, even one with the same name, is refused.
        """
        other = CertificateAuthority.init(Path(self.mktemp()))
        other.issue_agent("node-a")
        revoke(other, node_id="node-a")
        e = self.assertRaises(
            CRLError, load_crl, other.directory / CRL_FILE, self.ca.certificate
        )
        self.assertIn("not signed by the CA", str(e))

    def test_expired(self) -> None:
        """
        A CRL past its next-update is refused, saying how to renew it.
        """
        later = datetime.datetime.now(UTC) + datetime.timedelta(days=31)
        e = self.assertRaises(CRLError, load_crl, self.path, self.ca.certificate, later)
        self.assertIn("expired", str(e))
        self.assertIn("--renew", str(e))


def server_stream(server_proto: object) -> object:
    """
    The agent stream protocol under the limiter and TLS wrappers.
    """
    return server_proto.wrappedProtocol.wrappedProtocol  # type: ignore[attr-defined]


class ControlPlaneCRLTests(SynchronousTestCase):
    """
    The control plane checks the CRL on every handshake and closes revoked
    streams when it loads a new one.
    """

    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        self.ca = make_pki(self.dir, ["node-a", "node-b"])
        self.clock = MemoryReactorClock()
        self.clock.advance(time.time())
        self.port = 40000

    def control_plane(self) -> ControlPlane:
        cp = ControlPlane(
            self.clock, RecordingSink(), ServerTLS(server_files(self.dir)), "127.0.0.1", 0
        )
        cp.startService()
        self.addCleanup(cp.stopService)
        return cp

    def connect(self, cp: ControlPlane, node: str) -> tuple[object, object, object]:
        self.port += 1
        return connect_in_memory(cp.limiter, agent_tls(self.dir, node), node, self.clock, port=self.port)

    def test_revoked_agent_refused_at_handshake(self) -> None:
        """
        With C{crl.pem} present at start, a revoked agent's handshake fails
        and it never registers; another agent registers normally.
        """
        revoke(self.ca, node_id="node-a")
        cp = self.control_plane()
        a, _, _ = self.connect(cp, "node-a")
        b, _, _ = self.connect(cp, "node-b")
        self.assertFalse(a.registered)  # type: ignore[attr-defined]
        self.assertIn("revoked", a.lost.getErrorMessage())  # type: ignore[attr-defined]
        self.assertTrue(b.registered)  # type: ignore[attr-defined]
        self.assertEqual(cp.agents.connected_nodes(), ["node-b"])

    def test_reload_closes_revoked_open_stream_only(self) -> None:
        """
        Loading a CRL that revokes node-a closes node-a's open stream (TLS
        would never re-check it) and leaves node-b's stream open and
        working; node-a's next handshake is refused.
        """
        cp = self.control_plane()
        a, _, pump_a = self.connect(cp, "node-a")
        b, server_b, pump_b = self.connect(cp, "node-b")
        self.assertEqual(cp.agents.connected_nodes(), ["node-a", "node-b"])
        revoke(self.ca, node_id="node-a")
        result = cp.reload_tls()
        pump_a.flush()  # type: ignore[attr-defined]
        pump_b.flush()  # type: ignore[attr-defined]
        self.assertEqual(result["closed"], ["node-a"])
        self.assertTrue(result["ok"])
        self.assertFalse(a.connected)  # type: ignore[attr-defined]
        self.assertTrue(b.connected)  # type: ignore[attr-defined]
        self.assertEqual(cp.agents.connected_nodes(), ["node-b"])
        # node-b's stream still carries messages.
        seen = cp.inventory.get("node-b").last_seen  # type: ignore[union-attr]
        self.clock.advance(1)
        b.heartbeat()  # type: ignore[attr-defined]
        pump_b.flush()  # type: ignore[attr-defined]
        self.assertGreater(cp.inventory.get("node-b").last_seen, seen)  # type: ignore[union-attr]
        again, _, _ = self.connect(cp, "node-a")
        self.assertFalse(again.registered)  # type: ignore[attr-defined]

    def test_unregistered_revoked_connection_closed_on_reload(self) -> None:
        """
        A connection past its handshake but not yet registered is closed too
        when the CRL revokes its certificate.
        """
        cp = self.control_plane()
        a, server_a, pump = self.connect(cp, "node-a")
        stream = server_stream(server_a)
        cp.agents.detach("node-a", stream)  # type: ignore[arg-type]
        stream.node_id = None  # type: ignore[attr-defined]
        revoke(self.ca, node_id="node-a")
        self.assertEqual(len(cp.reload_tls()["closed"]), 1)

    def assert_bad_crl_keeps_previous(self, damage: str) -> None:
        revoke(self.ca, node_id="node-a")
        cp = self.control_plane()
        number = cp.tls_expiry_snapshot()["crl_number"]
        path = self.dir / CRL_FILE
        if damage == "damaged":
            path.write_text("-----BEGIN X509 CRL-----\nnot base64\n")
        elif damage == "foreign":
            other = CertificateAuthority.init(Path(self.mktemp()))
            other.issue_agent("node-z")
            revoke(other, node_id="node-z")
            path.write_bytes((other.directory / CRL_FILE).read_bytes())
        elif damage == "expired":
            state = json.loads((self.dir / STATE_FILE).read_text())
            past = datetime.datetime.now(UTC) - datetime.timedelta(days=3)
            state["last_update"] = None
            (self.dir / STATE_FILE).write_text(json.dumps(state))
            path.unlink()
            renew(self.ca, days=1, now=past)
        elif damage == "removed":
            path.unlink()
        result = cp.reload_tls()
        self.assertFalse(result["ok"])
        self.assertIn(str(path), result["error"])
        self.assertEqual(cp.tls_expiry_snapshot()["crl_number"], number)
        self.assertEqual(cp.tls_expiry_snapshot()["reloads_refused"], 1)
        # The previous CRL is still enforced.
        a, _, _ = self.connect(cp, "node-a")
        self.assertFalse(a.registered)  # type: ignore[attr-defined]
        b, _, _ = self.connect(cp, "node-b")
        self.assertTrue(b.registered)  # type: ignore[attr-defined]
        self.flushLoggedErrors()

    def test_damaged_crl_refused_on_reload(self) -> None:
        """
        A CRL that does not parse is refused at reload; the last good one stays.
        """
        self.assert_bad_crl_keeps_previous("damaged")

    def test_foreign_crl_refused_on_reload(self) -> None:
        """
        A CRL from another CA is refused at reload; the last good one stays.
        """
        self.assert_bad_crl_keeps_previous("foreign")

    def test_expired_crl_refused_on_reload(self) -> None:
        """
        An expired CRL is refused at reload; the last good one stays.
        """
        self.assert_bad_crl_keeps_previous("expired")

    def test_removed_crl_refused_on_reload(self) -> None:
        """
        A CRL that was loaded and then disappeared is refused, so a half-done
        copy cannot re-admit revoked nodes.
        """
        self.assert_bad_crl_keeps_previous("removed")

    def test_bad_crl_at_start_refuses_to_start(self) -> None:
        """
        At start, a damaged CRL stops C{twistd llmgw control} with a message
        naming the file.
        """
        revoke(self.ca, node_id="node-a")
        (self.dir / CRL_FILE).write_text("garbage")
        opts = Options()
        e = self.assertRaises(
            usage.UsageError, opts.parseOptions, ["--certs", str(self.dir), "--agent-listen", "127.0.0.1:0"]
        )
        self.assertIn("crl.pem", str(e))
        self.assertRaises(TLSConfigError, server_files, self.dir)


class CLITests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        self.ca = make_pki(self.dir, ["node-a"])

    def test_revoke_and_show(self) -> None:
        """
        C{llmgw ctl cert revoke NODE} writes the CRL and says so;
        C{show} then prints the CRL's next update and that the certificate
        is revoked; C{crl} lists the serial.
        """
        rc, out, err = run_cli("ctl", "cert", "revoke", "node-a", "--certs", str(self.dir),
                               "--reason", "keyCompromise")
        self.assertEqual((rc, err), (0, ""))
        serial = format(next(iter(serials_of(self.ca, "node-a"))), "x")
        self.assertIn(f"revoked serial {serial}", out)
        self.assertIn("CRL number 1", out)
        rc, out, _ = run_cli("ctl", "cert", "show", str(self.dir / "agent-node-a.pem"), "--certs", str(self.dir))
        self.assertEqual(rc, 0)
        self.assertIn("next update", out)
        self.assertIn("REVOKED", out)
        rc, out, _ = run_cli("ctl", "cert", "crl", "--certs", str(self.dir), "--json")
        info = json.loads(out)
        self.assertEqual([r["serial"] for r in info["revoked"]], [serial])
        self.assertTrue(info["valid"])

    def test_renew(self) -> None:
        """
        C{llmgw ctl cert crl --renew --days N} re-signs the CRL with the next
        number and the new next-update, even with nothing revoked.
        """
        rc, out, _ = run_cli("ctl", "cert", "crl", "--renew", "--days", "7", "--certs", str(self.dir))
        self.assertEqual(rc, 0)
        # Bracketed by the clock before and after, however long the run took.
        before = datetime.datetime.now(UTC).replace(microsecond=0)
        rc, out, _ = run_cli("ctl", "cert", "crl", "--renew", "--days", "7", "--certs", str(self.dir))
        after = datetime.datetime.now(UTC)
        crl = load_crl(self.dir / CRL_FILE, self.ca.certificate)
        self.assertEqual(crl_number(crl), 2)
        assert crl.next_update_utc is not None
        week = datetime.timedelta(days=7)
        self.assertTrue(before + week <= crl.next_update_utc <= after + week, crl.next_update_utc)

    def test_cli_errors(self) -> None:
        """
        Bad input exits 1 with a message and writes no CRL.
        """
        rc, _, err = run_cli("ctl", "cert", "revoke", "--certs", str(self.dir))
        self.assertEqual(rc, 1)
        self.assertIn("NODE_ID", err)
        rc, _, err = run_cli("ctl", "cert", "revoke", "--serial", "nothex", "--certs", str(self.dir))
        self.assertEqual(rc, 1)
        self.assertIn("hexadecimal", err)
        rc, _, err = run_cli("ctl", "cert", "crl", "--certs", str(self.dir))
        self.assertEqual(rc, 1)
        self.assertIn("--renew", err)
        self.assertFalse((self.dir / CRL_FILE).exists())
