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

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from twisted.internet.defer import maybeDeferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import server
from twisted.web.resource import Resource

from llmgw.addresses import ListenerService, format_address, is_loopback, server_endpoint
from llmgw.control.interfaces import AdminError, IFleetAdmin
from llmgw.hostcheck import HostCheck
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
    "GET /api/v1/nodes",
    "GET /api/v1/deployments",
    "GET /api/v1/replicas",
    "GET /api/v1/events?since=SECONDS",
    "POST /api/v1/nodes/{id}/cordon",
    "POST /api/v1/nodes/{id}/uncordon",
    "POST /api/v1/nodes/{id}/drain",
    'POST /api/v1/deployments/{model}/scale {"replicas": N}',
    "POST /api/v1/catalog/reload",
    "POST /api/v1/tls/reload",
    "GET /metrics",
]


class Refused(Exception):
    """
    A request the API refuses before asking the fleet; C{status} is the
    HTTP status it is answered with.
    """

    def __init__(self, status: int, reason: str, allow: tuple[str, ...] = ()):
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.allow = allow


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
        hosts: HostCheck | None = None,
    ):
        super().__init__()
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
            return (lambda: {"endpoints": ENDPOINTS}), ()
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
        if rest == ["nodes"]:
            only("GET")
            return (lambda: {"nodes": self.fleet.nodes()}), ()
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
            replicas = self._replicas(self._body(request))
            return self._scale, (request, model, replicas)
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

    # -- handlers -------------------------------------------------------------------

    def _status(self) -> dict[str, Any]:
        status = dict(self.fleet.status())
        if self.agents is not None and "agents_connected" not in status:
            status["agents_connected"] = len(self.agents.connected_nodes())
        return status

    def _node_action(self, request: Any, node_id: str, action: str) -> dict[str, Any]:
        do = {"cordon": self.fleet.cordon, "uncordon": self.fleet.uncordon, "drain": self.fleet.drain_node}[action]
        do(node_id)
        self.log.info(
            "admin API: {action} {node} (asked by {client})",
            action=action,
            node=node_id,
            client=client_address(request),
        )
        return {"node": node_id, "action": action, "ok": True}

    def _scale(self, request: Any, model: str, replicas: int) -> dict[str, Any]:
        self.fleet.scale(model, replicas)
        self.log.info(
            "admin API: scale {model} to {replicas} replicas (asked by {client})",
            model=model,
            replicas=replicas,
            client=client_address(request),
        )
        return {"model": model, "replicas": replicas, "ok": True}

    def _reload(self, request: Any) -> Any:
        def done(changes: Any) -> dict[str, Any]:
            self.log.info(
                "admin API: catalog reloaded (asked by {client}): {changes}",
                client=client_address(request),
                changes=changes,
            )
            return {"ok": True, "changes": changes}

        return maybeDeferred(self.fleet.reload_catalog).addCallback(done)

    def _reload_tls(self, request: Any) -> dict[str, Any]:
        result = self.control.reload_tls()
        self.log.info(
            "admin API: TLS reload asked by {client}: {result}",
            client=client_address(request),
            result=result,
        )
        if not result.get("ok"):
            refused = AdminError(str(result.get("error") or "TLS reload refused"))
            refused.status = 409
            raise refused
        return dict(result)

    def _metrics(self, request: Any) -> bytes:
        accept = (request.getHeader(b"accept") or b"").decode("latin-1")
        encoder, content_type = choose_encoder(accept)
        body = encoder(self.registry)
        request.setHeader(b"content-type", content_type.encode("ascii"))
        return body

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
        return self._error(request, e.status, e.reason)

    def _log_refusal(self, request: Any, status: int, reason: str) -> None:
        reason = _bounded(reason)
        self.log.info(
            "admin API: refused {method} {uri} from {client} with {status}: {reason}",
            method=_printable(request.method),
            uri=_printable(request.uri),
            client=client_address(request),
            status=status,
            reason=reason,
        )

    def _error_body(self, request: Any, status: int, reason: str) -> bytes:
        request.setResponseCode(status, b"Misdirected Request" if status == 421 else None)
        request.setHeader(b"content-type", JSON_TYPE)
        if status in (413,):
            request.setHeader(b"connection", b"close")
        return encode_json({"error": _bounded(reason), "status": status})

    def _error(self, request: Any, status: int, reason: str) -> bytes:
        body = self._error_body(request, status, reason)
        request.setHeader(b"cache-control", b"no-store")
        request.setHeader(b"x-content-type-options", b"nosniff")
        return body


class AdminSite(server.Site):
    """
    A C{Site} with bounded request bodies and a short idle timeout.
    """

    requestFactory = AdminRequest
    displayTracebacks = False


def admin_site(
    fleet: IFleetAdmin,
    registry: CollectorRegistry,
    agents: Any = None,
    reactor: Any = None,
    timeout: float = IDLE_TIMEOUT,
    control: Any = None,
    hosts: HostCheck | None = None,
) -> AdminSite:
    """
    The admin API's C{Site}; C{hosts} as for L{AdminResource}.
    """
    site = AdminSite(
        AdminResource(fleet, registry, agents, control=control, hosts=hosts),
        timeout=timeout,
        reactor=reactor,
    )
    return site


def admin_service(
    reactor: Any,
    host: str,
    port: int,
    fleet: IFleetAdmin,
    registry: CollectorRegistry,
    agents: Any = None,
    control: Any = None,
    hosts: list[str] | None = None,
) -> ListenerService:
    """
    A service that serves the admin API on C{host}:C{port} while running.
    Its C{port} attribute is the listening port once started. It answers to
    the loopback names, C{host} unless it is a wildcard, and C{hosts}
    (entries as L{llmgw.hostcheck.parse_hosts} returns them).
    """
    if not is_loopback(host):
        AdminResource.log.warn(
            "the admin API on {address} has no authentication: anyone who can reach it can "
            "drain nodes; keep it on loopback or behind an authenticating proxy",
            address=format_address(host, port),
        )
    svc = ListenerService(
        server_endpoint(reactor, host, port),
        admin_site(
            fleet, registry, agents, reactor, control=control,
            hosts=HostCheck(hosts or (), bound=host, option="--admin-hosts"),
        ),
    )
    svc.setName("admin-listener")
    return svc


def model_path(model: str) -> str:
    """
    The URL path segment for C{model} (slashes and all escaped).
    """
    return quote(model, safe="")
