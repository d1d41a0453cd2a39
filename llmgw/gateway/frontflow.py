"""
How a connection of the gateway's front (L{llmgw.gateway.front}) paces its
client: the time a client gets to send a request, and what the connection
holds back while its answers wait to be written.

Timeouts. A request head must be complete within the factory's
C{head_timeout} of its first byte (else 408 and close; a connection that
sent nothing is just closed), the whole request, head and body, within
C{request_timeout} of its first byte however it trickles, a body must keep
arriving (C{body_timeout} without a byte: 408 and close), and a kept-alive
connection with no request is closed after C{keep_alive_timeout}. None of
them runs while a request is with its handler (waiting for a replica, or
streaming the response): the proxy's own timeouts govern that. (A head's
time starts at the connection, or when the connection goes on parsing
after the previous response or a stall, when the next head is already
buffered.)

Each connection has one L{llmgw.gateway.deadline.Deadline} for them all.
Moving it later (a body's progress, the idle wait after a response) only
changes a number: its one reactor call, coming due early, is made again for
the rest. Moving it sooner (a head or body starting while the idle wait
runs) is a cancel and a new call. A request that arrives in one read and is
answered touches the deadline once, when its response ends. After the
connection's C{close}, a call of its own aborts a connection that does not
finish closing within L{CLOSE_LINGER}.

Holding back. A client may pipeline requests that the gateway answers at
once (the model list, a 401 without a key, a 404) and read none of the
answers. Were the connection to go on reading and answering, the answers
would pile up in the process without bound. So a connection stops parsing
the requests it has buffered, and stops reading its socket, while:

- the transport holds more of its output than the transport's high-water
  mark: the transport called the connection's C{pauseProducing}, and only
  its C{resumeProducing} (the output drained) lets parsing go on;
- one pass over buffered requests has written more than L{PASS_OUTPUT}
  bytes: the rest waits for a later reactor turn, by which time the bytes
  written have met the socket (and the transport has paused the connection
  if the socket did not take them);
- a request is with its handler and more than L{READ_AHEAD} bytes of the
  next requests have arrived.

The first two are the connection I{stalled}. A stalled connection with no
request at its handler must see its output drain: if the transport does not
resume it within the factory's C{send_timeout} (L{SEND_TIMEOUT} by default),
the client is taking nothing and the connection is aborted. So what one
client can make the gateway hold is about a pass's output, the transport's
high-water mark and the read-ahead, whatever it sends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Final

from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger

#: Default seconds from a request's first byte until its head is complete.
HEAD_TIMEOUT: Final = 10.0
#: Default seconds from a request's first byte until all of it (head and
#: body) has arrived, however slowly its bytes trickle in.
REQUEST_TIMEOUT: Final = 30.0
#: Default seconds a request body may go without a byte arriving.
BODY_TIMEOUT: Final = 60.0
#: Default seconds a kept-alive connection may wait for its next request.
KEEP_ALIVE_TIMEOUT: Final = 120.0
#: After the gateway closes a connection, how long the client gets to read
#: what is left before the connection is aborted.
CLOSE_LINGER: Final = 30.0
#: After a 413 for a body not read, the most the client may still send
#: (read and dropped, so that its answer is not lost to a reset) before
#: the connection is aborted.
DRAIN_MAX: Final = 1024 * 1024
#: Bytes read ahead (pipelined requests) while a response is in progress;
#: past this the connection stops reading until the response is done.
READ_AHEAD: Final = 64 * 1024
#: The most one pass over buffered requests writes before the rest waits
#: for a later reactor turn.
PASS_OUTPUT: Final = 128 * 1024
#: The most requests one pass over buffered (pipelined) requests hands to
#: their handlers before the rest waits for a later reactor turn: small
#: answers made at once (a 401, /v1/models) would otherwise let one read
#: of tiny requests hold the reactor for tens of milliseconds.
PASS_REQUESTS: Final = 32
#: Default seconds a stalled connection's output may go without draining
#: before the connection is aborted.
SEND_TIMEOUT: Final = 60.0


class Outflow:
    """
    One connection's output bookkeeping: the bytes written since its
    current pass began (L{written}), whether it is L{stalled}, and whether
    it has paused its transport's reading.

    C{go_on} is called on a later reactor turn after L{later}; L{close}
    lets go of it, at the connection's end.
    """

    # Named, and a ClassVar (setup.py's rules for compiled classes).
    log: ClassVar[Logger] = Logger(namespace=f"{__name__}.Outflow")

    def __init__(self, reactor: Any, go_on: Callable[[], None]):
        self._reactor = reactor
        self._go_on: Callable[[], None] | None = go_on
        self._later: IDelayedCall | None = None
        #: After L{closing}: the connection is aborted when it comes due.
        self._linger: IDelayedCall | None = None
        self._drain_left = 0
        #: Bytes of answers written since it was last set to 0 (each
        #: L{FrontRequest<llmgw.gateway.frontrequest.FrontRequest>} adds what it sends).
        self.written = 0
        #: Requests handed to their handlers in the current pass.
        self.requests = 0
        #: Parsing stopped with requests buffered, until the output drains.
        self.stalled = False
        #: The transport's reading is paused (see L{hold_reading}).
        self.reading_paused = False

    def hold_reading(self, transport: Any, hold: bool) -> None:
        """
        Pause C{transport}'s reading (C{hold}) or resume it, unless it is
        so already.
        """
        if hold != self.reading_paused:
            self.reading_paused = hold
            if hold:
                transport.pauseProducing()
            else:
                transport.resumeProducing()

    def later(self) -> None:
        """
        Call C{go_on} on a later reactor turn (once, however often asked
        before then).
        """
        if self._later is None and self._go_on is not None:
            self._later = self._reactor.callLater(0, self._turn)

    def _turn(self) -> None:
        self._later = None
        if self._go_on is not None:
            self._go_on()

    def closing(self, transport: Any, peer: str, drain: bool) -> None:
        """
        The connection is closing: C{transport} is aborted if it has not
        closed within L{CLOSE_LINGER}. With C{drain} (a body refused unread,
        the sending side closed alone), reading goes on, and L{drained}
        aborts the connection once more than L{DRAIN_MAX} bytes arrived.
        """
        if drain:
            self._drain_left = DRAIN_MAX
            self.hold_reading(transport, False)
        self._linger = self._reactor.callLater(CLOSE_LINGER, self._linger_expired, transport, peer)

    def drained(self, n: int, transport: Any, peer: str) -> None:
        """
        C{n} bytes arrived after L{closing}: dropped, and C{transport} is
        aborted once more than L{DRAIN_MAX} did.
        """
        if self._drain_left <= 0:
            return
        self._drain_left -= n
        if self._drain_left <= 0:
            self.log.debug("aborting connection from {peer}: it sent over {limit} bytes after its 413",
                           peer=peer, limit=DRAIN_MAX)
            transport.abortConnection()

    def _linger_expired(self, transport: Any, peer: str) -> None:
        self._linger = None
        self.log.debug("aborting connection from {peer}: it did not read its last {linger} s",
                       peer=peer, linger=CLOSE_LINGER)
        transport.abortConnection()

    def close(self) -> None:
        """
        The connection has ended: no call of C{go_on}, and no abort, from
        now on.
        """
        self._go_on = None
        for call in (self._later, self._linger):
            if call is not None and call.active():
                call.cancel()
        self._later = self._linger = None


__all__ = [
    "BODY_TIMEOUT", "CLOSE_LINGER", "DRAIN_MAX", "HEAD_TIMEOUT", "KEEP_ALIVE_TIMEOUT", "PASS_OUTPUT",
    "READ_AHEAD", "REQUEST_TIMEOUT", "SEND_TIMEOUT", "Outflow",
]
