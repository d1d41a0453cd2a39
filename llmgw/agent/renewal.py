"""
A node renewing its own certificate over its stream (DESIGN §20).

L{RenewalSchedule} is the pure part: when to ask (two thirds into the
certificate's lifetime), when to ask again after a request went unanswered,
waited for an operator or was refused (backing off), and when to warn (once
a day in the last L{WARN_DAYS} days). L{CertificateRenewal} carries it out:
it makes a new key on the node (mode 0600, beside the current one as
C{KEY.next}, reused for every ask until a certificate for it comes back),
sends a C{CertificateRequest} on the registered stream, checks the
C{CertificateIssued} it gets, writes key, certificate and CA bundle in place
and has the agent take them for its next connection. The open stream and
the shards are never touched for it.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from twisted.application.service import Service
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger

from llmgw.api.v1 import agent_pb2 as pb
from llmgw.tlsconf.certs import BACKDATE, common_name_of, issued_by
from llmgw.tlsconf.csr import public_key_hash, spki_hash
from llmgw.tlsconf.options import TLSFiles
from llmgw.tlsconf.pem import CAError, cert_pem, key_pem, load_key, write_private, write_public

#: The share of a certificate's lifetime after which the node asks for a new one.
RENEW_AT = 2 / 3
#: The longest wait between two asks, in seconds.
MAX_RETRY = 3600.0
#: The shortest wait between two asks, in seconds.
MIN_RETRY = 1.0
#: The node warns, once a day, when its certificate has fewer days left than this.
WARN_DAYS = 7
WARN_EVERY = 86400.0
#: The environment variable that sets the renewal share instead of L{RENEW_AT},
#: for tests that cannot wait two thirds of the shortest lifetime (a minute).
FRACTION_ENV = "LLMGW_TEST_RENEW_FRACTION"


def fraction_from_env(environ: dict[str, str] | None = None) -> float:
    """L{RENEW_AT}, or the share L{FRACTION_ENV} gives (between 0 and 1)."""
    text = (environ if environ is not None else dict(os.environ)).get(FRACTION_ENV, "")
    try:
        value = float(text) if text else RENEW_AT
    except ValueError:
        return RENEW_AT
    return value if 0.0 < value < 1.0 else RENEW_AT


def lifetime_start(cert: x509.Certificate) -> float:
    """
    When C{cert}'s lifetime counts from, in Unix seconds: its start, less
    the L{BACKDATE} llmgw puts every certificate's start back by, when the
    certificate is longer than that.
    """
    start = cert.not_valid_before_utc
    if cert.not_valid_after_utc - start > BACKDATE:
        start += BACKDATE
    return start.timestamp()


@dataclass
class RenewalSchedule:
    """
    When a certificate valid from C{start} to C{end} (Unix seconds) is
    renewed and warned about. Reads no clock: every method takes C{now}.
    """

    start: float
    end: float
    fraction: float = RENEW_AT
    #: Asks made for the current certificate that brought nothing.
    attempts: int = 0
    #: When the next ask is due.
    next_ask: float = 0.0
    last_warning: float | None = None

    def __post_init__(self) -> None:
        self.next_ask = self.due()

    @property
    def lifetime(self) -> float:
        return max(0.0, self.end - self.start)

    def due(self) -> float:
        """When the first ask is due: C{fraction} into the lifetime."""
        return self.start + self.fraction * self.lifetime

    def retry_delay(self) -> float:
        """
        The wait before the next ask after C{attempts} fruitless ones: a
        hundredth of the lifetime (between L{MIN_RETRY} and a minute),
        doubled each time, at most L{MAX_RETRY}.
        """
        base = min(60.0, max(MIN_RETRY, self.lifetime / 100))
        return float(min(MAX_RETRY, base * 2 ** max(0, self.attempts - 1)))

    def asked(self, now: float) -> float:
        """An ask was made at C{now}: when the next is due, unless an answer comes."""
        self.attempts += 1
        self.next_ask = now + self.retry_delay()
        return self.next_ask

    def should_ask(self, now: float) -> bool:
        return now >= self.next_ask

    def should_warn(self, now: float) -> bool:
        """Whether a warning is due: in the last L{WARN_DAYS} days, a day after the last."""
        if self.end - now >= WARN_DAYS * 86400:
            return False
        return self.last_warning is None or now - self.last_warning >= WARN_EVERY

    def warned(self, now: float) -> None:
        self.last_warning = now

    def wake_at(self, now: float) -> float:
        """The next moment something is due (an ask or a warning)."""
        warn = self.end - WARN_DAYS * 86400
        if self.last_warning is not None:
            warn = max(warn, self.last_warning + WARN_EVERY)
        return max(now, min(self.next_ask, warn))


class RenewalRefused(Exception):
    """A certificate that came back is not the one asked for; the message says why."""


def check_issued_to_node(issued: pb.CertificateIssued, node_id: str, key: ec.EllipticCurvePrivateKey,
                         trusted: tuple[x509.Certificate, ...], now: float,
                         ) -> tuple[x509.Certificate, list[x509.Certificate]]:
    """
    The certificate and the roots to trust from now on, if C{issued} is for
    C{key} and C{node_id}, valid at C{now}, and from a root of the bundle
    sent (or of C{trusted} when none was sent). A bundle must keep a root of
    C{trusted}: one that shares none could not have come from this fleet.

    @raise RenewalRefused: any of it fails.
    """
    try:
        cert = x509.load_pem_x509_certificate(issued.certificate_pem)
        roots = x509.load_pem_x509_certificates(issued.ca_bundle_pem) if issued.ca_bundle_pem else list(trusted)
    except ValueError as e:
        raise RenewalRefused(f"the certificate or CA bundle sent does not parse: {e}") from e
    if common_name_of(cert) != node_id:
        raise RenewalRefused(f"the certificate sent is for {common_name_of(cert)!r}, not this node {node_id!r}")
    if public_key_hash(cert) != _key_hash(key):
        raise RenewalRefused("the certificate sent is not for the key this node asked with")
    known = {spki_hash(r) for r in trusted}
    if not any(spki_hash(r) in known for r in roots):
        raise RenewalRefused("the CA bundle sent shares no root with the one this node trusts")
    if not any(issued_by(cert, r) for r in roots):
        raise RenewalRefused("the certificate sent was not issued by a root of the CA bundle")
    if cert.not_valid_after_utc.timestamp() <= now:
        raise RenewalRefused(f"the certificate sent expired on {cert.not_valid_after_utc.isoformat()}")
    return cert, roots


def _key_hash(key: ec.EllipticCurvePrivateKey) -> str:
    # The same hash as public_key_hash of a certificate or request for it.
    der = key.public_key().public_bytes(serialization.Encoding.DER,
                                        serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def stream_sender(core: Any) -> Callable[[pb.AgentMessage], bool]:
    """
    What sends on C{core}'s (an L{llmgw.agent.client.AgentCore}) registered
    stream: C{False} when there is none.
    """

    def send(msg: pb.AgentMessage) -> bool:
        proto = core.proto
        if proto is None or not proto.is_registered or proto.transport is None or proto.transport.disconnecting:
            return False
        proto.send_message(msg)
        return True

    return send


class CertificateRenewal(Service):
    """
    Renews the node's certificate before it lapses.

    @param files: the agent's TLS files now (they change after a renewal).
    @param send: sends a message on the registered stream; C{False} when
        there is none (the ask waits for the next registration).
    @param reload: has the agent take the files written (its
        C{reload_certificate}); C{False} if it refused them.
    """

    log = Logger()
    name = "certificate-renewal"

    def __init__(self, clock: Any, node_id: str, files: Callable[[], TLSFiles],
                 send: Callable[[pb.AgentMessage], bool], reload: Callable[[], bool],
                 fraction: float = RENEW_AT):
        self.clock = clock
        self.node_id = node_id
        self.files = files
        self.send = send
        self.reload = reload
        self.fraction = fraction
        self.schedule = self._schedule_for(files().cert)
        self._serial = files().cert.serial_number
        self._timer: IDelayedCall | None = None
        #: Certificates renewed by this process.
        self.renewals = 0
        #: The control plane's last answer that was not a certificate, for the warnings.
        self.last_answer = ""
        #: An ask came due while no stream was registered: made at the next registration.
        self._unsent = False

    def _schedule_for(self, cert: x509.Certificate) -> RenewalSchedule:
        return RenewalSchedule(lifetime_start(cert), cert.not_valid_after_utc.timestamp(), self.fraction)

    @property
    def next_key_path(self) -> Path:
        key_path = self.files().key_path
        return key_path.with_name(key_path.name + ".next")

    # -- lifetime -----------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._arm()

    def stopService(self) -> None:
        super().stopService()
        self._disarm()

    def _disarm(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _arm(self) -> None:
        self._disarm()
        if not self.running:
            return
        now = self.clock.seconds()
        self._timer = self.clock.callLater(self.schedule.wake_at(now) - now, self._wake)

    def _wake(self) -> None:
        self._timer = None
        try:
            self.check()
        except Exception:
            # A failure here must not end renewals for good: the next wake tries again.
            self.log.failure("certificate renewal of node {node} failed", node=self.node_id)
            self.schedule.asked(self.clock.seconds())
        self._arm()

    # -- asking -------------------------------------------------------------

    def check(self) -> None:
        """Warn and ask for a new certificate if either is due now."""
        now = self.clock.seconds()
        cert = self.files().cert
        if cert.serial_number != self._serial:
            # Renewed by hand (a new certificate and SIGHUP): its own schedule.
            self.schedule, self._serial = self._schedule_for(cert), cert.serial_number
            self.last_answer = ""
        s = self.schedule
        if s.should_warn(now):
            s.warned(now)
            left = max(0.0, s.end - now)
            end = datetime.datetime.fromtimestamp(s.end, datetime.UTC).isoformat()
            self.log.warn("this node's certificate expires in {days:.1f} days ({end}) and is not renewed "
                          "yet: its renewal is asked of the control plane over the stream{why}",
                          days=left / 86400, end=end, why=f" ({self.last_answer})" if self.last_answer else "")
        if s.should_ask(now):
            self.ask(now)

    def _next_key(self) -> ec.EllipticCurvePrivateKey:
        path = self.next_key_path
        if path.exists():
            try:
                key = load_key(path)  # the same key for every ask, across restarts too
                if isinstance(key, ec.EllipticCurvePrivateKey):
                    return key
            except (CAError, ValueError, OSError) as e:
                self.log.warn("the pending key {path} does not load ({error}): making a new one",
                              path=str(path), error=str(e))
        key = ec.generate_private_key(ec.SECP256R1())
        write_private(path, key_pem(key))
        return key

    def ask(self, now: float) -> bool:
        """Send a request now (if a stream is registered); returns whether it went."""
        self.schedule.asked(now)
        key = self._next_key()
        csr = (x509.CertificateSigningRequestBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self.node_id)]))
               .sign(key, hashes.SHA256()))
        sent = self.send(pb.AgentMessage(certificate_request=pb.CertificateRequest(
            csr_pem=csr.public_bytes(serialization.Encoding.PEM))))
        self._unsent = not sent
        if sent:
            self.log.info("asked the control plane for a new certificate for node {node} (this one ends {end})",
                          node=self.node_id, end=self.files().cert.not_valid_after_utc.isoformat())
        else:
            self.log.info("certificate renewal of node {node} is due: asking once the stream is registered",
                          node=self.node_id)
        return sent

    def registered(self) -> None:
        """A stream was registered: make the ask that found no stream, now."""
        if self.running and self._unsent:
            self.ask(self.clock.seconds())
            self._arm()

    # -- answers ------------------------------------------------------------

    def answered(self, ack: pb.Ack) -> None:
        """The control plane's C{Ack} of a request: waiting for an operator, or refused."""
        delay = self.schedule.next_ask - self.clock.seconds()
        if ack.ok:
            self.last_answer = "it waits for an operator's approval"
            self.log.warn("the renewal of node {node}'s certificate waits for an operator: `llmgw ctl csr approve "
                          "{node}` where the CA's key is; asking again in {delay:.0f}s",
                          node=self.node_id, delay=delay)
            return
        self.last_answer = f"refused: {ack.error}"
        self.log.error("the control plane REFUSED to renew node {node}'s certificate: {error}; it ends {end}, "
                       "after which this node cannot connect; asking again in {delay:.0f}s",
                       node=self.node_id, error=ack.error, delay=delay,
                       end=self.files().cert.not_valid_after_utc.isoformat())

    def issued(self, issued: pb.CertificateIssued) -> bool:
        """
        Take a certificate the control plane sent: checked against the key
        asked with, the node id and the roots, then written and reloaded.
        Anything else is logged and left; the next ask follows the schedule.

        @return: whether it was taken.
        """
        path = self.next_key_path
        if not path.exists():
            self.log.warn("ignoring a certificate the control plane sent unasked (node {node})", node=self.node_id)
            return False
        files = self.files()
        try:
            key = load_key(path)
            cert, roots = check_issued_to_node(issued, self.node_id, key, files.roots or (files.ca,),
                                               self.clock.seconds())
        except (RenewalRefused, CAError, ValueError, OSError) as e:
            self.log.error("refusing the certificate the control plane sent for node {node}: {error}",
                           node=self.node_id, error=str(e))
            return False
        self._write(files, path, cert, roots)
        if not self.reload():
            return False
        self.renewals += 1
        self.last_answer = ""
        self.schedule, self._serial = self._schedule_for(cert), cert.serial_number
        new_root = next(r for r in roots if issued_by(cert, r))
        self.log.info("node {node} renewed its certificate: serial {serial} from CA {ca} until {end}; used from "
                      "the next connection, the stream stays", node=self.node_id,
                      serial=format(cert.serial_number, "x"), ca=new_root.subject.rfc4514_string(),
                      end=cert.not_valid_after_utc.isoformat())
        self._arm()
        return True

    def _write(self, files: TLSFiles, next_key: Path, cert: x509.Certificate, roots: list[x509.Certificate]) -> None:
        # The bundle first (a superset of what was trusted), then the key
        # and certificate, each replaced atomically.
        bundle = b"".join(cert_pem(r) for r in roots)
        if files.ca_path.read_bytes() != bundle:
            write_public(files.ca_path, bundle)
        os.replace(next_key, files.key_path)
        write_public(files.cert_path, cert_pem(cert))
