"""
The admin API's C{Site} and listener: requests whose bodies are bounded
(L{AdminRequest}), a channel that times each request's arrival and the TLS
handshake and logs refused handshakes, per-address connection caps, the rule
that keeps an unauthenticated API on loopback (L{admin_tls_problem}), and
L{admin_service}, which serves the tree (L{AdminResource}) while it runs.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry
from twisted.logger import Logger
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.web import server

from llmgw.addresses import ListenerService, is_loopback, server_endpoint
from llmgw.control.admin.api import AdminResource
from llmgw.control.admin.base import MAX_BODY, client_address
from llmgw.control.admin.login import Logins
from llmgw.control.admin.watch import WatchHub
from llmgw.control.core.users import USERS_FILE, UserFile
from llmgw.control.shell.limits import DEFAULT_MAX_PER_ADDRESS, ConnectionLimiter
from llmgw.control.shell.series import ControlSources, SeriesKeeper
from llmgw.control.state.interfaces import IFleetAdmin
from llmgw.hostcheck import HostCheck
from llmgw.httpdeadline import DeadlineSite, TLSDeadlineChannel
from llmgw.tlsconf.describe import subject_alt_names
from llmgw.tlsconf.handshake import HANDSHAKE_TIMEOUT
from llmgw.tlsconf.optional import OptionalClientTLS
from llmgw.tlsconf.options import ServerTLS

DEFAULT_ADMIN_HOST = "127.0.0.1"
DEFAULT_ADMIN_PORT = 7480
#: Past this many body bytes the connection is aborted instead of read to
#: the end for a polite 413.
ABORT_BODY = 16 * MAX_BODY
#: Idle HTTP connections are closed after this many seconds.
IDLE_TIMEOUT = 60


class AdminRequest(server.Request):
    """
    A request whose body is kept in memory up to L{MAX_BODY} bytes.

    A longer body is read and dropped (so the client still reads its 413);
    past L{ABORT_BODY} the connection is aborted.
    """

    log = Logger()
    max_body = MAX_BODY
    abort_body = ABORT_BODY
    body_too_large = False
    _body_seen = 0

    def gotLength(self, length: int | None) -> None:
        self._body_seen = 0
        self.content = io.BytesIO()
        if length is not None and length > self.max_body:
            self.body_too_large = True

    def handleContentChunk(self, data: bytes) -> None:
        self._body_seen += len(data)
        if self._body_seen > self.abort_body:
            if self._body_seen - len(data) <= self.abort_body:
                self.log.warn(
                    "admin API: aborting the connection of {client}: request body over {limit} bytes",
                    client=client_address(self),
                    limit=self.abort_body,
                )
                transport: Any = self.transport
                transport.abortConnection()
            return
        if self.body_too_large or self._body_seen > self.max_body:
            self.body_too_large = True
            return
        content: Any = self.content
        content.write(data)


class AdminChannel(TLSDeadlineChannel):
    """
    The admin API's connection: each request must arrive in time
    (L{DeadlineChannel}); over TLS, the handshake too, and a refused one
    (such as one with the control plane's own certificate) is logged with
    the peer's address (L{TLSDeadlineChannel}).
    """

    log = Logger()
    what = "admin API"


class AdminSite(DeadlineSite):
    """
    A C{Site} with bounded request bodies, requests that must arrive in
    time, and a short idle timeout; with C{handshake_timeout} set (seconds;
    served over TLS), a handshake deadline.
    """

    requestFactory = AdminRequest
    protocol = AdminChannel
    handshake_timeout: float | None = None


def admin_site(
    fleet: IFleetAdmin,
    registry: CollectorRegistry,
    agents: Any = None,
    reactor: Any = None,
    timeout: float = IDLE_TIMEOUT,
    control: Any = None,
    require_certificate: bool = False,
    revoked: Callable[[], frozenset[int]] | None = None,
    hosts: HostCheck | None = None,
    watch: WatchHub | None = None,
    logins: Logins | None = None,
    series: SeriesKeeper | None = None,
) -> AdminSite:
    """
    The admin API's C{Site}; with C{require_certificate}, every request
    needs an admin certificate (serve it over L{ServerTLS}), or with
    C{logins} a session (L{llmgw.control.admin.login}); C{hosts} as
    for L{AdminResource}. The watch stream is served from C{watch}, by
    default a L{WatchHub} on C{reactor} (none without a reactor), and the
    curves from C{series}, by default a L{SeriesKeeper} likewise;
    L{AdminListenerService} starts and stops both.
    """
    if watch is None and reactor is not None:
        watch = WatchHub(fleet, reactor)
    if series is None and reactor is not None:
        series = SeriesKeeper(reactor, ControlSources(
            fleet, getattr(agents, "inventory", None),
            lambda: getattr(getattr(control, "gateway", None), "gateway", None)))
    if watch is not None and revoked is not None:
        watch.revoked = revoked
    site = AdminSite(
        AdminResource(
            fleet, registry, agents, control=control, require_certificate=require_certificate,
            revoked=revoked, hosts=hosts, watch=watch, logins=logins, series=series,
        ),
        timeout=timeout,
        reactor=reactor,
    )
    site.watch = watch  # type: ignore[attr-defined]
    site.series = series  # type: ignore[attr-defined]
    return site


class AdminTLSRequired(ValueError):
    """
    The admin API would listen beyond loopback without mutual TLS.
    """


def admin_tls_problem(host: str, tls: bool) -> str | None:
    """
    Why the admin API may not listen on C{host} (with or without mutual
    TLS), in one line; C{None} when it may.
    """
    if tls or is_loopback(host):
        return None
    return (
        f"the admin API on {host} is beyond loopback and needs --admin-tls (mutual TLS with "
        "admin certificates, which needs the control plane's certificates in --certs); "
        "refusing to serve it unauthenticated"
    )


def _revoked_by(tls: ServerTLS) -> Callable[[], frozenset[int]]:
    """
    The serials revoked by C{tls}'s CRLs now, computed again only when a
    reload brought new files.
    """
    cache: list[Any] = [None, frozenset()]

    def revoked() -> frozenset[int]:
        files = tls.files
        if cache[0] is not files:
            crls = files.crls or ((files.crl,) if files.crl is not None else ())
            cache[0], cache[1] = files, frozenset(e.serial_number for c in crls for e in c)
        result: frozenset[int] = cache[1]
        return result

    return revoked


class AdminListenerService(ListenerService):
    """
    The admin API's listener; its watch hub (C{watch}) follows the fleet
    while it runs, and its clients are dropped when it stops; its curves'
    keeper (C{series}) samples while it runs.
    """

    watch: WatchHub | None = None
    series: SeriesKeeper | None = None

    def startService(self) -> None:
        if self.watch is not None:
            self.watch.start()
        try:
            super().startService()
        except BaseException:
            if self.watch is not None:
                self.watch.stop()
            raise
        if self.series is not None:
            self.series.startService()

    def stopService(self) -> Any:
        if self.watch is not None:
            self.watch.stop()
        if self.series is not None and self.series.running:
            self.series.stopService()
        return super().stopService()


def admin_service(
    reactor: Any,
    host: str,
    port: int,
    fleet: IFleetAdmin,
    registry: CollectorRegistry,
    agents: Any = None,
    control: Any = None,
    tls: ServerTLS | None = None,
    hosts: list[str] | None = None,
    max_per_address: int = DEFAULT_MAX_PER_ADDRESS,
    logins: bool = False,
    users: UserFile | None = None,
) -> ListenerService:
    """
    A service that serves the admin API on C{host}:C{port} while running.
    Its C{port} attribute is the listening port once started. It answers to
    the loopback names, C{host} unless it is a wildcard, and C{hosts}
    (entries as L{llmgw.hostcheck.parse_hosts} returns them).

    With C{tls} (the control plane's L{ServerTLS}, shared with the agent
    port so that one reload renews both), the API is HTTPS and every client
    needs an admin certificate from llmgw's CA, and the names in the server
    certificate are served besides C{hosts}; a connection whose handshake
    is not done within L{HANDSHAKE_TIMEOUT} seconds of accept is aborted.

    With C{tls} and C{logins}, a client certificate is asked for, not
    required: a browser without one may log in as one of C{users} (by
    default those in C{users.json} beside the CA's certificate) and is
    then judged by its session (L{Logins}); a certificate that is offered
    is checked as before, and a client that has one is judged by it alone.

    Over TLS or beyond loopback, a source address may hold
    C{max_per_address} connections at once (0: no cap); past it a new one
    is closed at accept, before any TLS handshake, and the refusal logged.
    A plain loopback listener has no cap: its clients are all this host's,
    and a connection there costs no handshake's memory.

    @raise AdminTLSRequired: C{host} is not loopback and C{tls} is C{None}.
    """
    problem = admin_tls_problem(host, tls is not None)
    if problem is not None:
        raise AdminTLSRequired(problem)
    people = None
    if tls is not None and logins:
        if users is None:
            users = UserFile(tls.files.ca_path.parent / USERS_FILE)
        users.load()
        people = Logins(users, reactor)
    site = admin_site(
        fleet, registry, agents, reactor, control=control, require_certificate=tls is not None,
        logins=people,
        revoked=_revoked_by(tls) if tls is not None else None,
        hosts=HostCheck([*(hosts or ()), *_certificate_hosts(tls)], bound=host, option="--admin-hosts"),
    )
    factory: Any = site
    if tls is not None:
        site.handshake_timeout = HANDSHAKE_TIMEOUT
        creator: Any = OptionalClientTLS(tls) if people is not None else tls
        factory = TLSMemoryBIOFactory(creator, False, site, clock=reactor)
    limiter = None
    if max_per_address and (tls is not None or not is_loopback(host)):
        # Below TLS: a connection over the cap costs no handshake. Over TLS
        # even on loopback, where each pending handshake holds its buffers.
        limiter = factory = ConnectionLimiter(
            factory, reactor, max_connections=0, max_per_address=max_per_address, max_registering=0,
            name="the admin API",
        )
    svc = AdminListenerService(server_endpoint(reactor, host, port), factory)
    svc.limiter = limiter  # type: ignore[attr-defined]
    svc.watch = site.watch  # type: ignore[attr-defined]
    svc.series = site.series  # type: ignore[attr-defined]
    svc.logins = people  # type: ignore[attr-defined]
    svc.setName("admin-listener")
    svc.tls = tls is not None  # type: ignore[attr-defined]
    return svc


def _certificate_hosts(tls: ServerTLS | None) -> list[str]:
    """
    Over mutual TLS, the names the server certificate carries: clients can
    only verify the API under one of them, so each is a name it serves.
    """
    if tls is None:
        return []
    names = []
    for san in subject_alt_names(tls.files.cert):
        kind, name = san.split(":", 1)
        if kind == "IP" and ":" in name:
            name = f"[{name}]"
        elif name.startswith("*."):
            name = name[1:]  # a wildcard name serves its subdomains
        names.append(name)
    return names
