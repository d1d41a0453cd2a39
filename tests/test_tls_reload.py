"""
Tests for reloading TLS files without a restart (L{llmgw.control.shell.trust},
L{llmgw.tlsconf.options}) and for expiry visibility.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from twisted.internet.testing import MemoryReactorClock
from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.service import ControlPlane
from llmgw.control.shell.trust import TrustService, expiry_problems
from llmgw.testing.pki import agent_tls, connect_in_memory, make_pki
from llmgw.testing.sinks import RecordingSink
from llmgw.tlsconf.crl import renew
from llmgw.tlsconf.options import ServerTLS, TLSConfigError, server_files

UTC = datetime.UTC


class ThreadCallReactor(MemoryReactorClock):
    """
    A memory reactor that records C{callFromThread} calls, as a signal
    handler makes them, for the test to run.
    """

    def __init__(self) -> None:
        super().__init__()
        self.from_thread: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def callFromThread(self, f: Callable[..., Any], *args: Any) -> None:  # noqa: N802
        self.from_thread.append((f, args))

    def run_thread_calls(self) -> None:
        calls, self.from_thread = self.from_thread, []
        for f, args in calls:
            f(*args)


def peer_serial(agent: Any) -> int:
    return int(agent.transport.getPeerCertificate().get_serial_number())


def server_stream(server_proto: Any) -> Any:
    return server_proto.wrappedProtocol.wrappedProtocol


class ReloadBase(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        self.ca = make_pki(self.dir, ["node-a", "node-b"])
        self.clock = ThreadCallReactor()
        self.clock.advance(time.time())
        self.port = 41000

    def control_plane(self, **kw: Any) -> ControlPlane:
        cp = ControlPlane(
            self.clock, RecordingSink(), ServerTLS(server_files(self.dir)), "127.0.0.1", 0, **kw
        )
        cp.startService()
        self.addCleanup(cp.stopService)
        return cp

    def connect(self, cp: ControlPlane, node: str, tls: Any = None, **kw: Any) -> Any:
        self.port += 1
        tls = tls or agent_tls(self.dir, node)
        return connect_in_memory(cp.limiter, tls, node, self.clock, port=self.port, **kw)


class ServerReloadTests(ReloadBase):
    def test_rotated_server_certificate_used_by_new_handshakes(self) -> None:
        """
        After a rotation and a reload, a new handshake gets the new server
        certificate, while a stream opened before carries on with messages.
        """
        cp = self.control_plane()
        old_serial = cp.tls.files.cert.serial_number  # type: ignore[union-attr]
        a, _, pump_a = self.connect(cp, "node-a")
        self.assertEqual(peer_serial(a), old_serial)
        new = self.ca.issue_server(["127.0.0.1"])
        result = cp.reload_tls()
        self.assertTrue(result["ok"])
        self.assertEqual(result["server_serial"], format(new.certificate.serial_number, "x"))
        b, _, _ = self.connect(cp, "node-b")
        self.assertTrue(b.registered)
        self.assertEqual(peer_serial(b), new.certificate.serial_number)
        # The old stream still works.
        self.assertTrue(a.connected)
        seen = cp.inventory.get("node-a").last_seen  # type: ignore[union-attr]
        self.clock.advance(1)
        a.heartbeat()
        pump_a.flush()
        self.assertGreater(cp.inventory.get("node-a").last_seen, seen)  # type: ignore[union-attr]
        self.assertEqual(cp.agents.connected_nodes(), ["node-a", "node-b"])

    def assert_refused_and_kept(self, cp: ControlPlane, old_serial: int, words: str) -> None:
        with capturedLogs() as events:
            result = cp.reload_tls()
        self.assertFalse(result["ok"])
        self.assertIn(words, result["error"])
        self.assertTrue(
            any("running certificate, key, CA and CRL stay" in e["log_format"] for e in events)
        )
        b, _, _ = self.connect(cp, "node-b")
        self.assertTrue(b.registered)
        self.assertEqual(peer_serial(b), old_serial)

    def test_mismatched_key_refused(self) -> None:
        """
        A new certificate with the old key (a rotation half done) is
        refused; new handshakes keep the running certificate.
        """
        cp = self.control_plane()
        old_serial = cp.tls.files.cert.serial_number  # type: ignore[union-attr]
        old_key = (self.dir / "server.key").read_bytes()
        self.ca.issue_server(["127.0.0.1"])
        (self.dir / "server.key").write_bytes(old_key)
        self.assert_refused_and_kept(cp, old_serial, "does not belong")

    def test_half_written_certificate_refused(self) -> None:
        """
        A truncated server certificate is refused; the running one stays.
        """
        cp = self.control_plane()
        old_serial = cp.tls.files.cert.serial_number  # type: ignore[union-attr]
        data = (self.dir / "server.pem").read_bytes()
        (self.dir / "server.pem").write_bytes(data[: len(data) // 2])
        self.assert_refused_and_kept(cp, old_serial, "server.pem")

    def test_without_tls(self) -> None:
        """
        Without TLS there is nothing to reload, and that is said plainly.
        """
        cp = ControlPlane(self.clock, RecordingSink(), None, "127.0.0.1", 0)
        self.assertFalse(cp.reload_tls()["ok"])
        self.assertEqual(cp.tls_expiry_snapshot(), {})


class SighupTests(ReloadBase):
    def setUp(self) -> None:
        super().setUp()
        original = signal.getsignal(signal.SIGHUP)
        self.addCleanup(signal.signal, signal.SIGHUP, original)

    def test_sighup_reloads(self) -> None:
        """
        With SIGHUP handling on, the signal schedules a reload on the
        reactor thread, which picks up a rotated server certificate; a
        handler installed before still gets the signal; stopping restores it.
        """
        earlier: list[int] = []

        def previous(signum: int, frame: Any) -> None:
            earlier.append(signum)

        signal.signal(signal.SIGHUP, previous)
        cp = self.control_plane(handle_sighup=True)
        new = self.ca.issue_server(["127.0.0.1"])
        os.kill(os.getpid(), signal.SIGHUP)
        self.assertEqual(earlier, [signal.SIGHUP])
        # Nothing happens inside the signal handler itself.
        self.assertNotEqual(cp.tls.files.cert.serial_number, new.certificate.serial_number)  # type: ignore[union-attr]
        self.clock.run_thread_calls()
        self.assertEqual(cp.tls.files.cert.serial_number, new.certificate.serial_number)  # type: ignore[union-attr]
        cp.stopService()
        self.assertIs(signal.getsignal(signal.SIGHUP), previous)

    def test_no_handler_under_a_fake_reactor(self) -> None:
        """
        By default the handler is installed only under the global reactor,
        so embedding or testing the control plane leaves signals alone.
        """
        before = signal.getsignal(signal.SIGHUP)
        cp = self.control_plane()
        assert cp.trust is not None
        self.assertFalse(cp.trust.handle_sighup)
        self.assertIs(signal.getsignal(signal.SIGHUP), before)


class AgentReloadTests(ReloadBase):
    def test_agent_picks_up_renewed_certificate(self) -> None:
        """
        After its certificate is renewed, L{AgentClientTLS.reload} makes the
        next handshake present the new certificate; the stream opened
        before keeps running.
        """
        cp = self.control_plane()
        tls = agent_tls(self.dir, "node-a")
        first, server_first, _ = self.connect(cp, "node-a", tls)
        old = server_stream(server_first).certificate_serial
        renewed = self.ca.issue_agent("node-a")
        files = tls.reload()
        self.assertEqual(files.cert.serial_number, renewed.certificate.serial_number)
        self.assertTrue(first.connected)
        again, server_again, _ = self.connect(cp, "node-a", tls)
        self.assertTrue(again.registered)
        self.assertNotEqual(old, renewed.certificate.serial_number)
        self.assertEqual(
            server_stream(server_again).certificate_serial, renewed.certificate.serial_number
        )

    def test_agent_refuses_bad_renewal(self) -> None:
        """
        A half-written key or a certificate for another node is refused by
        the agent's reload, which keeps presenting its running certificate.
        """
        cp = self.control_plane()
        tls = agent_tls(self.dir, "node-a")
        running = tls.files.cert.serial_number
        key = self.dir / "agent-node-a.key"
        good = key.read_bytes()
        self.ca.issue_agent("node-a")
        key.write_bytes(good[:40])
        self.assertRaises(TLSConfigError, tls.reload)
        other = agent_tls(self.dir, "node-b").files
        e = self.assertRaises(TLSConfigError, tls.reload, other)
        self.assertIn("node-b", str(e))
        self.assertEqual(tls.files.cert.serial_number, running)
        a, server_a, _ = self.connect(cp, "node-a", tls)
        self.assertTrue(a.registered)
        self.assertEqual(server_stream(server_a).certificate_serial, running)


class ExpiryTests(ReloadBase):
    def test_snapshot_keys(self) -> None:
        """
        The expiry snapshot gives the CA's, the server certificate's, the
        CRL's and each reporting agent's dates as Unix seconds.
        """
        renew(self.ca)
        cp = self.control_plane()
        not_after = int(time.time()) + 86400 * 100
        self.connect(cp, "node-a", certificate_not_after=not_after)
        self.connect(cp, "node-b")
        snap = cp.tls_expiry_snapshot()
        files = cp.tls.files  # type: ignore[union-attr]
        self.assertEqual(snap["ca_not_after"], files.ca.not_valid_after_utc.timestamp())
        self.assertEqual(snap["server_not_after"], files.cert.not_valid_after_utc.timestamp())
        self.assertEqual(snap["crl_next_update"], files.crl.next_update_utc.timestamp())  # type: ignore[union-attr]
        self.assertEqual(snap["crl_number"], 1)
        self.assertEqual(snap["agents_not_after"], {"node-a": float(not_after)})
        self.assertEqual(snap["agents_unreported"], 1)
        self.assertEqual(snap["earliest_agent_not_after"], float(not_after))
        self.assertEqual(snap["reloads_ok"], 0)

    def test_warnings_under_30_days(self) -> None:
        """
        A server certificate and an agent certificate with under 30 days
        left are warned about in the log; an agent's expired certificate is
        an error; a 30-day CRL is warned about only in its second half.
        """
        self.ca.issue_server(["127.0.0.1"], days=20)
        renew(self.ca, days=30)
        cp = self.control_plane()
        soon = int(time.time()) + 86400 * 10
        self.connect(cp, "node-a", certificate_not_after=soon)
        self.connect(cp, "node-b", certificate_not_after=int(time.time()) - 60)
        assert cp.trust is not None
        with capturedLogs() as events:
            problems = cp.trust.check_expiry()
        text = "\n".join(m for _, m in problems)
        self.assertIn("server.pem", text)
        self.assertIn("node-a", text)
        self.assertNotIn("crl.pem", text)
        self.assertEqual([lvl for lvl, m in problems if "node-b" in m], ["error"])
        self.assertEqual([lvl for lvl, m in problems if "node-a" in m], ["warn"])
        self.assertEqual(len([e for e in events if "TLS expiry" in e["log_format"]]), len(problems))
        files = cp.tls.files  # type: ignore[union-attr]
        later = datetime.datetime.now(UTC) + datetime.timedelta(days=16)
        self.assertIn("crl.pem", "\n".join(m for _, m in expiry_problems(files, [], later)))

    def test_expiry_checked_periodically(self) -> None:
        """
        The expiry check runs at start and again every interval.
        """
        self.ca.issue_server(["127.0.0.1"], days=20)
        with capturedLogs() as events:
            cp = self.control_plane()
            assert cp.trust is not None
            self.clock.advance(cp.trust.check_interval)
        warned = [e for e in events if "TLS expiry" in e["log_format"]]
        self.assertEqual(len(warned), 2)

    def test_trust_service_type(self) -> None:
        """
        The control plane's trust part is a named child service.
        """
        cp = self.control_plane()
        self.assertIsInstance(cp.getServiceNamed("tls-trust"), TrustService)
