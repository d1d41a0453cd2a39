"""
A service that does one thing every so often while it runs, and keeps
doing it after a failure.
"""

from __future__ import annotations

from typing import Any

from twisted.application.service import Service
from twisted.internet.task import LoopingCall
from twisted.logger import Logger


class Periodic(Service):
    """
    Calls L{tick} every C{interval} seconds on C{clock} (both set by the
    subclass before it starts), the first an interval after it starts, or
    as it starts with L{at_start}. A tick that raises is logged with
    L{failed} and the next one runs as usual: a bare C{LoopingCall} would
    stop at its first failure.
    """

    log = Logger()
    clock: Any
    interval: float
    #: The log line of a failed tick.
    failed = "a periodic pass failed; the next one goes on"
    #: Whether the first tick runs as the service starts.
    at_start = False
    _loop: LoopingCall | None = None

    def tick(self) -> None:
        raise NotImplementedError

    def _tick_safely(self) -> None:
        try:
            self.tick()
        except Exception:
            self.log.failure(self.failed)

    def startService(self) -> None:
        super().startService()
        loop = self._loop = LoopingCall(self._tick_safely)
        loop.clock = self.clock
        loop.start(self.interval, now=self.at_start)

    def stopService(self) -> Any:
        loop, self._loop = self._loop, None
        if loop is not None and loop.running:
            loop.stop()
        return super().stopService()
