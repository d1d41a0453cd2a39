"""
A node renewing its certificate over its stream: the schedule (two thirds
of the lifetime, backoff, the daily warning), the node's checks of what
comes back, writing and reloading, a CA rollover, and the stream client
keeping its stream whatever the answer.
"""

from __future__ import annotations

import datetime
import stat
from pathlib import Path
from typing import Any

from twisted.internet.task import Clock
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.renewal import (
    FRACTION_ENV,
    MAX_RETRY,
    RENEW_AT,
    CertificateRenewal,
    RenewalSchedule,
    fraction_from_env,
    lifetime_start,
)
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.core.jointokens import TokenFile
from llmgw.control.shell.joining import JoinAuthority
from llmgw.tlsconf.ca import CertificateAuthority
from llmgw.tlsconf.csr import check_request, sign_request, spki_hash
from llmgw.tlsconf.options import TLSFiles
from llmgw.tlsconf.pem import cert_pem, key_pem, write_private, write_public
from tests.test_agent_client import Harness, read_frames

DAY = 86400.0


class ScheduleTests(SynchronousTestCase):
    def test_two_thirds(self) -> None:
        """The first ask is due two thirds into the lifetime."""
        s = RenewalSchedule(1000.0, 1000.0 + 30 * DAY)
        self.assertEqual(s.due(), 1000.0 + 20 * DAY)
        self.assertFalse(s.should_ask(1000.0 + 20 * DAY - 1))
        self.assertTrue(s.should_ask(1000.0 + 20 * DAY))

    def test_backoff(self) -> None:
        """Fruitless asks back off: a hundredth of the lifetime (at most a minute), doubled, at most an hour."""
        s = RenewalSchedule(0.0, 30 * DAY)
        now = s.due()
        delays = []
        for _ in range(9):
            delays.append(s.asked(now) - now)
        self.assertEqual(delays, [60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, MAX_RETRY, MAX_RETRY, MAX_RETRY])
        short = RenewalSchedule(0.0, 60.0)
        self.assertEqual([short.asked(40.0) - 40.0 for _ in range(3)], [1.0, 2.0, 4.0])

    def test_daily_warning_in_last_week(self) -> None:
        """Warnings start seven days before the end and come once a day."""
        end = 100 * DAY
        s = RenewalSchedule(0.0, end)
        self.assertFalse(s.should_warn(end - 7 * DAY - 1))
        self.assertEqual(s.wake_at(0.0), s.due())
        s.next_ask = end  # as if an ask were far off: the warning wakes it first
        self.assertEqual(s.wake_at(s.due()), end - 7 * DAY)
        now = end - 7 * DAY + 1
        self.assertTrue(s.should_warn(now))
        s.warned(now)
        self.assertFalse(s.should_warn(now + DAY - 1))
        self.assertTrue(s.should_warn(now + DAY))

    def test_backdate_not_counted(self) -> None:
        """A certificate's lifetime counts from its issue, not from the five minutes it is backdated by."""
        d = Path(self.mktemp())
        ca = CertificateAuthority.init(d)
        now = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)
        from llmgw.tlsconf.csr import new_request

        csr = check_request(new_request("n1")[1], "n1")
        cert = sign_request(csr, "n1", ca.key, ca.certificate, datetime.timedelta(minutes=1), now)
        self.assertEqual(lifetime_start(cert), now.timestamp())

    def test_fraction_from_env(self) -> None:
        """The test-only share comes from the environment when it is between 0 and 1, else 2/3."""
        self.assertEqual(fraction_from_env({}), RENEW_AT)
        self.assertEqual(fraction_from_env({FRACTION_ENV: "0.25"}), 0.25)
        self.assertEqual(fraction_from_env({FRACTION_ENV: "7"}), RENEW_AT)
        self.assertEqual(fraction_from_env({FRACTION_ENV: "x"}), RENEW_AT)


class RenewalCase(SynchronousTestCase):
    """A node's files from a CA, a renewal over a fake stream, and the authority that answers."""

    lifetime = datetime.timedelta(days=30)

    def setUp(self) -> None:
        self.events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(self.events.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.events.append)
        self.ca_dir = Path(self.mktemp())
        self.ca = CertificateAuthority.init(self.ca_dir)
        self.node_dir = Path(self.mktemp())
        self.node_dir.mkdir()
        # The clock starts in the past so that a renewal comes due near the
        # wall clock, which loading files checks validity against.
        self.clock = Clock()
        self.clock.advance(datetime.datetime.now(datetime.UTC).timestamp()
                           - RENEW_AT * self.lifetime.total_seconds() - 60)
        from llmgw.tlsconf.csr import new_request

        k, csr_pem = new_request("n1")
        cert = sign_request(check_request(csr_pem, "n1"), "n1", self.ca.key, self.ca.certificate, self.lifetime,
                            datetime.datetime.fromtimestamp(self.clock.seconds(), datetime.UTC))
        write_public(self.node_dir / "ca.pem", cert_pem(self.ca.certificate))
        write_public(self.node_dir / "agent-n1.pem", cert_pem(cert))
        write_private(self.node_dir / "agent-n1.key", key_pem(k))
        self.files = self.load()
        self.sent: list[pb.AgentMessage] = []
        self.stream = True
        self.reloads = 0
        self.renewal = CertificateRenewal(self.clock, "n1", lambda: self.files, self.send, self.reload)
        self.renewal.startService()
        self.addCleanup(self.renewal.stopService)
        self.authority = JoinAuthority(
            self.clock, TokenFile(self.ca_dir / "join-tokens.json"),
            lambda: list(CertificateAuthority.load(self.ca_dir).roots), lambda n: True,
            signer_dir=self.ca_dir, lifetime=self.lifetime)

    def load(self) -> TLSFiles:
        d = self.node_dir
        return TLSFiles.load(d / "ca.pem", d / "agent-n1.pem", d / "agent-n1.key")

    def send(self, msg: pb.AgentMessage) -> bool:
        if self.stream:
            self.sent.append(msg)
        return self.stream

    def reload(self) -> bool:
        self.reloads += 1
        self.files = self.load()
        return True

    def logged(self, fragment: str) -> list[str]:
        return [t for t in map(formatEvent, self.events) if fragment in t]

    def to_due(self) -> None:
        self.clock.advance(self.renewal.schedule.due() - self.clock.seconds())

    def answer(self, msg: pb.AgentMessage) -> pb.CertificateIssued:
        issued = self.authority.renew("n1", self.files.cert.serial_number, msg.certificate_request.csr_pem, "a")
        assert issued is not None
        return issued


class RenewalTests(RenewalCase):
    def test_asks_at_two_thirds_with_a_new_private_key(self) -> None:
        """Nothing is asked before two thirds; then a request for the node, with a new key kept 0600 on the node."""
        self.clock.advance(self.renewal.schedule.due() - self.clock.seconds() - 1)
        self.assertEqual(self.sent, [])
        self.clock.advance(1)
        (msg,) = self.sent
        csr = check_request(msg.certificate_request.csr_pem, "n1")
        nxt = self.node_dir / "agent-n1.key.next"
        self.assertEqual(stat.S_IMODE(nxt.stat().st_mode), 0o600)
        self.assertNotEqual(spki_of(csr), spki_of(self.files.cert))

    def test_issued_is_written_and_reloaded(self) -> None:
        """A certificate for the key asked with is written with its key, reloaded, and the next ask is two thirds into it."""
        self.to_due()
        issued = self.answer(self.sent[0])
        self.assertTrue(self.renewal.issued(issued))
        self.assertEqual(self.reloads, 1)
        self.assertFalse((self.node_dir / "agent-n1.key.next").exists())
        self.assertEqual(self.files.cert.public_bytes(x509_pem()), issued.certificate_pem)
        self.assertEqual(stat.S_IMODE((self.node_dir / "agent-n1.key").stat().st_mode), 0o600)
        self.assertEqual(self.renewal.schedule.due(), lifetime_start(self.files.cert) + RENEW_AT * 30 * DAY)
        self.assertEqual(self.renewal.renewals, 1)

    def test_pending_asked_again_with_same_key(self) -> None:
        """While it waits for an operator the node says so and asks again, backing off, with the same key."""
        self.to_due()
        self.renewal.answered(pb.Ack(message_id="certificate", ok=True, error="waiting"))
        self.assertTrue(self.logged("waits for an operator"))
        self.clock.advance(60)
        self.clock.advance(120)
        self.assertEqual(len(self.sent), 3)
        keys = {spki_of(check_request(m.certificate_request.csr_pem, "n1")) for m in self.sent}
        self.assertEqual(len(keys), 1)

    def test_refused_logged_and_retried(self) -> None:
        """A refused renewal (a revoked node) is logged as an error naming the reason, and asked again later."""
        self.to_due()
        self.renewal.answered(pb.Ack(message_id="certificate", ok=False, code=pb.Ack.CODE_PERMISSION_DENIED,
                                     error="node n1's certificate is revoked: it cannot renew"))
        (line,) = self.logged("REFUSED")
        self.assertIn("revoked", line)
        self.clock.advance(60)
        self.assertEqual(len(self.sent), 2)

    def test_not_for_our_key_refused(self) -> None:
        """A certificate for another key, or another node, is refused and nothing is written."""
        self.to_due()
        from llmgw.tlsconf.csr import new_request

        before = (self.node_dir / "agent-n1.pem").read_bytes()
        other = self.authority.renew("n1", 1, new_request("n1")[1], "a")
        assert other is not None
        self.assertFalse(self.renewal.issued(other))
        self.assertTrue(self.logged("not for the key"))
        self.assertEqual((self.node_dir / "agent-n1.pem").read_bytes(), before)
        self.assertEqual(self.reloads, 0)

    def test_unasked_ignored(self) -> None:
        """A certificate nobody asked for is ignored."""
        self.assertFalse(self.renewal.issued(pb.CertificateIssued(certificate_pem=b"x")))
        self.assertEqual(self.reloads, 0)

    def test_no_stream_asks_at_registration(self) -> None:
        """An ask due while no stream is registered is made when one registers."""
        self.stream = False
        self.to_due()
        self.assertEqual(self.sent, [])
        self.stream = True
        self.renewal.registered()
        self.assertEqual(len(self.sent), 1)

    def test_ca_rollover(self) -> None:
        """During a CA rollover the node gets a certificate of the new root and the bundle with both, and loads them."""
        old = self.ca.certificate
        self.ca.rotate()
        self.to_due()
        self.assertTrue(self.renewal.issued(self.answer(self.sent[0])))
        self.assertEqual(self.files.cert.issuer, self.ca.certificate.subject)
        self.assertEqual({spki_hash(r) for r in self.files.roots}, {spki_hash(old), spki_hash(self.ca.certificate)})

    def test_foreign_bundle_refused(self) -> None:
        """A bundle that shares no root with the node's trust is refused."""
        self.to_due()
        other = CertificateAuthority.init(Path(self.mktemp()))
        csr = check_request(self.sent[0].certificate_request.csr_pem, "n1")
        cert = sign_request(csr, "n1", other.key, other.certificate)
        issued = pb.CertificateIssued(certificate_pem=cert_pem(cert), ca_bundle_pem=cert_pem(other.certificate))
        self.assertFalse(self.renewal.issued(issued))
        self.assertTrue(self.logged("shares no root"))


class WarningTests(RenewalCase):
    lifetime = datetime.timedelta(days=10)

    def test_daily_in_last_week(self) -> None:
        """A node that cannot renew warns once a day in its last seven days, not at every ask."""
        self.stream = False
        self.clock.advance(3 * DAY - 60)
        self.assertEqual(self.logged("expires in"), [])
        self.clock.advance(120)
        self.assertEqual(len(self.logged("expires in")), 1)
        self.clock.advance(DAY - 200)
        self.assertEqual(len(self.logged("expires in")), 1)
        self.clock.advance(200)
        self.assertEqual(len(self.logged("expires in")), 2)


class StreamTests(SynchronousTestCase):
    def test_answers_never_close_the_stream(self) -> None:
        """A refused or pending renewal Ack goes to the renewal; the registered stream stays open."""
        h = Harness(self)
        answers: list[pb.Ack] = []

        class Fake:
            def answered(self, ack: pb.Ack) -> None:
                answers.append(ack)

            def registered(self) -> None:
                pass

        h.core.renewal = Fake()
        proto, transport = h.connect()
        proto.dataReceived(frame(pb.ControlMessage(ack=pb.Ack(message_id="register", ok=True))))
        proto.dataReceived(frame(pb.ControlMessage(ack=pb.Ack(
            message_id="certificate", ok=False, code=pb.Ack.CODE_PERMISSION_DENIED, error="revoked"))))
        self.assertEqual([a.error for a in answers], ["revoked"])
        self.assertFalse(transport.disconnecting)
        self.assertTrue(proto.is_registered)
        self.assertEqual(read_frames(transport.value())[0].WhichOneof("msg"), "register")


def frame(msg: pb.ControlMessage) -> bytes:
    import struct

    data = msg.SerializeToString()
    return struct.pack("!I", len(data)) + data


def spki_of(x: Any) -> str:
    from llmgw.tlsconf.csr import public_key_hash

    return public_key_hash(x)


def x509_pem() -> Any:
    from cryptography.hazmat.primitives.serialization import Encoding

    return Encoding.PEM

