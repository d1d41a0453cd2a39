"""
The gateway's twisted.web front.

L{GatewayResource} answers C{POST /v1/chat/completions}, C{/v1/completions}
and C{/v1/embeddings} by proxying to a replica, C{GET /v1/models} (and
C{/v1/models/NAME}) from the routing table, and C{GET /health} for load
balancers. L{GatewaySite} serves it with a request class that refuses
bodies over the limit without buffering them.
"""

from __future__ import annotations

import json
import time
from io import BytesIO
from typing import Any

from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import http, server
from twisted.web.resource import Resource

from llmgw.gateway import errors
from llmgw.gateway.metrics import UNKNOWN_MODEL
from llmgw.gateway.proxy import Gateway, ProxyCall, send_error

PROXIED = {
    b"/v1/chat/completions": "/v1/chat/completions",
    b"/v1/completions": "/v1/completions",
    b"/v1/embeddings": "/v1/embeddings",
}
MODELS = b"/v1/models"
MODELS_PREFIX = b"/v1/models/"
HEALTH = b"/health"


def _who(request: Any) -> str:
    peer = request.getClientAddress()
    host = getattr(peer, "host", None)
    return f"{host}:{getattr(peer, 'port', '?')}" if host else str(peer)


class GatewayResource(Resource):
    isLeaf = True
    log = Logger()

    def __init__(self, gateway: Gateway):
        super().__init__()
        self.gateway = gateway

    def render(self, request: Any) -> Any:
        started = time.monotonic()
        path = request.path
        key_name = None
        try:
            keys = self.gateway.keys
            if path == HEALTH:
                return self._health(request)
            if keys is not None:
                key_name = keys.authenticate(request.getHeader(b"authorization"))
                if key_name is None:
                    raise errors.unauthorized(
                        "A valid API key is required: send `Authorization: Bearer KEY`"
                    )
            label = PROXIED.get(path)
            if label is not None:
                if request.method != b"POST":
                    raise errors.method_not_allowed(request.method.decode("latin-1"), label, b"POST")
                return self._proxy(request, label, started, key_name)
            if path == MODELS or path == MODELS + b"/":
                self._only_get(request, "/v1/models")
                return self._json(request, self._model_list())
            if path.startswith(MODELS_PREFIX):
                self._only_get(request, "/v1/models/{model}")
                return self._model(request, path[len(MODELS_PREFIX) :].decode("utf-8", "replace"))
            raise errors.not_found(
                f"No such endpoint: {path.decode('utf-8', 'replace')[:200]}"
            )
        except errors.GatewayError as e:
            self._refused(request, e, key_name, UNKNOWN_MODEL, started)
            return server.NOT_DONE_YET

    # the proxied endpoints

    def _proxy(self, request: Any, label: str, started: float, key_name: str | None) -> Any:
        gw = self.gateway
        limit = gw.config.max_body
        if getattr(request, "too_large", False):
            raise errors.too_large(limit)
        content = request.content
        if content is None:
            body = b""
        elif isinstance(content, BytesIO):
            body = content.getvalue()
        else:
            content.seek(0)
            body = content.read()
        if len(body) > limit:
            raise errors.too_large(limit)
        try:
            obj = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise errors.bad_request(f"The request body is not valid JSON: {e}", "invalid_json") from None
        if not isinstance(obj, dict):
            raise errors.bad_request("The request body must be a JSON object", "invalid_json")
        model = obj.get("model")
        if not isinstance(model, str) or not model:
            raise errors.bad_request(
                "The request body needs a \"model\" field naming the model (a string)",
                "missing_model",
            )
        table = gw.table
        routes = table.routes(model)
        if not routes:
            if not table.knows_model(model):
                raise errors.model_not_found(model)
            err = errors.no_ready_replica(model, gw.config.retry_after)
            self._refused(request, err, key_name, model, started, path=label)
            return server.NOT_DONE_YET
        call = ProxyCall(gw, request, model, label, body, routes, started)
        call.start()
        return server.NOT_DONE_YET

    # local answers

    def _health(self, request: Any) -> bytes:
        return self._json(request, {"status": "ok"})

    def _only_get(self, request: Any, label: str) -> None:
        if request.method not in (b"GET", b"HEAD"):
            raise errors.method_not_allowed(request.method.decode("latin-1"), label, b"GET, HEAD")

    def _model_list(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [_model_entry(m) for m in self.gateway.table.models()],
        }

    def _model(self, request: Any, model: str) -> bytes:
        if model not in self.gateway.table.models():
            raise errors.model_not_found(model)
        return self._json(request, _model_entry(model))

    def _json(self, request: Any, obj: Any) -> bytes:
        body = json.dumps(obj).encode()
        request.setHeader(b"Content-Type", b"application/json")
        request.setHeader(b"Content-Length", b"%d" % len(body))
        return body

    def _refused(
        self,
        request: Any,
        err: errors.GatewayError,
        key_name: str | None,
        model: str,
        started: float,
        path: str | None = None,
    ) -> None:
        if err.status < 500:
            self.log.info(
                "refused {method} {path} from {peer}{key}: {status} {message}",
                method=request.method.decode("latin-1"),
                path=request.path.decode("utf-8", "replace")[:200],
                peer=_who(request),
                key=f" (key {key_name})" if key_name else "",
                status=err.status,
                message=err.message,
            )
        send_error(request, err)
        label = path or PROXIED.get(request.path, "other")
        m = self.gateway.metrics
        m.count(model, label, err.status)


def _model_entry(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "llmgw"}


class GatewayRequest(server.Request):
    """
    A request whose body is kept in memory up to the site's C{max_body}
    and dropped (C{too_large} set) past it, and which tells C{on_lost}
    when its connection goes.
    """

    too_large = False
    on_lost: Any = None
    content: Any
    channel: Any
    _received = 0

    def _limit(self) -> int:
        site = getattr(self.channel, "site", None)
        return getattr(site, "max_body", 8 * 1024 * 1024)

    def gotLength(self, length: int | None) -> None:
        if length is not None and length > self._limit():
            self.too_large = True
        self.content = BytesIO()

    def handleContentChunk(self, data: bytes) -> None:
        if self.too_large:
            return
        self._received += len(data)
        if self._received > self._limit():
            self.too_large = True
            self.content = BytesIO()
            return
        self.content.write(data)

    def process(self) -> None:
        # The site serves one leaf resource: skip the traversal and the
        # per-request bookkeeping of server.Request.process.
        self.site = site = self.channel.site
        self.prepath = []
        self.postpath = []
        try:
            body = site.resource.render(self)
        except Exception:
            self.processingFailed(Failure())
            return
        if body is not server.NOT_DONE_YET:
            self.write(body)
            self.finish()

    def connectionLost(self, reason: Failure) -> None:
        super().connectionLost(reason)
        hook, self.on_lost = self.on_lost, None
        if hook is not None:
            hook(reason)


class _Channel(http.HTTPChannel):
    transport: Any

    def connectionMade(self) -> None:
        super().connectionMade()
        try:
            # Streamed events are small writes; Nagle would hold them back.
            self.transport.setTcpNoDelay(True)
        except AttributeError:
            pass


class GatewaySite(server.Site):
    """
    Serves a L{GatewayResource}; no access log (the metrics count every
    request, and refusals are logged with who sent them).
    """

    protocol = _Channel  # type: ignore[assignment]
    displayTracebacks = False
    noisy = False

    def __init__(self, resource: GatewayResource, reactor: Any = None):
        # Bodies are JSON for the replica; parsing them as forms (the default,
        # through the email package) would cost a quarter of the gateway's CPU.
        super().__init__(
            resource, requestFactory=GatewayRequest, reactor=reactor, parsePOSTFormSubmission=False
        )
        self.max_body = resource.gateway.config.max_body

    def log(self, request: Any) -> None:
        pass

