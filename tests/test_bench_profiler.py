"""The benchmarks' C{profile} request: wall time by default, CPU time when asked."""

from __future__ import annotations

from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from bench import common
from bench.common import Profiler


class ProfilerTests(SynchronousTestCase):
    def run_profile(self, **start: str) -> int:
        """Profile a little work; how many times the process's CPU clock was read."""
        reads = [0]

        def cpu_clock() -> float:
            reads[0] += 1
            return reads[0] * 1e-6

        self.patch(common.time, "process_time", cpu_clock)
        prof = Profiler()
        self.assertEqual(prof({"action": "start", **start}), {"profiling": True})
        sorted(range(100), key=lambda i: -i)
        out = prof({"action": "stop", "path": str(Path(self.mktemp())), "top": 5})
        self.assertIn("function calls", out["top"])
        return reads[0]

    def test_cpu_clock_when_asked(self) -> None:
        """With clock "cpu" the profile's times are the process's CPU time; by default they are not."""
        self.assertGreater(self.run_profile(clock="cpu"), 0)
        self.assertEqual(self.run_profile(), 0)
