"""
The admin API (DESIGN §9): JSON over HTTP, and C{/metrics} for Prometheus.

L{AdminResource} is the root of a C{twisted.web} resource tree, one
resource a path segment (L{llmgw.control.admin.base.AdminNode}): the reads
in L{llmgw.control.admin.fleet}, the writes in
L{llmgw.control.admin.actions}, the page in L{llmgw.control.admin.page},
the watch stream in L{llmgw.control.admin.websocket}.
L{llmgw.control.admin.site.admin_site} wraps it in a C{Site} whose requests
keep their bodies bounded; L{llmgw.control.admin.site.admin_service}
listens with it. Everything it shows or does goes through an L{IFleetAdmin}
(the reconciler), so it is tested against a fake one.

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

With mutual TLS (L{llmgw.control.admin.site.admin_service} given the
control plane's C{ServerTLS}), every request must come with an admin
certificate from llmgw's CA (or, where people may log in, a session:
L{llmgw.control.admin.login}), whose role
(L{llmgw.control.admin.auth.role_allows}) decides what it may do:
C{viewer} reads, C{operator} also changes state, C{gateway} reads only
what a standalone gateway follows. Anything else (a node's or the server's
certificate, a role that may not do this) is a 403 that says why, logged
with the certificate's name. Every state change is logged with who asked:
the admin's name and role, or only the address on a loopback API without
TLS.

C{POST} requests must be C{Content-Type: application/json}, even when they
carry no body: a web page in the operator's browser cannot send that
content type to another origin without a CORS preflight, which this API
never grants, so it cannot cordon or drain nodes behind the operator's back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred, fail, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import server
from twisted.web.resource import Resource, getChildForRequest

from llmgw.control.admin import auth
from llmgw.control.admin.actions import CatalogReload, Demand, TLSReload
from llmgw.control.admin.base import (
    JSON_TYPE,
    MAX_BODY,
    AdminNode,
    Refused,
    bounded,
    client_address,
    encode_json,
    printable,
    request_method,
    request_path,
)
from llmgw.control.admin.csr import CertificateRequests
from llmgw.control.admin.deploy import CatalogView
from llmgw.control.admin.fleet import (
    Deployments,
    Events,
    Metrics,
    Models,
    Nodes,
    Replicas,
    Routes,
    Status,
    Usage,
    Whoami,
)
from llmgw.control.admin.leader import to_leader
from llmgw.control.admin.login import Login, Logins, Logout
from llmgw.control.admin.page import PageFiles, serve_page
from llmgw.control.admin.playground import Playground
from llmgw.control.admin.series import Series
from llmgw.control.admin.watch import WatchHub
from llmgw.control.admin.websocket import WatchFactory, WatchResource
from llmgw.control.state.interfaces import AdminError, IFleetAdmin
from llmgw.hostcheck import HostCheck

#: What C{GET /} lists.
ENDPOINTS = [
    "GET /api/v1/status",
    "GET /api/v1/whoami",
    'POST /api/v1/login {"user": NAME, "password": PASSWORD} (with --admin-tls: a session cookie)',
    "POST /api/v1/logout",
    "GET / (Accept: text/html): the fleet page",
    "GET /api/v1/nodes",
    "GET /api/v1/deployments",
    "GET /api/v1/replicas",
    "GET /api/v1/models",
    "GET /api/v1/events?since=SECONDS",
    "GET /api/v1/routes?since=REVISION",
    "GET /api/v1/watch?since=REVISION&epoch=EPOCH&only=routes (WebSocket)",
    "GET /api/v1/usage",
    "GET /api/v1/playground (the API keys this requester may spend in the playground)",
    'POST /api/v1/playground/chat {"model": M, "messages": [...], "key": NAME} (streamed, through the gateway)',
    "GET /api/v1/series?since=SECONDS&top=N&node=ID (curves of the last hour)",
    "POST /api/v1/nodes/{id}/cordon",
    "POST /api/v1/nodes/{id}/uncordon",
    "POST /api/v1/nodes/{id}/drain",
    'POST /api/v1/deployments/{model}/scale {"replicas": N} or {"min": N, "max": M} (autoscaled)',
    'POST /api/v1/demand {"gateway_id": ID, "models": {MODEL: {"in_flight": N, "waiting": N}}}',
    "PUT /api/v1/deployments/{model} {FIELD: VALUE, ...} (as a [[deployments]] table of the catalog)",
    "DELETE /api/v1/deployments/{model}",
    "POST /api/v1/deployments/{model}/retry",
    "GET /api/v1/deployments/{model}/rollout",
    "POST /api/v1/deployments/{model}/rollout/pause, /resume or /undo",
    'POST /api/v1/deployments/{model}/pull {"nodes": [ID, ...]} (none: where prefetch would)',
    "GET /api/v1/catalog (profiles, and each deployment's table as the catalog writes it)",
    "POST /api/v1/catalog/reload",
    "POST /api/v1/tls/reload",
    "GET /api/v1/csr (certificate requests waiting for an operator)",
    'POST /api/v1/csr/{node}/approve {"certificate_pem": PEM} (`llmgw ctl csr approve`)',
    'POST /api/v1/csr/{node}/deny {"reason": TEXT}',
    "GET /metrics",
]

_INTERNAL = "internal error in the control plane (logged there)"


def _branch(root: AdminResource, children: dict[bytes, Resource]) -> AdminNode:
    """
    A segment that is no endpoint itself (a 404), with C{children}.
    """
    node = AdminNode(root)
    for name, child in children.items():
        node.putChild(name, child)
    return node


class AdminResource(AdminNode):
    """
    The admin API's tree, and its root, C{GET /}: the list of endpoints, or
    the fleet page for a browser. Read-only views come from L{IFleetAdmin};
    actions call it and answer with what it says.

    Every resource of the tree renders through L{serve}, so the checks
    every request passes are made here once, in this order: the C{Host}
    (421), the path (400), the admin certificate and its role (403), and
    on a member of an HA control plane that does not lead, the answer from
    what the leader published or the way to the leader (307, 503); then
    the resource's method (404, 405, or its answer).

    @param fleet: the reconciler, or anything providing L{IFleetAdmin}.
    @param registry: what C{/metrics} serves.
    @param agents: the agent service; if given, C{/api/v1/status} adds the
        count of connected agents when the fleet's status has none.
    """

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
        logins: Logins | None = None,
        series: Any = None,
    ):
        super().__init__(self)
        #: With mutual TLS, the users who may log in without a certificate;
        #: none, every request needs one.
        self.logins = logins
        #: The curves' keeper (C{GET /api/v1/series}); none, a 404.
        self.series = series
        #: The watch stream's hub (C{GET /api/v1/watch}); none, no stream.
        self.watch = watch
        #: What serves the stream's connections; none, a 404.
        self.watch_factory = WatchFactory(watch) if watch is not None else None
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
        #: C{POST /api/v1/tls/reload}; its C{ha} and C{gateway}, if any,
        #: are the HA member and the embedded gateway.
        self.control = control
        self.putChild(b"metrics", Metrics(self))
        self.putChild(b"page", PageFiles(self))
        catalog = CatalogView(self)
        catalog.putChild(b"reload", CatalogReload(self))
        v1 = _branch(self, {
            b"status": Status(self),
            b"whoami": Whoami(self),
            b"login": Login(self),
            b"logout": Logout(self),
            b"nodes": Nodes(self),
            b"deployments": Deployments(self),
            b"replicas": Replicas(self),
            b"models": Models(self),
            b"events": Events(self),
            b"routes": Routes(self),
            b"watch": WatchResource(self),
            b"usage": Usage(self),
            b"series": Series(self),
            b"playground": Playground(self),
            b"demand": Demand(self),
            b"catalog": catalog,
            b"tls": _branch(self, {b"reload": TLSReload(self)}),
            b"csr": CertificateRequests(self),
        })
        self.putChild(b"api", _branch(self, {b"v1": v1}))

    def render(self, request: Any) -> Any:
        # Rendered as a leaf, with the path not walked (by whatever embeds
        # the API, or for a request over the watch socket): find the
        # resource as a Site would, then answer.
        if request.postpath:
            return getChildForRequest(self, request).render(request)
        return self.serve(request, self)

    def render_GET(self, request: Any) -> Any:  # noqa: N802
        if b"text/html" in (request.getHeader(b"accept") or b""):
            return serve_page(request, "index.html")
        return {"endpoints": ENDPOINTS}

    def who(self, request: Any) -> str:
        """
        Who sent C{request}, for log lines: the admin's name and role and
        the address, or the address alone without mutual TLS.
        """
        return auth.who(request, self.require_certificate)

    # -- every request -------------------------------------------------------------------

    def serve(self, request: Any, node: AdminNode) -> Any:
        """
        Answer C{request}, for which the walk down the tree found C{node}:
        the checks every request passes, then C{node}'s method. What
        C{render} returns: the body, or C{NOT_DONE_YET}.
        """
        try:
            method = request_method(request)
            auth.check_host(request, self.hosts)
            path = request_path(request)
            if self.require_certificate and self.logins is not None:
                self.logins.authorize(request, method, path, self.revoked)
            elif self.require_certificate:
                auth.authorize(request, method, path, self.revoked)
            ha = getattr(self.control, "ha", None)
            followed = to_leader(request, path, ha, self.who(request), self.log) if ha is not None else None
            if followed is not None:
                return self._respond(request, followed)
            handler = node.handler(method, path)
            return self._respond(request, lambda: handler(request))
        except Refused as e:
            return self._refuse(request, e)
        except Exception:
            self.log.failure(
                "admin API: {method} {uri} from {client} failed",
                method=printable(request.method),
                uri=printable(request.uri),
                client=client_address(request),
            )
            return self._error(request, 500, _INTERNAL)

    def _respond(self, request: Any, produce: Callable[[], Any]) -> Any:
        """
        Call C{produce} (a resource's method) and answer with what it
        returns, now or once its C{Deferred} fires: a JSON value as a 200,
        bytes as they are, an L{AdminError} as its status, anything else
        raised as a logged 500. C{NOT_DONE_YET} is passed on.

        @raise Refused: C{produce} refused the request before asking the fleet.
        """
        # Told first, so that a handler's own wait, cancelled when the
        # client goes, finds it gone.
        gone: list[Failure] = []
        request.notifyFinish().addErrback(gone.append)
        try:
            result = produce()
        except Refused:
            raise
        except Exception:
            result = fail(Failure())
        if result is server.NOT_DONE_YET:
            return result
        d: Deferred[Any] = result if isinstance(result, Deferred) else succeed(result)

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
            if isinstance(f.value, Refused):
                return self._refuse(request, f.value)
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
                method=printable(request.method),
                uri=printable(request.uri),
                client=client_address(request),
            )
            return self._error_body(request, 500, _INTERNAL)

        def write(body: bytes) -> None:
            if not gone:
                self._finish(request, body)

        d.addCallback(ok)
        d.addErrback(failed)
        d.addCallback(write)
        d.addErrback(lambda f: self.log.failure("admin API: writing the answer failed", failure=f))
        return server.NOT_DONE_YET

    # -- output --------------------------------------------------------------------------

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
        self.log.info(
            "admin API: refused {method} {uri} from {client} with {status}: {reason}",
            method=printable(request.method),
            uri=printable(request.uri),
            client=self.who(request),
            status=status,
            reason=bounded(reason),
        )

    def _error_body(self, request: Any, status: int, reason: str, extra: dict[str, Any] | None = None) -> bytes:
        request.setResponseCode(status, b"Misdirected Request" if status == 421 else None)
        request.setHeader(b"content-type", JSON_TYPE)
        if status == 413:
            request.setHeader(b"connection", b"close")
        return encode_json({"error": bounded(reason), "status": status, **(extra or {})})

    def _error(self, request: Any, status: int, reason: str, extra: dict[str, Any] | None = None) -> bytes:
        body = self._error_body(request, status, reason, extra)
        request.setHeader(b"cache-control", b"no-store")
        request.setHeader(b"x-content-type-options", b"nosniff")
        return body
