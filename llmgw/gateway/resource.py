"""
The gateway's front: L{GatewayResource} answers requests, L{GatewaySite}
serves it over HTTP/1.1 (L{llmgw.gateway.front}, a lean server: twisted.web's
request machinery cost more CPU than the rest of the gateway together).

C{POST /v1/chat/completions}, C{/v1/completions} and C{/v1/embeddings} are
proxied to a replica, C{GET /v1/models} (and C{/v1/models/NAME}) answered
from the routing table, and C{GET /health} for load balancers. Bodies over
the limit are refused (413) without being kept.

Every request but C{/health} must name in C{Host} a host the gateway serves
(L{llmgw.hostcheck}), else 421. A body must be JSON (RFC 8259's: no
C{NaN}, C{Infinity} or byte order mark) nested at most
L{llmgw.untrusted.MAX_JSON_DEPTH} deep and name C{"model"} once. Client
strings are quoted in errors and logs by L{llmgw.untrusted.clip}; metrics
label a model only when the routing table knows it.

Under a memory ceiling (L{llmgw.memceiling}) that sheds, every request but
C{/health} is refused with 503 C{overloaded} and C{Retry-After}, on its head
when it has a body (L{GatewayResource.screen}), before a byte of the body is
read; requests already admitted carry on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any, ClassVar, Final

from twisted.logger import Logger

from llmgw.gateway import errors
from llmgw.gateway.adapters import NO_ADAPTERS, AdapterRouting, with_member
from llmgw.gateway.admission import FREE, capacity
from llmgw.gateway.bigbody import AT_ONCE_COMMAS, SlicedParses, sliced
from llmgw.gateway.front import FrontFactory, FrontRequest
from llmgw.gateway.metrics import UNKNOWN_MODEL
from llmgw.gateway.policy import AFFINITY_POLICIES, affinity_key
from llmgw.gateway.proxy import Gateway, ProxyCall, send_error
from llmgw.gateway.usage import UsageMeter
from llmgw.memceiling import MemoryCeiling
from llmgw.routing import IRoutingTable
from llmgw.untrusted import MAX_JSON_DEPTH, JSONInputError, clip, load_json

PROXIED: Final = {
    b"/v1/chat/completions": "/v1/chat/completions",
    b"/v1/completions": "/v1/completions",
    b"/v1/embeddings": "/v1/embeddings",
}
#: Top-level keys of a large body that the gateway reads (routing, the
#: prefix policy's key); the rest of a sliced parse is checked, not kept.
KEPT_KEYS: Final = ("model", "user", "messages", "prompt", "lora")
MODELS: Final = b"/v1/models"
MODELS_PREFIX: Final = b"/v1/models/"
HEALTH: Final = b"/health"
_JSON: Final = [(b"Content-Type", b"application/json")]
#: The top-level keys a body may name once.
_UNIQUE: Final = ("model",)


class GatewayResource:
    """
    The gateway's request handler: call it with a L{FrontRequest}.
    C{ceiling}, when given, is the process's memory ceiling, whose shedding
    refuses new requests.
    """

    # Named, and a ClassVar (setup.py's rules for compiled classes).
    log: ClassVar[Logger] = Logger(namespace=f"{__name__}.GatewayResource")

    def __init__(self, gateway: Gateway, ceiling: MemoryCeiling | None = None):
        self.gateway = gateway
        self.ceiling = ceiling
        self.parses = SlicedParses(gateway.reactor)
        #: Which replicas take requests for adapters (L{llmgw.gateway.adapters}).
        self.adapter_routing = AdapterRouting()

    def __call__(self, request: FrontRequest) -> None:
        started = time.monotonic()
        path = request.path
        key_name = None
        try:
            keys = self.gateway.keys
            if path == HEALTH:
                self._json(request, {"status": "ok"})
                return
            if not request.screened:  # else the screen found its host good: hosts do not change
                host = request.header(b"host")
                hosts = self.gateway.hosts
                if not hosts.allows(host):
                    assert host is not None
                    raise errors.misdirected(host, hosts.option)
            if keys is not None:
                key_name = request.key_name
                if key_name is None:
                    key_name = keys.authenticate(request.header(b"authorization"))
                if key_name is None:
                    raise errors.unauthorized(
                        "A valid API key is required: send `Authorization: Bearer KEY`"
                    )
            ceiling = self.ceiling
            if ceiling is not None and ceiling.shedding:
                ceiling.refused()
                raise errors.overloaded(
                    "The gateway is short of memory and refuses new requests for now; retry later",
                    self.gateway.config.retry_after,
                )
            label = PROXIED.get(path)
            if label is not None:
                if request.method != b"POST":
                    raise errors.method_not_allowed(request.method.decode("latin-1"), label, b"POST")
                self._proxy(request, label, started, key_name)
                return
            if path == MODELS or path == MODELS + b"/":
                self._only_get(request, "/v1/models")
                self._json(request, self._model_list())
                return
            if path.startswith(MODELS_PREFIX):
                self._only_get(request, "/v1/models/{model}")
                self._model(request, path[len(MODELS_PREFIX) :].decode("utf-8", "replace"))
                return
            raise errors.not_found(f"No such endpoint: {clip(path)}")
        except errors.GatewayError as e:
            self._refused(request, e, key_name, UNKNOWN_MODEL, started)

    def screen(self, request: FrontRequest) -> bool:
        """
        Whether C{request}, its head read and none of its body, may go on:
        C{False} when L{__call__} would refuse it on its head alone (a
        missing or wrong API key, a host not served), so that the front
        answers it before reading a byte of its body. The API key's name
        found is kept on the request for L{__call__}. A request that would
        be shed (a memory ceiling shedding) is refused here too.
        """
        path = request.path
        if path == HEALTH:
            return True
        gateway = self.gateway
        if not gateway.hosts.allows(request.header(b"host")):
            return False
        keys = gateway.keys
        if keys is not None:
            key_name = keys.authenticate(request.header(b"authorization"))
            request.key_name = key_name
            if key_name is None:
                return False
        request.screened = True
        # Asked after the key: a client without one is told so (401), not
        # to retry later.
        ceiling = self.ceiling
        return ceiling is None or not ceiling.shedding

    # the proxied endpoints

    def _proxy(self, request: FrontRequest, label: str, started: float, key_name: str | None) -> None:
        gw = self.gateway
        limit = gw.config.max_body
        body = request.body
        if request.too_large or len(body) > limit:
            raise errors.too_large(limit)
        if len(body) > AT_ONCE_COMMAS and sliced(body):  # a shorter body has too few commas
            self._parse_later(request, label, started, key_name, body)
            return
        try:
            obj = load_json(body, MAX_JSON_DEPTH, _UNIQUE)  # by position: keywords cost the call more
        except JSONInputError as e:
            raise errors.bad_request(f"The request body is refused: {e}", e.code) from None
        self._route(request, label, started, key_name, body, obj)

    def _parse_later(
        self, request: FrontRequest, label: str, started: float, key_name: str | None, body: bytes
    ) -> None:
        """
        Parse a large body in slices over later reactor turns (a single
        parse of megabytes of small keys holds the reactor for a second),
        then go on as L{_proxy} does; the request waits meanwhile.
        """

        def done(obj: Any) -> None:
            request.on_lost = None
            try:
                self._route(request, label, started, key_name, body, obj)
            except errors.GatewayError as e:
                self._refused(request, e, key_name, UNKNOWN_MODEL, started)

        def failed(e: JSONInputError) -> None:
            request.on_lost = None
            err = errors.bad_request(f"The request body is refused: {e}", e.code)
            self._refused(request, err, key_name, UNKNOWN_MODEL, started)

        cancel = self.parses.parse(body, done, failed, unique=("model",), keep=KEPT_KEYS)
        if cancel is None:
            busy = errors.GatewayError(
                503, "Too many large request bodies wait to be read; retry later", "server_error",
                "overloaded", {b"Retry-After": b"%d" % self.gateway.config.retry_after},
            )
            self._refused(request, busy, key_name, UNKNOWN_MODEL, started, path=label)
            return
        request.on_lost = lambda reason: cancel()

    def _route(
        self, request: FrontRequest, label: str, started: float, key_name: str | None, body: bytes, obj: Any
    ) -> None:
        gw = self.gateway
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
        adapters = getattr(table, "adapters", NO_ADAPTERS)
        sent = body
        if not routes or routes[0].lora_ids:
            # Else (the common case) no adapter's: resolve's own first test, without a call.
            chosen = self.adapter_routing.resolve(adapters, table.routes, model, routes)
            if chosen is not None:
                sent, routes = self._for_adapters(obj, body, chosen)
            elif not routes and not table.knows_model(model):
                raise errors.model_not_found(model)
        admission = gw.admission
        router = gw.router
        if router.all_free(routes):
            state = FREE  # capacity's answer, at a glance
        else:
            state = capacity(routes, router.cooling, gw.reactor.seconds(), gw.config.policy, admission.asleep)
        if state != FREE and admission.waker is not None:
            # The queue's own look, which wakes a sleeping replica if one would take it.
            state = admission.capacity(model)
        wait = admission.must_wait(model, state)
        if wait and not getattr(table, "loaded", True):
            # A standalone gateway with no table yet: every model counts as
            # known, so none waits (names are the client's to choose).
            refusal = errors.no_ready_replica(model, gw.config.retry_after)
            self._refused(request, refusal, key_name, _label(table, model), started, path=label)
            return
        # usage and limits (llmgw.gateway.usage): a key over its limit is
        # refused here, before it waits or anything is forwarded.
        try:
            meter = gw.usage.admit(key_name, gw.metrics.model_label(model))
        except errors.GatewayError as err:
            self._refused(request, err, key_name, _label(table, model), started, path=label)
            return
        if wait:
            self._wait(request, obj, model, label, body, started, key_name, meter)
            return
        policy = gw.policy_for(adapters.get(model, model) if adapters else model)
        key = None
        if policy in AFFINITY_POLICIES and len(routes) > 1:
            key = self._key(request, obj, policy)
        ProxyCall(gw, request, model, label, sent, routes, started, policy, key, meter).start()

    def _for_adapters(self, obj: dict[str, Any], body: bytes, chosen: tuple[Any, bytes]) -> tuple[bytes, Any]:
        """
        The body and candidate routes of a request for an adapter, or for a
        base whose replicas select adapters by the body's C{"lora"} field,
        which is then the gateway's to write.
        """
        routes, member = chosen
        if not member:
            return body, routes
        if "lora" in obj:
            raise errors.bad_request(
                "The request body may not carry \"lora\": the gateway selects the adapter the "
                "\"model\" field names", "invalid_lora")
        return with_member(body, member), routes

    def _key(self, request: FrontRequest, obj: dict[str, Any], policy: str) -> bytes | None:
        session = request.header(b"x-session-id")
        # chain by position: a keyword costs the call more, once a request.
        return affinity_key(
            obj, session.decode("utf-8", "replace") if session else None, self.gateway.config.policy,
            policy == "cache_aware",
        )

    def _wait(
        self,
        request: FrontRequest,
        obj: dict[str, Any],
        model: str,
        label: str,
        body: bytes,
        started: float,
        key_name: str | None,
        meter: UsageMeter | None,
    ) -> None:
        """
        Put the request in C{model}'s admission queue, under its API key
        (else its client's address), to be sent on when a replica can take
        it, or refused with 503.
        """
        gw = self.gateway
        adapters = getattr(gw.table, "adapters", NO_ADAPTERS)
        policy = gw.policy_for(adapters.get(model, model))
        # The affinity key now: the parsed body is not kept while waiting.
        key = self._key(request, obj, policy) if policy in AFFINITY_POLICIES else None

        def go() -> None:
            table = gw.table
            routes = table.routes(model)
            sent = body
            # An adapter's holders, and the "lora" they take, as they are now.
            chosen = self.adapter_routing.resolve(getattr(table, "adapters", NO_ADAPTERS), table.routes, model, routes)
            if chosen is not None:
                routes, member = chosen
                sent = with_member(body, member) if member else body
            ProxyCall(gw, request, model, label, sent, routes, started, gw.policy_for(adapters.get(model, model)),
                      key, meter).start()

        def refuse(err: errors.GatewayError) -> None:
            self._refused(request, err, key_name, model, started, path=label)

        who = "key:" + key_name if key_name is not None else "addr:" + (request.client_host or "")
        gw.admission.enter(model, who, request, go, refuse, len(body))

    # local answers

    def _only_get(self, request: FrontRequest, label: str) -> None:
        if request.method not in (b"GET", b"HEAD"):
            raise errors.method_not_allowed(request.method.decode("latin-1"), label, b"GET, HEAD")

    def _model_list(self) -> dict[str, Any]:
        table = self.gateway.table
        return {"object": "list", "data": listed_models(table.models(), getattr(table, "adapters", NO_ADAPTERS))}

    def _model(self, request: FrontRequest, model: str) -> None:
        table = self.gateway.table
        for entry in listed_models(table.models(), getattr(table, "adapters", NO_ADAPTERS)):
            if entry["id"] == model:
                self._json(request, entry)
                return
        raise errors.model_not_found(model)

    def _json(self, request: FrontRequest, obj: Any) -> None:
        body = json.dumps(obj).encode()
        request.start_response(200, _JSON, len(body), hold=True)
        request.write(body)
        request.finish()

    def _refused(
        self,
        request: FrontRequest,
        err: errors.GatewayError,
        key_name: str | None,
        model: str,
        started: float,
        path: str | None = None,
    ) -> None:
        if err.status < 500:
            self.log.info(
                "refused {method} {path} from {peer}{key}: {status} {problem}",
                method=clip(request.method),
                path=clip(request.path),
                peer=request.peer,
                key=f" (key {key_name})" if key_name else "",
                status=err.status,
                problem=err.message,
            )
        send_error(request, err)
        label = path or PROXIED.get(request.path, "other")
        m = self.gateway.metrics
        m.count(model, label, err.status)


def _label(table: IRoutingTable, model: str) -> str:
    """
    The metrics label for a model with no route now: itself when the table
    declares it, else L{UNKNOWN_MODEL}. A table that has not loaded yet (a
    standalone gateway before its first poll) answers every model as known,
    and then declares nothing.
    """
    if getattr(table, "loaded", True) and table.knows_model(model):
        return model
    return UNKNOWN_MODEL


def listed_models(models: list[str], adapters: Mapping[str, str]) -> list[dict[str, Any]]:
    """
    C{GET /v1/models}' entries: each model with a ready replica, followed
    by its adapters (with their base as C{parent}, as vLLM lists them).
    """
    out = []
    children: dict[str, list[str]] = {}
    for adapter, base in sorted(adapters.items()):
        children.setdefault(base, []).append(adapter)
    for m in models:
        out.append(_model_entry(m))
        for adapter in children.get(m, ()):
            entry = _model_entry(adapter)
            entry["parent"] = m
            out.append(entry)
    return out


def _model_entry(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "llmgw"}


class GatewaySite(FrontFactory):
    """
    Serves a L{GatewayResource}, with its gateway's body limit, client
    timeouts and per-address cap; a request's API key (and host) is checked
    on its head, before its body is read. No access
    log: the metrics count every request, and refusals are logged with who
    sent them.
    """

    def __init__(self, resource: GatewayResource, reactor: Any = None):
        if reactor is None:
            reactor = resource.gateway.reactor
        config = resource.gateway.config
        super().__init__(
            resource,
            reactor,
            config.max_body,
            head_timeout=config.head_timeout,
            body_timeout=config.body_timeout,
            keep_alive_timeout=config.keep_alive_timeout,
            request_timeout=config.request_timeout,
            max_per_address=config.max_per_address,
            screen=resource.screen,
        )
        self.resource = resource
