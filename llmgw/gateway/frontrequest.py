"""
A request as the gateway's front (L{llmgw.gateway.front}) hands it to its
handler, and the way the handler answers it.

A handler is a callable taking a L{FrontRequest}; it answers (now or later)
with L{FrontRequest.start_response}, L{FrontRequest.write} and
L{FrontRequest.finish}, or drops the connection with L{FrontRequest.abort}.
Responses are framed by C{Content-Length} when the handler knows it, else
chunked (HTTP/1.0: until the connection closes), and written as they come;
a response's producer is paused while the client's connection has too much
unsent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final

from twisted.internet.interfaces import IPushProducer
from twisted.python.failure import Failure
from twisted.web.http import RESPONSES

if TYPE_CHECKING:
    from llmgw.gateway.front import HTTPFront

#: Reason phrases, with those twisted.web lacks.
REASONS: Final = dict(RESPONSES)
REASONS.update({
    413: b"Content Too Large",
    421: b"Misdirected Request",
    431: b"Request Header Fields Too Large",
})


class FrontRequest:
    """
    One request, its body read in full, and the way to answer it.

    C{headers} are C{(name, value)} pairs in arrival order, names in lower
    case. C{on_lost}, when set, is called with the reason if the connection
    goes before the response is finished.
    """

    __slots__ = (
        "channel", "method", "uri", "path", "http10", "headers", "body", "too_large",
        "keep_alive", "on_lost", "started", "finished", "producer", "_chunked", "_no_body", "_held",
        "key_name", "screened",
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
        self._held = b""
        #: The name of the API key the factory's screen found, if any.
        self.key_name: str | None = None
        #: The factory's screen found its host and key good (on its head).
        self.screened = False

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
        headers: Sequence[tuple[bytes, bytes]],
        length: int | None = None,
        reason: bytes | None = None,
        hold: bool = False,
        block: bytes = b"",
    ) -> None:
        """
        Send the status line and C{headers}. With C{length} the body is
        framed by C{Content-Length} (C{headers} must not carry one); without,
        it is chunked (to an HTTP/1.0 client: ended by closing). C{block}:
        header lines ready to send, each after a CRLF, sent before
        C{headers} (a proxy's relay of its upstream's; the same rules).

        With C{hold} the head is kept until the first L{write}, L{finish} or
        L{flush}, and goes out with the body's first bytes in one send: a
        caller that has body bytes at hand passes C{hold} and writes them.
        """
        if self.started:
            raise RuntimeError("the response has already started")
        self.started = True
        channel = self.channel
        no_body = self.method == b"HEAD" or status in (204, 304) or status < 200
        head = b"HTTP/1.1 %d %s%s\r\n" % (status, reason or REASONS.get(status, b"Unknown"), block)
        if headers:
            parts = [head]
            for name, value in headers:
                parts += (name, b": ", value, b"\r\n")
            head = b"".join(parts)
        if length is not None:
            framing = b"Content-Length: %d\r\n" % length
        elif no_body:
            framing = b""
        elif self.http10:
            self.keep_alive = False
            framing = b""
        else:
            self._chunked = True
            framing = b"Transfer-Encoding: chunked\r\n"
        if not self.keep_alive:
            framing += b"Connection: close\r\n"
        elif self.http10:
            framing += b"Connection: keep-alive\r\n"
        self._no_body = no_body
        head = b"%s%s%s\r\n" % (head, framing, channel.factory.date_line())
        if hold:
            self._held = head
        else:
            channel.flow.written += len(head)
            channel.send(head)

    def write(self, data: bytes) -> None:
        """
        Send part of the body (after L{start_response}), with the head if
        it was held.
        """
        if not data or self.finished or self._no_body:
            self.flush()
            return
        if self._chunked:
            data = b"%x\r\n%s\r\n" % (len(data), data)
        held = self._held
        if held:
            self._held = b""
            data = held + data
        channel = self.channel
        # Counted here, not by wrapping the writer: one call less a write.
        channel.flow.written += len(data)
        channel.send(data)

    def flush(self) -> None:
        """
        Send the head now if L{start_response} held it.
        """
        held = self._held
        if held:
            self._held = b""
            self.channel.flow.written += len(held)
            self.channel.send(held)

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
        held, self._held = self._held, b""
        if self._chunked:
            held += b"0\r\n\r\n"
        channel = self.channel
        if held:
            channel.flow.written += len(held)
            channel.send(held)
        channel.request_done(self)

    def abort(self) -> None:
        """
        End the response unfinished: what was written goes out, then the
        connection closes (a chunked response lacks its last chunk, so the
        client knows it is incomplete).
        """
        if self.finished:
            return
        self.flush()
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
