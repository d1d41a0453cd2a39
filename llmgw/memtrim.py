"""
Give memory back to the operating system after a burst of large request
bodies has gone.

glibc's allocator keeps freed heap memory for reuse: after many queued
bodies of a hundred KiB or so leave, the process kept about two thirds of
what they held (bench/queue_memory.py: 600 x 100 KiB, 40 of 60 MiB kept),
bounded (a second burst reuses it) but never returned. C{malloc_trim(0)}
returns it. L{Trimmer} calls it when told that a burst has drained, only
after one that held at least C{threshold} bytes, and at most once every
C{min_interval} seconds of the injected clock; never per request.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from typing import Final

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

#: A burst smaller than this is not worth a trim (its memory is reused).
TRIM_THRESHOLD: Final = 16 * 1024 * 1024
#: Seconds between two trims at least: a trim walks the whole heap.
TRIM_INTERVAL: Final = 10.0


def malloc_trim() -> Callable[[], None] | None:
    """
    glibc's C{malloc_trim(0)}, or C{None} where the C library has none
    (musl, macOS): there nothing is trimmed.
    """
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int

    def call() -> None:
        trim(0)

    return call


class Trimmer:
    """
    Calls C{trim} after a burst that held C{threshold} bytes or more has
    drained (L{drained}), at most once every C{min_interval} seconds: a
    burst that drains sooner than that after the last trim is trimmed when
    the interval is up.
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        trim: Callable[[], None],
        threshold: int = TRIM_THRESHOLD,
        min_interval: float = TRIM_INTERVAL,
    ):
        self.clock = clock
        self.trim = trim
        self.threshold = threshold
        self.min_interval = min_interval
        self.trims = 0
        self._last = -min_interval
        self._pending: IDelayedCall | None = None

    def drained(self, held: int) -> None:
        """
        A burst that held at most C{held} bytes has gone.
        """
        if held < self.threshold or self._pending is not None:
            return
        wait = max(0.0, self._last + self.min_interval - self.clock.seconds())
        self._pending = self.clock.callLater(wait, self._run)

    def _run(self) -> None:
        self._pending = None
        self._last = self.clock.seconds()
        self.trims += 1
        try:
            self.trim()
        except Exception:
            self.log.failure("returning freed memory to the system failed")

    def close(self) -> None:
        """
        Cancel a trim not yet made.
        """
        if self._pending is not None and self._pending.active():
            self._pending.cancel()
        self._pending = None
