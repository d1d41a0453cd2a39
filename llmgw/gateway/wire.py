"""
Writing to TCP connections in one burst per reactor turn, straight to
their sockets.

A Twisted transport's C{write} only queues the bytes: it asks the reactor
to watch the socket for writability (an C{epoll_ctl}), the reactor's next
turn finds it writable and sends, then stops watching (another
C{epoll_ctl}). For a proxy that writes one request or one response piece
per read, that is two system calls and a reactor turn per write, and the
bytes wait behind a whole further turn.

L{send_now} returns a writer that keeps its bytes only until the events
of the current turn have been handled (L{llmgw.reactor.LeanEPollReactor}'s
C{afterEvents}; on another reactor, a C{callLater(0)}, which runs before
the reactor next waits), then sends them on the transport's socket (the
C{send} Twisted would make later). Sending after the turn's reads rather
than between them means that a replica or a client woken by its bytes
finds the others' too, and does not take the CPU from the gateway while it
still has reads to handle: on a loaded machine, fewer wakeups and context
switches for everyone.

Order is kept per connection (each connection's bytes go out in the order
written, and all bytes a writer was given go through the writer). Bytes
written when the transport has bytes of its own queued already (a slow
client), with none of this writer's waiting for the burst, go to C{write}
at once: the reactor may find that socket writable later in the same turn,
send the queue and, the connection closing, close it, and bytes kept for
the burst would then find it closed. (A transport with nothing queued is
not watched for writability in the turn's events, so it cannot close
before the burst.) What the socket does not take at the burst is handed to
C{write} too, as is everything when the send fails (the transport meets
the same error on its own turn and closes as usual).

What this needs to know of the transport beyond its public interface
(whether it holds bytes, whether it is closing) is read through
L{llmgw.transportpeek} alone; a transport it does not vouch for
(not a plain TCP one: TLS, test transports; or a Twisted outside the range
it was checked against) gets C{transport.write} itself as its writer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final
from weakref import WeakKeyDictionary, ref

from twisted.logger import Logger

from llmgw.transportpeek import busy, queued, raw_socket, reactor_of

# An explicit namespace: compiled (setup.py), the module is not a frame
# Logger could find its name from.
log: Final = Logger(namespace=__name__)


class _Burst:
    """
    The bytes written to one reactor's connections during a turn, sent
    together after its events (see the module's docstring).
    """

    def __init__(self, reactor: Any):
        self._sends: list[Callable[[bytes], None]] = []
        self._data: list[bytes] = []
        # Weakly: the registry of bursts must not keep a reactor alive.
        self._reactor = ref(reactor)
        self._after = hasattr(reactor, "afterEvents")

    def add(self, send: Callable[[bytes], None], data: bytes) -> None:
        sends = self._sends
        sends.append(send)
        self._data.append(data)
        if len(sends) == 1:
            reactor = self._reactor()
            if reactor is None:
                return
            if self._after:
                reactor.afterEvents(self.flush)
            else:
                reactor.callLater(0, self.flush)

    def flush(self) -> None:
        sends, data = self._sends, self._data
        self._sends, self._data = [], []
        for send, chunk in zip(sends, data, strict=True):
            try:
                send(chunk)
            except Exception:
                # One connection's failure is not the others' (the writer
                # aborts its own connection first: see send_now).
                log.failure("sending on a connection failed")


_bursts: Final[WeakKeyDictionary[Any, _Burst]] = WeakKeyDictionary()
#: Each transport a writer sends on directly: its burst and how many of its
#: writes wait for that burst (see L{after_sent}).
_pending: Final[WeakKeyDictionary[Any, tuple[_Burst, list[int]]]] = WeakKeyDictionary()


def after_sent(transport: Any, then: Callable[[], None]) -> None:
    """
    Call C{then} (a C{loseConnection}, say) once the bytes written to
    C{transport} through L{send_now} have been handed to it: at once when
    none wait for the burst, else right after them in the burst. Closing
    before they are handed over would lose them: a transport with nothing
    queued closes on the reactor's next poll, which may come before the
    burst (on a reactor without C{afterEvents}, the burst is a
    C{callLater(0)}, and a close from a timer polls first).
    """
    pending = _pending.get(transport)
    if pending is None or not pending[1][0]:
        then()
        return
    pending[0].add(lambda _data: then(), b"")


def _burst_for(reactor: Any) -> _Burst:
    burst = _bursts.get(reactor)
    if burst is None:
        burst = _bursts[reactor] = _Burst(reactor)
    return burst


def send_now(transport: Any) -> Callable[[bytes], None]:
    """
    A writer for C{transport}: each call's bytes are sent on its socket
    once the reactor's current events have been handled, in order with
    the rest written through it.
    """
    write: Callable[[bytes], None] = transport.write
    sock = raw_socket(transport)
    if sock is None:
        return write
    send = sock.send
    burst = _burst_for(reactor_of(transport))
    add = burst.add
    # How many of this writer's writes wait for the burst.
    waiting = [0]
    _pending[transport] = (burst, waiting)

    def send_or_queue(data: bytes) -> None:
        waiting[0] -= 1
        t: Any = transport
        try:
            # Bytes queued in the transport, or it is closing or aborting:
            # its own write, not the socket.
            if busy(t):
                write(data)
                return
            try:
                n = send(data)
            except OSError:
                # Full (EAGAIN), interrupted, or the connection is lost:
                # queued, the bytes are sent, or meet the same error, on the
                # reactor's turn, and the transport carries on or closes.
                write(data)
                return
            if n < len(data):
                write(data[n:])
        except Exception:
            # Not a socket error (a producer's pauseProducing raising, say):
            # the rest of this connection's bytes must not follow a hole.
            t.abortConnection()
            raise

    def writer(data: bytes) -> None:
        if type(data) is not bytes:
            # As the transport would, now rather than when sending.
            if not isinstance(data, bytes):
                raise TypeError(f"Data must be bytes, not {type(data).__name__}")
            data = bytes(data)
        if not data:
            return
        if not waiting[0]:
            if queued(transport):
                write(data)
                return
        waiting[0] += 1
        add(send_or_queue, data)

    return writer
