"""
The admin API (DESIGN §9): JSON over HTTP, and C{/metrics} for Prometheus.

L{AdminResource} is the whole resource tree; L{admin_site} wraps it in a
C{Site} whose requests keep their bodies bounded; L{admin_service} listens
with it. Everything it shows or does goes through an L{IFleetAdmin} (the
reconciler), so it is tested against a fake one.

Every answer is JSON. A refused request gets
C{{"error": REASON, "status": CODE}} with the matching HTTP status: 400 for
a malformed request, 404 for an unknown path, node or deployment, 405 for a
method the path does not take, 409 for a conflict, 413 for a body over the
limit, 415 for a C{POST} that is not C{application/json}. A failure inside
the control plane is a 500 whose body says only that; the traceback goes to
the log with the requester's address. A request whose C{Host} is not a
name the API serves (L{llmgw.hostcheck}: loopback names, the bound address,
C{--admin-hosts}) is refused with 421 before anything else, so that a page
whose name rebinds to this address reads and changes nothing. A JSON body
nested more than L{llmgw.untrusted.MAX_JSON_DEPTH} deep, or naming a key
twice, is a 400; client strings in errors and logs are clipped.

With mutual TLS (L{admin_service} given the control plane's L{ServerTLS}),
every request must come with an admin certificate from llmgw's CA, whose
role (L{role_allows}) decides what it may do: C{viewer} reads,
C{operator} also changes state, C{gateway} reads only what a standalone
gateway follows. Anything else (a node's or the server's certificate, a
role that may not do this) is a 403 that says why, logged with the
certificate's name. Every state change is logged with who asked: the
admin's name and role, or only the address on a loopback API without TLS.

C{POST} requests must be C{Content-Type: application/json}, even when they
carry no body: a web page in the operator's browser cannot send that
content type to another origin without a CORS preflight, which this API
never grants, so it cannot cordon or drain nodes behind the operator's back.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from OpenSSL import SSL
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from twisted.internet.defer import CancelledError, Deferred, maybeDeferred
from twisted.logger import Logger
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.failure import Failure
from twisted.web import server
from twisted.web.http import HTTPChannel, _GenericHTTPChannelProtocol
from twisted.web.resource import Resource

from llmgw.addresses import ListenerService, format_address, is_loopback, server_endpoint
from llmgw.control.admin.watch import (
    ResumeError,
    SocketRequest,
    WatchFactory,
    WatchHub,
    parse_resume,
    upgrade,
)
from llmgw.control.state.demand import DemandReportError, parse_report
from llmgw.control.state.interfaces import AdminError, IFleetAdmin
from llmgw.hostcheck import HostCheck
from llmgw.routing import LONG_POLL_MAX_S, RoutesDataError, RoutingTable, snapshot_to_json
from llmgw.tlsconf.ca import subject_alt_names
from llmgw.tlsconf.options import AdminIdentity, IdentityError, ServerTLS, peer_admin
from llmgw.untrusted import CLIP, JSONInputError, clip, load_json
from llmgw.wire import InvalidNodeId, validate_node_id

DEFAULT_ADMIN_HOST = "127.0.0.1"
DEFAULT_ADMIN_PORT = 7480
#: Largest request body accepted, in bytes.
MAX_BODY = 64 * 1024
#: Past this many body bytes the connection is aborted instead of read to
#: the end for a polite 413.
ABORT_BODY = 16 * MAX_BODY
#: Idle HTTP connections are closed after this many seconds.
IDLE_TIMEOUT = 60

JSON_TYPE = b"application/json; charset=utf-8"
NODE_ACTIONS = ("cordon", "uncordon", "drain")

#: What C{GET /} lists.
ENDPOINTS = [
    "GET /api/v1/status",
    "GET /api/v1/whoami",
    "GET / (Accept: text/html): the fleet page",
    "GET /api/v1/nodes",
    "GET /api/v1/deployments",
    "GET /api/v1/replicas",
    "GET /api/v1/events?since=SECONDS",
    "GET /api/v1/routes?since=REVISION",
    "GET /api/v1/watch?since=REVISION&epoch=EPOCH&only=routes (WebSocket)",
    "GET /api/v1/usage",
    "POST /api/v1/nodes/{id}/cordon",
    "POST /api/v1/nodes/{id}/uncordon",
    "POST /api/v1/nodes/{id}/drain",
    'POST /api/v1/deployments/{model}/scale {"replicas": N} or {"min": N, "max": M} (autoscaled)',
    'POST /api/v1/demand {"gateway_id": ID, "models": {MODEL: {"in_flight": N, "waiting": N}}}',
    "POST /api/v1/deployments/{model}/retry",
    "POST /api/v1/catalog/reload",
    "POST /api/v1/tls/reload",
    "GET /metrics",
]


#: The fleet page's files and their types.
PAGE_FILES = {
    "index.html": b"text/html; charset=utf-8",
    "page.js": b"text/javascript; charset=utf-8",
    "page.css": b"text/css; charset=utf-8",
}
#: The page loads only its own files and talks only to this API.
PAGE_CSP = (b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
            b"img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_page_cache: dict[str, tuple[bytes, bytes]] = {}


def page_file(name: str) -> tuple[bytes, bytes] | None:
    """
    The bytes and content type of the page file C{name}, read from the
    package once; C{None} for a name that is not one.
    """
    if name not in PAGE_FILES:
        return None
    if name not in _page_cache:
        from importlib.resources import files

        body = files("llmgw.control.admin").joinpath("page", name).read_bytes()
        _page_cache[name] = (body, PAGE_FILES[name])
    return _page_cache[name]


#: What the C{gateway} role may read: the routing data a standalone gateway
#: follows, and nothing about nodes or events.
GATEWAY_READS = (("api", "v1", "routes"), ("api", "v1", "watch"))
#: What the C{gateway} role may post: its demand, for the autoscaler.
GATEWAY_POSTS = (("api", "v1", "demand"),)


def role_allows(role: str, method: str, path: list[str]) -> bool:
    """
    Whether an admin with C{role} may C{method} (C{GET} for C{HEAD}) the
    path C{path} (its segments): C{viewer} any C{GET}; C{operator} any
    C{GET} or C{POST} (cordon, uncordon, drain, scale, retry, catalog and
    TLS reload); C{gateway} a C{GET} of L{GATEWAY_READS} and a C{POST} of
    L{GATEWAY_POSTS} only.
    """
    if role == "operator":
        return True
    if role == "gateway" and method == "POST":
        return tuple(path) in GATEWAY_POSTS
    if method != "GET":
        return False
    if role == "viewer":
        return True
    if role == "gateway":
        return tuple(path) in GATEWAY_READS
    return False


#: hadmin (issue 14 item 5): what every member of an HA control plane
#: answers itself, leading or not: its own status, who it takes the client
#: for, its metrics, its embedded gateway's usage, its own TLS reload, and
#: the fleet page's files (whose API calls are sent on like any other).
LOCAL_PATHS = frozenset({
    (), ("metrics",), ("api", "v1", "status"), ("api", "v1", "whoami"), ("api", "v1", "usage"),
    ("api", "v1", "tls", "reload"),
})


#: ha3: what a member that does not lead answers from the routing table the
#: leader published in etcd (L{llmgw.control.ha.published}), once it holds one;
#: the watch stream too, when it follows the routes alone (C{?only=routes}
#: or the C{gateway} role).
FOLLOWED_PATHS = frozenset({("api", "v1", "routes")})
#: ha4: what such a member answers from the fleet views the leader
#: published (L{llmgw.control.ha.published.FleetFollower}), once it holds them.
FLEET_FOLLOWED_PATHS = frozenset({("api", "v1", "nodes"), ("api", "v1", "replicas"), ("api", "v1", "events")})
#: The header with which such a member names the leader's admin URL.
LEADER_HEADER = b"x-llmgw-leader"


def local_path(path: list[str]) -> bool:
    """
    Whether a member answers C{path} itself rather than sending the client
    to the leader (L{LOCAL_PATHS}, and C{/page/...}).
    """
    return tuple(path) in LOCAL_PATHS or path[:1] == ["page"]


def leader_location(status: dict[str, Any], uri: bytes) -> tuple[str | None, dict[str, Any]] | None:
    """
    Where a request for C{uri} (the request target, whose path and query
    are kept) goes, given an HA member's C{status} (L{HAMember.status}):
    C{None} when this member leads (it answers itself); else the leader's
    admin URL with that path and query, or C{None} in its place when no
    other member is known to lead with an admin URL; and the status.
    """
    from urllib.parse import urlsplit

    if status.get("role") == "leader":
        return None
    base = status.get("leader_admin_url") or ""
    leader = status.get("leader_id")
    if not leader or leader == status.get("member_id") or not isinstance(base, str) or not base:
        return None, status
    parts = urlsplit(uri.decode("latin-1"))
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    # Bytes past ASCII, as the client sent them, percent-encoded.
    target = quote(target.encode("latin-1"), safe="/?&=%:@!$'()*+,;~-._")
    return base.rstrip("/") + target, status


class Refused(Exception):
    """
    A request the API refuses before asking the fleet; C{status} is the
    HTTP status it is answered with.
    """

    def __init__(self, status: int, reason: str, allow: tuple[str, ...] = (),
                 headers: dict[bytes, bytes] | None = None, extra: dict[str, Any] | None = None):
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.allow = allow
        #: More response headers (C{Location}, C{Retry-After}).
        self.headers = headers or {}
        #: More fields of the JSON body.
        self.extra = extra or {}


def client_address(request: Any) -> str:
    """
    The requester's address as C{host:port}, for log lines.
    """
    addr = request.getClientAddress()
    host = getattr(addr, "host", None)
    if host is None:
        return str(addr)
    return format_address(host, addr.port)


def _printable(raw: bytes) -> str:
    """
    C{raw} (a method or URI a client sent) safe for a log line: control
    characters escaped, and past 4 * L{CLIP} bytes cut, with its length.
    """
    limit = 4 * CLIP
    text = raw[:limit].decode("latin-1")
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(raw) <= limit else f"{text}\u2026 ({len(raw)} bytes)"


def _bounded(reason: str) -> str:
    """
    A refusal's reason, cut past 16 * L{CLIP} characters: the fleet's own
    messages may quote what a client sent in full.
    """
    limit = 16 * CLIP
    return reason if len(reason) <= limit else f"{reason[:limit]}\u2026 ({len(reason)} characters)"


def _same_origin(origin: bytes, host: bytes) -> bool:
    """
    Whether a browser's C{Origin} names the host and port the request was
    sent to (its C{Host}).
    """
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(origin.decode("ascii"))
        netloc = parts.netloc.lower()
    except (UnicodeDecodeError, ValueError):
        return False
    if parts.scheme not in ("http", "https") or not netloc:
        return False
    default = ":443" if parts.scheme == "https" else ":80"
    want = host.decode("latin-1").lower()
    return netloc == want or netloc + default == want or netloc == want + default


def _certificate_name(cert: Any) -> str | None:
    """
    A peer certificate's common name, printable, for log lines.
    """
    if cert is None:
        return None
    try:
        cn = cert.get_subject().CN
    except Exception:
        return None
    return _printable(cn.encode("utf-8", "replace")) if cn else None


def _json_default(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def encode_json(value: Any) -> bytes:
    """
    C{value} as JSON bytes with a final newline.

    @raise ValueError: a float is not finite (NaN would not be valid JSON).
    @raise TypeError: something in C{value} has no JSON form.
    """
    return (json.dumps(value, allow_nan=False, default=_json_default) + "\n").encode("utf-8")


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


def nodes_view(fleet: Any, agents: Any) -> dict[str, Any]:
    """
    C{GET /api/v1/nodes}: the fleet's nodes view, each node with the
    C{stray_processes} its agent listed in its latest Register (from the
    inventory, where the fleet's view does not carry them).
    """
    nodes = fleet.nodes()
    inventory = getattr(agents, "inventory", None)
    out = []
    for view in nodes:
        if "stray_processes" not in view:
            strays = inventory.strays(view.get("id", "")) if inventory is not None else []
            view = {**view, "stray_processes": [s.as_dict() for s in strays]}
        out.append(view)
    return {"nodes": out}


def fleet_status(fleet: Any, agents: Any) -> dict[str, Any]:
    """C{GET /api/v1/status}'s fleet parts (without the HA member's own)."""
    status = dict(fleet.status())
    if agents is not None and "agents_connected" not in status:
        status["agents_connected"] = len(agents.connected_nodes())
    return status


class AdminResource(Resource):
    """
    The admin API's whole tree. Read-only views come from
    L{IFleetAdmin}; actions call it and answer with what it says.

    @param fleet: the reconciler, or anything providing L{IFleetAdmin}.
    @param registry: what C{/metrics} serves.
    @param agents: the agent service; if given, C{/api/v1/status} adds the
        count of connected agents when the fleet's status has none.
    """

    isLeaf = True
    log = Logger()

    def __init__(
        self,
        fleet: IFleetAdmin,
        registry: CollectorRegistry,
        agents: Any = None,
        max_body: int = MAX_BODY,
        control: Any = None,
        require_certificate: bool = False,
        hosts: HostCheck | None = None,
        revoked: Callable[[], frozenset[int]] | None = None,
        watch: WatchHub | None = None,
    ):
        super().__init__()
        #: The watch stream's hub (C{GET /api/v1/watch}); none, no stream.
        self.watch = watch
        self._watch_factory = WatchFactory(watch) if watch is not None else None
        #: The serials the CRL in force lists, read per request: TLS checks
        #: the CRL only at the handshake, and a kept-alive connection of a
        #: certificate revoked since must not go on changing the fleet.
        self.revoked = revoked
        #: With mutual TLS: every request needs an admin certificate whose
        #: role allows it.
        self.require_certificate = require_certificate
        #: The C{Host} names served (loopback ones when not given).
        self.hosts = hosts if hosts is not None else HostCheck(option="--admin-hosts")
        self.fleet = fleet
        self.registry = registry
        self.agents = agents
        self.max_body = max_body
        #: Anything with C{reload_tls()} (the control plane), for
        #: C{POST /api/v1/tls/reload}.
        self.control = control

    # -- dispatch -------------------------------------------------------------

    def render(self, request: Any) -> Any:
        try:
            method = request.method.decode("ascii", "replace")
            if method == "HEAD":
                method = "GET"
            self._check_host(request)
            path = self._path(request)
            self._authorize(request, method, path)
            followed = self._to_leader(request, path)
            if followed is not None:
                return self._call(request, followed, ())
            if path == ["api", "v1", "watch"]:
                return self._watch(request, method)
            handler, args = self._route(method, path, request)
            return self._call(request, handler, args)
        except Refused as e:
            return self._refuse(request, e)
        except Exception:
            self.log.failure(
                "admin API: {method} {uri} from {client} failed",
                method=_printable(request.method),
                uri=_printable(request.uri),
                client=client_address(request),
            )
            return self._error(request, 500, "internal error in the control plane (logged there)")

    # -- who ------------------------------------------------------------------

    def _admin(self, request: Any) -> AdminIdentity:
        """
        The admin the request's client certificate proves, read once per
        connection.

        @raise Refused: 403, the certificate is no admin certificate.
        """
        channel = request.channel
        cached = getattr(channel, "llmgw_admin", None)
        if isinstance(cached, AdminIdentity):
            return cached
        if isinstance(cached, Refused):
            raise cached
        cert = None
        get_peer = getattr(request.transport, "getPeerCertificate", None)
        if get_peer is not None:
            cert = get_peer()
        try:
            if cert is None:
                raise IdentityError("no client certificate; the admin API needs an admin certificate")
            identity = peer_admin(cert.to_cryptography())
        except IdentityError as e:
            name = _certificate_name(cert)
            refused = Refused(403, str(e))
            refused.who = f"{client_address(request)}" + (f" (certificate {name})" if name else "")  # type: ignore[attr-defined]
            channel.llmgw_admin = refused
            raise refused from None
        channel.llmgw_admin = identity
        channel.llmgw_admin_serial = cert.get_serial_number()
        return identity

    def _authorize(self, request: Any, method: str, path: list[str]) -> None:
        """
        With L{require_certificate}: refuse (403) a request without an admin
        certificate, or one whose role may not do this.
        """
        if not self.require_certificate:
            return
        admin = self._admin(request)
        if self.revoked is not None and getattr(request.channel, "llmgw_admin_serial", None) in self.revoked():
            raise Refused(403, f"the certificate of admin {admin.name!r} has been revoked")
        if not role_allows(admin.role, method, path):
            what = "changes state" if method != "GET" else "reads this"
            raise Refused(
                403,
                f"admin {admin.name!r} has role {admin.role}, which may not {method} "
                f"{'/' + '/'.join(path)} (this {what}; "
                + ("operator" if method != "GET" else "viewer or operator") + " may)",
            )

    def who(self, request: Any) -> str:
        """
        Who sent C{request}, for log lines: the admin's name and role and
        the address, or the address alone without mutual TLS.
        """
        addr = client_address(request)
        if not self.require_certificate:
            return addr
        cached = getattr(request.channel, "llmgw_admin", None)
        if isinstance(cached, AdminIdentity):
            return f"admin {cached} at {addr}"
        return getattr(cached, "who", addr)

    # -- hadmin (issue 14 item 5): a follower sends clients to the leader ----------

    def _to_leader(self, request: Any, path: list[str]) -> Callable[[], Any] | None:
        """
        On a member of an HA control plane that does not lead: refuse with
        a C{307} whose C{Location} is the same request on the leader's admin
        URL (as the leader published it in etcd), or with a C{503} naming
        the leader when its URL is unknown (no leader, an election under
        way, or a leader without C{--advertise-admin}). What is this
        member's own (L{local_path}) is answered here. It runs after
        L{_authorize}: a request this member refuses is not redirected.
        ha4: a read of nodes, replicas or events, once this member holds
        the fleet views the leader published, is answered from them: the
        handler to call is returned (C{None}: answer as usual).

        @raise Refused: 307 or 503, as above.
        """
        ha = getattr(self.control, "ha", None)
        if ha is None or local_path(path):
            return None
        if tuple(path) == ("api", "v1", "watch") and self._routes_only(request) and ha.serves_routes():
            # A watch of the routes alone follows the published table here.
            return None
        if tuple(path) in FOLLOWED_PATHS and ha.serves_routes():
            # Answered here; the header tells a gateway where the leader is
            # (its watch stream and demand go there).
            leader_url = ha.status().get("leader_admin_url")
            if isinstance(leader_url, str) and leader_url:
                request.setHeader(LEADER_HEADER, leader_url.encode("utf-8", "replace"))
            return None
        if tuple(path) in FLEET_FOLLOWED_PATHS and request.method in (b"GET", b"HEAD"):
            followed = ha.followed_fleet()
            view = self._followed_view(request, path[-1], followed) if followed is not None else None
            if view is not None:
                return view
        where = leader_location(ha.status(), request.uri)
        if where is None:
            return None
        location, st = where
        leader = st.get("leader_id")
        if location is None:
            raise Refused(
                503,
                f"this control-plane member ({st.get('member_id')}) does not lead, and "
                + (f"the leader {leader} published no admin URL (--advertise-admin)" if leader
                   else "no leader is known (an election is under way, or etcd is unreachable)")
                + "; try another member",
                headers={b"retry-after": b"1"},
                extra={"leader_id": leader, "leader_admin_url": None},
            )
        raise Refused(
            307,
            f"this control-plane member ({st.get('member_id')}) does not lead: {leader} does, "
            f"at {clip(location)}",
            headers={b"location": location.encode("utf-8", "replace")},
            extra={"leader_id": leader, "leader_admin_url": st.get("leader_admin_url"), "location": location},
        )

    def _followed_view(self, request: Any, kind: str, followed: Any) -> Callable[[], Any] | None:
        """
        ha4: C{GET /api/v1/nodes}, C{/replicas} or C{/events} on a member
        that does not lead, from the fleet views the leader published
        (C{followed}, a L{llmgw.control.ha.published.FleetDocument}): the
        leader's answer, with C{published_at} (the leader's clock when it
        wrote them) and C{published_by} (the leader), and the leader's admin
        URL in the L{LEADER_HEADER} header. ha5: nodes and replicas are the
        bytes the leader packed, answered as they are (not parsed here).
        C{None}: the part is unreadable (logged; the client is sent to the
        leader).

        @raise Refused: 400, a malformed C{?since=} (events).
        """
        since = self._since(request) if kind == "events" else 0.0
        try:
            if kind == "events":
                events = [e for e in followed.events()
                          if isinstance(e, dict) and isinstance(e.get("time"), (int, float)) and e["time"] > since]
                answer: Any = {"published_at": followed.published_at, "published_by": followed.leader,
                               "events": events}
            else:
                answer = followed.part(kind) + b"\n"
        except RoutesDataError as e:
            self.log.error("admin API: the {kind} the leader published are unreadable ({error}); {client} "
                           "is sent to the leader", kind=kind, error=str(e), client=self.who(request))
            return None
        leader_url = followed.leader_admin_url
        if leader_url:
            request.setHeader(LEADER_HEADER, leader_url.encode("utf-8", "replace"))
        if isinstance(answer, bytes):
            request.setResponseCode(200)
            request.setHeader(b"content-type", JSON_TYPE)
        return lambda: answer

    @staticmethod
    def _routes_only(request: Any) -> bool:
        """
        Whether a watch request follows the routes alone: C{?only=routes},
        or an admin of the C{gateway} role (who gets nothing else).
        """
        cached = getattr(request.channel, "llmgw_admin", None)
        if isinstance(cached, AdminIdentity) and cached.role == "gateway":
            return True
        return request.args.get(b"only") == [b"routes"]

    def _check_host(self, request: Any) -> None:
        hosts = request.requestHeaders.getRawHeaders(b"host") or []
        if len(hosts) > 1:
            raise Refused(400, "the request has more than one Host header")
        if not hosts:
            if request.clientproto != b"HTTP/1.0":
                raise Refused(400, "the request has no Host header")
            return
        if not self.hosts.allows(hosts[0]):
            raise Refused(
                421,
                f"this admin API does not serve the host {clip(hosts[0])}; its operator lists "
                f"the names it serves with {self.hosts.option}",
            )

    def _path(self, request: Any) -> list[str]:
        try:
            path = [seg.decode("utf-8") for seg in request.postpath]
        except UnicodeDecodeError:
            raise Refused(400, "the path is not UTF-8") from None
        if path and path[-1] == "":
            path.pop()
        return path

    def _route(self, method: str, path: list[str], request: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        def only(allowed: str) -> None:
            if method != allowed:
                raise Refused(
                    405, f"{clip('/' + '/'.join(path))} takes {allowed}, not {clip(method)}", allow=(allowed,)
                )

        if path == []:
            only("GET")
            if b"text/html" in (request.getHeader(b"accept") or b""):
                return self._page, (request, "index.html")
            return (lambda: {"endpoints": ENDPOINTS}), ()
        if path[:1] == ["page"]:
            only("GET")
            if len(path) != 2 or path[1] not in PAGE_FILES:
                raise Refused(404, f"no such page file: {'/'.join(path[1:])}")
            return self._page, (request, path[1])
        if path == ["metrics"]:
            only("GET")
            return self._metrics, (request,)
        if path[:2] != ["api", "v1"] or len(path) < 3:
            raise Refused(404, f"no such endpoint: {clip('/' + '/'.join(path))}")
        rest = path[2:]
        head = rest[0]
        if rest == ["status"]:
            only("GET")
            return self._status, ()
        if rest == ["whoami"]:
            only("GET")
            return self._whoami, (request,)
        if rest == ["nodes"]:
            only("GET")
            return self._nodes, ()
        if rest == ["deployments"]:
            only("GET")
            return (lambda: {"deployments": self.fleet.deployments()}), ()
        if rest == ["replicas"]:
            only("GET")
            return (lambda: {"replicas": self.fleet.replicas()}), ()
        if rest == ["events"]:
            only("GET")
            since = self._since(request)
            return (lambda: {"events": self.fleet.events(since)}), ()
        if rest == ["routes"]:
            only("GET")
            return self._routes_route(request)
        if rest == ["usage"]:
            only("GET")
            return self._usage(), ()
        if head == "nodes" and len(rest) == 3 and rest[2] in NODE_ACTIONS:
            only("POST")
            self._body(request)
            try:
                node_id = validate_node_id(rest[1])
            except InvalidNodeId as e:
                raise Refused(400, str(e)) from None
            return self._node_action, (request, node_id, rest[2])
        if head == "deployments" and len(rest) >= 3 and rest[-1] == "scale":
            only("POST")
            # A model name may hold slashes ("org/model"): whatever lies
            # between deployments/ and /scale is the name.
            model = "/".join(rest[1:-1])
            if not model:
                raise Refused(400, "the model name is empty")
            body = self._body(request)
            if "min" in body or "max" in body:
                low, high = self._bounds(body)
                return self._scale_bounds, (request, model, low, high)
            replicas = self._replicas(body)
            return self._scale, (request, model, replicas)
        if rest == ["demand"]:
            only("POST")
            try:
                gateway_id, demand = parse_report(self._body(request))
            except DemandReportError as e:
                raise Refused(400, str(e)) from None
            # With mutual TLS a report is the certificate's: one gateway
            # certificate cannot overwrite or crowd out another's reports.
            cached = getattr(request.channel, "llmgw_admin", None)
            if self.require_certificate and isinstance(cached, AdminIdentity):
                gateway_id = f"{cached.name}/{gateway_id}" if cached.name != gateway_id else gateway_id
            return self._demand, (gateway_id, demand)
        if head == "deployments" and len(rest) >= 3 and rest[-1] == "retry":
            only("POST")
            model = "/".join(rest[1:-1])
            if not model:
                raise Refused(400, "the model name is empty")
            body = self._body(request)
            if body:
                raise Refused(400, "retry takes no fields; send {} or nothing")
            return self._retry, (request, model)
        if rest == ["catalog", "reload"]:
            only("POST")
            self._body(request)
            return self._reload, (request,)
        if rest == ["tls", "reload"] and self.control is not None:
            only("POST")
            self._body(request)
            return self._reload_tls, (request,)
        raise Refused(404, f"no such endpoint: {clip('/' + '/'.join(path))}")

    # -- input ------------------------------------------------------------------

    def _since(self, request: Any) -> float:
        values = request.args.get(b"since")
        if not values:
            return 0.0
        if len(values) > 1:
            raise Refused(400, "give 'since' once")
        raw = values[0].decode("utf-8", "replace")
        try:
            since = float(raw)
        except ValueError:
            raise Refused(400, f"since={clip(raw)} is not a number of seconds since 1970") from None
        if not math.isfinite(since):
            raise Refused(400, f"since={clip(raw)} is not a finite number")
        return since

    def _body(self, request: Any) -> dict[str, Any]:
        """
        The JSON object a C{POST} carries (C{{}} when it carries nothing).
        """
        ctype = (request.getHeader(b"content-type") or b"").split(b";")[0].strip().lower()
        if ctype != b"application/json":
            raise Refused(
                415,
                "POST requests must have Content-Type: application/json"
                + (f" (got {clip(ctype)})" if ctype else ""),
            )
        if getattr(request, "body_too_large", False):
            raise Refused(413, f"the request body is over {self.max_body} bytes")
        request.content.seek(0)
        raw = request.content.read(self.max_body + 1)
        if len(raw) > self.max_body:
            raise Refused(413, f"the request body is over {self.max_body} bytes")
        if not raw.strip():
            return {}
        try:
            body = load_json(raw, unique=None)
        except JSONInputError as e:
            raise Refused(400, str(e)) from None
        if not isinstance(body, dict):
            raise Refused(400, f"the body must be a JSON object, not {type(body).__name__}")
        return body

    def _replicas(self, body: dict[str, Any]) -> int:
        unknown = sorted(set(body) - {"replicas"})
        if unknown:
            raise Refused(
                400, f"unknown field(s) {', '.join(map(clip, unknown[:5]))}; the body is {{\"replicas\": N}}"
            )
        if "replicas" not in body:
            raise Refused(400, 'missing field "replicas"; the body is {"replicas": N}')
        n = body["replicas"]
        if isinstance(n, bool) or not isinstance(n, int):
            raise Refused(400, f'"replicas" must be a whole number, not {clip(json.dumps(n))}')
        if n < 0:
            raise Refused(400, f'"replicas" must not be negative (got {n})')
        return n

    def _bounds(self, body: dict[str, Any]) -> tuple[int, int]:
        unknown = sorted(set(body) - {"min", "max"})
        if unknown:
            raise Refused(
                400, f"unknown field(s) {', '.join(map(clip, unknown[:5]))}; the body is "
                     f'{{"min": N, "max": M}} (an autoscaled deployment\'s bounds) or {{"replicas": N}}'
            )
        if "min" not in body or "max" not in body:
            raise Refused(400, 'give both "min" and "max": the body is {"min": N, "max": M}')
        out = []
        for key in ("min", "max"):
            n = body[key]
            if isinstance(n, bool) or not isinstance(n, int):
                raise Refused(400, f'"{key}" must be a whole number, not {clip(json.dumps(n))}')
            if n < 0:
                raise Refused(400, f'"{key}" must not be negative (got {n})')
            out.append(n)
        return out[0], out[1]

    # -- handlers -------------------------------------------------------------------

    def _whoami(self, request: Any) -> dict[str, Any]:
        """
        Who the API takes the requester for: with mutual TLS the admin's
        name and role; without it (loopback only) an operator.
        """
        cached = getattr(request.channel, "llmgw_admin", None)
        if self.require_certificate and isinstance(cached, AdminIdentity):
            return {"name": cached.name, "role": cached.role, "tls": True}
        return {"name": None, "role": "operator", "tls": False}

    def _page(self, request: Any, name: str) -> bytes:
        """
        A file of the fleet page (C{llmgw/control/admin/page/}), from the package.
        """
        found = page_file(name)
        assert found is not None  # the route checked the name
        body, ctype = found
        request.setResponseCode(200)
        request.setHeader(b"content-type", ctype)
        request.setHeader(b"content-security-policy", PAGE_CSP)
        request.setHeader(b"x-frame-options", b"DENY")
        return body

    def _status(self) -> dict[str, Any]:
        status = fleet_status(self.fleet, self.agents)
        # ha (issue 14): role, leader and epoch of a member on etcd.
        ha = getattr(self.control, "ha", None)
        if ha is not None:
            # ha4: a member that does not lead says the leader's fleet, as
            # published (its own reconciler does not run).
            followed = ha.followed_fleet()
            if followed is not None:
                try:
                    status = {**followed.status(), "published_at": followed.published_at,
                              "published_by": followed.leader}
                except RoutesDataError as e:
                    # This member's own view of the fleet stays.
                    self.log.error("admin API: the status the leader published is unreadable ({error})",
                                   error=str(e))
            ha_status = ha.status()
            status["ha"] = ha_status
            for key in ("role", "member_id", "leader_id", "leader_agent_address", "epoch"):
                status[key] = ha_status[key]
        return status

    def _node_action(self, request: Any, node_id: str, action: str) -> Deferred[dict[str, Any]]:
        # ha2: an HA fleet answers once etcd kept the change (a Deferred).
        do = {"cordon": self.fleet.cordon, "uncordon": self.fleet.uncordon, "drain": self.fleet.drain_node}[action]

        def done(_: Any = None) -> dict[str, Any]:
            self.log.info(
                "admin API: {action} {node} (asked by {client})",
                action=action,
                node=node_id,
                client=self.who(request),
            )
            return {"node": node_id, "action": action, "ok": True}

        return maybeDeferred(do, node_id).addCallback(done)

    def _scale(self, request: Any, model: str, replicas: int) -> Deferred[dict[str, Any]]:
        # ha2: an HA fleet answers once etcd kept the change (a Deferred).
        def done(_: Any = None) -> dict[str, Any]:
            self.log.info(
                "admin API: scale {model} to {replicas} replicas (asked by {client})",
                model=model,
                replicas=replicas,
                client=self.who(request),
            )
            return {"model": model, "replicas": replicas, "ok": True}

        return maybeDeferred(self.fleet.scale, model, replicas).addCallback(done)

    def _scale_bounds(self, request: Any, model: str, low: int, high: int) -> Deferred[dict[str, Any]]:
        # ha2: an HA fleet answers once etcd kept the change (a Deferred).
        def done(_: Any = None) -> dict[str, Any]:
            self.log.info(
                "admin API: autoscale {model} between {low} and {high} replicas (asked by {client})",
                model=model, low=low, high=high, client=self.who(request),
            )
            return {"model": model, "min": low, "max": high, "ok": True}

        return maybeDeferred(self.fleet.scale_bounds, model, low, high).addCallback(done)

    def _demand(self, gateway_id: str, demand: dict[str, Any]) -> dict[str, Any]:
        # A report a second per gateway: not logged, its effect is (events).
        self.fleet.report_demand(gateway_id, demand)
        return {"ok": True}

    def _retry(self, request: Any, model: str) -> Deferred[dict[str, Any]]:
        # ha3: an HA fleet answers once etcd kept the released hold (a Deferred).
        def done(_: Any = None) -> dict[str, Any]:
            self.log.info(
                "admin API: retry {model}: hold and backoff cleared (asked by {client})",
                model=model,
                client=self.who(request),
            )
            return {"model": model, "action": "retry", "ok": True}

        return maybeDeferred(self.fleet.retry, model).addCallback(done)

    def _nodes(self) -> dict[str, Any]:
        return nodes_view(self.fleet, self.agents)

    def _reload(self, request: Any) -> Any:
        def done(changes: Any) -> dict[str, Any]:
            self.log.info(
                "admin API: catalog reloaded (asked by {client}): {changes}",
                client=self.who(request),
                changes=changes,
            )
            return {"ok": True, "changes": changes}

        return maybeDeferred(self.fleet.reload_catalog).addCallback(done)

    def _reload_tls(self, request: Any) -> dict[str, Any]:
        result = self.control.reload_tls()
        self.log.info(
            "admin API: TLS reload asked by {client}: {result}",
            client=self.who(request),
            result=result,
        )
        if not result.get("ok"):
            refused = AdminError(str(result.get("error") or "TLS reload refused"))
            refused.status = 409
            raise refused
        return dict(result)

    def _usage(self) -> Callable[[], dict[str, Any]]:
        """
        What answers C{GET /api/v1/usage}: the embedded gateway's usage per
        API key and model (L{llmgw.gateway.usage.Usage.snapshot}).

        @raise Refused: 404, this control plane runs no gateway.
        """
        service = getattr(self.control, "gateway", None)
        usage = getattr(getattr(service, "gateway", None), "usage", None)
        if usage is None:
            raise Refused(404, "this control plane runs no gateway (--gateway off); a standalone "
                               "gateway serves its own /api/v1/usage on its --metrics address")
        snapshot: Callable[[], dict[str, Any]] = usage.snapshot
        return snapshot

    def _metrics(self, request: Any) -> bytes:
        accept = (request.getHeader(b"accept") or b"").decode("latin-1")
        encoder, content_type = choose_encoder(accept)
        body = encoder(self.registry)
        request.setHeader(b"content-type", content_type.encode("ascii"))
        return body

    # -- GET /api/v1/routes: the routing table, long-polled ------------------------------

    def _routes_route(self, request: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """
        The handler of C{GET /api/v1/routes}: the fleet's published
        L{RoutingTable} (its C{routing_table}), and the revision the client
        holds (C{?since=}), if it gave one.
        """
        table = getattr(self.fleet, "routing_table", None)
        if not isinstance(table, RoutingTable):
            raise Refused(404, "this control plane publishes no routing table")
        values = request.args.get(b"since")
        since: int | None = None
        if values:
            if len(values) > 1:
                raise Refused(400, "give 'since' once")
            raw = values[0].decode("utf-8", "replace")
            if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
                raise Refused(400, f"since={raw!r} is not a revision (a whole number, 0 or more)")
            since = int(raw)
        return self._routes, (request, table, since)

    def _routes(self, request: Any, table: RoutingTable, since: int | None) -> Any:
        """
        The table as C{snapshot_to_json} writes it: at once without C{since}
        or when the table's revision differs from it (newer, or a client of
        an earlier control plane process whose count was higher); else when
        the table next changes or after L{LONG_POLL_MAX_S} seconds, whichever
        comes first. A client that goes away cancels its wait.
        """
        if since is None or since != table.revision:
            return snapshot_to_json(table, table.clock.seconds())
        waiting = table.wait_newer(since, LONG_POLL_MAX_S)
        request.notifyFinish().addErrback(lambda _: waiting.cancel())

        def answer(_: int) -> dict[str, Any]:
            return snapshot_to_json(table, table.clock.seconds())

        def gone(f: Failure) -> bytes:
            f.trap(CancelledError)
            return b""  # nobody is there to read it

        return waiting.addCallbacks(answer, gone)

    # -- GET /api/v1/watch: the watch stream ------------------------------------------------

    def _watch(self, request: Any, method: str) -> Any:
        """
        Upgrade an authorised C{GET /api/v1/watch} to the watch stream
        (L{llmgw.control.admin.watch}); the C{gateway} role is sent routes only.
        """
        if method != "GET":
            raise Refused(405, f"/api/v1/watch takes GET, not {method}", allow=("GET",))
        if self._watch_factory is None:
            raise Refused(404, "this control plane serves no watch stream")
        if isinstance(request, SocketRequest):
            raise Refused(400, "this request came over the watch stream already")
        origin = request.getHeader(b"origin")
        if origin is not None and not _same_origin(origin, request.getHeader(b"host") or b""):
            # Browsers let any page open a WebSocket anywhere; the socket
            # takes commands, so only a page of this API may open it.
            raise Refused(403, f"a WebSocket from origin {_printable(origin[:200])} is refused: "
                               "only pages of this admin API may open the stream")
        if (request.getHeader(b"upgrade") or b"").lower() != b"websocket":
            request.setHeader(b"upgrade", b"websocket")
            raise Refused(426, "/api/v1/watch is a WebSocket: send Upgrade: websocket")
        try:
            since, epoch, routes_only = parse_resume(request.args)
        except ResumeError as e:
            raise Refused(400, str(e)) from None
        role = None
        cached = getattr(request.channel, "llmgw_admin", None)
        if isinstance(cached, AdminIdentity):
            role = cached.role
        self.log.info("admin API: watch stream opened by {client} (since {since})",
                      client=self.who(request), since=since)
        return upgrade(request, self._watch_factory, fleet_reader=role != "gateway" and not routes_only, since=since,
                       epoch=epoch, who=self.who(request), resource=self)

    # -- output ------------------------------------------------------------------------

    def _call(self, request: Any, handler: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        gone: list[Failure] = []
        request.notifyFinish().addErrback(gone.append)
        d = maybeDeferred(handler, *args)

        def ok(result: Any) -> bytes:
            # Encode before touching the request, so that a view with no
            # JSON form becomes a clean 500 below.
            if isinstance(result, bytes):
                return result
            body = encode_json(result)
            request.setResponseCode(200)
            request.setHeader(b"content-type", JSON_TYPE)
            return body

        def failed(f: Failure) -> bytes:
            if f.check(AdminError):
                err = f.value
                status = getattr(err, "status", 400)
                if not isinstance(status, int) or not 400 <= status <= 499:
                    status = 400
                self._log_refusal(request, status, str(err))
                return self._error_body(request, status, str(err))
            self.log.failure(
                "admin API: {method} {uri} from {client} failed",
                failure=f,
                method=_printable(request.method),
                uri=_printable(request.uri),
                client=client_address(request),
            )
            return self._error_body(request, 500, "internal error in the control plane (logged there)")

        def write(body: bytes) -> None:
            if not gone:
                self._finish(request, body)

        d.addCallback(ok)
        d.addErrback(failed)
        d.addCallback(write)
        d.addErrback(lambda f: self.log.failure("admin API: writing the answer failed", failure=f))
        return server.NOT_DONE_YET

    def _finish(self, request: Any, body: bytes) -> None:
        request.setHeader(b"cache-control", b"no-store")
        request.setHeader(b"x-content-type-options", b"nosniff")
        request.setHeader(b"content-length", str(len(body)).encode("ascii"))
        request.write(body)
        request.finish()

    def _refuse(self, request: Any, e: Refused) -> bytes:
        self._log_refusal(request, e.status, e.reason)
        if e.allow:
            request.setHeader(b"allow", ", ".join(e.allow).encode("ascii"))
        for name, value in e.headers.items():
            request.setHeader(name, value)
        return self._error(request, e.status, e.reason, e.extra)

    def _log_refusal(self, request: Any, status: int, reason: str) -> None:
        reason = _bounded(reason)
        self.log.info(
            "admin API: refused {method} {uri} from {client} with {status}: {reason}",
            method=_printable(request.method),
            uri=_printable(request.uri),
            client=self.who(request),
            status=status,
            reason=reason,
        )

    def _error_body(self, request: Any, status: int, reason: str, extra: dict[str, Any] | None = None) -> bytes:
        request.setResponseCode(status, b"Misdirected Request" if status == 421 else None)
        request.setHeader(b"content-type", JSON_TYPE)
        if status in (413,):
            request.setHeader(b"connection", b"close")
        return encode_json({"error": _bounded(reason), "status": status, **(extra or {})})

    def _error(self, request: Any, status: int, reason: str, extra: dict[str, Any] | None = None) -> bytes:
        body = self._error_body(request, status, reason, extra)
        request.setHeader(b"cache-control", b"no-store")
        request.setHeader(b"x-content-type-options", b"nosniff")
        return body


class AdminChannel(HTTPChannel):
    """
    The admin API's connection: logs a refused TLS handshake (a
    certificate from another CA, revoked, expired, or not for client
    authentication, such as the control plane's own) with the peer's
    address, since no request ever reaches the resource to say so.
    """

    log = Logger()

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:  # noqa: B008, N802
        if reason.check(SSL.Error):
            peer = self.transport.getPeer() if self.transport is not None else None
            host, port = getattr(peer, "host", "?"), getattr(peer, "port", "?")
            self.log.warn(
                "admin API: TLS handshake from {client} refused: {reason}",
                client=format_address(host, port) if isinstance(port, int) else f"{host}:{port}",
                reason=reason.getErrorMessage(),
            )
        super().connectionLost(reason)


def _admin_channel() -> _GenericHTTPChannelProtocol:
    # As twisted.web's default factory does, with our channel inside.
    return _GenericHTTPChannelProtocol(AdminChannel())


class AdminSite(server.Site):
    """
    A C{Site} with bounded request bodies and a short idle timeout.
    """

    requestFactory = AdminRequest
    protocol = staticmethod(_admin_channel)
    displayTracebacks = False


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
) -> AdminSite:
    """
    The admin API's C{Site}; with C{require_certificate}, every request
    needs an admin certificate (serve it over L{ServerTLS}); C{hosts} as
    for L{AdminResource}. The watch stream is served from C{watch}, by
    default a L{WatchHub} on C{reactor} (none without a reactor);
    L{AdminListenerService} starts and stops it.
    """
    if watch is None and reactor is not None:
        watch = WatchHub(fleet, reactor)
    if watch is not None and revoked is not None:
        watch.revoked = revoked
    site = AdminSite(
        AdminResource(
            fleet, registry, agents, control=control, require_certificate=require_certificate,
            revoked=revoked, hosts=hosts, watch=watch,
        ),
        timeout=timeout,
        reactor=reactor,
    )
    site.watch = watch  # type: ignore[attr-defined]
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
    while it runs, and its clients are dropped when it stops.
    """

    watch: WatchHub | None = None

    def startService(self) -> None:
        if self.watch is not None:
            self.watch.start()
        try:
            super().startService()
        except BaseException:
            if self.watch is not None:
                self.watch.stop()
            raise

    def stopService(self) -> Any:
        if self.watch is not None:
            self.watch.stop()
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
) -> ListenerService:
    """
    A service that serves the admin API on C{host}:C{port} while running.
    Its C{port} attribute is the listening port once started. It answers to
    the loopback names, C{host} unless it is a wildcard, and C{hosts}
    (entries as L{llmgw.hostcheck.parse_hosts} returns them).

    With C{tls} (the control plane's L{ServerTLS}, shared with the agent
    port so that one reload renews both), the API is HTTPS and every client
    needs an admin certificate from llmgw's CA, and the names in the server
    certificate are served besides C{hosts}.

    @raise AdminTLSRequired: C{host} is not loopback and C{tls} is C{None}.
    """
    problem = admin_tls_problem(host, tls is not None)
    if problem is not None:
        raise AdminTLSRequired(problem)
    site = admin_site(
        fleet, registry, agents, reactor, control=control, require_certificate=tls is not None,
        revoked=_revoked_by(tls) if tls is not None else None,
        hosts=HostCheck([*(hosts or ()), *_certificate_hosts(tls)], bound=host, option="--admin-hosts"),
    )
    factory: Any = site
    if tls is not None:
        # The Site's idle timeout starts at TCP accept, so it bounds the
        # handshake too.
        factory = TLSMemoryBIOFactory(tls, False, site, clock=reactor)
    svc = AdminListenerService(server_endpoint(reactor, host, port), factory)
    svc.watch = site.watch  # type: ignore[attr-defined]
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


def model_path(model: str) -> str:
    """
    The URL path segment for C{model} (slashes and all escaped).
    """
    return quote(model, safe="")
