"""
Nodes that join and renew (DESIGN §20), on the control plane's side: the
authority that decides on each certificate request (L{JoinAuthority}), and
the join listener a node without a certificate asks at (L{JoinFactory}).

Why a listener of its own rather than the agent port: the agent port never
accepts a connection without a client certificate from the CA, so a stream
always speaks for the node its certificate names, and nothing on it is read
from a stranger. The join listener is TLS with the control plane's
certificate and no client certificate; it reads one bounded frame (a
L{pb.JoinRequest}), answers once, and closes. Nothing it does registers a
node: it can only issue a certificate, under a valid token, for a name no
connected node holds.

With a signer (C{--signer}: the CA's key in the certificates directory) a
request is signed at once; without one it waits for an operator
(C{llmgw ctl csr approve NAME}, run where the CA's key is), and the node asks
again until it is issued or denied.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.protocol import ServerFactory
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmgw.addresses import format_address
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.core.jointokens import TokenFile, TokenRefused
from llmgw.control.shell.signqueue import SigningQueue
from llmgw.control.shell.tokenwrites import InThread, TokenWrites
from llmgw.tlsconf.ca import CertificateAuthority, issued_line, signed_file
from llmgw.tlsconf.csr import (
    DEFAULT_NODE_LIFETIME,
    RequestRefused,
    check_issued,
    check_request,
    key_description,
    public_key_hash,
    sign_request,
    spki_hash,
)
from llmgw.tlsconf.pem import CAError, cert_pem
from llmgw.wire import InvalidNodeId, MessageStream, validate_node_id

#: The signer's files whose change means its CA is to be loaded again (a
#: rollover rewrites both).
CA_FILES = ("ca.pem", "ca.key")
#: Requests that may wait for an operator at once: past it, new ones are refused.
MAX_PENDING = 256
#: Join connections served at once; past it a new one waits, unread, for a place.
MAX_JOIN_CONNECTIONS = 64
#: Join connections that may wait for a place; past it a new one is closed at accept.
MAX_JOIN_WAITING = 1024
#: The one frame a joining node may send, in bytes.
MAX_JOIN_FRAME = 16 * 1024
#: A join connection has this long for its handshake and its request.
JOIN_DEADLINE = 10.0

Status = pb.JoinResponse


@dataclasses.dataclass
class Pending:
    """A request waiting for an operator."""

    node_id: str
    csr: x509.CertificateSigningRequest
    key_hash: str
    address: str
    since: float
    kind: str  # "join" or "renewal"
    token_id: str = ""
    issued: pb.CertificateIssued | None = None
    denied: str = ""

    def describe(self, now: float) -> dict[str, Any]:
        """What an operator sees of it (C{ctl csr list}), the request's PEM included."""
        return {"node": self.node_id, "kind": self.kind, "address": self.address, "since": self.since,
                "age": max(0.0, now - self.since), "token": self.token_id, "key": key_description(self.csr),
                "key_sha256": self.key_hash, "csr": self.csr.public_bytes(Encoding.PEM).decode("ascii"),
                "state": "denied" if self.denied else ("approved" if self.issued else "pending")}



def _held(node_id: str) -> str:
    return f"node {node_id!r} is connected now: another node holds that name"


class JoinAuthority:
    """
    Decides on certificate requests: joins (with a token) and renewals (over
    a node's stream). Signs them with C{signer_dir}'s CA when given, else
    keeps them pending for an operator.

    @param roots: the roots the control plane trusts now (its CA bundle).
    @param connected: whether a node id has a live stream.
    @param revoked: the serials the CRL in force lists.
    @param deliver: sends a renewal an operator approved to its node's stream.
    @param in_thread: runs the token book's writes and the
        C{issued.jsonl} lines of what is signed off the reactor, in group
        commits (see L{TokenWrites}); without it they are done at once.
    """

    log = Logger()

    def __init__(
        self, clock: IReactorTime, tokens: TokenFile, roots: Callable[[], list[x509.Certificate]],
        connected: Callable[[str], bool], signer_dir: Path | None = None,
        lifetime: datetime.timedelta = DEFAULT_NODE_LIFETIME,
        revoked: Callable[[], frozenset[int]] = frozenset,
        deliver: Callable[[str, pb.CertificateIssued], None] | None = None,
        agent_port: int = 0, max_pending: int = MAX_PENDING,
        on_renewed: Callable[[str, x509.Certificate], None] | None = None,
        in_thread: InThread | None = None,
    ):
        self.clock = clock
        self.tokens = tokens
        #: The book's writes: a join is answered once L{TokenWrites.written} fires.
        self.writes = TokenWrites(tokens, in_thread, clock if in_thread is not None else None)
        #: Joins and renewals are decided in turn, a few milliseconds of the reactor at a time.
        self.queue = SigningQueue(clock)
        self.roots = roots
        self.connected = connected
        self.signer_dir = signer_dir
        self.lifetime = lifetime
        self.revoked = revoked
        self.deliver = deliver
        self.agent_port = agent_port
        self.max_pending = max_pending
        #: Told of each renewal issued or approved (the node's new expiry).
        self.on_renewed = on_renewed
        self.pending: dict[str, Pending] = {}
        #: Answers sent since start, by kind (C{join}: by the join listener;
        #: C{renewal}: over a stream) and outcome (C{issued}, C{pending},
        #: C{refused}): what C{/metrics} counts. A node that waits for an
        #: operator is answered C{pending} each time it asks.
        self.answers: dict[tuple[str, str], int] = {}
        #: HA: the join tokens in etcd (an
        #: L{llmgw.control.ha.sharedtokens.SharedTokens}, whose C{check} and
        #: C{spend} return Deferreds), in place of L{tokens}; None standalone.
        self.shared: Any = None
        #: HA: whether a node connected to another member (the leader)
        #: holds a name, awaited by a join (an
        #: L{llmgw.control.ha.fleetnames.FleetNames}'s C{holds}, which may
        #: raise L{RequestRefused}); None standalone, where L{connected} is the fleet.
        self.held_elsewhere: Callable[[str], Awaitable[bool]] | None = None
        self._ca: tuple[tuple[tuple[int, int, int], ...], CertificateAuthority] | None = None

    # -- tokens -------------------------------------------------------------

    def ca_hash(self) -> str:
        """The hash a token names the CA by: the active root's (first in the bundle)."""
        return spki_hash(self.roots()[0])

    # -- signing ------------------------------------------------------------

    def _sign(self, csr: x509.CertificateSigningRequest, node_id: str, how: str) -> pb.CertificateIssued:
        """
        The certificate for C{csr}. Its C{issued.jsonl} line goes into
        L{writes}' next commit (appended and fsynced there, off the reactor
        when a thread is given), which the caller waits for before the
        certificate leaves: L{recorded}.

        @raise CAError: the CA cannot be loaded.
        """
        ca = self._signer()
        trusted = {spki_hash(r) for r in self.roots()}
        if spki_hash(ca.certificate) not in trusted:
            # A node with a certificate of it could not connect again.
            raise CAError(
                f"the CA in {self.signer_dir} signs with a root this control plane does not trust yet "
                "(a rollover begun after it loaded its CA bundle): reload it (SIGHUP, or `llmgw ctl reload "
                "--tls`) before nodes can join or renew")
        now = datetime.datetime.fromtimestamp(self.clock.seconds(), datetime.UTC)
        cert = sign_request(csr, node_id, ca.key, ca.certificate, self.lifetime, now)
        self.writes.record(ca.issued_path, issued_line(cert, signed_file(how), "agent"))
        return self._certificate(cert, ca)

    def recorded(self) -> defer.Deferred[None]:
        """
        Fires once the C{issued.jsonl} lines of every certificate signed so
        far are on disk (or, where that failed, in the log: L{TokenWrites}),
        so that C{ctl cert revoke NODE} finds a certificate before its node
        holds it. Never fails: a failed write of the token book is the
        joins' to report, not a renewal's.
        """
        return self.writes.written().addErrback(lambda _: None)

    def _certificate(self, cert: x509.Certificate, ca: CertificateAuthority) -> pb.CertificateIssued:
        return pb.CertificateIssued(
            certificate_pem=cert_pem(cert), ca_bundle_pem=b"".join(cert_pem(r) for r in ca.roots))

    def _signer(self) -> CertificateAuthority:
        """
        The signer's CA, loaded again whenever its files changed: a CA
        rollover (`ctl cert rotate-ca`) makes the new root the one that
        signs from the next request on.

        @raise CAError: it cannot be loaded.
        """
        assert self.signer_dir is not None
        try:
            stamp = tuple((s.st_mtime_ns, s.st_size, s.st_ino) for s in
                          (os.stat(self.signer_dir / name) for name in CA_FILES))
        except OSError:
            stamp = None  # let load say what is missing
        if stamp is None or self._ca is None or stamp != self._ca[0]:
            ca = CertificateAuthority.load(self.signer_dir)
            self._ca = (stamp, ca) if stamp is not None else None
            return ca
        return self._ca[1]

    def _bundle(self) -> bytes:
        return b"".join(cert_pem(r) for r in self.roots())

    def _keep(self, pending: Pending) -> None:
        if len(self.pending) >= self.max_pending and pending.node_id not in self.pending:
            raise RequestRefused(
                f"{len(self.pending)} certificate requests already wait for an operator "
                "(`llmgw ctl csr list`); try again later")
        self.pending[pending.node_id] = pending
        self.log.warn(
            "certificate request ({kind}) for node {node} from {address} waits for approval: "
            "`llmgw ctl csr approve {node}` where the CA's key is", kind=pending.kind,
            node=pending.node_id, address=pending.address)

    # -- joins --------------------------------------------------------------

    def join(self, req: pb.JoinRequest, address: str) -> pb.JoinResponse:
        """
        The answer to one join request from C{address}: issued, pending, or
        refused with the reason (also logged with the address).
        """
        try:
            return self._join(req, address)
        except (TokenRefused, RequestRefused, CAError) as e:
            self.log.warn("join refused for node {node} from {address}: {error}",
                          node=req.node_id[:64], address=address, error=str(e))
            return pb.JoinResponse(status=Status.STATUS_REFUSED, error=str(e))

    def answer(self, req: pb.JoinRequest, address: str) -> defer.Deferred[pb.JoinResponse]:
        """
        L{join}, or with L{shared} tokens (in etcd) the same decisions with
        the token read and its use spent there: what the join listener
        sends back. A token store that cannot be reached refuses the join.
        """
        if self.shared is None:
            return defer.succeed(self.join(req, address))
        d = defer.ensureDeferred(self._join_shared(req, address))

        def refused(f: Failure) -> pb.JoinResponse:
            f.trap(TokenRefused, RequestRefused, CAError)
            self.log.warn("join refused for node {node} from {address}: {error}",
                          node=req.node_id[:64], address=address, error=f.getErrorMessage())
            return pb.JoinResponse(status=Status.STATUS_REFUSED, error=f.getErrorMessage())

        return d.addErrback(refused)

    def _asked_again(self, req: pb.JoinRequest, address: str) -> tuple[x509.CertificateSigningRequest, str] | pb.JoinResponse:
        """
        The request's CSR and key hash, or the answer when the same node
        asks again about a request kept for an operator.
        """
        node_id = req.node_id
        try:
            validate_node_id(node_id)
        except InvalidNodeId as e:
            raise RequestRefused(str(e)) from e
        csr = check_request(req.csr_pem, node_id)
        key_hash = public_key_hash(csr)
        waiting = self.pending.get(node_id)
        if waiting is not None and waiting.key_hash == key_hash and waiting.kind == "join":
            # The same node asking again after its request was kept.
            if waiting.denied:
                del self.pending[node_id]
                raise RequestRefused(f"an operator denied the request: {waiting.denied}")
            if waiting.issued is not None:
                del self.pending[node_id]
                self.log.info("node {node} at {address} collected its approved certificate",
                              node=node_id, address=address)
                return self._issued(waiting.issued)
            return pb.JoinResponse(status=Status.STATUS_PENDING, agent_port=self.agent_port)
        return csr, key_hash

    def _admissible(self, node_id: str) -> None:
        """
        @raise RequestRefused: a connected node holds C{node_id}, or another
            request for it waits.
        """
        if self.connected(node_id):
            raise RequestRefused(_held(node_id))
        if node_id in self.pending:
            raise RequestRefused(
                f"a request for node {node_id!r} with another key already waits for approval")
        if self.signer_dir is None and len(self.pending) >= self.max_pending:
            raise RequestRefused(
                f"{len(self.pending)} certificate requests already wait for an operator "
                "(`llmgw ctl csr list`); try again later")

    def _join(self, req: pb.JoinRequest, address: str) -> pb.JoinResponse:
        asked = self._asked_again(req, address)
        if isinstance(asked, pb.JoinResponse):
            return asked
        csr, key_hash = asked
        node_id, now = req.node_id, self.clock.seconds()
        if not self.writes.busy:
            # (While our own write is under way the file is older than the book.)
            self.tokens.refresh()
        book = self.tokens.book
        book.check(req.token_id, req.token_secret, node_id, now)
        self._admissible(node_id)
        if self.signer_dir is None:
            self._keep(Pending(node_id, csr, key_hash, address, now, "join", req.token_id))
            book.use(req.token_id, node_id)
            self.writes.save()
            return pb.JoinResponse(status=Status.STATUS_PENDING, agent_port=self.agent_port)
        # Its record is in the commit that writes the token's use, which
        # the answer waits for.
        issued = self._sign(csr, node_id, "joined")
        book.use(req.token_id, node_id)
        self.writes.save()
        self.log.info("node {node} joined from {address} with token {token}",
                      node=node_id, address=address, token=req.token_id)
        return self._issued(issued)

    async def _join_shared(self, req: pb.JoinRequest, address: str) -> pb.JoinResponse:
        asked = self._asked_again(req, address)
        if isinstance(asked, pb.JoinResponse):
            return asked
        csr, key_hash = asked
        node_id, now = req.node_id, self.clock.seconds()
        # Checked before anything about the name is said: a stranger
        # without a valid token learns nothing of which nodes are connected.
        await self.shared.check(req.token_id, req.token_secret, node_id, now)
        self._admissible(node_id)
        if self.held_elsewhere is not None and await self.held_elsewhere(node_id):
            # Before the use is spent: a refused name costs the token nothing.
            raise RequestRefused(_held(node_id))
        if self.signer_dir is not None:
            # The CA is loaded before a use is spent, so that a signer that
            # cannot sign spends nothing.
            CertificateAuthority.load(self.signer_dir)
        await self.shared.spend(req.token_id, req.token_secret, node_id, now)
        # Checked again: another request for the name may have come meanwhile.
        self._admissible(node_id)
        if self.signer_dir is None:
            self._keep(Pending(node_id, csr, key_hash, address, now, "join", req.token_id))
            return pb.JoinResponse(status=Status.STATUS_PENDING, agent_port=self.agent_port)
        issued = self._sign(csr, node_id, "joined")
        await self.recorded()
        self.log.info("node {node} joined from {address} with token {token} (kept in etcd)",
                      node=node_id, address=address, token=req.token_id)
        return self._issued(issued)

    def count(self, kind: str, outcome: str) -> None:
        """One more answer of C{kind} with C{outcome} (L{answers})."""
        self.answers[kind, outcome] = self.answers.get((kind, outcome), 0) + 1

    def _issued(self, issued: pb.CertificateIssued) -> pb.JoinResponse:
        return pb.JoinResponse(status=Status.STATUS_ISSUED, issued=issued, agent_port=self.agent_port)

    # -- renewals -----------------------------------------------------------

    def renew(self, node_id: str, serial: int | None, csr_pem: bytes, address: str) -> pb.CertificateIssued | None:
        """
        A renewal for the node a stream's certificate proved: the new
        certificate, or C{None} while it waits for an operator.

        @raise RequestRefused: the node's certificate is revoked, or the
            request is not for it.
        @raise CAError: the signer's CA cannot be loaded.
        """
        if serial is not None and serial in self.revoked():
            raise RequestRefused(f"node {node_id}'s certificate is revoked: it cannot renew")
        csr = check_request(csr_pem, node_id)
        if self.signer_dir is not None:
            issued = self._sign(csr, node_id, "renewed")
            # Started now; the stream's answer waits for it (L{recorded}).
            self.recorded()
            self.log.info("renewed the certificate of node {node} ({address})", node=node_id, address=address)
            self._renewed(node_id, issued)
            return issued
        self._keep(Pending(node_id, csr, public_key_hash(csr), address, self.clock.seconds(), "renewal"))
        return None

    # -- an operator's decisions -----------------------------------------------

    def listing(self) -> list[dict[str, Any]]:
        """Every request kept for an operator, oldest first (L{Pending.describe})."""
        now = self.clock.seconds()
        return [p.describe(now) for p in sorted(self.pending.values(), key=lambda p: p.since)]

    def approve(self, node_id: str, certificate_pem: bytes, who: str) -> None:
        """
        Take an operator's certificate for C{node_id}'s request: checked
        against the request and the roots, never trusted as sent.

        @raise KeyError: no request for C{node_id} waits.
        @raise RequestRefused: the certificate is not what was asked for.
        """
        p = self.pending[node_id]
        roots = self.roots()
        check_issued(certificate_pem, p.csr, node_id, roots)
        issued = pb.CertificateIssued(certificate_pem=certificate_pem, ca_bundle_pem=self._bundle())
        self.log.info("certificate request ({kind}) of node {node} approved by {who}",
                      kind=p.kind, node=node_id, who=who)
        if p.kind == "join":
            p.issued = issued
            return
        del self.pending[node_id]
        self._renewed(node_id, issued)
        if self.deliver is not None:
            self.deliver(node_id, issued)
            self.count("renewal", "issued")

    def _renewed(self, node_id: str, issued: pb.CertificateIssued) -> None:
        if self.on_renewed is not None:
            self.on_renewed(node_id, x509.load_pem_x509_certificate(issued.certificate_pem))

    def deny(self, node_id: str, who: str, reason: str = "") -> None:
        """
        @raise KeyError: no request for C{node_id} waits.
        """
        p = self.pending[node_id]
        self.log.warn("certificate request ({kind}) of node {node} denied by {who}",
                      kind=p.kind, node=node_id, who=who)
        if p.kind == "join":
            p.denied = reason or f"denied by {who}"
        else:
            del self.pending[node_id]


class JoinProtocol(MessageStream[pb.JoinRequest]):
    """One join connection: one request, one answer, closed."""

    incoming = pb.JoinRequest
    log = Logger()
    MAX_LENGTH = MAX_JOIN_FRAME

    def __init__(self, factory: JoinFactory):
        self.factory = factory
        self._timer: IDelayedCall | None = None
        self._answered = False
        self._lost = False

    def connectionMade(self) -> None:
        verdict = self.factory.opened(self)
        if verdict == REFUSE:
            self.log.warn("join connection from {peer} closed: {count} are served and {waiting} wait already",
                          peer=self.peer_name(), count=self.factory.max_connections,
                          waiting=self.factory.max_waiting)
            self.transport.abortConnection()
        elif verdict == WAIT:
            # Nothing is read (so no handshake is done) until a place is free.
            self.transport.pauseProducing()
        else:
            self.serve()

    def serve(self, waited: bool = False) -> None:
        """
        Start on this connection: read it (again, if it C{waited}), under
        the deadline.
        """
        if waited:
            self.transport.resumeProducing()
        self._timer = self.factory.clock.callLater(self.factory.deadline, self._expired)

    def peer_name(self) -> str:
        """C{HOST:PORT} of the node at the other end, for log lines and the pending list."""
        peer = self.transport.getPeer() if self.transport else None
        host, port = getattr(peer, "host", None), getattr(peer, "port", None)
        return format_address(host, port) if isinstance(host, str) and isinstance(port, int) else "?"

    def _expired(self) -> None:
        self._timer = None
        self.log.warn("join connection from {peer} closed: no request within {seconds}s",
                      peer=self.peer_name(), seconds=self.factory.deadline)
        self.transport.abortConnection()

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:  # noqa: B008
        self._lost = True
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        self.factory.closed(self)

    def message_received(self, msg: pb.JoinRequest) -> None:
        if self._answered:
            return
        self._answered = True
        authority = self.factory.authority
        if not authority.queue.submit(lambda: self._decide(msg)):
            self._answer(pb.JoinResponse(status=Status.STATUS_REFUSED, error=(
                f"{len(authority.queue)} certificate requests wait already; ask again later")))

    def _decide(self, msg: pb.JoinRequest) -> None:
        if self not in self.factory.serving:
            return  # closed while it waited its turn
        authority, peer = self.factory.authority, self.peer_name()
        if authority.shared is not None:
            # HA: the token is etcd's, and its use is spent there before
            # the answer (no file to wait for).
            authority.answer(msg, peer).addCallback(self._answer).addErrback(
                lambda f: self.log.failure("answering the join request from {peer} failed", f, peer=peer))
            return
        answer = authority.join(msg, peer)
        if answer.status == Status.STATUS_REFUSED:
            self._answer(answer)
            return

        def unrecorded(f: Failure) -> pb.JoinResponse:
            self.log.error("join of node {node} from {address} refused: its token's use could not be "
                           "recorded in {path}: {error}", node=msg.node_id, address=peer,
                           path=str(authority.tokens.path), error=f.getErrorMessage())
            return pb.JoinResponse(status=Status.STATUS_REFUSED,
                                   error="the control plane could not record the token's use; try again later")

        # Told it joined only once its token's use is on disk.
        authority.writes.written().addCallbacks(lambda _: answer, unrecorded).addCallback(self._answer)

    def _answer(self, answer: pb.JoinResponse) -> None:
        if self not in self.factory.serving or self.transport.disconnecting:
            return  # closed (or timed out) while its write was under way
        self.factory.authority.count("join", _OUTCOMES.get(answer.status, "refused"))
        self.send_message(answer)
        self.transport.loseConnection()

    def frame_refused(self, reason: str) -> None:
        self.log.warn("join connection from {peer} closed: {reason}", peer=self.peer_name(), reason=reason)
        self.transport.abortConnection()


#: A join answer's status, as L{JoinAuthority.answers} counts it.
_OUTCOMES = {Status.STATUS_ISSUED: "issued", Status.STATUS_PENDING: "pending"}

#: What L{JoinFactory.opened} says of a new connection.
SERVE, WAIT, REFUSE = "serve", "wait", "refuse"


class JoinFactory(ServerFactory):
    """
    The join listener's protocols, bounded in number: C{max_connections}
    served at once; past that, new ones wait unread, oldest first, for a
    served one to close (a burst of nodes joining at once is served in turn,
    not turned away to ask again later); past C{max_waiting} waiting, a new
    one is closed at accept.
    """

    noisy = False

    def __init__(self, authority: JoinAuthority, clock: IReactorTime, deadline: float = JOIN_DEADLINE,
                 max_connections: int = MAX_JOIN_CONNECTIONS, max_waiting: int = MAX_JOIN_WAITING):
        self.authority = authority
        self.clock = clock
        self.deadline = deadline
        self.max_connections = max_connections
        self.max_waiting = max_waiting
        #: The connections being served (not those that wait).
        self.serving: set[JoinProtocol] = set()
        # Insertion-ordered: the oldest waits first.
        self._waiting: dict[JoinProtocol, None] = {}
        #: Connections that waited for a place, since start.
        self.waited = 0

    def buildProtocol(self, addr: Any) -> JoinProtocol:
        return JoinProtocol(self)

    def opened(self, proto: JoinProtocol) -> str:
        """L{SERVE} C{proto} now, let it L{WAIT} (paused), or L{REFUSE} it."""
        if len(self.serving) < self.max_connections and not self._waiting:
            self.serving.add(proto)
            return SERVE
        if len(self._waiting) < self.max_waiting:
            self._waiting[proto] = None
            self.waited += 1
            return WAIT
        return REFUSE

    def closed(self, proto: JoinProtocol) -> None:
        self._waiting.pop(proto, None)
        self.serving.discard(proto)
        while self._waiting and len(self.serving) < self.max_connections:
            nxt = next(iter(self._waiting))
            del self._waiting[nxt]
            self.serving.add(nxt)
            nxt.serve(waited=True)



def certificate_requested(proto: Any, req: pb.CertificateRequest) -> None:
    """
    A registered stream's C{CertificateRequest}: answered with a
    C{CertificateIssued}, or an C{Ack} (message id C{certificate}) that says
    it waits for an operator or why it is refused. The stream is not
    disturbed either way. It is handled in turn (L{JoinAuthority.queue}):
    at once, or in a later reactor turn if a burst came before it; not at
    all if the stream is no longer its node's by then (the node asks again).
    """
    from llmgw.wire import ack

    authority: JoinAuthority | None = getattr(proto.factory, "joining", None)
    if authority is None:
        proto.send_message(ack("certificate", ok=False, code=pb.Ack.CODE_FAILED_PRECONDITION,
                               error="this control plane issues no certificates"))
        return

    def handle() -> None:
        if proto.factory.stream(proto.node_id) is not proto:
            return
        try:
            issued = authority.renew(proto.node_id, proto.certificate_serial, req.csr_pem, proto.peer_name())
        except (RequestRefused, CAError) as e:
            proto.log.warn("certificate renewal of node {node} ({peer}) refused: {error}",
                           node=proto.node_id, peer=proto.peer_name(), error=str(e))
            authority.count("renewal", "refused")
            proto.send_message(ack("certificate", ok=False, code=pb.Ack.CODE_PERMISSION_DENIED, error=str(e)))
            return
        if issued is None:
            authority.count("renewal", "pending")
            proto.send_message(ack("certificate", ok=True, error="waiting for an operator's approval"))
            return

        def send(_: None) -> None:
            # A stream gone meanwhile: its node asks again on its next one.
            if proto.factory.stream(proto.node_id) is proto:
                authority.count("renewal", "issued")
                proto.send_command(pb.ControlMessage(certificate_issued=issued), force=True)

        authority.recorded().addCallback(send)

    if not authority.queue.submit(handle):
        proto.log.warn("certificate renewal of node {node} ({peer}) turned away: {count} requests wait already",
                       node=proto.node_id, peer=proto.peer_name(), count=len(authority.queue))
        authority.count("renewal", "refused")
        proto.send_message(ack("certificate", ok=False, code=pb.Ack.CODE_RESOURCE_EXHAUSTED,
                               error=f"{len(authority.queue)} certificate requests wait already; ask again later"))
