"""
The watch stream's clients (L{llmgw.control.admin.watch}): C{GET
/api/v1/watch} (L{WatchResource}) hands an authorised request's connection
over to a L{WatchProtocol}, which the hub writes to. A client may also send
requests over the socket (C{{"type": "request", ...}}): each is rendered by
the admin API's own tree as a L{SocketRequest} of that connection (its
admin identity, its Host), and answered with a C{response} message.

Requests are bounded per socket: L{MAX_REQUESTS_IN_FLIGHT} unanswered, and
a token bucket of L{REQUEST_BURST} that refills at L{REQUEST_RATE} a
second; a request past it is answered 429, and a socket that goes on
sending past it (L{FLOOD_REFUSALS} refusals in a row) is closed with 1008
(policy violation). A socket whose answers and stream messages wait
unwritten (its transport paused us) is not read until they drain, so a
client that sends and never reads costs no more than one buffer.
"""

from __future__ import annotations

import json
from typing import Any

from autobahn.twisted.websocket import WebSocketServerFactory, WebSocketServerProtocol
from twisted.internet.interfaces import IPushProducer
from twisted.web.http_headers import Headers
from zope.interface import implementer

from llmgw.control.admin.auth import known_admin, same_origin
from llmgw.control.admin.base import AdminNode, Refused, printable
from llmgw.control.admin.watch import ResumeError, WatchHub, parse_resume
from llmgw.transportpeek import busy, raw_socket
from llmgw.untrusted import MAX_JSON_DEPTH, JSONInputError, load_json
from llmgw.wslog import WebSocketLogger

#: Largest message a client may send, in bytes.
MAX_CLIENT_MESSAGE = 64 * 1024
#: Requests a socket may send at once (after a pause), and a second after.
REQUEST_BURST = 32
REQUEST_RATE = 32.0
#: Requests refused in a row (over the rate) after which the socket is
#: closed as a flood.
FLOOD_REFUSALS = 64
#: Seconds a flooding socket's close frame may take to go out before the
#: connection is aborted (its peer may read nothing).
FLOOD_CLOSE_GRACE = 5.0


class RequestBudget:
    """
    A token bucket: C{burst} requests at once, refilled at C{rate} a
    second. Pure: L{take} is given the time.
    """

    __slots__ = ("burst", "rate", "tokens", "last")

    def __init__(self, burst: int, rate: float, now: float):
        self.burst = burst
        self.rate = rate
        self.tokens = float(burst)
        self.last = now

    def take(self, now: float) -> bool:
        """
        Whether a request at C{now} is within the budget (and count it).
        """
        if now > self.last:
            self.tokens = min(float(self.burst), self.tokens + (now - self.last) * self.rate)
            self.last = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


def _write_now(transport: Any, data: bytes) -> None:
    """
    C{transport.write(data)}, but straight to the socket when the transport
    is a TCP connection holding nothing of its own and not closing (what
    L{llmgw.transportpeek} vouches for): a flush to a thousand clients then
    costs a C{send} each, not also two C{epoll_ctl} and a reactor round.
    Whatever the socket does not take, and any socket error, goes the
    ordinary way. The caller sends only while the client is not paused.
    """
    sock = raw_socket(transport)
    if sock is None or busy(transport):
        transport.write(data)
        return
    try:
        sent = sock.send(data)
    except OSError:
        transport.write(data)
        return
    if sent < len(data):
        transport.write(data[sent:])


@implementer(IPushProducer)
class _Backpressure:
    """
    Registered on a watch client's transport: its pauses tell the client to
    hold what it is sent.
    """

    def __init__(self, client: WatchProtocol):
        self.client = client

    def pauseProducing(self) -> None:
        self.client.paused = True
        self.client.reading(False)

    def resumeProducing(self) -> None:
        self.client.resumed()

    def stopProducing(self) -> None:
        self.client.paused = True


class WatchProtocol(WebSocketServerProtocol):
    """
    One watch client. Its C{hub}, C{fleet_reader}, C{since}, C{epoch} and
    C{who} are set before the connection is handed over.
    """

    # Autobahn's handshake and frame dumps stay out of the log (debug).
    log = WebSocketLogger()
    hub: WatchHub
    fleet_reader = True
    since: int | None = None
    epoch: str | None = None
    who = "?"
    paused = False
    attached = False
    #: Closed as a flood: nothing more it sends is read.
    flooded = False

    resource: Any = None
    serial: int | None = None
    channel: Any = None
    host: bytes = b""
    #: The upgrade's C{Cookie} headers (a logged-in browser's session).
    cookies: list[bytes] = []
    address: Any = None

    def __init__(self) -> None:
        super().__init__()
        self.requests: set[SocketRequest] = set()
        self._held: list[bytes] = []
        self._held_bytes = 0
        self._budget: RequestBudget | None = None
        self._refused = 0
        self._refused_in_a_row = 0
        self._abort_later: Any = None

    def onOpen(self) -> None:
        transport: Any = self.transport
        if getattr(transport, "producer", None) is not None:
            transport.unregisterProducer()
        transport.registerProducer(_Backpressure(self), True)
        self.attached = True
        self.hub.attach(self, self.since, self.epoch)

    def onMessage(self, payload: bytes, isBinary: bool) -> None:  # noqa: N803
        if self.flooded:
            return
        if not self._within_budget():
            self._over_budget(payload)
            return
        try:
            rid, method, path, body, csrf = parse_request(payload)
        except RequestError as e:
            self.log.info("watch: refused a message from {who}: {reason}", who=self.who, reason=str(e))
            self._answer(getattr(e, "rid", None), 400, {"error": str(e), "status": 400})
            return
        if len(self.requests) >= MAX_REQUESTS_IN_FLIGHT:
            self._answer(rid, 429, {"error": f"over {MAX_REQUESTS_IN_FLIGHT} requests in flight on this "
                                    "socket; wait for answers", "status": 429})
            return
        if self.resource is None:
            self._answer(rid, 404, {"error": "this stream serves no requests", "status": 404})
            return
        request = SocketRequest(self, rid, method, path, body, csrf)
        self.requests.add(request)
        request.run(self.resource)

    def _within_budget(self) -> bool:
        now = self.hub.clock.seconds()
        if self._budget is None:
            self._budget = RequestBudget(REQUEST_BURST, REQUEST_RATE, now)
        if self._budget.take(now):
            self._refused_in_a_row = 0
            return True
        return False

    def _over_budget(self, payload: bytes) -> None:
        """
        Refuse a request sent past the rate (429), or close the socket
        (1008) once it keeps flooding: its later messages are not read.
        """
        self._refused += 1
        self._refused_in_a_row += 1
        if self._refused_in_a_row > FLOOD_REFUSALS:
            self.log.warn(
                "watch: closing {who}'s socket: it sent {n} requests in a row past {rate:g} a second "
                "(burst {burst})", who=self.who, n=self._refused_in_a_row, rate=REQUEST_RATE, burst=REQUEST_BURST,
            )
            self.flooded = True
            self.reading(False)
            if self.attached:
                self.attached = False
                self.hub.detach(self)
            reason = f"more than {REQUEST_RATE:g} requests a second, refused {self._refused_in_a_row} in a row"
            # sendClose takes only 1000 and 3000-4999; 1008 is the code
            # RFC 6455 gives a policy violation.
            self.sendCloseFrame(code=self.CLOSE_STATUS_CODE_POLICY_VIOLATION, reasonUtf8=reason.encode()[:123])
            # Dropped at once (its unread messages are not worth reading);
            # the close frame goes first unless its buffer is already full,
            # and is given a grace to go out.
            self.dropConnection(abort=self.paused)
            transport: Any = self.transport
            if not self.paused and transport is not None:
                self._abort_later = self.hub.clock.callLater(FLOOD_CLOSE_GRACE, transport.abortConnection)
            return
        if self._refused == 1:
            self.log.info("watch: {who} sends requests faster than {rate:g} a second (burst {burst}); "
                          "refusing the excess", who=self.who, rate=REQUEST_RATE, burst=REQUEST_BURST)
        try:
            rid = parse_request(payload)[0]
        except RequestError as e:
            rid = getattr(e, "rid", None)
        self._answer(rid, 429, {"error": f"over {REQUEST_RATE:g} requests a second on this socket (a burst of "
                                f"{REQUEST_BURST}); slow down", "status": 429})

    def reading(self, on: bool) -> None:
        """
        Read the socket again (C{on}), or stop reading it: while its
        answers wait unwritten, and once it is closed as a flood.
        """
        transport: Any = self.transport
        if transport is None or getattr(transport, "disconnecting", False) or (on and self.flooded):
            return
        if on:
            transport.resumeProducing()
        else:
            transport.pauseProducing()

    def _answer(self, rid: Any, status: int, body: Any) -> None:
        message = {"type": "response", "id": rid, "status": status, "body": body}
        self.send_framed(self.hub.frame(message))

    def onClose(self, wasClean: bool, code: int | None, reason: str | None) -> None:  # noqa: N803
        if self._abort_later is not None and self._abort_later.active():
            self._abort_later.cancel()
        self._abort_later = None
        for request in list(self.requests):
            request.gone()
        if self.attached:
            self.attached = False
            self.hub.detach(self)

    def send_framed(self, data: bytes) -> None:
        """
        Write already framed messages, or hold them while the transport is
        full; past the hub's C{max_buffer} held bytes, drop the client.
        """
        if not self.attached or self.transport is None:
            return
        if not self.paused:
            _write_now(self.transport, data)
            return
        self._held.append(data)
        self._held_bytes += len(data)
        if self._held_bytes > self.hub.max_buffer:
            self.log.warn(
                "watch: dropping {who}: it reads too slowly ({n} bytes waiting over {limit})",
                who=self.who, n=self._held_bytes, limit=self.hub.max_buffer,
            )
            self.hub.dropped += 1
            self._held, self._held_bytes = [], 0
            self.attached = False
            self.hub.detach(self)
            transport: Any = self.transport
            transport.abortConnection()

    def resumed(self) -> None:
        self.paused = False
        held, self._held, self._held_bytes = self._held, [], 0
        if held and self.attached and self.transport is not None:
            self.transport.write(b"".join(held))
        if not self.paused:
            self.reading(True)


#: Requests a socket may have unanswered at once.
MAX_REQUESTS_IN_FLIGHT = 16


class RequestError(ValueError):
    """
    A message from a client is not a request.
    """


def parse_request(payload: bytes) -> tuple[Any, str, str, Any, str | None]:
    """
    A C{{"type": "request", "id": ID, "method": "GET"|"POST", "path":
    "/api/v1/...", "body": {...}, "csrf": TOKEN}} message's id, method,
    path, body and CSRF token (which a logged-in page repeats on writes, as
    C{X-CSRF-Token} over HTTP).

    The message is read as the REST API reads a body (L{load_json}): its
    C{body} nests at most as deep as a REST body may, and a message that
    nests deeper, repeats a key or is not JSON (C{NaN}, C{Infinity}, a byte
    order mark) is refused, never a C{RecursionError}.

    @raise RequestError: it is not one (its C{rid} attribute is the id,
        when one could be read).
    """
    try:
        # One level more than a REST body: the body is inside the message.
        message = load_json(payload, max_depth=MAX_JSON_DEPTH + 1, unique=None)
    except JSONInputError as e:
        raise RequestError(f"a message is a JSON request object: {e}") from None
    if not isinstance(message, dict):
        raise RequestError("a message is a JSON request object")
    rid = message.get("id")
    problem = None
    if message.get("type") != "request":
        problem = 'a message is a request: "type": "request"'
    elif isinstance(rid, bool) or not isinstance(rid, int | str):
        problem = '"id" must be a number or a string'
    elif message.get("method") not in ("GET", "POST"):
        problem = '"method" must be "GET" or "POST"'
    elif not isinstance(message.get("path"), str) or not message["path"].startswith("/"):
        problem = '"path" must be a string starting with /'
    elif "body" in message and not isinstance(message["body"], dict):
        problem = '"body" must be a JSON object'
    elif "csrf" in message and not isinstance(message["csrf"], str):
        problem = '"csrf" must be a string'
    if problem is not None:
        err = RequestError(problem)
        err.rid = rid if isinstance(rid, int | str) and not isinstance(rid, bool) else None  # type: ignore[attr-defined]
        raise err
    return rid, message["method"], message["path"], message.get("body"), message.get("csrf")


class SocketRequest:
    """
    A request that came over the watch socket, shaped as much like a
    C{twisted.web} request as the admin API's tree needs, so that the tree
    (authorisation, routing, handlers, errors) answers it. The answer goes back as a C{response}
    message with the same C{id}, the HTTP status and the JSON body.
    """

    def __init__(self, protocol: WatchProtocol, rid: Any, method: str, path: str, body: Any,
                 csrf: str | None = None):
        from io import BytesIO
        from urllib.parse import parse_qs, urlsplit

        self.protocol = protocol
        self.rid = rid
        parts = urlsplit(path)
        self.method = method.encode("ascii")
        self.uri = path.encode("utf-8")
        self.path = parts.path.encode("utf-8")
        self.prepath: list[bytes] = []
        self.postpath = [seg.encode("utf-8") for seg in parts.path.split("/")[1:]]
        self.args = {
            k.encode("utf-8"): [v.encode("utf-8") for v in vs]
            for k, vs in parse_qs(parts.query, keep_blank_values=True).items()
        }
        self.content = BytesIO(json.dumps(body).encode("utf-8") if body is not None else b"")
        self.channel = protocol.channel
        self.transport = None
        # The upgrade's own request line and Host, which the admin API
        # checked when the socket opened; the checks at the API's entry
        # read them again for each request that comes over it.
        self.clientproto = b"HTTP/1.1"
        self.requestHeaders = Headers({b"content-type": [b"application/json"]})
        if protocol.host:
            self.requestHeaders.setRawHeaders(b"host", [protocol.host])
        # A logged-in browser's socket: its session is checked again for
        # each request, so a logout or an expiry ends what it may do.
        if protocol.cookies:
            self.requestHeaders.setRawHeaders(b"cookie", protocol.cookies)
        if csrf is not None:
            self.requestHeaders.setRawHeaders(b"x-csrf-token", [csrf.encode("utf-8", "replace")])
        self.code = 200
        self._out: list[bytes] = []
        self._finish_waiters: list[Any] = []
        self.finished = False

    # -- what the resource reads -------------------------------------------------------

    def getHeader(self, name: bytes) -> bytes | None:  # noqa: N802
        values = self.requestHeaders.getRawHeaders(name)
        return values[-1] if values else None

    def getClientAddress(self) -> Any:  # noqa: N802
        return self.protocol.address

    # -- what it writes ------------------------------------------------------------------

    def setResponseCode(self, code: int, message: bytes | None = None) -> None:  # noqa: N802
        self.code = code

    def setHeader(self, name: bytes, value: bytes) -> None:  # noqa: N802
        pass

    def write(self, data: bytes) -> None:
        self._out.append(data)

    def notifyFinish(self) -> Any:  # noqa: N802
        from twisted.internet.defer import Deferred

        d: Deferred[None] = Deferred()
        self._finish_waiters.append(d)
        return d

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        self.protocol.requests.discard(self)
        raw = b"".join(self._out)
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")  # /metrics is text
        self.protocol._answer(self.rid, self.code, body)
        waiters, self._finish_waiters = self._finish_waiters, []
        for d in waiters:
            d.callback(None)

    def gone(self) -> None:
        """
        The socket closed before the answer: handlers waiting (a long-poll)
        are told, as a web request's are.
        """
        from twisted.internet.error import ConnectionLost
        from twisted.python.failure import Failure

        self.finished = True
        waiters, self._finish_waiters = self._finish_waiters, []
        for d in waiters:
            d.errback(Failure(ConnectionLost("the watch socket closed")))

    def run(self, resource: Any) -> None:
        """
        Answer this request with the admin API's tree, whose root is
        C{resource} (which finds the resource for the path itself).
        """
        from twisted.web.server import NOT_DONE_YET

        result = resource.render(self)
        if result is not NOT_DONE_YET and not self.finished:
            if isinstance(result, bytes):
                self.write(result)
            self.finish()


class WatchFactory(WebSocketServerFactory):
    protocol = WatchProtocol

    def __init__(self, hub: WatchHub):
        super().__init__()
        self.hub = hub
        self.setProtocolOptions(
            maxFramePayloadSize=MAX_CLIENT_MESSAGE,
            maxMessagePayloadSize=MAX_CLIENT_MESSAGE,
            autoPingInterval=30 if hub.timeouts else 0,
            autoPingTimeout=15 if hub.timeouts else 0,
            openHandshakeTimeout=10 if hub.timeouts else 0,
            closeHandshakeTimeout=1 if hub.timeouts else 0,
            perMessageCompressionAccept=lambda offers: None,
        )


def upgrade(request: Any, factory: WatchFactory, fleet_reader: bool, since: int | None,
            epoch: str | None, who: str, resource: Any = None) -> Any:
    """
    Hand C{request}'s connection over to a L{WatchProtocol} (as autobahn's
    C{WebSocketResource} does), already authorised by the admin API.
    """
    from twisted.protocols.policies import ProtocolWrapper
    from twisted.web.server import NOT_DONE_YET

    channel = request.channel
    if channel.transport is None:
        request.setResponseCode(426)
        request.setHeader(b"upgrade", b"websocket")
        return b'{"error": "the watch stream needs an HTTP/1.1 WebSocket upgrade", "status": 426}\n'
    protocol: Any = factory.buildProtocol(request.transport.getPeer())
    protocol.hub = factory.hub
    protocol.fleet_reader = fleet_reader
    protocol.since = since
    protocol.epoch = epoch
    protocol.who = who
    # Requests over the socket are rendered by the admin API's own resource
    # as this connection's (its admin identity, its Host).
    protocol.resource = resource
    protocol.channel = channel
    protocol.serial = getattr(channel, "llmgw_admin_serial", None)
    protocol.host = request.getHeader(b"host") or b""
    protocol.cookies = request.requestHeaders.getRawHeaders(b"cookie") or []
    protocol.address = request.getClientAddress()
    channel.setTimeout(None)
    transport, channel.transport = channel.transport, None
    if isinstance(transport, ProtocolWrapper):
        transport.wrappedProtocol = protocol
    elif isinstance(getattr(transport, "protocol", None), ProtocolWrapper):
        transport.protocol.wrappedProtocol = protocol
    else:
        transport.protocol = protocol
    if getattr(transport, "producer", None) is not None:
        transport.unregisterProducer()
    protocol.makeConnection(transport)
    if hasattr(transport, "resumeProducing"):
        transport.resumeProducing()
    data = request.method + b" " + request.uri + b" HTTP/1.1\r\n"
    for name, values in request.requestHeaders.getAllRawHeaders():
        data += name + b": " + b",".join(values) + b"\r\n"
    data += b"\r\n"
    protocol.dataReceived(data)
    return NOT_DONE_YET


class WatchResource(AdminNode):
    """
    C{GET /api/v1/watch}: upgrade an authorised request to the watch stream;
    the C{gateway} role, and C{?only=routes}, are sent routes only. A 404 on
    an API that serves no stream (its root's C{watch_factory} is C{None}).
    """

    def render_GET(self, request: Any) -> Any:  # noqa: N802
        root = self.root
        if root.watch_factory is None:
            raise Refused(404, "this control plane serves no watch stream")
        if isinstance(request, SocketRequest):
            raise Refused(400, "this request came over the watch stream already")
        origin = request.getHeader(b"origin")
        if origin is not None and not same_origin(origin, request.getHeader(b"host") or b""):
            # Browsers let any page open a WebSocket anywhere; the socket
            # takes commands, so only a page of this API may open it.
            raise Refused(403, f"a WebSocket from origin {printable(origin[:200])} is refused: "
                               "only pages of this admin API may open the stream")
        if (request.getHeader(b"upgrade") or b"").lower() != b"websocket":
            request.setHeader(b"upgrade", b"websocket")
            raise Refused(426, "/api/v1/watch is a WebSocket: send Upgrade: websocket")
        try:
            since, epoch, routes_only = parse_resume(request.args)
        except ResumeError as e:
            raise Refused(400, str(e)) from None
        admin = known_admin(request)
        who = root.who(request)
        root.log.info("admin API: watch stream opened by {client} (since {since})", client=who, since=since)
        fleet_reader = (admin is None or admin.role != "gateway") and not routes_only
        return upgrade(request, root.watch_factory, fleet_reader=fleet_reader, since=since,
                       epoch=epoch, who=who, resource=root)
