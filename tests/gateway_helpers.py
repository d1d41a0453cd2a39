"""
Test tools for the gateway's loopback tests: a fake replica (a model
server whose every move the test controls), factories that can close
every connection they made, so each test leaves a clean reactor, and a
count of the objects a run leaves for the cyclic garbage collector.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from typing import Any

import treq
from twisted.internet import reactor as global_reactor
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.interfaces import IPushProducer
from twisted.protocols.policies import WrappingFactory
from twisted.python.failure import Failure
from twisted.web import server
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.resource import Resource
from zope.interface import implementer

from llmgw.gateway.proxy import Gateway, GatewayConfig
from llmgw.gateway.resource import GatewayResource, GatewaySite
from llmgw.routing import Route, RoutingSnapshot
from llmgw.testing.fakemodel import FakeModelConfig, make_resource


class TrackingFactory(WrappingFactory):
    """
    Wraps a server factory; L{close_all} aborts every open connection and
    fires when all are gone.
    """

    def __init__(self, wrapped: Any):
        super().__init__(wrapped)
        self._waiters: list[Deferred[None]] = []

    def unregisterProtocol(self, p: Any) -> None:
        super().unregisterProtocol(p)
        if not self.protocols:
            waiters, self._waiters = self._waiters, []
            for d in waiters:
                d.callback(None)

    def close_all(self) -> Deferred[None]:
        if not self.protocols:
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._waiters.append(d)
        for p in list(self.protocols):
            p.transport.abortConnection()
        return d


def chat_completion(model: str, content: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 1700000000,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def sse_chunk(model: str, content: str | None) -> bytes:
    delta = {"content": content} if content is not None else {}
    chunk = {
        "id": "chatcmpl-test",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": model,
        "choices": [
            {"index": 0, "delta": delta, "finish_reason": None if content is not None else "stop"}
        ],
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


@implementer(IPushProducer)
class _Flood:
    """
    Writes C{total} bytes as fast as the connection takes them, counting
    the times it is paused.
    """

    def __init__(self, request: Any, total: int, block: int = 256 * 1024):
        self.request = request
        self.total = total
        self.sent = 0
        self.block = b"x" * block
        self.paused = False
        self.pauses = 0
        self.sent_at_first_pause: int | None = None
        self.stopped = False
        request.registerProducer(self, True)
        global_reactor.callLater(0, self._pump)

    def _pump(self) -> None:
        while not self.paused and not self.stopped and self.sent < self.total:
            n = min(len(self.block), self.total - self.sent)
            self.sent += n
            self.request.write(self.block[:n])
        if self.sent >= self.total and not self.stopped:
            self.stopped = True
            self.request.unregisterProducer()
            self.request.finish()

    def pauseProducing(self) -> None:
        if not self.paused:
            self.pauses += 1
            if self.sent_at_first_pause is None:
                self.sent_at_first_pause = self.sent
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        global_reactor.callLater(0, self._pump)

    def stopProducing(self) -> None:
        self.stopped = True


class FakeReplica(Resource):
    """
    A fake model server for tests, on loopback. It answers chat
    completions (JSON or server-sent events) naming itself in the content,
    and can instead hold requests, stream under the test's control, or
    flood a slow reader.

    C{mode}: C{"answer"} (default; C{stream: true} gets C{events} events
    C{interval} s apart), C{"hold"} (keep the request open until the test
    acts), C{"manual"} (stream: the first event at once, the rest when the
    test calls L{send_event} and L{finish}), C{"flood"} (write
    C{flood_bytes} through a push producer).
    """

    isLeaf = True

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.mode = "answer"
        self.events = 3
        self.interval = 0.0
        self.flood_bytes = 0
        self.flood: _Flood | None = None
        self.received: list[dict[str, Any]] = []
        self.headers: list[Any] = []
        self.open: list[Any] = []
        self.lost: list[Deferred[str]] = []
        self._arrivals: list[Deferred[Any]] = []
        self.port: Any = None
        self.factory: TrackingFactory | None = None

    # the test's side

    def arrived(self) -> Deferred[Any]:
        """
        Fires with the next request to arrive (or the last one, if one is
        already open and not yet collected).
        """
        d: Deferred[Any] = Deferred()
        self._arrivals.append(d)
        return d

    def send_event(self, request: Any, content: str) -> None:
        request.write(sse_chunk(self.received[-1].get("model", "?"), content))

    def finish(self, request: Any) -> None:
        request.write(b"data: [DONE]\n\n")
        request.finish()

    def answer(self, request: Any) -> None:
        body = json.dumps(chat_completion(self.received[-1].get("model", "?"), self.name)).encode()
        request.setHeader(b"Content-Type", b"application/json")
        request.setHeader(b"Content-Length", b"%d" % len(body))
        request.write(body)
        request.finish()

    def address(self) -> str:
        return f"127.0.0.1:{self.port.getHost().port}"

    # the server's side

    def render_POST(self, request: Any) -> Any:
        body = json.loads(request.content.read())
        self.received.append(body)
        self.headers.append(request.requestHeaders)
        lost: Deferred[str] = Deferred()
        request.notifyFinish().addBoth(
            lambda r: lost.callback("cancelled" if isinstance(r, Failure) else "finished")
        )
        self.lost.append(lost)
        arrivals, self._arrivals = self._arrivals, []
        for d in arrivals:
            d.callback(request)
        model = body.get("model", "?")
        if self.mode == "hold":
            self.open.append(request)
            return server.NOT_DONE_YET
        if self.mode == "flood":
            request.setHeader(b"Content-Type", b"application/octet-stream")
            self.flood = _Flood(request, self.flood_bytes)
            return server.NOT_DONE_YET
        if body.get("stream"):
            request.setHeader(b"Content-Type", b"text/event-stream")
            request.setHeader(b"Cache-Control", b"no-cache")
            if self.mode == "manual":
                self.open.append(request)
                request.write(sse_chunk(model, "first"))
                return server.NOT_DONE_YET
            self._stream(request, model, 0)
            return server.NOT_DONE_YET
        content = json.dumps(chat_completion(model, self.name)).encode()
        request.setHeader(b"Content-Type", b"application/json")
        return content

    def _stream(self, request: Any, model: str, i: int) -> None:
        if request._disconnected:
            return
        if i < self.events:
            request.write(sse_chunk(model, f"{self.name}-{i} "))
            global_reactor.callLater(self.interval, self._stream, request, model, i + 1)
            return
        request.write(sse_chunk(model, None))
        request.write(b"data: [DONE]\n\n")
        request.finish()

    def listen(self) -> None:
        site = server.Site(self)
        site.log = lambda r: None  # type: ignore[method-assign]
        self.factory = TrackingFactory(site)
        self.port = global_reactor.listenTCP(0, self.factory, interface="127.0.0.1")

    def stop(self) -> Deferred[Any]:
        assert self.factory is not None
        d = self.factory.close_all()
        d.addCallback(lambda _: self.port.stopListening())
        return d


class FakeModelServer:
    """
    The project's fake model server (L{llmgw.testing.fakemodel}) on a
    loopback port, with connections the test can close.
    """

    def __init__(self, config: FakeModelConfig):
        site = server.Site(make_resource(config, global_reactor))
        site.log = lambda r: None  # type: ignore[method-assign]
        self.factory = TrackingFactory(site)
        self.port = global_reactor.listenTCP(0, self.factory, interface="127.0.0.1")

    def address(self) -> str:
        return f"127.0.0.1:{self.port.getHost().port}"

    def stop(self) -> Deferred[Any]:
        d = self.factory.close_all()
        d.addCallback(lambda _: self.port.stopListening())
        return d


def dead_address() -> str:
    """
    A loopback address where nothing listens (a port just released).
    """
    port = global_reactor.listenTCP(0, server.Site(Resource()), interface="127.0.0.1")
    number = port.getHost().port
    port.stopListening()
    return f"127.0.0.1:{number}"


class Harness:
    """
    Fake replicas and a gateway in front of them on loopback, with a treq
    client that does not keep connections; L{cleanup} closes everything.
    """

    def __init__(self, testcase: Any, config: GatewayConfig | None = None, keys: Any = None):
        self.testcase = testcase
        self.replicas: dict[str, Any] = {}
        self.route_list: list[Route] = []
        self.known: set[str] = set()
        self.table = RoutingSnapshot()
        #: Routing policy per model, as a routing table names them; the
        #: harness's tests pin least-loaded routing unless they set another.
        self.policies: dict[str, str] = {}
        self.gateway = Gateway(global_reactor, self, config or GatewayConfig(), keys=keys)
        site = GatewaySite(GatewayResource(self.gateway), reactor=global_reactor)
        self.front = TrackingFactory(site)
        self.port = global_reactor.listenTCP(0, self.front, interface="127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port.getHost().port}"
        self.pool = HTTPConnectionPool(global_reactor, persistent=False)
        self.http = treq.client.HTTPClient(Agent(global_reactor, pool=self.pool))
        testcase.addCleanup(self.cleanup)

    # IRoutingTable, delegated to a snapshot the test rebuilds

    def policy(self, model: str) -> str:
        return self.policies.get(model, "least_loaded")

    def routes_for(self) -> None:
        self.table = RoutingSnapshot(self.route_list, self.known)

    def routes(self, model: str) -> list[Route]:
        return self.table.routes(model)

    def models(self) -> list[str]:
        return self.table.models()

    def knows_model(self, model: str) -> bool:
        return self.table.knows_model(model)

    def replica(self, replica_id: str, model: str = "demo", draining: bool = False) -> FakeReplica:
        r = FakeReplica(replica_id)
        r.listen()
        self.replicas[replica_id] = r
        self.add_route(replica_id, model, r.address(), draining)
        return r

    def fakemodel(self, replica_id: str, model: str = "demo", **config: Any) -> FakeModelServer:
        f = FakeModelServer(FakeModelConfig(model=model, **config))
        self.replicas[replica_id] = f
        self.add_route(replica_id, model, f.address())
        return f

    def add_route(self, replica_id: str, model: str, address: str, draining: bool = False) -> None:
        self.route_list.append(Route(replica_id, model, address, draining))
        self.known.add(model)
        self.routes_for()

    def post(self, path: str, body: Any, **kw: Any) -> Deferred[Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = kw.pop("headers", {})
        headers.setdefault(b"Content-Type", [b"application/json"])
        return self.http.post(self.url + path, data=data, headers=headers, **kw)

    def chat(self, model: str = "demo", **kw: Any) -> Deferred[Any]:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        body.update(kw.pop("extra", {}))
        return self.post("/v1/chat/completions", body, **kw)

    def cleanup(self) -> Deferred[Any]:
        d = self.pool.closeCachedConnections()
        d.addCallback(lambda _: self.front.close_all())

        def close_upstreams(_: Any) -> Deferred[Any]:
            self.gateway.close()
            return DeferredList([r.stop() for r in self.replicas.values()])

        d.addCallback(close_upstreams)
        d.addCallback(lambda _: self.port.stopListening())
        return d


def cyclic_leftovers(run: Callable[[], object], *types: type) -> int:
    """
    How many instances of C{types} made while C{run} ran are still there
    once it has returned, with the cyclic garbage collector held off: those
    that only that collector would free. 0 when each went as its last
    reference did.
    """
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        before = {id(o) for o in gc.get_objects() if type(o) in types}
        run()
        return sum(1 for o in gc.get_objects() if type(o) in types and id(o) not in before)
    finally:
        if enabled:
            gc.enable()
