"""
Writing to a TCP connection now rather than on the reactor's next turn.

A Twisted transport's C{write} only queues the bytes: it asks the reactor
to watch the socket for writability (an C{epoll_ctl}), the reactor's next
turn finds it writable and sends, then stops watching (another
C{epoll_ctl}). For a proxy that writes one request or one response piece
per read, that is two system calls and a reactor turn per write, and the
bytes wait behind whatever else that turn does (other connections' reads,
timers): most of the latency a hop adds, and a good share of its CPU.

L{send_now} returns a writer that sends at once on the transport's socket
(the C{send} Twisted would make later) when nothing is queued before it,
and hands to C{write} whatever the socket did not take, or everything when
something is queued already (order is kept), when the connection is
closing, when the send fails (the transport meets the same error on its
own turn and closes as usual), or when the transport is not a plain TCP
one (TLS, test transports): then it is C{transport.write} itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.abstract import FileDescriptor


def send_now(transport: Any) -> Callable[[bytes], None]:
    """
    A writer for C{transport}: each call sends its bytes now when the
    transport has nothing queued, else queues them behind the rest.
    """
    write: Callable[[bytes], None] = transport.write
    if not isinstance(transport, FileDescriptor) or getattr(transport, "socket", None) is None:
        return write
    send = transport.socket.send  # type: ignore[attr-defined]

    def writer(data: bytes) -> None:
        t = transport
        if (
            not data
            or t._tempDataLen
            or t.offset != len(t.dataBuffer)
            or t.disconnecting
            or not t.connected
            or t._writeDisconnecting
            or t._writeDisconnected
        ):
            write(data)
            return
        try:
            n = send(data)
        except OSError:
            # Full (EAGAIN), interrupted, or the connection is lost: queued,
            # the bytes are sent, or meet the same error, on the reactor's
            # turn, and the transport carries on or closes as usual.
            write(data)
            return
        if n < len(data):
            write(data[n:])

    return writer
