"""
The gateway's HTTP front on two other parsers, for L{bench.gateway}'s
comparison: the same L{GatewayResource} behind

- L{HttptoolsSite}: the lean front's request and response code with the
  parsing done by C{httptools} (llhttp, the C parser uvicorn uses);
- L{TwistedWebSite}: C{twisted.web}'s C{HTTPChannel} and C{Request}, with an
  adapter that gives the handler what L{FrontRequest} gives it.

They are measurement candidates, not production code: enough to answer the
benchmark's requests the way the lean front does (bodies, keep-alive,
streamed responses with backpressure). L{check_cases} says which of the
malformed requests of the front's hostile-input tests each parser refuses on its own.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from twisted.internet.interfaces import IPushProducer
from twisted.python.failure import Failure
from twisted.web import resource, server

from llmgw.gateway.front import _W_IDLE, _W_NONE, FrontFactory, FrontRequest, HTTPFront


class HttptoolsFront(HTTPFront):
    """
    One client connection parsed by C{httptools}; requests that arrive while
    one is with its handler are queued (complete) and answered in order.
    """

    def connectionMade(self) -> None:
        import httptools

        super().connectionMade()
        self._parser = httptools.HttpRequestParser(self)
        self._error = httptools.HttpParserError
        self._queue: deque[FrontRequest] = deque()
        self._url = b""
        self._hdrs: list[tuple[bytes, bytes]] = []
        self._size = 0
        self._big = False

    # httptools' callbacks

    def on_message_begin(self) -> None:
        self._url = b""
        self._hdrs = []
        self._parts = []
        self._size = 0
        self._big = False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._hdrs.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self.max_body:
            self._big = True
            self._parts = []
        elif not self._big:
            self._parts.append(body)

    def on_message_complete(self) -> None:
        p = self._parser
        request = FrontRequest(
            self, p.get_method(), self._url, p.get_http_version() == "1.0", self._hdrs, p.should_keep_alive()
        )
        request.too_large = self._big
        if self._parts and not self._big:
            request.body = b"".join(self._parts)
        self._queue.append(request)

    # the connection

    def dataReceived(self, data: bytes) -> None:
        if self._closing:
            return
        try:
            self._parser.feed_data(data)
        except self._error as e:
            self._refuse(400, f"Malformed request: {e}", "bad_request")
            return
        self._next()

    def _next(self) -> None:
        while not self._busy and not self._closing and self._queue:
            request = self._queue.popleft()
            self._busy = True
            self._watching = _W_NONE
            self._request = request
            self.factory.dispatch(request)

    def request_done(self, request: FrontRequest) -> None:
        if request is not self._request:
            return
        self._request = None
        self._busy = False
        if not request.keep_alive:
            self.close()
            return
        if self._queue:
            self.factory.reactor.callLater(0, self._next)
        else:
            self._watch(self.factory.keep_alive_timeout, _W_IDLE)


class HttptoolsSite(FrontFactory):
    """
    A L{FrontFactory} whose connections parse with C{httptools}.
    """

    def buildProtocol(self, addr: Any) -> HTTPFront:  # type: ignore[override]
        self.connections += 1
        return HttptoolsFront(self)


class _WebRequest:
    """
    What the gateway's handler uses of a L{FrontRequest}, over a
    C{twisted.web} request.
    """

    def __init__(self, request: server.Request):
        self.request = request
        self.method = request.method
        self.uri = request.uri
        self.path = request.path
        self.http10 = request.clientproto == b"HTTP/1.0"
        self.headers = [
            (name.lower(), value)
            for name, values in request.requestHeaders.getAllRawHeaders()
            for value in values
        ]
        self.body = request.content.read()  # type: ignore[union-attr]
        self.too_large = False
        self.keep_alive = True
        self.on_lost: Any = None
        self.started = False
        self.finished = False
        self.producer: IPushProducer | None = None
        request.notifyFinish().addErrback(self._lost)

    def _lost(self, reason: Failure) -> None:
        self.finished = True
        hook, self.on_lost = self.on_lost, None
        if hook is not None:
            hook(reason)

    def header(self, name: bytes) -> bytes | None:
        return self.request.getHeader(name)

    @property
    def client_host(self) -> str | None:
        return getattr(self.request.getClientAddress(), "host", None)

    @property
    def peer(self) -> str:
        return str(self.request.getClientAddress())

    def start_response(self, status: int, headers: list[tuple[bytes, bytes]], length: int | None = None,
                       reason: bytes | None = None, hold: bool = False) -> None:
        # twisted.web sends the head with the first write whether held or not.
        self.started = True
        r = self.request
        r.setResponseCode(status, reason)
        r.responseHeaders.removeHeader(b"content-type")
        for name, value in headers:
            r.responseHeaders.addRawHeader(name, value)
        if length is not None:
            r.setHeader(b"content-length", b"%d" % length)

    def write(self, data: bytes) -> None:
        if data and not self.finished:
            self.request.write(data)
        else:
            self.flush()

    def flush(self) -> None:
        if not self.finished:
            # An empty write sends the head if it has not gone yet.
            self.request.write(b"")

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        self.on_lost = None
        if self.producer is not None:
            self.producer = None
            self.request.unregisterProducer()
        self.request.finish()

    def abort(self) -> None:
        if self.finished:
            return
        self.finished = True
        self.on_lost = None
        self.request.channel.transport.loseConnection()  # type: ignore[attr-defined]

    def set_producer(self, producer: IPushProducer) -> None:
        self.producer = producer
        self.request.registerProducer(producer, True)

    def clear_producer(self) -> None:
        if self.producer is not None:
            self.producer = None
            self.request.unregisterProducer()


class _Adapter(resource.Resource):
    isLeaf = True

    def __init__(self, handle: Any):
        super().__init__()
        self.handle = handle

    def render(self, request: server.Request) -> Any:
        self.handle(_WebRequest(request))
        return server.NOT_DONE_YET


def twisted_web_site(handle: Any) -> server.Site:
    """
    A C{twisted.web} site serving C{handle} (a L{GatewayResource}), with no
    access log (as the lean front has none).
    """
    site = server.Site(_Adapter(handle))
    site.log = lambda request: None  # type: ignore[method-assign]
    return site


#: The malformed requests the front is tested with, and what a front must answer.
CASES: list[tuple[str, bytes, str]] = [
    ("header name not a token (VT)", b"GET / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding\x0b: chunked\r\n\r\n", "400"),
    ("header name with a space", b"GET / HTTP/1.1\r\nHost: a\r\nX Y: z\r\n\r\n", "400"),
    ("control byte in a value", b"GET / HTTP/1.1\r\nHost: a\r\nX: a\x01b\r\n\r\n", "400"),
    ("HTTP/1.1 without Host", b"GET / HTTP/1.1\r\n\r\n", "400"),
    ("two Host headers", b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", "400"),
    ("bare LF", b"GET / HTTP/1.1\nHost: a\n\n", "400"),
    ("Content-Length of 21 digits", b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 100000000000000000000\r\n\r\n",
     "413 or 400 at once"),
    ("HTTP/1.0 with chunked", b"POST / HTTP/1.0\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"0\r\n\r\n", "close after the response"),
]


def check_cases() -> dict[str, dict[str, str]]:
    """
    Feed each of L{CASES} to each front through a L{StringTransport}, with
    a handler that answers 200 (or 413 for a C{too_large} request); say
    what came back.
    """
    from twisted.internet.task import Clock
    from twisted.internet.testing import StringTransport

    def handle(request: Any) -> None:
        status = 413 if request.too_large else 200
        request.start_response(status, [], 2)
        request.write(b"ok")
        request.finish()

    out: dict[str, dict[str, str]] = {}
    for front in ("lean", "httptools", "twisted_web"):
        got: dict[str, str] = {}
        for name, data, _ in CASES:
            clock = Clock()
            factory: Any
            if front == "lean":
                factory = FrontFactory(handle, clock)
            elif front == "httptools":
                factory = HttptoolsSite(handle, clock)
            else:
                factory = twisted_web_site(handle)
            proto = factory.buildProtocol(None)
            transport = StringTransport()
            proto.makeConnection(transport)
            proto.dataReceived(data)
            value = transport.value()
            status = value.split(b" ", 2)[1].decode() if value.startswith(b"HTTP/") else "nothing yet"
            closing = " and closes" if transport.disconnecting else " and keeps the connection"
            got[name] = status + closing
            proto.connectionLost(Failure(ConnectionError("done")))
            for call in clock.getDelayedCalls():
                call.cancel()
        out[front] = got
    out["wanted"] = {name: want for name, _, want in CASES}
    return out


def parse_cost(n: int = 20000) -> dict[str, float]:
    """
    CPU microseconds per request that each front spends reading a request
    as C{wrk} sends it and writing a canned answer, in process, over a
    L{StringTransport}: the parser's own cost, with no sockets and no proxy.
    """
    import time

    from twisted.internet.task import Clock
    from twisted.internet.testing import StringTransport

    body = b'{"model": "bench", "messages": [{"role": "user", "content": "Say hello."}]}'
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
               b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    def handle(r: Any) -> None:
        r.start_response(200, [(b"Content-Type", b"application/json")], 2)
        r.write(b"{}")
        r.finish()

    out: dict[str, float] = {}
    for front in ("lean", "httptools", "twisted_web"):
        clock = Clock()
        factory: Any = (FrontFactory(handle, clock) if front == "lean" else HttptoolsSite(handle, clock)
                        if front == "httptools" else twisted_web_site(handle))
        proto = factory.buildProtocol(None)
        transport = StringTransport()
        proto.makeConnection(transport)
        best = float("inf")
        for _ in range(3):
            started = time.process_time()
            for _ in range(n):
                proto.dataReceived(request)
                transport.clear()
            best = min(best, time.process_time() - started)
        out[front] = round(best / n * 1e6, 2)
        proto.connectionLost(Failure(ConnectionError("done")))
        for call in clock.getDelayedCalls():
            call.cancel()
    return out


if __name__ == "__main__":
    import json

    print(json.dumps({"cpu_us_per_request": parse_cost(), "cases": check_cases()}, indent=2))
