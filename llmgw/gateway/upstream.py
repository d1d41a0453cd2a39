"""
A lean HTTP/1.1 client for talking to replicas, with persistent connections.

Twisted's C{Agent} is general and costs more per request than the rest of
the gateway together; replicas speak plain HTTP/1.1 on a private address,
so this client does only that: one request at a time per connection, a
response body framed by C{Content-Length}, chunked encoding or the end of
the connection, handed over as it arrives (chunked framing removed), and
the connection kept for the next request when the response allows it.

L{UpstreamConnection} reports to a L{ResponseHandler}; L{UpstreamPool}
keeps idle connections per address.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, ClassVar, Final
from typing import Protocol as TypingProtocol

from twisted.internet.defer import Deferred
from twisted.internet.endpoints import (
    HostnameEndpoint,
    TCP4ClientEndpoint,
    TCP6ClientEndpoint,
)
from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmgw.addresses import AddressError, is_ipv6, parse_address
from llmgw.gateway.chunked import ChunkedDecoder, ChunkError
from llmgw.gateway.deadline import Deadline
from llmgw.gateway.wire import send_now
from llmgw.untrusted import clip

#: The most a response's status line and headers may take.
MAX_HEAD: Final = 64 * 1024
#: Most digits of a Content-Length (10**18 bytes is past any response).
MAX_LENGTH_DIGITS: Final = 18

# RFC 9110 §5.1 and §5.5, RFC 9112 §4: a status line, then header lines
# whose names are tokens and whose values hold no control character but
# HTAB (so no bare CR or LF either: a line break inside a value would be a
# header of the replica's choosing at the client). One C scan of the head.
# Possessive quantifiers: nothing to backtrack into, a fifth faster.
_TOKEN: Final = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]++"
_TEXT: Final = rb"[\t\x20-\x7e\x80-\xff]*+"
_VALID_HEAD: Final = re.compile(
    rb"HTTP/1\.[0-9] [0-9]{3}(?: " + _TEXT + rb")?(?:\r\n" + _TOKEN + rb"[ \t]*+:" + _TEXT + rb")*+"
)
_IS_TOKEN: Final = re.compile(_TOKEN)
_IS_TEXT: Final = re.compile(_TEXT)
# The relay (L{ResponseHandler.response_relayed}): in a head already
# valid and in lower case, its one Content-Length; and, in the head as
# sent, the lines of the headers the gateway writes itself.
_ONE_LENGTH: Final = re.compile(rb"\r\ncontent-length[ \t]*+:[ \t]*+([0-9]{1,18})[ \t]*+(?:\r\n|\Z)")
_OWN_LINES: Final = re.compile(
    rb"\r\n(?:keep-alive|proxy-authenticate|trailer|upgrade|date|server|content-length)[ \t]*+:[^\r]*+",
    re.IGNORECASE,
)

_HEAD, _LENGTH, _CHUNKED, _UNTIL_CLOSE, _DONE = range(5)


class UpstreamProtocolError(Exception):
    """
    The replica's answer is not HTTP/1.1 this client can read.
    """


class ResponseHandler(TypingProtocol):
    """
    What an L{UpstreamConnection} reports a response to.

    After C{response_finished} or C{response_failed} nothing more is
    reported. C{started} tells whether any byte of the response arrived.
    """

    def response_started(self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]]) -> None: ...

    # A handler may also have C{response_relayed(status, reason, block,
    # length)}: then a response in the common shape (one Content-Length,
    # no Transfer-Encoding, no Connection header) is reported there instead,
    # with its headers as one C{block} of lines, each after a CRLF, as the
    # replica wrote them, less those a proxy writes itself (Server, Date,
    # Content-Length, Keep-Alive and the other hop-by-hop ones): bytes a
    # proxy can pass on without taking them apart and putting them back.

    def response_data(self, data: bytes) -> None:
        """
        Body bytes (framing removed). In the read that completes the head,
        this follows C{response_started} at once with the body bytes that
        read held, C{b""} when it held none (or only framing), so that a
        handler may keep the head until then and send both together.
        """

    def response_finished(self) -> None: ...

    def response_failed(self, reason: Failure, started: bool) -> None: ...


class UpstreamConnection(Protocol):
    """
    One connection to a replica. Call L{send} with a whole request when it
    is idle; L{abort} to give up on the response (the connection is closed,
    never reused).
    """

    # Named, and a ClassVar (setup.py's rules for compiled classes).
    log: ClassVar[Logger] = Logger(namespace=f"{__name__}.UpstreamConnection")
    transport: Any

    def __init__(self, pool: UpstreamPool | None, address: str):
        self.pool = pool
        self.address = address
        self.handler: ResponseHandler | None = None
        self.connected_ = False
        self.requests = 0
        self._state = _DONE
        self._buf = b""
        self._remaining = 0
        self._decoder: ChunkedDecoder | None = None
        self._started = False
        self._keep_alive = True
        self._write: Callable[[bytes], None] = self._write_unconnected
        #: The connection's one timer (L{arm}), kept from one response to
        #: the next, and what it calls when it comes due.
        self._deadline: Deadline | None = None
        self._on_due: Callable[[], None] | None = None
        #: The wait between reads of a response, while armed (see L{arm}).
        self._idle = 0.0

    def _write_unconnected(self, data: bytes) -> None:
        self.transport.write(data)

    def connectionMade(self) -> None:
        self.connected_ = True
        try:
            self.transport.setTcpNoDelay(True)
        except AttributeError:
            pass
        # Requests go out now, not on the reactor's next turn.
        self._write = send_now(self.transport)

    # API

    def send(self, data: bytes, handler: ResponseHandler) -> None:
        """
        Write a complete request (head and body) and report its response to
        C{handler}.
        """
        assert self.handler is None, "one request at a time"
        self.handler = handler
        self.requests += 1
        self._state = _HEAD
        self._buf = b""
        self._started = False
        self._keep_alive = True
        self._write(data)

    def arm(self, clock: IReactorTime, delay: float, callback: Callable[[], None], idle: float = 0.0) -> None:
        """
        Call C{callback} in C{delay} seconds unless L{disarm}ed first: the
        handler's timeout, on the connection's one L{Deadline}. A timer
        made anew for each response and cancelled at its end cost more than
        the rest of the timeout handling; this one stays while the
        connection idles (coming due then, it does nothing), and the next
        response's deadline, later, only changes a number. The handler puts
        it later with L{later} while armed; with C{idle}, each read after
        the response's head that leaves the response unfinished puts it
        C{idle} seconds from then (the wait between bytes), and one that
        finishes it, as most do, touches no timer. (The connection's
        deadline keeps the clock of its first arming: one pool, one reactor.)
        """
        self._on_due = callback
        self._idle = idle
        deadline = self._deadline
        if deadline is None:
            deadline = self._deadline = Deadline(clock, self._came_due)
        deadline.set(delay)

    def later(self, delay: float) -> None:
        """
        The armed callback is due C{delay} seconds from now instead.
        """
        deadline = self._deadline
        if deadline is not None and deadline.armed:
            deadline.set(delay)

    def disarm(self, callback: Callable[[], None]) -> None:
        """
        C{callback}, if armed, is not called (the timer itself stays).
        """
        if self._on_due == callback:
            self._on_due = None
            if self._deadline is not None:
                self._deadline.clear()

    def _came_due(self) -> None:
        callback, self._on_due = self._on_due, None
        if callback is not None:
            callback()

    def _stop_timer(self) -> None:
        self._on_due = None
        if self._deadline is not None:
            self._deadline.stop()

    def abort(self) -> None:
        """
        Drop the response in progress and the connection; the handler hears
        nothing more.
        """
        self.handler = None
        self._keep_alive = False
        if self.connected_:
            self.connected_ = False
            self.transport.abortConnection()

    def pause(self) -> None:
        self.transport.pauseProducing()

    def resume(self) -> None:
        self.transport.resumeProducing()

    # Protocol

    def dataReceived(self, data: bytes) -> None:
        if self.handler is None:
            # Bytes with no request outstanding: the stream is out of step.
            self.log.warn(
                "replica {address} sent {n} bytes with no request outstanding; closing",
                address=self.address,
                n=len(data),
            )
            self.abort()
            return
        self._started = True
        try:
            self._parse(data)
        except UpstreamProtocolError as e:
            self._fail(Failure(e))
            return
        if self.handler is not None and self._idle and self._state != _HEAD:
            # More of the response to come: the wait for it starts now (see arm).
            deadline = self._deadline
            if deadline is not None and deadline.armed:
                deadline.set(self._idle)

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        self.connected_ = False
        self._stop_timer()
        if self._deadline is not None:
            # Freed when the last reference goes, not by the cyclic collector.
            self._deadline.close()
        if self.pool is not None:
            self.pool.lost(self)
        handler = self.handler
        if handler is None:
            return
        if self._state == _UNTIL_CLOSE:
            self.handler = None
            handler.response_finished()
            return
        self.handler = None
        handler.response_failed(reason, self._started)

    # parsing

    def _fail(self, reason: Failure) -> None:
        handler = self.handler
        started = self._started
        self.abort()
        if handler is not None:
            handler.response_failed(reason, started)

    def _parse(self, data: bytes) -> None:
        if self._state == _HEAD:
            buf = self._buf + data if self._buf else data
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD:
                    raise UpstreamProtocolError(f"response head over {MAX_HEAD} bytes")
                self._buf = buf
                return
            self._buf = b""
            rest = buf[end + 4 :]
            if not self._head(buf[:end]):
                # An interim 1xx response: the real one follows.
                if rest:
                    self._parse(rest)
                return
            if self.handler is None:
                return
            data = rest
            if not data:
                if self._state == _DONE:
                    self._complete()
                    return
                # Nothing of the body in this read: the handler hears so.
                self.handler.response_data(b"")
                return
            if self._state == _CHUNKED:
                self._chunked(data, True)
                return
        state = self._state
        if state == _LENGTH:
            n = len(data)
            if n < self._remaining:
                self._remaining -= n
                self.handler.response_data(data)  # type: ignore[union-attr]
                return
            if n > self._remaining:
                # More than the response holds: the connection is out of step.
                self._keep_alive = False
                data = data[: self._remaining]
            self._remaining = 0
            if data:
                self.handler.response_data(data)  # type: ignore[union-attr]
            self._complete()
        elif state == _UNTIL_CLOSE:
            if data:
                self.handler.response_data(data)  # type: ignore[union-attr]
        elif state == _DONE:
            if data:
                self._keep_alive = False
            self._complete()
        else:
            self._chunked(data)

    def _head(self, head: bytes) -> bool:
        """
        Parse the status line and headers; report them unless the response
        is an interim one (returns C{False} then).

        @raise UpstreamProtocolError: the head is malformed (see
            L{_VALID_HEAD}), its Content-Length is not a plain number or two
            disagree, or its Transfer-Encoding is anything but C{chunked}
            alone (the only coding this client decodes), or comes in an
            HTTP/1.0 response.
        """
        if _VALID_HEAD.fullmatch(head) is None:
            raise UpstreamProtocolError(_head_problem(head))
        status = int(head[9:12])
        if 100 <= status < 200:
            return False
        # Looked up per response, not kept: a kept connection must hold
        # nothing of its last handler (nor, through it, that client).
        relay = getattr(self.handler, "response_relayed", None)
        if relay is not None and status != 204 and status != 304:
            low = head.lower()
            if (
                # find, not in: bytes' in tries its operand as a number
                # first, making and dropping a TypeError each time.
                low.find(b"\r\ntransfer-encoding") < 0
                and low.find(b"\r\nconnection") < 0
                and low.count(b"\r\ncontent-length") == 1
                # A blank before a colon is allowed here, but a proxy must
                # remove it (RFC 9112 §5.1): such heads are rebuilt.
                and head.find(b" :") < 0
                and head.find(b"\t:") < 0
            ):
                m = _ONE_LENGTH.search(low)
                if m is not None:
                    # The common shape: framed by its one Content-Length,
                    # kept alive unless HTTP/1.0 (no Connection header).
                    eol = head.find(b"\r\n")
                    size = int(m.group(1))
                    self._keep_alive = head[7] != 48  # HTTP/1.0
                    self._remaining = size
                    self._state = _LENGTH if size else _DONE
                    relay(status, head[13:eol], _OWN_LINES.sub(b"", head[eol:]), size)
                    return True
        lines = head.split(b"\r\n")
        status_line = lines[0]
        http10 = status_line.startswith(b"HTTP/1.0")
        reason = status_line[13:]
        headers: list[tuple[bytes, bytes]] = []
        length: int | None = None
        codings: list[bytes] = []
        keep_alive = not http10
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.rstrip(b" \t").lower()
            value = value.strip(b" \t")
            if name == b"content-length":
                if not (value.isdigit() and len(value) <= MAX_LENGTH_DIGITS):
                    raise UpstreamProtocolError(f"bad Content-Length {clip(value)}")
                n = int(value)
                if length is not None and n != length:
                    raise UpstreamProtocolError(f"two Content-Lengths, {length} and {n}")
                length = n
            elif name == b"transfer-encoding":
                codings += [c for c in (t.strip(b" \t").lower() for t in value.split(b",")) if c]
            elif name == b"connection":
                tokens = {t.strip(b" \t").lower() for t in value.split(b",")}
                if b"close" in tokens:
                    keep_alive = False
                elif b"keep-alive" in tokens:
                    keep_alive = True
            headers.append((name, value))
        chunked = False
        if codings:
            if http10:
                raise UpstreamProtocolError("an HTTP/1.0 response with Transfer-Encoding")
            if codings != [b"chunked"]:
                raise UpstreamProtocolError(
                    f"Transfer-Encoding {clip(b', '.join(codings))}: only chunked, alone, "
                    "can be decoded"
                )
            chunked = True
            if length is not None:
                # Both: a sign of a smuggling attempt (RFC 9112 §6.3); read
                # it chunked and never reuse the connection.
                keep_alive = False
        self._keep_alive = keep_alive
        if status in (204, 304):
            self._state = _DONE
        elif chunked:
            self._decoder = ChunkedDecoder()
            self._state = _CHUNKED
        elif length is not None:
            self._remaining = length
            self._state = _LENGTH if length else _DONE
        else:
            self._keep_alive = False
            self._state = _UNTIL_CLOSE
        self.handler.response_started(status, reason, headers)  # type: ignore[union-attr]
        return True

    def _chunked(self, data: bytes, head_read: bool = False) -> None:
        buf = self._buf + data if self._buf else data
        decoder = self._decoder
        assert decoder is not None
        out: list[bytes] = []
        try:
            used = decoder.feed(buf, out.append)
        except ChunkError as e:
            self._decoder = None
            raise UpstreamProtocolError(str(e)) from None
        self._buf = buf[used:] if used < len(buf) else b""
        if out:
            self.handler.response_data(out[0] if len(out) == 1 else b"".join(out))  # type: ignore[union-attr]
        elif head_read:
            # The read that completed the head held only framing.
            self.handler.response_data(b"")  # type: ignore[union-attr]
        if decoder.done:
            self._decoder = None
            if self._buf:
                self._keep_alive = False
            self._complete()

    def _complete(self) -> None:
        handler = self.handler
        if handler is None:
            return
        self.handler = None
        self._state = _DONE
        if self._keep_alive and self.connected_ and self.pool is not None:
            self.pool.release(self)
        elif self.connected_:
            self.connected_ = False
            self.transport.loseConnection()
        handler.response_finished()


def _head_problem(head: bytes) -> str:
    """
    What is wrong with a response head that L{_VALID_HEAD} refused.
    """
    lines = head.split(b"\r\n")
    first = lines[0]
    if re.fullmatch(rb"HTTP/1\.[0-9] [0-9]{3}(?: " + _TEXT + rb")?", first) is None:
        return f"bad status line {clip(first)}"
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            return f"header line without a colon: {clip(line)}"
        if _IS_TOKEN.fullmatch(name.rstrip(b" \t")) is None:
            return f"header name {clip(name)} is not a token"
        if _IS_TEXT.fullmatch(value) is None:
            return f"header {clip(name)} has a control character (CR, LF or another) in its value"
    return "malformed response head"


class _Connecting(Factory):
    """
    The factory of one outgoing connection: it builds the protocol it was
    given, once, and then lets go of it. (Twisted's C{connectProtocol} does
    the same with a class defined anew for each connection, which, with the
    connection it holds, waits for the cyclic garbage collector.)
    """

    noisy = False

    def __init__(self, protocol: UpstreamConnection):
        self._protocol: UpstreamConnection | None = protocol

    def buildProtocol(self, addr: Any) -> UpstreamConnection | None:  # type: ignore[override]
        protocol, self._protocol = self._protocol, None
        return protocol


class UpstreamPool:
    """
    Idle connections per replica address, and new ones on demand.

    L{take} returns an idle connection (the most recently used) or C{None};
    L{connect} makes a new one within C{connect_timeout}. At most
    C{max_idle} connections per address are kept idle; more are closed.
    """

    # Named, and a ClassVar (setup.py's rules for compiled classes).
    log: ClassVar[Logger] = Logger(namespace=f"{__name__}.UpstreamPool")

    def __init__(self, reactor: Any, connect_timeout: float = 5.0, max_idle: int = 256):
        self.reactor = reactor
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self._idle: dict[str, list[UpstreamConnection]] = {}
        self._endpoints: dict[str, Any] = {}
        self._closing = False

    def take(self, address: str) -> UpstreamConnection | None:
        idle = self._idle.get(address)
        while idle:
            conn = idle.pop()
            if conn.connected_:
                return conn
        return None

    def connect(self, address: str) -> Deferred[UpstreamConnection]:
        """
        A new connection to C{address} (C{host:port}).

        @raise AddressError: the address cannot be parsed.
        """
        endpoint = self._endpoints.get(address)
        if endpoint is None:
            endpoint = self._endpoints[address] = self._endpoint(address)
        return endpoint.connect(_Connecting(UpstreamConnection(self, address)))  # type: ignore[no-any-return]

    def _endpoint(self, address: str) -> Any:
        host, port = parse_address(address, "")
        if not host:
            raise AddressError(f"{address!r}: no host")
        if is_ipv6(host):
            return TCP6ClientEndpoint(self.reactor, host, port, timeout=self.connect_timeout)
        if host.replace(".", "").isdigit():
            return TCP4ClientEndpoint(self.reactor, host, port, timeout=self.connect_timeout)
        return HostnameEndpoint(self.reactor, host.encode("idna"), port, timeout=self.connect_timeout)

    def release(self, conn: UpstreamConnection) -> None:
        """
        C{conn} finished a response and may serve another.
        """
        idle = self._idle.get(conn.address)
        if idle is None:
            idle = self._idle[conn.address] = []
        if self._closing or len(idle) >= self.max_idle:
            conn.connected_ = False
            conn.transport.loseConnection()
            return
        idle.append(conn)

    def lost(self, conn: UpstreamConnection) -> None:
        idle = self._idle.get(conn.address)
        if idle and conn in idle:
            idle.remove(conn)

    def idle_count(self, address: str | None = None) -> int:
        if address is not None:
            return len(self._idle.get(address, ()))
        return sum(len(v) for v in self._idle.values())

    def close(self) -> None:
        """
        Close every idle connection and keep none from now on.
        """
        self._closing = True
        for idle in self._idle.values():
            for conn in list(idle):
                conn.connected_ = False
                conn.transport.loseConnection()
        self._idle.clear()
