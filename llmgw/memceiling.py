"""
A memory ceiling for a process that takes work from clients: shed new work
with a clear 503 before the process's resident memory passes what the
operator allows, as Envoy's overload manager does.

L{MemoryCeiling} reads the process's resident set size (RSS) on a
L{LoopingCall} of the injected clock, every L{POLL_S} seconds, never per
request: on Linux a read of C{/proc/self/statm} is two short system calls
that the kernel answers from memory, so it does not hold the reactor. Once
the RSS reaches L{HIGH_WATER} of the ceiling it starts shedding, and it
stops only under L{LOW_WATER} (hysteresis: a process hovering at the mark
does not flap). One line is logged when shedding starts and one when it
stops, with the count of requests refused meanwhile; the front asks
L{MemoryCeiling.shedding} for each new request and calls
L{MemoryCeiling.refused} for each it turns away.

Requests already admitted carry on: the ceiling sheds new work only, so
memory comes down as they finish.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Final

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from llmgw.periodic import Periodic

#: Where Linux tells a process its memory, in pages: size, resident, ...
STATM: Final = "/proc/self/statm"
#: Shedding starts at this fraction of the ceiling, and stops under the low one.
HIGH_WATER: Final = 0.9
LOW_WATER: Final = 0.8
#: Seconds between two reads of the RSS.
POLL_S: Final = 0.5

_MIB: Final = 1024 * 1024


class MemoryCeilingError(Exception):
    """
    The memory ceiling cannot work here (no C{/proc/self/statm} to read the
    process's memory from).
    """


def read_rss(path: str = STATM) -> int:
    """
    This process's resident memory in bytes, from C{path} (Linux's statm).

    @raise OSError: the file cannot be read.
    @raise ValueError: it does not read as statm does.
    """
    with open(path, "rb") as f:
        fields = f.read(256).split()
    return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")


def check_readable(path: str = STATM) -> None:
    """
    Check that L{read_rss} works on this system.

    @raise MemoryCeilingError: naming what is missing.
    """
    try:
        read_rss(path)
    except (OSError, ValueError, IndexError) as e:
        raise MemoryCeilingError(
            f"a memory ceiling needs the process's resident memory from {path}, which cannot be "
            f"read here ({e}); it works on Linux only"
        ) from None


class MemoryCeiling(Periodic):
    """
    Whether a process is over its memory ceiling: C{shedding} turns C{True}
    when the RSS reaches C{high} of C{limit} bytes, and C{False} again under
    C{low} of it. Polls only while running (a child of the process's
    services).

    @param read: the RSS reader (L{read_rss}; a fake in tests).
    @param what: the process, for the log ("the gateway").
    @param option: the option that sets C{limit}, for the log.
    """

    log = Logger()
    at_start = True

    def __init__(
        self,
        clock: IReactorTime,
        limit: int,
        read: Callable[[], int] = read_rss,
        high: float = HIGH_WATER,
        low: float = LOW_WATER,
        interval: float = POLL_S,
        what: str = "the gateway",
        option: str = "--memory-limit",
    ):
        if not 0 < low < high <= 1:
            raise ValueError(f"memory ceiling marks: need 0 < low ({low}) < high ({high}) <= 1")
        self.clock = clock
        self.limit = limit
        self.read = read
        self.high = int(limit * high)
        self.low = int(limit * low)
        self.interval = interval
        self.what = what
        self.option = option
        self.shedding = False
        #: The last RSS read, in bytes (0 before the first).
        self.rss = 0
        #: Requests refused while shedding: in all, and in this episode.
        self.shed = 0
        self._shed_now = 0
        self._read_failed = False

    def refused(self) -> None:
        """
        Count a request refused because of the ceiling.
        """
        self.shed += 1
        self._shed_now += 1

    def poll(self) -> None:
        """
        Read the RSS once and start or stop shedding. A failed read is
        logged (once until a read works again) and changes nothing.
        """
        try:
            rss = self.read()
        except Exception:
            if not self._read_failed:
                self._read_failed = True
                self.log.failure("{what}: reading its resident memory failed", what=self.what)
            return
        self._read_failed = False
        self.rss = rss
        if not self.shedding and rss >= self.high:
            self.shedding = True
            self._shed_now = 0
            self.log.warn(
                "{what}: resident memory {rss} MiB reached {high} MiB, {pct}% of its ceiling of "
                "{limit} MiB ({option}): refusing new requests with 503 until it is under {low} MiB",
                what=self.what, rss=rss // _MIB, high=self.high // _MIB, pct=round(100 * self.high / self.limit),
                limit=self.limit // _MIB, option=self.option, low=self.low // _MIB,
            )
        elif self.shedding and rss < self.low:
            self.shedding = False
            self.log.info(
                "{what}: resident memory {rss} MiB is under {low} MiB again: accepting new requests "
                "({shed} refused meanwhile)",
                what=self.what, rss=rss // _MIB, low=self.low // _MIB, shed=self._shed_now,
            )

    def tick(self) -> None:
        self.poll()

    def register(self, registry: CollectorRegistry, prefix: str = "llmgw_gateway") -> None:
        """
        Offer the ceiling in C{registry}: whether it sheds now, and the
        requests it refused.
        """
        registry.register(_CeilingCollector(self, prefix))


class _CeilingCollector(Collector):
    def __init__(self, ceiling: MemoryCeiling, prefix: str):
        self._ceiling = ceiling
        self._prefix = prefix

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        c = self._ceiling
        yield GaugeMetricFamily(
            f"{self._prefix}_memory_shedding",
            "1 while the process's resident memory is over its ceiling's high-water mark and new "
            "requests are refused with 503, else 0",
            value=int(c.shedding),
        )
        yield GaugeMetricFamily(
            f"{self._prefix}_memory_limit_bytes", "The memory ceiling (--memory-limit)", value=c.limit
        )
        yield CounterMetricFamily(
            f"{self._prefix}_memory_shed_requests",
            "Requests refused with 503 because the process's memory was over its ceiling",
            value=c.shed,
        )
