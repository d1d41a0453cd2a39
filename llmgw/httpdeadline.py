"""
A twisted.web channel that bounds how long a client may take to send a
request, however its bytes trickle.

twisted.web's C{timeOut} is an idle timeout: every byte resets it, so a
client sending one byte every few seconds holds a connection (and a
request's buffers) for ever. L{DeadlineChannel} adds a deadline on the
reactor's clock per request: from the request's first byte, its head must
be complete within C{head_timeout} and the whole request, head and body,
within C{request_timeout}; past either the client gets a 408 and the
connection is closed. The deadline covers receiving the request only: it
ends when the request is complete, so a long-poll or a WebSocket upgrade
answered slowly is not cut by it.

A L{DeadlineChannel} also stops answering while its answers wait to be
written. twisted.web's channel pauses reading when the transport's buffer
is full only if no request is being handled at that moment, and a request
answered at once is always being handled when its answer fills the buffer;
and the pipelined requests of a read already taken (thousands of small
ones in 64 KiB) are answered all the same. So a client that pipelines and
reads nothing would grow the process without bound. Here, when the
transport pauses the channel, reading stops and so does the parsing of
what is buffered (through C{LineReceiver}'s own pausing), until the
transport drains.

L{DeadlineSite} is a C{Site} whose connections are L{DeadlineChannel}s.
Neither the gateway nor the control plane owns this module: both serve
HTTP listeners with it (the admin API, the gateway's /metrics).
"""

from __future__ import annotations

import json
from typing import Any, Final

from OpenSSL import SSL
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IDelayedCall, IHandshakeListener
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import server
from twisted.web.http import HTTPChannel
from zope.interface import implementer

from llmgw.addresses import format_address
from llmgw.tlsconf.handshake import HandshakeDeadline

#: Seconds from a request's first byte to the end of its head.
HEAD_TIMEOUT: Final = 10.0
#: Seconds from a request's first byte to the end of its body.
REQUEST_TIMEOUT: Final = 30.0
#: The most requests a connection has answered from what it already read
#: before the rest waits for a later reactor turn: one read of pipelined
#: tiny requests would otherwise hold the reactor for all their answers.
REQUESTS_PER_TURN: Final = 16


class DeadlineChannel(HTTPChannel):
    """
    An C{HTTPChannel} whose requests must arrive in time: each request's
    head within C{head_timeout} seconds of its first byte, all of it within
    C{request_timeout}; else a 408 is sent and the connection closed (and
    aborted, as twisted.web's own timeout does, if it has not closed within
    C{abortTimeout}). A request's first byte is the first one read after the
    previous request was answered (or, when the client pipelined, the
    moment the previous answer ended). Nothing is timed while a request is
    with its resource.
    """

    log = Logger()
    head_timeout: float = HEAD_TIMEOUT
    request_timeout: float = REQUEST_TIMEOUT
    #: Who serves the connection, for the log.
    what = "HTTP"
    _deadline: IDelayedCall | None = None
    #: A request is complete and with its resource until its answer ends
    #: (twisted.web keeps the same fact privately; this is ours).
    _answering = False
    #: Our abort of a client that does not take its 408.
    _abort: IDelayedCall | None = None
    #: When the request being received is due in full (reactor seconds).
    _due = 0.0
    _head_done = False
    _timed_out = False
    #: Requests complete in the current turn, and the call that starts the next.
    _turn_requests = 0
    _next_turn: IDelayedCall | None = None
    #: The transport's buffer is full (it paused us).
    _transport_full = False

    def dataReceived(self, data: bytes) -> None:
        if self._timed_out:
            return  # answered with a 408 already; the rest is not read
        if data and self._deadline is None and not self._answering:
            self._request_started()
        super().dataReceived(data)

    def _request_started(self) -> None:
        now = self._now()
        self._due = now + self.request_timeout
        self._head_done = False
        self._deadline = self.callLater(min(self.head_timeout, self.request_timeout), self._expired)

    def _now(self) -> float:
        # The clock the channel's timers run on: its Site's reactor.
        reactor: Any = getattr(self.factory, "reactor", None)
        if reactor is None:
            from twisted.internet import reactor
        result: float = reactor.seconds()
        return result

    def allHeadersReceived(self) -> None:
        if self._deadline is not None and self._deadline.active():
            self._deadline.cancel()
            self._head_done = True
            self._deadline = self.callLater(max(0.0, self._due - self._now()), self._expired)
        super().allHeadersReceived()

    def allContentReceived(self) -> None:
        self._stop_deadline()
        self._answering = True
        self._turn_requests += 1
        super().allContentReceived()
        if self._turn_requests >= REQUESTS_PER_TURN and self._next_turn is None:
            # This one is answered (or with its resource); what else was
            # read waits (the line loop honours C{paused}), and nothing more
            # is read meanwhile (after twisted.web's own resume at its end).
            self.paused = True
            transport: Any = self.transport
            if transport is not None:
                transport.pauseProducing()
            self._next_turn = self.callLater(0, self._turn)

    def _turn(self) -> None:
        self._next_turn = None
        self._turn_requests = 0
        if self._transport_full or self.transport is None:
            # Its resumeProducing goes on once the answers drain.
            return
        self.paused = False
        if not self._answering:
            transport: Any = self.transport
            transport.resumeProducing()
        self.dataReceived(b"")

    def requestDone(self, request: Any) -> None:
        # Before twisted.web feeds this connection's pipelined bytes to
        # dataReceived, which starts the next request's deadline.
        self._answering = False
        super().requestDone(request)

    def pauseProducing(self) -> None:
        # The transport's buffer is full: twisted.web pauses the request's
        # producer; we stop reading, and stop feeding buffered lines (the
        # LineReceiver loop honours C{paused}), whether or not a request is
        # being handled.
        super().pauseProducing()
        self.paused = True
        self._transport_full = True
        transport: Any = self.transport
        if transport is not None:
            transport.pauseProducing()

    def resumeProducing(self) -> None:
        # Drained: twisted.web resumes reading unless a request is being
        # handled (its end resumes it then); the buffered lines go on.
        super().resumeProducing()
        self._transport_full = False
        if self.paused and self._next_turn is None:
            self.paused = False
            if self.transport is not None:
                self.dataReceived(b"")

    def connectionLost(self, reason: Failure = Failure(ConnectionDone())) -> None:  # noqa: B008
        self._stop_deadline()
        if self._next_turn is not None and self._next_turn.active():
            self._next_turn.cancel()
        self._next_turn = None
        if self._abort is not None and self._abort.active():
            self._abort.cancel()
        self._abort = None
        super().connectionLost(reason)

    def _stop_deadline(self) -> None:
        if self._deadline is not None and self._deadline.active():
            self._deadline.cancel()
        self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        transport: Any = self.transport
        if transport is None or self._answering:
            return
        self._timed_out = True
        # Our own abort timer below governs what is left of the connection.
        self.setTimeout(None)
        peer = transport.getPeer()
        client = f"{getattr(peer, 'host', '?')}:{getattr(peer, 'port', '?')}"
        if self._head_done:
            why = f"The request was not complete within {self.request_timeout:g} s"
        else:
            why = f"The request head was not complete within {self.head_timeout:g} s"
        if getattr(transport, "disconnecting", False):
            # An answer (a 400) is already on its way out and the peer does
            # not take it: nothing more can be said on this connection.
            self.log.info("{what}: aborting the connection of {client}: {why}",
                          what=self.what, client=client, why=why)
            transport.abortConnection()
            return
        self.log.info("{what}: 408 to {client}: {why}", what=self.what, client=client, why=why)
        body = json.dumps({"error": why, "status": 408}).encode() + b"\n"
        transport.write(
            b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
        )
        self.loseConnection()
        if self.abortTimeout is not None and self._abort is None:
            # As twisted.web's own timeout: a peer that does not read the
            # answer is cut off.
            self._abort = self.callLater(self.abortTimeout, self._abort_client)

    def _abort_client(self) -> None:
        self._abort = None
        transport: Any = self.transport
        if transport is not None:
            transport.abortConnection()


@implementer(IHandshakeListener)
class TLSDeadlineChannel(DeadlineChannel):
    """
    A L{DeadlineChannel} served over TLS: the handshake must be done within
    its site's C{handshake_timeout} seconds of accept (none when the site
    has none, as over plain HTTP), or the connection is aborted; and a
    refused handshake (a certificate from another CA, revoked, expired, or
    for the wrong use) is logged with the client's address, since no
    request ever reaches a resource to say so. Log lines start with
    C{what}.
    """

    _handshake: HandshakeDeadline | None = None

    def connectionMade(self) -> None:
        super().connectionMade()
        timeout = getattr(getattr(self, "site", None), "handshake_timeout", None)
        if timeout:
            # Over TLS this runs at TCP accept, before the handshake.
            self._handshake = HandshakeDeadline(self.callLater, self._handshake_expired, timeout)

    def handshakeCompleted(self) -> None:
        if self._handshake is not None:
            self._handshake.done()

    def _handshake_expired(self) -> None:
        self.log.warn(
            "{what}: aborting the connection of {client}: TLS handshake not done within {timeout}s",
            what=self.what, client=self.client(),
            timeout=getattr(getattr(self, "site", None), "handshake_timeout", None),
        )
        transport: Any = self.transport
        if transport is not None:
            transport.abortConnection()

    def client(self) -> str:
        """
        The client's address, for log lines.
        """
        peer = self.transport.getPeer() if self.transport is not None else None
        host, port = getattr(peer, "host", "?"), getattr(peer, "port", "?")
        return format_address(host, port) if isinstance(port, int) else f"{host}:{port}"

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:  # noqa: B008
        if self._handshake is not None:
            self._handshake.done()
        if reason.check(SSL.Error):
            self.log.warn("{what}: TLS handshake from {client} refused: {reason}",
                          what=self.what, client=self.client(), reason=reason.getErrorMessage())
        super().connectionLost(reason)


class DeadlineSite(server.Site):
    """
    A C{Site} whose requests must arrive in time (L{DeadlineChannel}). Its
    connections are the channel itself, not twisted.web's default wrapper
    (a private class that would only add HTTP/2 negotiation, which these
    listeners do not offer).
    """

    protocol = DeadlineChannel  # type: ignore[assignment]  # typed as the wrapper it replaces
    displayTracebacks = False


__all__ = ["HEAD_TIMEOUT", "REQUEST_TIMEOUT", "DeadlineChannel", "DeadlineSite", "TLSDeadlineChannel"]
