"""
L{llmgw.periodic.Periodic}: the loop the agent's scraper and sleeper, the
gateway's first-byte checks and the memory ceiling and trimmer run on.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.logger import LogLevel, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from llmgw.periodic import Periodic


class Counting(Periodic):
    failed = "counting failed; it goes on"

    def __init__(self, clock: Clock, interval: float, fail_at: int = 0) -> None:
        self.clock, self.interval, self.fail_at = clock, interval, fail_at
        self.ticks = 0

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks == self.fail_at:
            raise RuntimeError("boom")


class PeriodicTests(SynchronousTestCase):
    def test_ticks_after_each_interval(self) -> None:
        """
        The first tick is an interval after the start, then one per
        interval; none after the stop.
        """
        clock = Clock()
        s = Counting(clock, 2.0)
        s.startService()
        self.assertEqual(s.ticks, 0)
        clock.advance(2.0)
        clock.advance(2.0)
        self.assertEqual(s.ticks, 2)
        s.stopService()
        clock.advance(10.0)
        self.assertEqual((s.ticks, s.running), (2, 0))

    def test_at_start(self) -> None:
        """
        With C{at_start}, the first tick runs as the service starts.
        """
        clock = Clock()
        s = Counting(clock, 2.0)
        s.at_start = True
        s.startService()
        self.assertEqual(s.ticks, 1)
        clock.advance(2.0)
        self.assertEqual(s.ticks, 2)

    def test_failure_logged_and_goes_on(self) -> None:
        """
        A tick that raises is logged with the service's line and the loop
        keeps going.
        """
        seen: list[dict[str, object]] = []
        globalLogPublisher.addObserver(seen.append)  # type: ignore[arg-type]
        self.addCleanup(globalLogPublisher.removeObserver, seen.append)  # type: ignore[arg-type]
        clock = Clock()
        s = Counting(clock, 1.0, fail_at=1)
        s.startService()
        clock.advance(1.0)
        clock.advance(1.0)
        self.assertEqual(s.ticks, 2)
        [failure] = [e for e in seen if e.get("log_level") == LogLevel.critical]
        self.assertEqual(failure["log_format"], "counting failed; it goes on")
        self.flushLoggedErrors(RuntimeError)

    def test_stop_without_start(self) -> None:
        """
        Stopping one that never started (a parent's start failed part-way)
        is a no-op.
        """
        s = Counting(Clock(), 1.0)
        self.assertIsNone(s.stopService())
        self.assertEqual(s.running, 0)
