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

from llmgw.memceiling import read_rss
from llmgw.periodic import Periodic

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


#: Seconds between two looks at the resident memory.
WATCH_INTERVAL: Final = 10.0
#: Growth over the lowest resident memory since the last trim that is
#: worth a trim.
WATCH_GROWTH: Final = 32 * 1024 * 1024


class GrowthTrimmer(Periodic):
    """
    Trims after any burst, not only the queue's: every C{interval}
    seconds it reads the process's resident memory, and when that is
    C{growth} bytes or more above the lowest seen since the last trim
    (thousands of TLS handshakes or connections come and gone, say), it
    trims and takes what is left as the new floor. Memory that stays in use
    is trimmed once, not every interval: the floor rises with it.
    """

    log = Logger()
    at_start = True

    def __init__(
        self,
        clock: IReactorTime,
        trim: Callable[[], None],
        read: Callable[[], int],
        interval: float = WATCH_INTERVAL,
        growth: int = WATCH_GROWTH,
    ):
        self.clock = clock
        self.trim = trim
        self.read = read
        self.interval = interval
        self.growth = growth
        self.trims = 0
        self.floor: int | None = None

    def look(self) -> None:
        """
        Read the resident memory; trim when it grew by C{growth} or more.
        """
        try:
            rss = self.read()
        except (OSError, ValueError):
            return
        if self.floor is None or rss < self.floor:
            self.floor = rss
            return
        if rss - self.floor < self.growth:
            return
        self.trims += 1
        try:
            self.trim()
            self.floor = self.read()
        except Exception:
            self.log.failure("returning freed memory to the system failed")
            self.floor = rss

    def tick(self) -> None:
        self.look()


def growth_trimmer(clock: IReactorTime) -> GrowthTrimmer | None:
    """
    A L{GrowthTrimmer} for this process, or C{None} where there is nothing
    to trim with (no glibc) or no resident memory to read (no C{/proc}).
    """
    trim = malloc_trim()
    if trim is None:
        return None
    try:
        read_rss()
    except (OSError, ValueError, IndexError):
        return None
    return GrowthTrimmer(clock, trim, read_rss)
