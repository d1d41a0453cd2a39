"""
The join listener's TLS and its place in the control plane: the options
(C{--join-listen}, C{--signer}, C{--cert-lifetime}), the server side of the
handshake (the control plane's certificate, with its CA roots sent along so
a node can check them against its token's hash, and no client certificate
asked for), and L{attach_joining}, which adds it all to a control plane.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.serialization import Encoding
from OpenSSL import SSL
from twisted.internet import ssl
from twisted.internet.interfaces import IOpenSSLServerConnectionCreator
from twisted.internet.threads import deferToThreadPool
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python import usage
from zope.interface import implementer

from llmgw.addresses import AddressError, ListenerService, parse_address, server_endpoint
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.core.jointokens import TokenFile
from llmgw.control.shell.joining import JoinAuthority, JoinFactory
from llmgw.control.state.events import log_event
from llmgw.control.state.interfaces import NotConnected, NotKeepingUp
from llmgw.oslimits import FdNeed
from llmgw.tlsconf.ca import CertificateAuthority
from llmgw.tlsconf.options import SERVER_GROUPS, ServerTLS, TLSFiles, set_groups
from llmgw.tlsconf.pem import CAError

#: The join listener's default port: the agent port's default plus one.
DEFAULT_JOIN_PORT = 7444

#: Rows for the control plane's C{optParameters}.
JOIN_OPTIONS: list[list[Any]] = [
    ["join-listen", None, "off", "[HOST:]PORT nodes join at with a token (`llmgw ctl token "
     f"create`), or 'off'; {DEFAULT_JOIN_PORT} is usual"],
    ["cert-lifetime", None, "30d", "lifetime of the node certificates this control plane signs "
     "with --signer (e.g. 30d, 12h, 1m)"],
]
JOIN_FLAGS: list[list[Any]] = [
    ["signer", None, "sign nodes' certificate requests (joins, renewals) with the CA key in --certs; "
     "without it they wait for `llmgw ctl csr approve`"],
]


def parse_lifetime(text: str) -> datetime.timedelta:
    """
    C{30d}, C{12h}, C{90m}, C{60s} or plain seconds; at least a minute.

    @raise usage.UsageError: it is none of these.
    """
    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    t = text.strip().lower()
    try:
        seconds = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        raise usage.UsageError(f"--cert-lifetime {text!r}: give a duration such as 30d, 12h or 1m") from None
    if not 60 <= seconds <= 3650 * 86400:
        raise usage.UsageError(f"--cert-lifetime {text!r}: between one minute and ten years")
    return datetime.timedelta(seconds=seconds)


def join_post_options(options: Any) -> None:
    """Check the join options; sets C{join_address}, C{cert_lifetime}, C{signer_dir}."""
    options["cert_lifetime"] = parse_lifetime(options["cert-lifetime"])
    spec = options["join-listen"].strip()
    options["join_address"] = None
    if spec != "off":
        try:
            options["join_address"] = parse_address(spec, "0.0.0.0")
        except AddressError as e:
            raise usage.UsageError(f"--join-listen: {e}") from e
    options["signer_dir"] = None
    if options["signer"]:
        if options["insecure"]:
            raise usage.UsageError("--signer issues certificates: it needs TLS, not --insecure")
        try:
            CertificateAuthority.load(options["certs"])
        except CAError as e:
            raise usage.UsageError(f"--signer: {e}") from e
        options["signer_dir"] = Path(options["certs"])
    if options["join_address"] is not None and options["insecure"]:
        raise usage.UsageError("--join-listen issues certificates: it needs TLS, not --insecure")


@implementer(IOpenSSLServerConnectionCreator)
class JoinServerTLS:
    """
    The join listener's side of the handshake: the agent port's certificate
    (followed after a reload), the CA roots sent after it, no client
    certificate asked for; TLS 1.2 at least and the agent port's
    key-exchange groups. One context, made again only after a reload.
    """

    def __init__(self, tls: ServerTLS):
        self.tls = tls
        self._files: TLSFiles | None = None
        self._context: SSL.Context | None = None

    def _make(self, files: TLSFiles) -> SSL.Context:
        priv = files.twisted_private()
        extra = [ssl.Certificate.loadPEM(r.public_bytes(Encoding.PEM)).original for r in (files.roots or (files.ca,))]
        context = ssl.CertificateOptions(
            privateKey=priv.privateKey.original, certificate=priv.original, extraCertChain=extra,
            raiseMinimumTo=ssl.TLSVersion.TLSv1_2,
        ).getContext()
        set_groups(context, SERVER_GROUPS)
        return context

    def serverConnectionForTLS(self, tlsProtocol: Any) -> SSL.Connection:
        files = self.tls.files
        if files is not self._files or self._context is None:
            self._context, self._files = self._make(files), files
        return SSL.Connection(self._context, None)



def revoked_serials(files: TLSFiles) -> frozenset[int]:
    """The serials C{files}' CRLs list."""
    crls = files.crls or ((files.crl,) if files.crl is not None else ())
    return frozenset(e.serial_number for c in crls for e in c)


def _deliver(agents: Any) -> Any:
    def deliver(node_id: str, issued: pb.CertificateIssued) -> None:
        stream = agents.stream(node_id)
        if stream is None:
            raise NotConnected(f"node {node_id} is not connected: it will ask again")
        try:
            stream.send_command(pb.ControlMessage(certificate_issued=issued))
        except NotKeepingUp as e:
            raise NotConnected(str(e)) from e

    return deliver


def note_expiry(inventory: Any, node_id: str, cert: Any) -> None:
    """
    A node was issued C{cert}: its expiry (metrics, C{ctl nodes}) is the new
    one from now, before the node's next Register reports it.
    """
    node = inventory.get(node_id)
    if node is not None:
        node.certificate_not_after = cert.not_valid_after_utc.timestamp()
        inventory.upsert(node)


def attach_joining(cp: Any, options: Any, reactor: Any) -> JoinAuthority | None:
    """
    Give control plane C{cp} its join authority (C{cp.joining}; renewals
    over streams use it even without a join listener) and, with
    C{--join-listen}, the listener. Tokens are kept in C{CERTS/join-tokens.json}.
    """
    tls: ServerTLS | None = cp.tls
    if tls is None:
        return None
    tokens = TokenFile(Path(options["certs"]) / "join-tokens.json")
    tokens.load()
    address = options.get("join_address")
    authority = JoinAuthority(
        reactor, tokens, lambda: list(tls.files.roots or (tls.files.ca,)), cp.agents.is_connected,
        signer_dir=options.get("signer_dir"), lifetime=options.get("cert_lifetime", datetime.timedelta(days=30)),
        revoked=lambda: revoked_serials(tls.files), deliver=_deliver(cp.agents), agent_port=cp.agents_address[1],
        on_renewed=lambda node_id, cert: note_expiry(cp.inventory, node_id, cert),
        # The token file's rewrite (two fsyncs) and the issued log's fsync
        # would hold the reactor at every join.
        in_thread=lambda f: deferToThreadPool(reactor, reactor.getThreadPool(), f),
    )
    cp.joining = authority
    cp.agents.joining = authority
    rec = getattr(cp, "reconciler", None)
    if cp.trust is not None and rec is not None:
        # Nodes close to their certificate's end appear in the fleet's events.
        def notify(kind: str, level: str = "info", **fields: Any) -> None:
            log_event(rec.log, level, rec.event_log.add(reactor.seconds(), kind, **fields))

        cp.trust.notify = notify
    if address is not None:
        joins = JoinFactory(authority, reactor)
        factory = TLSMemoryBIOFactory(JoinServerTLS(tls), False, joins, clock=reactor)
        # Served and waiting join connections each hold a descriptor.
        cp.join_fd_needs = [FdNeed(joins.max_connections + joins.max_waiting, "the join listener's connections",
                                   "--join-listen")]
        listener = ListenerService(server_endpoint(reactor, *address), factory, "the join listener",
                                   "--join-listen")
        listener.setName("join-listener")
        listener.setServiceParent(cp)
        cp.join_listener = listener
    return authority
