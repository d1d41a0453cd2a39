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
  memory up to C{max_body}; a request whose declared length is over it (or
  whose chunked body passes it) goes to the handler at once, marked
  C{too_large} and with no body, the rest of the body is never read, and
  the connection closes after the answer;
- bounded heads (L{MAX_HEAD} bytes, L{httphead.MAX_HEADERS} lines), read from one
  buffer with a scan offset, so a head trickling in costs linear time;
  header names must be tokens, no control bytes anywhere in the head, one
  C{Host} (required in HTTP/1.1), one C{Authorization}, no bare CR or LF;
  an absolute-form target is its path, its authority the C{Host}; chunk
  extensions checked, trailers bounded as a head is;
  malformed input gets a 400 (431, 501, 505 where those say more) in
  OpenAI's error shape, is logged with who sent it, and closes that
  connection only;
- responses framed by C{Content-Length} when the handler knows it, else
  chunked (HTTP/1.0: until the connection closes), written as they come;
- the connection is the transport's streaming producer and passes
  pause/resume on to the current response's producer (backpressure);
- a connection that goes away tells the current request's C{on_lost};
- at most C{max_connections} client connections, and C{max_per_address}
  from one address when set (see L{FrontFactory});
- a request's head goes to the factory's C{screen}, when it has one, before
  any of its body is read: a request it refuses (a missing API key) is
  answered at once, its body never read (with a body announced, the
  connection closes after the answer, as for a body over the limit);
- slow or idle clients are timed out (see L{FrontFactory}), and a client
  that does not read its answers is not read either: the timeouts, and the
  holding back, are described in L{llmgw.gateway.frontflow}.

A handler is a callable taking a L{FrontRequest}; it answers (now or later)
with L{FrontRequest.start_response}, L{FrontRequest.write} and
L{FrontRequest.finish}, or drops the connection with L{FrontRequest.abort}.

This module is the connection (L{HTTPFront}) and its factory; a request
and its answer are L{llmgw.gateway.frontrequest}, and reading a request
head is L{llmgw.gateway.httphead}.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from mypy_extensions import mypyc_attr
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http import datetimeToString
from zope.interface import classImplements

from llmgw.gateway.chunked import ChunkedDecoder, ChunkError
from llmgw.gateway.deadline import SLACK, Deadline
from llmgw.gateway.errors import error_body
from llmgw.gateway.frontaccept import MAX_CONNECTIONS, CappedFactory
from llmgw.gateway.frontflow import (
    BODY_TIMEOUT,
    HEAD_TIMEOUT,
    KEEP_ALIVE_TIMEOUT,
    PASS_OUTPUT,
    PASS_REQUESTS,
    READ_AHEAD,
    REQUEST_TIMEOUT,
    SEND_TIMEOUT,
    Outflow,
)
from llmgw.gateway.frontrequest import REASONS, FrontRequest
from llmgw.gateway.httphead import MAX_HEAD, HeadRefused, head_so_far, parse_head
from llmgw.gateway.wire import after_sent, send_now

_HEAD, _BODY, _CHUNKED = range(3)
# What the connection's timer watches: nothing (a request is with its
# handler), the wait for a request, a head arriving, a body arriving, the
# output draining (stalled: see L{llmgw.gateway.frontflow}).
_W_NONE, _W_IDLE, _W_HEAD, _W_BODY, _W_SEND = range(5)


class HTTPFront(Protocol):
    """
    One client connection; see the module's description.
    """

    # Named, and a ClassVar (setup.py's rules for compiled classes).
    log: ClassVar[Logger] = Logger(namespace=f"{__name__}.HTTPFront")
    transport: Any

    def __init__(self, factory: FrontFactory):
        self.factory = factory
        self.max_body = factory.max_body
        self.peer_host: str | None = None
        self.peer = "?"
        self.paused = False
        self._buf = bytearray()
        self._scan = 0
        self._unread_body = False
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
        #: What holds the connection back while its answers wait.
        self.flow = Outflow(factory.reactor, self._go_on)
        #: The one deadline of the head, the body or the idle wait, as
        #: C{_watching} says (first set when the connection is made).
        self._deadline: Deadline = Deadline(factory.reactor, self._timed_out)
        self._watching = _W_NONE
        #: When the request being read must be complete (the reactor's
        #: seconds), set as its first byte arrives.
        self._request_at = 0.0
        #: The address counted against the factory's per-address cap.
        self.counted_host: str | None = None
        #: Writes to the client: at once when nothing is queued (see
        #: L{llmgw.gateway.wire}).
        self.send: Callable[[bytes], None] = self._send_unconnected

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
        self.send = send_now(transport)
        # A new connection is there to send a request: it gets the head's
        # time, not the idle wait's.
        self._watch_head()

    def _send_unconnected(self, data: bytes) -> None:
        self.transport.write(data)

    # timeouts

    def _watch(self, delay: float, what: int) -> None:
        """
        Time out C{what} C{delay} seconds from now, on the one deadline.
        """
        self._watching = what
        self._deadline.set(delay)

    def _watch_head(self) -> None:
        """
        A request starts now: its head is due within C{head_timeout}, all
        of it within C{request_timeout}.
        """
        factory = self.factory
        self._request_at = factory.reactor.seconds() + factory.request_timeout
        self._watch(min(factory.head_timeout, factory.request_timeout), _W_HEAD)

    def _body_delay(self) -> float:
        """
        Seconds the body may now go without a byte: C{body_timeout}, and
        never past the whole request's deadline, so that a byte now and
        then does not keep a request open.
        """
        left = self._request_at - self.factory.reactor.seconds()
        return max(0.0, min(self.factory.body_timeout, left))

    def _stop_timer(self) -> None:
        self._watching = _W_NONE
        self._deadline.stop()

    def _timed_out(self) -> None:
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
        elif what == _W_SEND:
            self.log.info("aborting connection from {peer}: it took none of its answers for {timeout:g} s",
                          peer=self.peer, timeout=factory.send_timeout)
            self._closing = True
            self.transport.abortConnection()
        elif what == _W_HEAD:
            if self._buf:
                limit = min(factory.head_timeout, factory.request_timeout)
                self._refuse(408, f"The request head was not complete within {limit:g} s", "request_timeout")
            else:
                self.log.debug("closing connection from {peer}: no request within {timeout} s",
                               peer=self.peer, timeout=factory.head_timeout)
                self.close()
        elif self._request_at - factory.reactor.seconds() <= SLACK:
            self._refuse(
                408, f"The request was not complete within {factory.request_timeout:g} s", "request_timeout"
            )
        else:
            self._refuse(
                408, f"The request body stalled: nothing arrived for {factory.body_timeout:g} s", "request_timeout"
            )

    # reading

    def dataReceived(self, data: bytes) -> None:
        if self._closing:
            self.flow.drained(len(data), self.transport, self.peer)
            return
        buf = self._buf
        flow = self.flow
        if self._busy or self.paused or flow.stalled:
            # Kept for later: a request is with its handler, or the
            # answers wait to be written.
            buf += data
            if not self._busy:
                self._stall()
            self._update_reading()
            return
        flow.written = flow.requests = 0
        if buf:
            buf += data
            self._consume(buf)
        else:
            self._consume(data)

    def _consume(self, buf: bytes | bytearray) -> None:
        """
        Read requests from C{buf}: the connection's own buffer, or a read
        that arrived with nothing buffered. What is left is kept in the
        one buffer; a head still incomplete is searched again only from
        where the last search ended (C{_scan}), so a head that arrives a
        byte at a time costs no more than one that arrives whole.
        """
        self._in_consume = True
        pos = 0
        size = len(buf)
        flow = self.flow
        try:
            while pos < size and not self._busy and not self._closing:
                if flow.requests and (self.paused or flow.written > PASS_OUTPUT or flow.requests >= PASS_REQUESTS):
                    # The answers so far must reach the client first (a pass starts unpaused).
                    self._stall()
                    break
                state = self._state
                if state == _HEAD:
                    c = buf[pos]
                    if c == 13 or c == 10:
                        # Empty lines before a request line are allowed.
                        pos += 1
                        continue
                    end = buf.find(b"\r\n\r\n", pos + self._scan)
                    if end < 0:
                        if not self._head_so_far(buf, pos, size):
                            return
                        break
                    self._scan = 0
                    if end - pos > MAX_HEAD:
                        self._refuse(431, f"The request head is over {MAX_HEAD} bytes", "head_too_large")
                        return
                    head = bytes(buf[pos:end])
                    pos = end + 4
                    request = self._head(head)
                    if request is not None and size - pos >= self._remaining:
                        # The whole body came with its head (the common case): no pieces to join.
                        n = self._remaining
                        request.body = bytes(buf[pos : pos + n])
                        pos += n
                        self._remaining = 0
                        self._dispatch()
                elif state == _BODY:
                    n = self._remaining
                    left = size - pos
                    if left <= n:
                        self._remaining = n - left
                        self._body_piece(buf if pos == 0 and type(buf) is bytes else bytes(buf[pos:]))
                        pos = size
                        if self._remaining:
                            break
                    else:
                        self._body_piece(bytes(buf[pos : pos + n]))
                        pos += n
                        self._remaining = 0
                    self._dispatch()
                else:
                    used = self._chunks(buf if pos == 0 else buf[pos:])
                    if used < 0:
                        return
                    pos += used
                    if self._state == _CHUNKED:
                        break
        finally:
            self._in_consume = False
            if self._closing:
                self._buf = bytearray()
            elif buf is self._buf:
                if pos:
                    del buf[:pos]
            elif pos < size:
                self._buf += memoryview(buf)[pos:]
        if self._closing:
            return
        if self._buf or flow.reading_paused or self.paused or flow.stalled:
            self._update_reading()  # else reading goes on as it is: the common case, no call
        if self._busy or flow.stalled:
            pass
        elif self._state != _HEAD:
            # A body is arriving: each read of it puts the deadline later,
            # up to the whole request's.
            watching = self._watching
            if watching == _W_BODY:
                self._deadline.set(self._body_delay())
            else:
                if watching != _W_HEAD:
                    # The whole head came in this read: the request's
                    # time starts now.
                    self._request_at = self.factory.reactor.seconds() + self.factory.request_timeout
                self._watch(self._body_delay(), _W_BODY)
        elif self._buf:
            # Part of a head: its time runs from its first byte.
            if self._watching != _W_HEAD:
                self._watch_head()
        elif self._watching == _W_NONE:
            # A response ended and nothing more is here: wait for the next.
            self._watch(self.factory.keep_alive_timeout, _W_IDLE)

    def _head_so_far(self, buf: bytes | bytearray, pos: int, size: int) -> bool:
        """
        An incomplete head from C{pos}: refused now if it must be
        (L{httphead.head_so_far}), else the next search starts where this
        one ended. Returns C{False} when it refused.
        """
        refusal = head_so_far(buf, pos, size, pos + self._scan)
        if refusal is not None:
            self._refuse(*refusal)
            return False
        # The terminator may straddle this read and the next.
        self._scan = max(0, size - pos - 3)
        return True

    def _head(self, head: bytes) -> FrontRequest | None:
        # Returns the request when its body (by Content-Length) is to be read next.
        try:
            method, uri, http10, headers, length, chunked, keep_alive, expect = parse_head(head)
        except HeadRefused as e:
            self._refuse(e.status, e.message, e.code)
            return None
        request = FrontRequest(self, method, uri, http10, headers, keep_alive)
        self._reading = request
        self._received = 0
        digits = length.lstrip(b"0") if length is not None else b""
        screen = self.factory.screen
        if screen is not None and not screen(request):
            # Refused on its head: answered now, before a byte of its body
            # is read (and none is: the connection closes after the answer).
            if chunked or digits:
                self._unread(request)
            else:
                self._dispatch()
            return None
        if chunked:
            self._decoder = ChunkedDecoder()
            self._state = _CHUNKED
        elif digits:
            n = int(digits) if len(digits) <= 18 else self.max_body + 1
            if n > self.max_body:
                # Refused before a byte of the body is read (and never
                # read: the connection closes after the answer).
                self._too_large(request)
                return None
            self._remaining = n
            self._state = _BODY
        else:
            self._dispatch()
            return None
        if expect and not http10:
            self.send(b"HTTP/1.1 100 Continue\r\n\r\n")
        return request if self._state == _BODY else None

    def _too_large(self, request: FrontRequest) -> None:
        """
        C{request}'s body is over the limit: hand it to the handler now,
        marked C{too_large}, and read no more of this connection except to
        let the answer reach the client (see L{close}).
        """
        request.too_large = True
        self._unread(request)

    def _unread(self, request: FrontRequest) -> None:
        """
        Hand C{request} to the handler now, its body unread, and read no
        more of this connection except to let the answer reach the client.
        """
        request.keep_alive = False
        self._unread_body = True
        self._decoder = None
        self._parts = []
        self._state = _HEAD
        self._reading = None
        self._busy = True
        self._watching = _W_NONE
        self._request = request
        self.flow.requests += 1
        self.factory.dispatch(request)

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

    def _chunks(self, buf: bytes | bytearray) -> int:
        """
        Read chunked body framing from C{buf}; returns how many bytes it
        used (the rest is kept for the next call, or is the next request),
        or -1 when the request was refused or handed on as too large.
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
            return -1
        request = self._reading
        if request is not None and request.too_large:
            self._too_large(request)
            return -1
        if decoder.done:
            self._decoder = None
            self._dispatch()
        return used

    def _dispatch(self) -> None:
        request = self._reading
        assert request is not None
        self._reading = None
        self._state = _HEAD
        parts = self._parts
        if parts:
            if not request.too_large:
                body = parts[0] if len(parts) == 1 else b"".join(parts)
                request.body = body if type(body) is bytes else bytes(body)
            self._parts = []
        self._busy = True
        self._watching = _W_NONE
        self._request = request
        self.flow.requests += 1
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
        if self._in_consume or self._closing:
            # _consume goes on with what is buffered, and sets the timer.
            return
        if self._buf:
            self._consume(self._buf)
        else:
            flow = self.flow
            if flow.reading_paused or self.paused or flow.stalled:
                self._update_reading()
            self._watching = _W_IDLE  # _watch, inline: once a request
            self._deadline.set(self.factory.keep_alive_timeout)

    # holding back while the answers wait (see llmgw.gateway.frontflow)

    def _stall(self) -> None:
        # Go on when the answers so far are taken: on a later turn if the
        # transport has them, else when it drains.
        flow = self.flow
        flow.stalled = True
        if not self.paused:
            flow.later()
        if self._watching != _W_SEND:
            self._watch(self.factory.send_timeout, _W_SEND)

    def _go_on(self) -> None:
        flow = self.flow
        if self._closing or self.paused or not flow.stalled:
            # Paused meanwhile: its resumeProducing goes on.
            return
        flow.stalled = False
        flow.written = flow.requests = 0
        self._watching = _W_NONE
        self._deadline.clear()
        # It sets the reading and the timer, even with nothing buffered.
        self._consume(self._buf)

    def _update_reading(self) -> None:
        # Read unless the answers wait, or the read-ahead is full.
        if not self._closing:
            flow = self.flow
            flow.hold_reading(self.transport, self.paused or flow.stalled or (self._busy and len(self._buf) > READ_AHEAD))

    def close(self) -> None:
        """
        Send what is buffered, then close; read nothing more.

        When a body was refused unread (413), closing at once would reset a
        connection the client still sends on, which can destroy the answer
        unread; so only the sending side closes, and up to
        C{frontflow.DRAIN_MAX} more bytes are read and dropped first.
        """
        if not self._closing:
            self._closing = True
            self._buf = bytearray()
            self._stop_timer()
            half_close = getattr(self.transport, "loseWriteConnection", None)
            drain = self._unread_body and half_close is not None
            # A client that never reads what is left must not hold the
            # socket: the flow aborts the connection after a while.
            self.flow.closing(self.transport, self.peer, drain)
            # After the answer's bytes, which may still wait for the burst.
            after_sent(self.transport, half_close if half_close is not None and drain else self.transport.loseConnection)

    def _refuse(self, status: int, message: str, code: str) -> None:
        self.log.info(
            "refused a request from {peer}: {status} {message}", peer=self.peer, status=status, message=message
        )
        body = error_body(message, "invalid_request_error", code)
        reason = REASONS.get(status, b"Bad Request")
        self.send(
            b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            b"Connection: close\r\n%s\r\n%s" % (status, reason, len(body), self.factory.date_line(), body)
        )
        self._reading = None
        self.close()

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        self._closing = True
        self._buf = bytearray()
        self._stop_timer()
        # Freed when the last reference goes, not by the cyclic collector.
        self._deadline.close()
        self.flow.close()
        factory = self.factory
        factory.connection_ended()
        if self.counted_host is not None:
            factory.address_released(self.counted_host)
            self.counted_host = None
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
        self._update_reading()

    def resumeProducing(self) -> None:
        self.paused = False
        request = self._request
        if request is not None and request.producer is not None:
            request.producer.resumeProducing()
        if self.flow.stalled and not self._closing:
            self.flow.later()
        self._update_reading()

    def stopProducing(self) -> None:
        # The connection is going; connectionLost tells the request.
        pass


# Not @implementer (setup.py's rules for compiled classes).
classImplements(HTTPFront, IPushProducer)


# Compiled (setup.py), it may still be subclassed by uncompiled code.
@mypyc_attr(allow_interpreted_subclasses=True)
class FrontFactory(CappedFactory):
    """
    Serves C{handle} (a callable taking a L{FrontRequest}) with bodies up
    to C{max_body} bytes. C{reactor} is the clock of every timeout: a
    request head must be complete within C{head_timeout} seconds of its
    first byte (or of the connection's start), the whole request within
    C{request_timeout} seconds of it, a body may go C{body_timeout} seconds
    without a byte, and a kept-alive connection may wait
    C{keep_alive_timeout} seconds for its next request. A connection that
    stopped for its answers to be written is aborted when they do not drain
    within C{send_timeout} (L{llmgw.gateway.frontflow}).

    C{screen}, when set, is called with each request as soon as its head is
    read, before any of its body: C{True} lets the request go on (its body
    read, then the handler called); C{False} hands it to the handler at
    once, its body unread, for the handler to refuse (as it would anyway:
    the screen only says so sooner).

    The caps on connections at accept, C{max_connections} in all and
    C{max_per_address} from one address (0: none), are L{CappedFactory}'s.
    """

    # Named, and a ClassVar (setup.py's rules for compiled classes).
    log: ClassVar[Logger] = Logger(namespace=f"{__name__}.FrontFactory")

    def __init__(
        self,
        handle: Callable[[FrontRequest], Any],
        reactor: Any,
        max_body: int = 8 * 1024 * 1024,
        head_timeout: float = HEAD_TIMEOUT,
        body_timeout: float = BODY_TIMEOUT,
        keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
        request_timeout: float = REQUEST_TIMEOUT,
        max_per_address: int = 0,
        screen: Callable[[FrontRequest], bool] | None = None,
        send_timeout: float = SEND_TIMEOUT,
    ):
        self.handle = handle
        self.screen = screen
        super().__init__(reactor, max_connections, max_per_address)
        self.max_body = max_body
        self.head_timeout = head_timeout
        self.body_timeout = body_timeout
        self.request_timeout = request_timeout
        self.keep_alive_timeout = keep_alive_timeout
        self.send_timeout = send_timeout
        self._date_second = -1
        self._date = b""

    def buildProtocol(self, addr: Any) -> HTTPFront | None:  # type: ignore[override]
        if not self.admit(addr):
            return None
        proto = HTTPFront(self)
        proto.counted_host = self.counted_host(addr)
        return proto

    def dispatch(self, request: FrontRequest) -> None:
        try:
            self.handle(request)
        except Exception:
            self.log.failure("handling {method} {path} from {peer}", method=request.method,
                             path=request.path[:200], peer=request.peer)
            if not request.started:
                body = error_body("The gateway failed to handle the request", "server_error", "internal_error")
                request.keep_alive = False
                request.start_response(500, [(b"Content-Type", b"application/json")], len(body), hold=True)
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
