"""
Helpers for integration tests that run real processes on loopback.
"""

from __future__ import annotations

import socket
from typing import Any

from twisted.internet import defer
from twisted.internet.protocol import ProcessProtocol

#: How much of a child's output L{ProcessOutput} keeps.
KEEP_BYTES = 200_000


def free_port() -> int:
    """
    A TCP port on 127.0.0.1 that was free a moment ago.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ProcessOutput(ProcessProtocol):
    """
    Keeps the tail of a child's stdout and stderr; C{ended} fires with the
    reason's value when the process has ended and its pipes are closed.
    """

    def __init__(self) -> None:
        self.data = b""
        self.ended: defer.Deferred[Any] = defer.Deferred()

    def childDataReceived(self, fd: int, data: bytes) -> None:
        self.data = (self.data + data)[-KEEP_BYTES:]

    def processEnded(self, reason: Any) -> None:
        self.ended.callback(reason.value)

    def text(self) -> str:
        return self.data.decode("utf-8", "replace")
