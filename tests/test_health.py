"""
Tests for L{llmgw.agent.health}: readiness, the startup timeout and failed
probes, through the supervisor and on a L{HealthWatch} alone.
"""

from __future__ import annotations

import signal

from tests.supervisor_harness import SupervisorCase, spec


class SupervisorHealthTests(SupervisorCase):
    """
    Health probes of the shards a supervisor runs.
    """

    def test_ready_then_slower_probes(self) -> None:
        """
        A shard is starting until its health path answers; then ready, and
        probed at the slower ready interval.
        """
        self.sup.start(spec(health_path="/healthz"))
        self.clock.advance(0)
        self.assertEqual(self.prober.answer(False), "http://127.0.0.1:8001/healthz")
        self.clock.advance(1)
        self.prober.answer(True)
        self.assertEqual(self.states(), ["starting", "ready"])
        self.clock.advance(9)
        self.assertEqual(self.prober.pending, [])
        self.clock.advance(1)
        self.assertEqual(len(self.prober.pending), 1)

    def test_startup_timeout(self) -> None:
        """
        A shard not healthy within its startup timeout is TERMed, and when
        it ends it is failed with the reason and how it ended.
        """
        shard = self.sup.start(spec(startup_timeout_s=5, stop_grace_s=3))
        for _ in range(5):
            self.clock.advance(0)
            self.prober.answer(False)
            self.clock.advance(1)
        self.assertEqual(self.ops.signals, [(shard.pid, signal.SIGTERM)])
        self.spawner.processes[0].end(1, signal.SIGTERM)
        (_, state, err, _, sig) = self.reports[-1]
        self.assertEqual((state, sig), ("failed", signal.SIGTERM))
        self.assertIn("startup timeout of 5s", err)
        self.assertIn("HTTP 503", err)
        self.clock.advance(10)
        self.assertEqual(self.ops.signals, [(shard.pid, signal.SIGTERM)])

    def test_unhealthy_while_ready(self) -> None:
        """
        Three failed health checks in a row while ready fail the shard (it is
        stopped, then reported failed with the health error).
        """
        self.start_ready()
        for _ in range(3):
            self.clock.advance(10)
            self.prober.answer(False)
        self.assertEqual(self.ops.signals[0][1], signal.SIGTERM)
        self.spawner.processes[0].end(0)
        self.assertEqual(self.reports[-1][1], "failed")
        self.assertIn("failed 3 health checks in a row", self.reports[-1][2])
