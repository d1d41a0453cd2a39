"""
A node joining with a token (DESIGN §20): it makes its key itself (mode
0600, never sent), dials the control plane's join listener, checks the
certificate chain it is shown against the token's CA hash before it sends
anything, sends its certificate request, and writes the certificate and the
CA bundle it gets back, atomically. Then it runs as any agent does.

A node whose files are already there does not join again; one whose request
waits for an operator asks again every L{POLL_INTERVAL} seconds with the
same key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import NameOID
from OpenSSL import SSL
from twisted.application.service import MultiService
from twisted.internet.abstract import isIPAddress, isIPv6Address
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import (
    HostnameEndpoint,
    TCP4ClientEndpoint,
    TCP6ClientEndpoint,
    connectProtocol,
    wrapClientTLS,
)
from twisted.internet.interfaces import IHandshakeListener, IOpenSSLClientConnectionCreator
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from llmgw.addresses import format_address
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.tlsconf.certs import issued_by
from llmgw.tlsconf.csr import spki_hash
from llmgw.tlsconf.jointoken import ParsedToken
from llmgw.tlsconf.options import (
    AGENT_GROUPS,
    ServerIdentityError,
    TLSConfigError,
    TLSFiles,
    bare_context,
    set_groups,
    verify_server_identity,
)
from llmgw.tlsconf.pem import cert_pem, key_pem, load_key, write_private, write_public
from llmgw.wire import MessageStream

#: Seconds between two asks while a request waits for an operator, or the
#: control plane cannot be reached.
POLL_INTERVAL = 10.0


class JoinRefused(Exception):
    """The control plane (or the token's check of it) refused the join."""


class WrongControlPlane(JoinRefused):
    """The control plane's chain holds no root with the token's CA hash."""


def join_context() -> SSL.Context:
    """
    The client context of a join: TLS 1.2 at least, the agent port's
    key-exchange groups, no CA (the node has none yet: the chain is checked
    against the token's hash in L{JoinClientProtocol.handshakeCompleted},
    before anything is sent). Made once per L{Joiner}, when it is made.
    """
    context = SSL.Context(SSL.TLS_METHOD)
    context.set_min_proto_version(SSL.TLS1_2_VERSION)
    set_groups(context, AGENT_GROUPS)
    return context


@implementer(IOpenSSLClientConnectionCreator)
class _UnverifiedTLS:
    def __init__(self, host: str, context: SSL.Context):
        self.host = host.strip("[]")
        self.context = context

    def clientConnectionForTLS(self, tlsProtocol: Any) -> SSL.Connection:
        conn = SSL.Connection(self.context, None)
        conn.set_app_data(tlsProtocol)
        if not any(c in self.host for c in ":") and not self.host.replace(".", "").isdigit():
            conn.set_tlsext_host_name(self.host.encode("idna"))
        return conn


def check_chain(chain: list[x509.Certificate], host: str, ca_hash: str) -> x509.Certificate:
    """
    The root in C{chain} that the token names, if the leaf (first) was issued
    by it and names C{host}.

    @raise WrongControlPlane: no root in the chain has C{ca_hash}, or the
        leaf is not the control plane's for C{host}; naming both hashes.
    """
    if not chain:
        raise WrongControlPlane(f"the control plane at {host} showed no certificate")
    leaf, rest = chain[0], chain[1:]
    shown = [spki_hash(c) for c in rest]
    root = next((c for c, h in zip(rest, shown, strict=True) if h == ca_hash), None)
    if root is None:
        raise WrongControlPlane(
            f"the control plane at {host} is not the one this token names: the token's CA hash is "
            f"{ca_hash}, the CA hashes it showed are {', '.join(shown) or 'none'}; nothing was sent")
    if not issued_by(leaf, root):
        raise WrongControlPlane(f"the certificate of {host} was not issued by the CA {ca_hash}; nothing was sent")
    try:
        verify_server_identity(leaf, host.strip("[]"))
    except ServerIdentityError as e:
        raise WrongControlPlane(f"{e}; nothing was sent") from e
    return root


@implementer(IHandshakeListener)
class JoinClientProtocol(MessageStream[pb.JoinResponse]):
    """Checks the chain, sends one request, reads one answer."""

    incoming = pb.JoinResponse
    MAX_LENGTH = 256 * 1024

    def __init__(self, host: str, token: ParsedToken, request: pb.JoinRequest):
        self.host = host
        self.token = token
        self.request = request
        self.done: Deferred[pb.JoinResponse] = Deferred()

    def handshakeCompleted(self) -> None:
        chain = self.transport.getHandle().get_peer_cert_chain() or []
        try:
            check_chain([c.to_cryptography() for c in chain], self.host, self.token.ca_hash)
        except WrongControlPlane as e:
            self._finish(Failure(e))
            self.transport.abortConnection()
            return
        self.send_message(self.request)

    def message_received(self, msg: pb.JoinResponse) -> None:
        self._finish(msg)
        self.transport.loseConnection()

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:  # noqa: B008
        self._finish(Failure(ConnectionError(f"the join connection to {self.host} closed: "
                                             f"{reason.getErrorMessage()}")))

    def _finish(self, result: Any) -> None:
        if not self.done.called:
            self.done.callback(result) if not isinstance(result, Failure) else self.done.errback(result)


class Joiner:
    """
    Joins node C{node_id} at C{host}:C{port} with C{token}, keeping its files
    in C{directory}: C{ca.pem}, C{agent-NODE.pem} and C{agent-NODE.key}.

    C{also} names more join listeners of the same control plane (the
    members of an HA one): when one cannot be reached or closes without an
    answer, the next is asked at once, and only after a whole round fails
    does the node wait L{POLL_INTERVAL} seconds. Each one's chain is checked
    against the token before anything is sent to it; a refusal, or a chain
    the token does not name, ends the join as with one address.
    """

    log = Logger()

    def __init__(self, reactor: Any, host: str, port: int, token: ParsedToken, node_id: str,
                 directory: Path, poll_interval: float = POLL_INTERVAL,
                 also: Sequence[tuple[str, int]] = ()):
        self.reactor = reactor
        #: The listener asked last (after a join: the one that answered).
        self.host, self.port = host, port
        #: Every listener, in the order they are tried.
        self.addresses: list[tuple[str, int]] = [(host, port), *also]
        self.token = token
        self.node_id = node_id
        self.directory = directory
        self.poll_interval = poll_interval
        #: The agent port the control plane named in its answer (0: none).
        self.agent_port = 0
        self.context = join_context()
        #: The agent stream's context, made now without an identity (see
        #: L{llmgw.tlsconf.contexts}); after a join it presents the files
        #: issued (L{AgentClientTLS}'s C{context}). Not used for the join.
        self.agent_context = bare_context(AGENT_GROUPS)
        # The key made (or found) for the request, kept for the files it goes in.
        self._key: Any = None
        self._paths: tuple[Path, str, tuple[Path, Path, Path]] | None = None

    @property
    def paths(self) -> tuple[Path, Path, Path]:
        """C{ca.pem}, C{agent-NODE.pem} and C{agent-NODE.key} in L{directory}."""
        d, node = self.directory, self.node_id
        if self._paths is None or self._paths[0] is not d or self._paths[1] is not node:
            # Made once: a join asks for them several times.
            self._paths = (d, node, (d / "ca.pem", d / f"agent-{node}.pem", d / f"agent-{node}.key"))
        return self._paths[2]

    def existing(self) -> TLSFiles | None:
        """The files of an earlier join, if they are all there and load."""
        ca, cert, key = self.paths
        if not (ca.exists() and cert.exists() and key.exists()):
            return None
        try:
            return TLSFiles.load(ca, cert, key)
        except TLSConfigError as e:
            self.log.warn("the files of an earlier join do not load ({error}): joining again", error=str(e))
            return None

    def _request(self) -> pb.JoinRequest:
        _, _, key_path = self.paths
        self.directory.mkdir(parents=True, exist_ok=True)
        if self._key is not None and key_path.exists():
            key = self._key  # a request that waits is asked again with the same key
        elif key_path.exists():
            key = load_key(key_path)
        else:
            from cryptography.hazmat.primitives.asymmetric import ec

            key = ec.generate_private_key(ec.SECP256R1())
            write_private(key_path, key_pem(key))
        self._key = key
        csr = (x509.CertificateSigningRequestBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self.node_id)]))
               .sign(key, hashes.SHA256()))
        return pb.JoinRequest(token_id=self.token.id, token_secret=self.token.secret, node_id=self.node_id,
                              csr_pem=csr.public_bytes(serialization.Encoding.PEM))

    def ask_once(self) -> Deferred[pb.JoinResponse]:
        """One join request; fires with the answer, or fails (L{WrongControlPlane}, a connection error)."""
        proto = JoinClientProtocol(self.host, self.token, self._request())
        endpoint = wrapClientTLS(_UnverifiedTLS(self.host, self.context), self._tcp_endpoint())
        d = connectProtocol(endpoint, proto)
        d.addCallback(lambda _: proto.done)
        return d

    def _tcp_endpoint(self) -> Any:
        # An address needs no resolver (whose lookups run in the reactor's
        # thread pool); a name does.
        host = self.host.strip("[]")
        if isIPAddress(host):
            return TCP4ClientEndpoint(self.reactor, host, self.port, timeout=10)
        if isIPv6Address(host):
            return TCP6ClientEndpoint(self.reactor, host, self.port, timeout=10)
        return HostnameEndpoint(self.reactor, self.host, self.port, timeout=10)

    def write(self, issued: pb.CertificateIssued) -> TLSFiles:
        """
        Write what was issued (the certificate, the CA bundle) atomically;
        the files as L{TLSFiles.load} would load them, with its checks, from
        what was written rather than read back.

        @raise JoinRefused: it does not belong to the key, is not from the
            bundle's roots, or the bundle lacks the token's CA.
        """
        ca_path, cert_path, key_path = self.paths
        try:
            roots = x509.load_pem_x509_certificates(issued.ca_bundle_pem)
            cert = x509.load_pem_x509_certificate(issued.certificate_pem)
        except ValueError as e:
            raise JoinRefused(f"the issued certificate or CA bundle is not PEM: {e}") from e
        if not any(spki_hash(r) == self.token.ca_hash for r in roots):
            raise JoinRefused(f"the CA bundle sent lacks the token's CA {self.token.ca_hash}")
        key = self._key if self._key is not None else load_key(key_path)
        try:
            files = TLSFiles.of(roots, cert, key, ca_path, cert_path, key_path)
        except TLSConfigError as e:
            raise JoinRefused(f"the issued certificate does not load: {e}") from e
        write_public(ca_path, b"".join(cert_pem(r) for r in roots))
        write_public(cert_path, cert_pem(cert))
        return files

    async def run(self) -> TLSFiles:
        """
        Join (or find the files of an earlier join): fires with the files.

        @raise JoinRefused: refused by the control plane, or it is not the
            one the token names.
        """
        files = self.existing()
        if files is not None:
            self.log.info("node {node} has its certificate in {dir}: not joining again",
                          node=self.node_id, dir=str(self.directory))
            return files
        at, failed = 0, 0
        while True:
            self.host, self.port = self.addresses[at]
            try:
                answer = await self.ask_once()
            except JoinRefused:
                raise
            except Exception as e:  # a connection refused, reset, timed out
                failed += 1
                at = (at + 1) % len(self.addresses)
                if failed < len(self.addresses):
                    self.log.warn("cannot join at {host}:{port} ({error}); trying {next}",
                                  host=self.host, port=self.port, error=str(e),
                                  next=format_address(*self.addresses[at]))
                    continue
                failed = 0
                self.log.warn("cannot join at {host}:{port} ({error}); asking again in {s}s",
                              host=self.host, port=self.port, error=str(e), s=self.poll_interval)
                await deferLater(self.reactor, self.poll_interval)
                continue
            failed = 0
            self.agent_port = answer.agent_port
            if answer.status == pb.JoinResponse.STATUS_ISSUED:
                files = self.write(answer.issued)
                self.log.info("node {node} joined: certificate serial {serial} until {until}",
                              node=self.node_id, serial=format(files.cert.serial_number, "x"),
                              until=files.cert.not_valid_after_utc.isoformat())
                return files
            if answer.status == pb.JoinResponse.STATUS_PENDING:
                # A request kept for an operator is that listener's: it is asked again.
                self.log.warn("node {node}'s request waits for an operator at {host}:{port}: "
                              "`llmgw ctl csr approve {node}`", node=self.node_id, host=self.host, port=self.port)
                await deferLater(self.reactor, self.poll_interval)
                continue
            raise JoinRefused(f"the control plane at {self.host}:{self.port} refused the join: {answer.error}")


class JoiningAgent(MultiService):
    """
    Joins, then builds the agent with the files it got (C{build(files,
    agent_port)} returns the service) and runs it as its child. A refused
    join stops the process with the reason logged (C{stop} is expected to
    end it with a non-zero status).
    """

    log = Logger()

    def __init__(self, joiner: Joiner, build: Callable[[TLSFiles, int], Any], stop: Callable[[], None]):
        super().__init__()
        self.joiner = joiner
        self.build = build
        self.stop = stop
        self.agent: Any = None

    def startService(self) -> None:
        super().startService()
        d = Deferred.fromCoroutine(self.joiner.run())
        d.addCallbacks(self._joined, self._refused)

    def _joined(self, files: TLSFiles) -> None:
        if not self.running:
            return
        self.agent = self.build(files, self.joiner.agent_port)
        self.agent.setServiceParent(self)

    def _refused(self, f: Failure) -> None:
        if f.check(JoinRefused):
            # A refusal is an answer, not a bug: its reason is the whole story.
            self.log.error("node {node} could not join: {reason}; stopping",
                           node=self.joiner.node_id, reason=f.getErrorMessage())
        else:
            self.log.failure("node {node} could not join", f, node=self.joiner.node_id)
        self.stop()
