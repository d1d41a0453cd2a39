"""
A lean HTTP/1.1 server for the gateway's front.

twisted.web's C{HTTPChannel} and C{Request} cost more CPU per request than
the rest of the gateway together (a line callback and a C{Headers} object
per header, the request's bookkeeping, C{notifyFinish}, access logging).
The gateway answers a handful of JSON endpoints and passes bodies through
without re-encoding them, so this server does only what that needs:

- HTTP/1.1 and 1.0, persistent connections, pipelined requests answered in
  order (one at a time; what arrives meanwhile is read ahead up to
  L{READ_AHEAD} bytes, then the connection is paused);
- request bodies framed by C{Content-Length} or chunked encoding, kept in
  memory up to C{max_body} and discarded past it (the request is then
  marked C{too_large} for the handler to refuse);
- bounded heads (L{MAX_HEAD} bytes, L{MAX_HEADERS} lines); malformed input
  gets a 400 (431, 501, 505 where those say more) in OpenAI's error shape,
  is logged with who sent it, and closes that connection only;
- responses framed by C{Content-Length} when the handler knows it, else
  chunked (HTTP/1.0: until the connection closes), written as they come;
- the connection is the transport's streaming producer and passes
  pause/resume on to the current response's producer (backpressure);
- a connection that goes away tells the current request's C{on_lost};
- slow or idle clients are timed out (see L{FrontFactory}): a request head
  must be complete within C{head_timeout} of its first byte (else 408 and
  close; a connection that sent nothing is just closed), a body must keep
  arriving (C{body_timeout} without a byte: 408 and close), and a kept-alive
  connection with no request is closed after C{keep_alive_timeout}. None of
  them runs while a request is with its handler (waiting for a replica, or
  streaming the response): the proxy's own timeouts govern that.

Each connection has one C{DelayedCall} for all three. Moving a deadline
later (a body's progress, the idle wait after a response) is
C{DelayedCall.reset} or C{delay}, which cost the reactor nothing until the
call comes due; moving it sooner (a head or body starting while the idle wait runs) is
a cancel and a new call, because a sooner C{reset} makes the reactor search
its whole timer heap. A request that arrives in one read and is answered
touches the timer once, when its response ends.

A handler is a callable taking a L{FrontRequest}; it answers (now or later)
with L{FrontRequest.start_response}, L{FrontRequest.write} and
L{FrontRequest.finish}, or drops the connection with L{FrontRequest.abort}.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.interfaces import IDelayedCall, IPushProducer
from twisted.internet.protocol import Protocol, ServerFactory
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http import RESPONSES, datetimeToString
from zope.interface import implementer

from llmgw.gateway.chunked import ChunkedDecoder, ChunkError
from llmgw.gateway.errors import error_body

#: The most a request line and its headers may take.
MAX_HEAD = 64 * 1024
#: The most header lines a request may have.
MAX_HEADERS = 100
#: Bytes read ahead (pipelined requests) while a response is in progress;
#: past this the connection stops reading until the response is done.
READ_AHEAD = 64 * 1024

#: Default seconds from a request's first byte until its head is complete.
HEAD_TIMEOUT = 30.0
#: Default seconds a request body may go without a byte arriving.
BODY_TIMEOUT = 60.0
#: Default seconds a kept-alive connection may wait for its next request.
KEEP_ALIVE_TIMEOUT = 120.0
#: After the gateway closes a connection, how long the client gets to read
#: what is left before the connection is aborted.
CLOSE_LINGER = 30.0

_HEAD, _BODY, _CHUNKED = range(3)
# What the connection's timer watches: nothing (a request is with its
# handler), the wait for a request, a head arriving, a body arriving.
_W_NONE, _W_IDLE, _W_HEAD, _W_BODY = range(4)


class FrontRequest:
    """
    One request, its body read in full, and the way to answer it.

    C{headers} are C{(name, value)} pairs in arrival order, names in lower
    case. C{on_lost}, when set, is called with the reason if the connection
    goes before the response is finished.
    """

    __slots__ = (
        "channel", "method", "uri", "path", "http10", "headers", "body", "too_large",
        "keep_alive", "on_lost", "started", "finished", "producer", "_chunked", "_no_body",
    )

    def __init__(
        self,
        channel: HTTPFront,
        method: bytes,
        uri: bytes,
        http10: bool,
        headers: list[tuple[bytes, bytes]],
        keep_alive: bool,
    ):
        self.channel = channel
        self.method = method
        self.uri = uri
        self.path = uri.partition(b"?")[0]
        self.http10 = http10
        self.headers = headers
        self.keep_alive = keep_alive
        self.body = b""
        self.too_large = False
        self.on_lost: Callable[[Failure], None] | None = None
        self.started = False
        self.finished = False
        self.producer: IPushProducer | None = None
        self._chunked = False
        self._no_body = False

    # what the handler reads

    def header(self, name: bytes) -> bytes | None:
        """
        The first value of header C{name} (lower case), or C{None}.
        """
        for n, v in self.headers:
            if n == name:
                return v
        return None

    @property
    def client_host(self) -> str | None:
        """
        The client's IP address, when it has one.
        """
        return self.channel.peer_host

    @property
    def peer(self) -> str:
        """
        Who sent the request, for log lines.
        """
        return self.channel.peer

    # answering

    def start_response(
        self,
        status: int,
        headers: list[tuple[bytes, bytes]],
        length: int | None = None,
        reason: bytes | None = None,
    ) -> None:
        """
        Send the status line and C{headers}. With C{length} the body is
        framed by C{Content-Length} (C{headers} must not carry one); without,
        it is chunked (to an HTTP/1.0 client: ended by closing).
        """
        if self.started:
            raise RuntimeError("the response has already started")
        self.started = True
        channel = self.channel
        no_body = self.method == b"HEAD" or status in (204, 304) or status < 200
        parts = [b"HTTP/1.1 %d %s\r\n" % (status, reason or RESPONSES.get(status, b"Unknown"))]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        if length is not None:
            parts.append(b"Content-Length: %d\r\n" % length)
        elif not no_body:
            if self.http10:
                self.keep_alive = False
            else:
                self._chunked = True
                parts.append(b"Transfer-Encoding: chunked\r\n")
        if not self.keep_alive:
            parts.append(b"Connection: close\r\n")
        elif self.http10:
            parts.append(b"Connection: keep-alive\r\n")
        parts.append(channel.factory.date_line())
        parts.append(b"\r\n")
        self._no_body = no_body
        channel.transport.write(b"".join(parts))

    def write(self, data: bytes) -> None:
        """
        Send part of the body (after L{start_response}).
        """
        if not data or self.finished or self._no_body:
            return
        if self._chunked:
            self.channel.transport.writeSequence((b"%x\r\n" % len(data), data, b"\r\n"))
        else:
            self.channel.transport.write(data)

    def finish(self) -> None:
        """
        The response is complete; the connection goes on to the next
        request (or closes, if it is not kept alive).
        """
        if self.finished:
            return
        self.finished = True
        self.on_lost = None
        self.producer = None
        if self._chunked:
            self.channel.transport.write(b"0\r\n\r\n")
        self.channel.request_done(self)

    def abort(self) -> None:
        """
        End the response unfinished: what was written goes out, then the
        connection closes (a chunked response lacks its last chunk, so the
        client knows it is incomplete).
        """
        if self.finished:
            return
        self.finished = True
        self.on_lost = None
        self.producer = None
        self.channel.close()

    def set_producer(self, producer: IPushProducer) -> None:
        """
        C{producer} feeds this response: it is paused while the client's
        connection has too much unsent, and resumed when it drains.
        """
        self.producer = producer
        if self.channel.paused:
            producer.pauseProducing()

    def clear_producer(self) -> None:
        self.producer = None


@implementer(IPushProducer)
class HTTPFront(Protocol):
    """
    One client connection; see the module's description.
    """

    log = Logger()
    transport: Any

    def __init__(self, factory: FrontFactory):
        self.factory = factory
        self.max_body = factory.max_body
        self.peer_host: str | None = None
        self.peer = "?"
        self.paused = False
        self._buf = b""
        self._state = _HEAD
        self._request: FrontRequest | None = None
        self._reading: FrontRequest | None = None
        self._parts: list[bytes] = []
        self._remaining = 0
        self._decoder: ChunkedDecoder | None = None
        self._received = 0
        self._busy = False
        self._closing = False
        self._in_consume = False
        self._reading_paused = False
        self._timer: IDelayedCall | None = None
        self._watching = _W_NONE

    def connectionMade(self) -> None:
        transport = self.transport
        peer = transport.getPeer()
        host = getattr(peer, "host", None)
        if host:
            self.peer_host = host
            self.peer = f"{host}:{getattr(peer, 'port', '?')}"
        else:
            self.peer = str(peer)
        try:
            # Streamed events are small writes; Nagle would hold them back.
            transport.setTcpNoDelay(True)
        except AttributeError:
            pass
        transport.registerProducer(self, True)
        # A new connection is there to send a request: it gets the head's
        # time, not the idle wait's.
        self._watch(self.factory.head_timeout, _W_HEAD)

    # timeouts

    def _watch(self, delay: float, what: int) -> None:
        """
        Time out C{what} C{delay} seconds from now, on the one timer.
        """
        self._watching = what
        timer = self._timer
        clock = self.factory.reactor
        if timer is None:
            self._timer = clock.callLater(delay, self._timed_out)
            return
        deadline = clock.seconds() + delay
        due = timer.getTime()
        if due > deadline:
            # Sooner: a reactor finds the call by a linear search of its
            # heap to reset it sooner; cancelling is free, a new call log n.
            timer.cancel()
            self._timer = clock.callLater(delay, self._timed_out)
        elif due < deadline:
            # Later (what DelayedCall.reset does, without reading the
            # clock again): the reactor only looks at it when it comes due.
            timer.delay(deadline - due)

    def _stop_timer(self) -> None:
        self._watching = _W_NONE
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()

    def _timed_out(self) -> None:
        self._timer = None
        what = self._watching
        self._watching = _W_NONE
        if self._closing or what == _W_NONE:
            # A request went to its handler meanwhile; its end restarts
            # the timer.
            return
        factory = self.factory
        if what == _W_IDLE:
            self.log.debug("closing idle connection from {peer}", peer=self.peer)
            self.close()
        elif what == _W_HEAD:
            if self._buf:
                self._refuse(
                    408, f"The request head was not complete within {factory.head_timeout:g} s", "request_timeout"
                )
            else:
                self.log.debug("closing connection from {peer}: no request within {timeout} s",
                               peer=self.peer, timeout=factory.head_timeout)
                self.close()
        else:
            self._refuse(
                408, f"The request body stalled: nothing arrived for {factory.body_timeout:g} s", "request_timeout"
            )

    # reading

    def dataReceived(self, data: bytes) -> None:
        if self._closing:
            return
        if self._busy:
            buf = self._buf = self._buf + data if self._buf else data
            if len(buf) > READ_AHEAD and not self._reading_paused:
                self._reading_paused = True
                self.transport.pauseProducing()
            return
        self._consume(self._buf + data if self._buf else data)

    def _consume(self, buf: bytes) -> None:
        self._in_consume = True
        try:
            while buf and not self._busy and not self._closing:
                state = self._state
                if state == _HEAD:
                    if buf[:1] in (b"\r", b"\n"):
                        # Empty lines before a request line are allowed.
                        buf = buf.lstrip(b"\r\n")
                        continue
                    end = buf.find(b"\r\n\r\n")
                    if end < 0:
                        if len(buf) > MAX_HEAD:
                            self._refuse(431, f"The request head is over {MAX_HEAD} bytes", "head_too_large")
                            return
                        break
                    if end > MAX_HEAD:
                        self._refuse(431, f"The request head is over {MAX_HEAD} bytes", "head_too_large")
                        return
                    head = buf[:end]
                    buf = buf[end + 4 :]
                    self._head(head)
                elif state == _BODY:
                    n = self._remaining
                    if len(buf) < n:
                        self._remaining = n - len(buf)
                        self._body_piece(buf)
                        buf = b""
                        break
                    self._body_piece(buf[:n] if len(buf) > n else buf)
                    buf = buf[n:]
                    self._remaining = 0
                    self._dispatch()
                else:
                    buf = self._chunks(buf)
                    if self._state != _HEAD:
                        break
            self._buf = buf
        finally:
            self._in_consume = False
        if self._closing:
            return
        if self._busy:
            if len(self._buf) > READ_AHEAD and not self._reading_paused:
                self._reading_paused = True
                self.transport.pauseProducing()
        elif self._state != _HEAD:
            # A body is arriving: each read of it puts the deadline later.
            if self._watching == _W_BODY:
                self._timer.reset(self.factory.body_timeout)  # type: ignore[union-attr]
            else:
                self._watch(self.factory.body_timeout, _W_BODY)
        elif self._buf:
            # Part of a head: its time runs from its first byte.
            if self._watching != _W_HEAD:
                self._watch(self.factory.head_timeout, _W_HEAD)
        elif self._watching == _W_NONE:
            # A response ended and nothing more is here: wait for the next.
            self._watch(self.factory.keep_alive_timeout, _W_IDLE)

    def _head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        if head.count(b"\n") != len(lines) - 1 or head.count(b"\r") != len(lines) - 1 or b"\0" in head:
            self._refuse(400, "The request head has a bare CR, LF or NUL", "bad_request")
            return
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not parts[0].isalpha() or not parts[1]:
            self._refuse(400, f"Malformed request line {lines[0][:80]!r}", "bad_request")
            return
        method, uri, version = parts
        if version == b"HTTP/1.1":
            http10 = False
        elif version == b"HTTP/1.0":
            http10 = True
        elif version.startswith(b"HTTP/"):
            self._refuse(505, f"HTTP version {version[:20]!r} is not supported", "bad_request")
            return
        else:
            self._refuse(400, f"Malformed request line {lines[0][:80]!r}", "bad_request")
            return
        if len(lines) > MAX_HEADERS + 1:
            self._refuse(431, f"The request has over {MAX_HEADERS} header lines", "too_many_headers")
            return
        headers: list[tuple[bytes, bytes]] = []
        length: bytes | None = None
        chunked = False
        connection: bytes | None = None
        expect = False
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name[-1:] in b" \t" or name[:1] in b" \t":
                self._refuse(400, f"Malformed header line {line[:80]!r}", "bad_request")
                return
            name = name.lower()
            value = value.strip(b" \t")
            if name == b"content-length":
                if not value.isdigit() or (length is not None and value != length):
                    self._refuse(400, f"Bad Content-Length {value[:40]!r}", "bad_request")
                    return
                length = value
            elif name == b"transfer-encoding":
                if value.lower() != b"chunked" or chunked:
                    self._refuse(
                        501, f"Transfer-Encoding {value[:40]!r} is not supported (only chunked)", "bad_request"
                    )
                    return
                chunked = True
            elif name == b"connection":
                connection = value.lower()
            elif name == b"expect":
                expect = value.lower() == b"100-continue"
            headers.append((name, value))
        if chunked and length is not None:
            self._refuse(400, "A request cannot have both Content-Length and Transfer-Encoding", "bad_request")
            return
        keep_alive = not http10
        if connection is not None:
            if b"close" in connection:
                keep_alive = False
            elif http10 and b"keep-alive" in connection:
                keep_alive = True
        request = FrontRequest(self, method, uri, http10, headers, keep_alive)
        self._reading = request
        self._parts = []
        self._received = 0
        if chunked:
            self._decoder = ChunkedDecoder()
            self._state = _CHUNKED
        elif length is not None and length.lstrip(b"0"):
            n = int(length) if len(length) < 19 else 1 << 62
            if n > self.max_body:
                request.too_large = True
                if expect:
                    # The client waits for a go-ahead before sending the
                    # body: refuse now, and never read it.
                    self._reading = None
                    self._busy = True
                    self._watching = _W_NONE
                    self._request = request
                    request.keep_alive = False
                    self.factory.dispatch(request)
                    return
            self._remaining = n
            self._state = _BODY
        else:
            self._dispatch()
            return
        if expect and not http10:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _body_piece(self, data: bytes) -> None:
        request = self._reading
        assert request is not None
        if request.too_large:
            return
        self._received += len(data)
        if self._received > self.max_body:
            request.too_large = True
            self._parts = []
            return
        self._parts.append(data)

    def _chunks(self, buf: bytes) -> bytes:
        """
        Read chunked body framing from C{buf}; returns what is left over
        (kept for the next call, or the next request's bytes).
        """
        decoder = self._decoder
        assert decoder is not None
        try:
            used = decoder.feed(buf, self._body_piece)
        except ChunkError as e:
            self._decoder = None
            if e.trailer:
                self._refuse(431, "The request's trailer is too long", "head_too_large")
            else:
                self._refuse(400, str(e), "bad_request")
            return b""
        if decoder.done:
            self._decoder = None
            self._dispatch()
        return buf[used:] if used < len(buf) else b""

    def _dispatch(self) -> None:
        request = self._reading
        assert request is not None
        self._reading = None
        self._state = _HEAD
        parts = self._parts
        if parts and not request.too_large:
            request.body = parts[0] if len(parts) == 1 else b"".join(parts)
        self._parts = []
        self._busy = True
        self._watching = _W_NONE
        self._request = request
        self.factory.dispatch(request)

    # the response's end

    def request_done(self, request: FrontRequest) -> None:
        """
        C{request}'s response is complete: go on to the next request.
        """
        if request is not self._request:
            return
        self._request = None
        self._busy = False
        if not request.keep_alive:
            self.close()
            return
        if self._reading_paused:
            self._reading_paused = False
            self.transport.resumeProducing()
        if self._in_consume or self._closing:
            # _consume goes on with what is buffered, and sets the timer.
            return
        if self._buf:
            buf, self._buf = self._buf, b""
            self._consume(buf)
        else:
            self._watch(self.factory.keep_alive_timeout, _W_IDLE)

    def close(self) -> None:
        """
        Send what is buffered, then close; read nothing more.
        """
        if not self._closing:
            self._closing = True
            self._buf = b""
            self._stop_timer()
            self.transport.loseConnection()
            # A client that never reads what is left must not hold the
            # socket: the one timer now aborts the connection.
            self._timer = self.factory.reactor.callLater(CLOSE_LINGER, self._linger_expired)

    def _linger_expired(self) -> None:
        self._timer = None
        self.log.debug("aborting connection from {peer}: it did not read its last {linger} s",
                       peer=self.peer, linger=CLOSE_LINGER)
        self.transport.abortConnection()

    def _refuse(self, status: int, message: str, code: str) -> None:
        self.log.info(
            "refused a request from {peer}: {status} {message}", peer=self.peer, status=status, message=message
        )
        body = error_body(message, "invalid_request_error", code)
        reason = RESPONSES.get(status, b"Bad Request")
        self.transport.write(
            b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            b"Connection: close\r\n%s\r\n%s" % (status, reason, len(body), self.factory.date_line(), body)
        )
        self._reading = None
        self.close()

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        self._closing = True
        self._buf = b""
        self._stop_timer()
        request, self._request = self._request, None
        if request is not None and not request.finished:
            request.finished = True
            hook, request.on_lost = request.on_lost, None
            request.producer = None
            if hook is not None:
                hook(reason)

    # IPushProducer, for the transport: its send buffer is full or drained

    def pauseProducing(self) -> None:
        self.paused = True
        request = self._request
        if request is not None and request.producer is not None:
            request.producer.pauseProducing()

    def resumeProducing(self) -> None:
        self.paused = False
        request = self._request
        if request is not None and request.producer is not None:
            request.producer.resumeProducing()

    def stopProducing(self) -> None:
        # The connection is going; connectionLost tells the request.
        pass


class FrontFactory(ServerFactory):
    """
    Serves C{handle} (a callable taking a L{FrontRequest}) with bodies up
    to C{max_body} bytes. C{reactor} is the clock of every timeout: a
    request head must be complete within C{head_timeout} seconds of its
    first byte (or of the connection's start), a body may go
    C{body_timeout} seconds without a byte, and a kept-alive connection may
    wait C{keep_alive_timeout} seconds for its next request.
    """

    log = Logger()
    noisy = False

    def __init__(
        self,
        handle: Callable[[FrontRequest], Any],
        reactor: Any,
        max_body: int = 8 * 1024 * 1024,
        head_timeout: float = HEAD_TIMEOUT,
        body_timeout: float = BODY_TIMEOUT,
        keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT,
    ):
        self.handle = handle
        self.reactor = reactor
        self.max_body = max_body
        self.head_timeout = head_timeout
        self.body_timeout = body_timeout
        self.keep_alive_timeout = keep_alive_timeout
        self._date_second = -1
        self._date = b""

    def buildProtocol(self, addr: Any) -> HTTPFront:
        return HTTPFront(self)

    def dispatch(self, request: FrontRequest) -> None:
        try:
            self.handle(request)
        except Exception:
            self.log.failure("handling {method} {path} from {peer}", method=request.method,
                             path=request.path[:200], peer=request.peer)
            if not request.started:
                body = error_body("The gateway failed to handle the request", "server_error", "internal_error")
                request.keep_alive = False
                request.start_response(500, [(b"Content-Type", b"application/json")], len(body))
                request.write(body)
                request.finish()
            else:
                request.abort()

    def date_line(self) -> bytes:
        """
        The C{Date} header line, formatted once a second.
        """
        now = int(self.reactor.seconds())
        if now != self._date_second:
            self._date_second = now
            self._date = b"Date: " + datetimeToString(now) + b"\r\n"
        return self._date
