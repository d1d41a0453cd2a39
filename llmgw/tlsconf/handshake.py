"""
How long a TLS listener waits for a connection's handshake.

A socket that connects and never completes its handshake (a port scan, a
stalled or hostile peer) holds a file descriptor and a TLS object; each
listener aborts it after L{HANDSHAKE_TIMEOUT} seconds from accept. The
agent port times it on its stream's one timer (which goes on to time the
Register and the heartbeats); other listeners use L{HandshakeDeadline}.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from twisted.internet.interfaces import IDelayedCall

#: Seconds from TCP accept to a completed TLS handshake.
HANDSHAKE_TIMEOUT: Final = 10.0


class HandshakeDeadline:
    """
    One connection's handshake deadline: C{expired} is called
    C{timeout} seconds after construction unless L{done} was called first
    (the handshake completed, or the connection was lost). C{call_later}
    is the reactor's C{callLater} (a test's C{Clock.callLater}).
    """

    def __init__(
        self,
        call_later: Callable[..., IDelayedCall],
        expired: Callable[[], None],
        timeout: float = HANDSHAKE_TIMEOUT,
    ):
        self.timeout = timeout
        self._call: IDelayedCall | None = call_later(timeout, self._expired, expired)

    @property
    def pending(self) -> bool:
        """
        Whether the deadline still runs.
        """
        return self._call is not None

    def done(self) -> None:
        """
        Stop the deadline; calling it again does nothing.
        """
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None

    def _expired(self, expired: Callable[[], None]) -> None:
        self._call = None
        expired()


__all__ = ["HANDSHAKE_TIMEOUT", "HandshakeDeadline"]
