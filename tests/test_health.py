"""
Tests for L{llmgw.agent.health}: readiness, the startup timeout and failed
probes, through the supervisor and on a L{HealthWatch} alone.
"""

from __future__ import annotations

import signal

from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.health import HealthWatch, probe_error
from llmgw.agent.shard import DRAINING, READY, STARTING, Shard
from tests.supervisor_harness import FakeProber, SupervisorCase, spec


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


class HealthWatchTests(SynchronousTestCase):
    """
    A L{HealthWatch} alone, on a Clock with a fake prober.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.prober = FakeProber()
        self.changes: list[str] = []
        self.unhealthy: list[str] = []
        self.watch = HealthWatch(
            self.clock, self.prober, lambda: "10.0.0.2",
            changed=lambda s: self.changes.append(s.state),
            unhealthy=lambda s, why: self.unhealthy.append(why),
            interval_starting=1, interval_ready=10, unhealthy_after=2,
        )

    def test_ready(self) -> None:
        """
        A starting shard is probed at once at the advertised host; a good
        answer makes it ready (once), and the startup timeout no longer
        runs.
        """
        shard = Shard(spec(startup_timeout_s=5))
        self.watch.watch_start(shard)
        self.clock.advance(0)
        self.assertEqual(self.prober.answer(True), "http://10.0.0.2:8001/health")
        self.assertEqual((shard.state, self.changes), (READY, [READY]))
        self.clock.advance(10)
        self.prober.answer(True)
        self.assertEqual(self.changes, [READY])
        self.assertEqual(self.unhealthy, [])

    def test_starting_probes_quick_then_slower(self) -> None:
        """
        A starting shard's probes after the first come 0.1 s apart,
        doubling up to C{interval_starting}: an engine up in a fraction of
        a second is ready that much sooner; a slow one is probed once per
        interval after a handful.
        """
        shard = Shard(spec(startup_timeout_s=60))
        self.watch.watch_start(shard)
        self.clock.advance(0)
        gaps = []
        for _ in range(6):
            self.prober.answer(False)
            # The next probe is the soonest call (the startup timeout is 60 s).
            gap = min(c.getTime() for c in self.clock.getDelayedCalls()) - self.clock.seconds()
            gaps.append(round(gap, 3))
            self.clock.advance(gap)
            self.assertEqual(len(self.prober.pending), 1)
        self.assertEqual(gaps, [0.1, 0.2, 0.4, 0.8, 1.0, 1.0])

    def test_startup_timeout(self) -> None:
        """
        A shard not ready within its startup timeout is unhealthy, with the
        last probe's error.
        """
        shard = Shard(spec(startup_timeout_s=2))
        self.watch.watch_start(shard)
        self.clock.advance(0)
        self.prober.answer(False)
        self.clock.advance(2)
        self.assertEqual(self.unhealthy, ["not healthy within its startup timeout of 2s "
                                          "(last health check: HTTP 503)"])

    def test_failures_in_a_row(self) -> None:
        """
        A ready or draining shard is unhealthy after so many failed probes
        in a row; a good answer between them starts the count again.
        """
        shard = Shard(spec(), DRAINING)
        self.watch.first_probe(shard)
        self.prober.answer(True)
        for ok in (False, True, False, False):
            self.clock.advance(10)
            self.prober.answer(ok)
        self.assertEqual(self.unhealthy, ["failed 2 health checks in a row (last: HTTP 503)"])
        self.clock.advance(100)
        self.assertEqual(self.prober.pending, [])

    def test_first_probe_fails(self) -> None:
        """
        A re-adopted ready shard that does not answer its first probe is
        starting again; the Deferred fires all the same.
        """
        shard = Shard(spec(), READY)
        d = self.watch.first_probe(shard)
        self.prober.answer(False)
        self.assertIsNone(self.successResultOf(d))
        self.assertEqual((shard.state, self.changes), (STARTING, [STARTING]))
        self.assertIn("startup", shard.timers)

    def test_forget(self) -> None:
        """
        A forgotten shard has no startup timeout or probe left.
        """
        shard = Shard(spec())
        self.watch.watch_start(shard)
        self.watch.forget(shard)
        self.assertEqual((shard.timers, self.clock.getDelayedCalls()), ({}, []))

    def test_no_prober(self) -> None:
        """
        Without a prober nothing is probed: the startup timeout decides.
        """
        watch = HealthWatch(self.clock, None, lambda: "h", changed=lambda s: None,
                            unhealthy=lambda s, why: self.unhealthy.append(why))
        shard = Shard(spec(startup_timeout_s=3))
        self.assertIsNone(self.successResultOf(watch.first_probe(shard)))
        watch.watch_start(shard)
        self.clock.advance(3)
        self.assertEqual(len(self.unhealthy), 1)

    def test_probe_error(self) -> None:
        """
        A timeout reads "no answer in time"; another error its message, or
        its type when it has none.
        """
        self.assertEqual(probe_error(Failure(defer.TimeoutError())), "no answer in time")
        self.assertEqual(probe_error(Failure(ValueError("HTTP 500"))), "HTTP 500")
        self.assertEqual(probe_error(Failure(ConnectionRefusedError())), "ConnectionRefusedError")
