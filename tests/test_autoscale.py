"""
The autoscaling decision (L{llmgw.control.core.autoscale}) as a pure function,
driven pass by pass on a L{Clock}.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.core import autoscale as a
from llmgw.control.core.autoscale import AutoscalePolicy, Observed, ScalerState, decide, recommend


class Driver:
    """
    Runs the decision once a second, as the reconciler's pass does, with
    C{active} following the count (every replica asked for is placed)
    unless a test says otherwise; keeps every event.
    """

    def __init__(self, policy: AutoscalePolicy, desired: int | None = None):
        self.policy = policy
        self.clock = Clock()
        self.clock.advance(1000)
        self.state = ScalerState(policy.min_replicas if desired is None else desired)
        self.events: list[a.ScaleEvent] = []
        self.room: int | None = None  # most replicas that can be placed; None: any

    @property
    def desired(self) -> int:
        return self.state.desired

    def step(self, in_flight: int = 0, waiting: int = 0, engine_waiting: float = 0.0,
             active: int | None = None, settling: bool = False) -> int:
        held = self.state.desired
        placed = held if self.room is None else min(held, self.room)
        seen = Observed(active=placed if active is None else active, in_flight=in_flight, waiting=waiting,
                        engine_waiting=engine_waiting, short=held - placed, settling=settling)
        decision = decide(self.policy, self.state, seen, self.clock.seconds())
        self.state = decision.state
        self.events.extend(decision.events)
        return decision.desired

    def run(self, seconds: int, **load: float) -> list[int]:
        """
        C{seconds} passes a second apart under the same load; the counts.
        """
        out = []
        for _ in range(seconds):
            self.clock.advance(1)
            out.append(self.step(**load))  # type: ignore[arg-type]
        return out

    def kinds(self) -> list[str]:
        return [e.kind for e in self.events]


def policy(**kw: float) -> AutoscalePolicy:
    base: dict[str, float] = {"min_replicas": 1, "max_replicas": 8, "target_in_flight": 4.0,
                              "stabilization_s": 300.0}
    base.update(kw)
    return AutoscalePolicy(**base)  # type: ignore[arg-type]


class RecommendTests(SynchronousTestCase):
    def test_in_flight_target(self) -> None:
        """
        With C{target_in_flight}, in-flight plus queued requests over the
        target, rounded up, within the bounds.
        """
        p = policy(target_in_flight=4)
        self.assertEqual(recommend(p, Observed(active=1, in_flight=9)), 3)
        self.assertEqual(recommend(p, Observed(active=1, in_flight=7, waiting=2)), 3)
        self.assertEqual(recommend(p, Observed(active=1, in_flight=100)), 8)
        self.assertEqual(recommend(p, Observed(active=1)), 1)

    def test_waiting_target(self) -> None:
        """
        With C{target_waiting}, the queued and the engines' waiting
        requests over the target; in-flight alone asks for one.
        """
        p = policy(target_in_flight=None, target_waiting=2)
        self.assertEqual(recommend(p, Observed(active=1, waiting=3, engine_waiting=4.5)), 4)
        self.assertEqual(recommend(p, Observed(active=1, in_flight=50)), 1)

    def test_both_targets_larger_wins(self) -> None:
        """
        Given both targets, the larger recommendation is taken.
        """
        p = policy(target_in_flight=10, target_waiting=1)
        self.assertEqual(recommend(p, Observed(active=1, in_flight=10, engine_waiting=3)), 3)
        self.assertEqual(recommend(p, Observed(active=1, in_flight=50, engine_waiting=1)), 5)

    def test_never_zero_while_busy(self) -> None:
        """
        With C{min_replicas = 0} a recommendation is still at least 1: zero
        comes only from idleness.
        """
        p = policy(min_replicas=0, target_in_flight=100)
        self.assertEqual(recommend(p, Observed(active=0, waiting=1)), 1)
        self.assertEqual(recommend(p, Observed(active=0)), 1)


class ScaleUpTests(SynchronousTestCase):
    def test_up_at_once(self) -> None:
        """
        A load over the target raises the count in the same pass, with an
        event that gives the load and the target.
        """
        d = Driver(policy())
        self.assertEqual(d.run(1, in_flight=13), [4])
        self.assertEqual(d.kinds(), [a.UP])
        self.assertIn("13 in flight", d.events[0].reason)
        self.assertIn("target 4 in flight per replica", d.events[0].reason)

    def test_up_bounded_by_max(self) -> None:
        """
        The count never goes over C{max_replicas}.
        """
        d = Driver(policy(max_replicas=3))
        self.assertEqual(d.run(3, in_flight=1000), [3, 3, 3])
        self.assertEqual(d.kinds(), [a.UP])

    def test_from_zero_on_first_request(self) -> None:
        """
        At zero replicas, the first queued request asks for one at once.
        """
        d = Driver(policy(min_replicas=0, scale_to_zero_after_s=60))
        self.assertEqual(d.run(5), [0] * 5)
        self.assertEqual(d.run(1, waiting=1), [1])
        self.assertEqual(d.kinds(), [a.UP])
        self.assertIn("from 0 to 1", d.events[0].reason)

    def test_from_zero_to_what_the_load_asks(self) -> None:
        """
        A burst that finds zero replicas asks for as many as it needs.
        """
        d = Driver(policy(min_replicas=0, scale_to_zero_after_s=60))
        self.assertEqual(d.run(1, waiting=10), [3])


class StabilizationTests(SynchronousTestCase):
    def test_down_only_after_the_window(self) -> None:
        """
        Below the count, nothing happens for C{stabilization_s}; then the
        count goes down to what the load asks, with an event.
        """
        d = Driver(policy(stabilization_s=300), desired=4)
        counts = d.run(300, in_flight=4)  # below from the first pass on
        self.assertEqual(set(counts), {4})
        self.assertEqual(d.kinds(), [])
        self.assertEqual(d.run(2, in_flight=4), [1, 1])
        self.assertEqual(d.kinds(), [a.DOWN])
        self.assertIn("from 4 to 1", d.events[0].reason)

    def test_down_to_the_peak_of_the_window(self) -> None:
        """
        The count goes down to the highest recommendation seen over the
        window, not to the last one.
        """
        d = Driver(policy(stabilization_s=100), desired=5)
        d.run(10, in_flight=12)  # asks for 3
        d.run(95, in_flight=1)  # asks for 1
        self.assertEqual(d.desired, 3)

    def test_no_down_within_the_window_after_an_up(self) -> None:
        """
        No thrash: a scale down never comes within C{stabilization_s} of a
        scale up, however quickly the load fell.
        """
        d = Driver(policy(stabilization_s=300))
        d.run(1, in_flight=40)
        self.assertEqual(d.desired, 8)
        counts = d.run(299, in_flight=0)
        self.assertEqual(set(counts), {8})
        d.run(2, in_flight=0)
        self.assertEqual(d.desired, 1)
        self.assertEqual(d.kinds(), [a.UP, a.DOWN])

    def test_oscillating_load_does_not_thrash(self) -> None:
        """
        A load that swings every 30 s over a 300 s window changes the count
        once (up), not on every swing.
        """
        d = Driver(policy(stabilization_s=300))
        for _ in range(30):
            d.run(30, in_flight=16)
            d.run(30, in_flight=2)
        self.assertEqual(d.kinds(), [a.UP])
        self.assertEqual(d.desired, 4)

    def test_rise_during_the_window_restarts_it(self) -> None:
        """
        A recommendation back at the count ends the wait: the window
        starts again the next time it falls below.
        """
        d = Driver(policy(stabilization_s=100), desired=3)
        d.run(90, in_flight=1)
        d.run(1, in_flight=12)
        d.run(90, in_flight=1)
        self.assertEqual(d.desired, 3)
        d.run(20, in_flight=1)
        self.assertEqual(d.desired, 1)

    def test_nothing_down_while_settling(self) -> None:
        """
        During the control plane's adoption grace nothing is scaled down.
        """
        d = Driver(policy(stabilization_s=10), desired=4)
        d.run(50, settling=True)
        self.assertEqual(d.desired, 4)


class ScaleToZeroTests(SynchronousTestCase):
    def test_to_zero_after_idleness(self) -> None:
        """
        With C{min_replicas = 0}, C{scale_to_zero_after_s} with nothing in
        flight or queued takes the count to zero, with an event that says
        how long it was idle.
        """
        d = Driver(policy(min_replicas=0, scale_to_zero_after_s=60, stabilization_s=300))
        d.run(1, waiting=1)
        d.run(30, in_flight=1)
        counts = d.run(59)
        self.assertEqual(set(counts), {1})
        self.assertEqual(d.run(1), [0])
        self.assertEqual(d.kinds(), [a.UP, a.TO_ZERO])
        self.assertIn("for 60s", d.events[-1].reason)

    def test_default_target_from_the_catalog(self) -> None:
        """
        A deployment with C{min_replicas = 0} and C{scale_to_zero_after_s}
        but no target (given L{a.DEFAULT_TARGET_IN_FLIGHT} by the catalog)
        comes up from zero on its first request, asks for one replica per
        eight in flight, and goes back to zero when idle.
        """
        import tomllib

        from llmgw.control.core.catalog import parse_catalog

        text = (
            '[profiles.p]\ngpus_per_shard = 1\ngpu_memory_mb = 1\ncommand = ["x"]\n'
            '[[deployments]]\nmodel = "demo"\nprofile = "p"\nmin_replicas = 0\nmax_replicas = 4\n'
            "scale_to_zero_after_s = 60\nstabilization_s = 0\n"
        )
        pol = parse_catalog(tomllib.loads(text)).deployments["demo"].autoscale
        assert pol is not None
        d = Driver(pol)
        self.assertEqual(d.run(1, waiting=1), [1])
        self.assertEqual(d.run(1, in_flight=17), [3])
        d.run(1, in_flight=8)
        self.assertEqual(d.desired, 1)
        d.run(59)
        self.assertEqual(d.run(1), [0])

    def test_any_request_restarts_the_idle_clock(self) -> None:
        """
        One request in flight during the idle time starts it again.
        """
        d = Driver(policy(min_replicas=0, scale_to_zero_after_s=60), desired=1)
        d.run(50)
        d.run(1, in_flight=1)
        d.run(59)
        self.assertEqual(d.desired, 1)
        d.run(1)
        self.assertEqual(d.desired, 0)

    def test_engine_waiting_is_not_idle(self) -> None:
        """
        Requests the engines report waiting keep a deployment from zero.
        """
        d = Driver(policy(min_replicas=0, scale_to_zero_after_s=10), desired=1)
        d.run(100, engine_waiting=1)
        self.assertEqual(d.desired, 1)

    def test_back_from_zero(self) -> None:
        """
        After scaling to zero, the next request brings a replica back, and
        the deployment goes to zero again after the next idle time.
        """
        d = Driver(policy(min_replicas=0, scale_to_zero_after_s=20))
        d.run(1, waiting=1)
        d.run(21)
        self.assertEqual(d.desired, 0)
        d.run(10)
        self.assertEqual(d.desired, 0)
        self.assertEqual(d.run(1, waiting=2), [1])
        d.run(21)
        self.assertEqual(d.kinds(), [a.UP, a.TO_ZERO, a.UP, a.TO_ZERO])

    def test_never_to_zero_with_a_minimum(self) -> None:
        """
        With C{min_replicas} above zero, idleness never goes below it.
        """
        d = Driver(policy(min_replicas=1, stabilization_s=10), desired=3)
        d.run(1000)
        self.assertEqual(d.desired, 1)


class CapacityTests(SynchronousTestCase):
    def test_capacity_bound_said_once(self) -> None:
        """
        When the replicas asked for cannot all be placed, the count is not
        raised further and one event says so, however long it lasts.
        """
        d = Driver(policy(max_replicas=8))
        d.room = 2
        d.run(1, in_flight=12)
        self.assertEqual(d.desired, 3)
        d.run(100, in_flight=40)
        self.assertEqual(d.desired, 3)
        self.assertEqual(d.kinds(), [a.UP, a.CAPACITY])
        self.assertIn("free GPUs", d.events[-1].reason)

    def test_capacity_freed_resumes(self) -> None:
        """
        Once everything asked for is placed, scaling up goes on (and a later
        want of room is said again).
        """
        d = Driver(policy(max_replicas=8))
        d.room = 2
        d.run(1, in_flight=12)
        d.run(5, in_flight=40)
        d.room = None
        d.run(2, in_flight=40)
        self.assertEqual(d.desired, 8)
        d.room = 5
        d.run(5, in_flight=32)
        d.room = None
        self.assertEqual(d.kinds(), [a.UP, a.CAPACITY, a.UP])

    def test_unplaced_trimmed_at_once(self) -> None:
        """
        When the load falls while some of the count was never placed, the
        count falls to what runs at once: that stops nothing.
        """
        d = Driver(policy(max_replicas=8, stabilization_s=300))
        d.room = 2
        d.run(1, in_flight=24)
        self.assertEqual(d.desired, 6)
        d.run(1, in_flight=4)
        self.assertEqual(d.desired, 2)
        self.assertEqual(d.kinds(), [a.UP, a.DOWN])
        self.assertIn("never placed", d.events[-1].reason)


class AdoptionAndBoundsTests(SynchronousTestCase):
    def test_running_replicas_are_kept(self) -> None:
        """
        More replicas running than the count (adopted after a restart)
        raise the count to them, and the window starts afresh.
        """
        d = Driver(policy(stabilization_s=300), desired=1)
        d.clock.advance(1)
        d.step(active=5)
        self.assertEqual(d.desired, 5)
        self.assertEqual(d.kinds(), [a.ADOPTED])
        d.run(299)
        self.assertEqual(d.desired, 5)
        d.run(2)
        self.assertEqual(d.desired, 1)

    def test_adoption_within_max(self) -> None:
        """
        Adopted replicas over C{max_replicas} are not all kept.
        """
        d = Driver(policy(max_replicas=3), desired=1)
        d.clock.advance(1)
        d.step(active=5)
        self.assertEqual(d.desired, 3)

    def test_new_bounds_apply_at_once(self) -> None:
        """
        Bounds changed under the count (an operator's C{ctl scale --min
        --max}) move it into them in the next pass, with an event.
        """
        d = Driver(policy(), desired=6)
        d.policy = d.policy.bounded(1, 2)
        d.run(1, in_flight=24)
        self.assertEqual(d.desired, 2)
        d.policy = d.policy.bounded(4, 6)
        d.run(1)
        self.assertEqual(d.desired, 4)
        self.assertEqual(d.kinds(), [a.BOUNDS, a.BOUNDS])


class Properties(SynchronousTestCase):
    @settings(max_examples=200, deadline=None)
    @given(
        st.integers(0, 3), st.integers(1, 6), st.sampled_from([10.0, 60.0]), st.sampled_from([5.0, 30.0]),
        st.lists(st.tuples(st.integers(1, 20), st.integers(0, 30), st.integers(0, 5), st.integers(0, 3)),
                 min_size=1, max_size=60),
    )
    def test_invariants(self, low: int, span: int, window: float, idle: float,
                        steps: list[tuple[int, int, int, int]]) -> None:
        """
        Whatever the load: the count stays within the bounds (zero only
        with min_replicas = 0); every change of the count is an event; no
        scale down that drains running replicas comes within the window
        after a scale up; a scale to
        zero comes only after the idle time with nothing in flight or
        queued; and the same inputs give the same decisions.
        """
        kw: dict[str, float] = {"min_replicas": low, "max_replicas": low + span, "stabilization_s": window}
        if low == 0:
            kw["scale_to_zero_after_s"] = idle
        p = policy(**kw)
        runs = []
        for _ in range(2):
            d = Driver(p)
            last_up: float | None = None
            busy_at = d.clock.seconds()
            trace = []
            for dt, in_flight, waiting, room in steps:
                d.room = None if room == 0 else room
                d.clock.advance(dt)
                now = d.clock.seconds()
                before, seen = d.desired, len(d.events)
                after = d.step(in_flight=in_flight, waiting=waiting)
                new = [e.kind for e in d.events[seen:]]
                busy = in_flight > 0 or waiting > 0
                if busy:
                    busy_at = now
                self.assertLessEqual(after, p.max_replicas)
                self.assertGreaterEqual(after, p.min_replicas)
                if after != before:
                    self.assertTrue(new)
                placed = before if d.room is None else min(before, d.room)
                # Running replicas drained (not unplaced ones dropped); a
                # scale to zero in the same pass answers to its own rule.
                if a.DOWN in new and a.TO_ZERO not in new and after < placed:
                    self.assertTrue(last_up is None or now - last_up >= window, (now, last_up))
                if a.TO_ZERO in new:
                    self.assertFalse(busy)
                    self.assertGreaterEqual(now - busy_at, idle)
                if a.UP in new:
                    last_up = now
                trace.append((after, tuple(new)))
            runs.append(trace)
        self.assertEqual(runs[0], runs[1])
