"""
The gateway's pick-a-replica logic and circuit breaker (pure, with a Clock).
"""

from __future__ import annotations

from collections import Counter

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.state.interfaces import IInFlight, Route
from llmgw.gateway.router import Router


def routes(*ids: str, draining: tuple[str, ...] = ()) -> list[Route]:
    return [Route(i, "m", f"10.0.0.{n}:8000", i in draining) for n, i in enumerate(ids, 1)]


class PickTests(SynchronousTestCase):
    def test_provides_in_flight(self) -> None:
        """
        The router is the gateway's L{IInFlight}: it counts begun and ended
        requests per replica.
        """
        r = Router(Clock())
        self.assertTrue(IInFlight.providedBy(r))
        r.begin("a")
        r.begin("a")
        r.end("a")
        self.assertEqual(r.in_flight("a"), 1)
        r.end("a")
        self.assertEqual(r.in_flight("a"), 0)
        self.assertEqual(r.snapshot(), {})

    def test_fewest_in_flight(self) -> None:
        """
        The replica with the fewest requests in flight is picked.
        """
        r = Router(Clock())
        for _ in range(3):
            r.begin("a")
        r.begin("b")
        for _ in range(10):
            self.assertEqual(r.pick(routes("a", "b", "c")).replica_id, "c")  # type: ignore[union-attr]
        r.begin("c")
        r.begin("c")
        self.assertEqual(r.pick(routes("a", "b", "c")).replica_id, "b")  # type: ignore[union-attr]

    def test_ties_spread(self) -> None:
        """
        Equally loaded replicas take turns.
        """
        r = Router(Clock())
        picks = Counter(r.pick(routes("a", "b", "c")).replica_id for _ in range(300))  # type: ignore[union-attr]
        self.assertEqual(picks, {"a": 100, "b": 100, "c": 100})

    def test_draining_and_excluded_skipped(self) -> None:
        """
        Draining replicas and those in C{exclude} are never picked; with no
        candidate left the answer is C{None}.
        """
        r = Router(Clock())
        rs = routes("a", "b", "c", draining=("b",))
        for _ in range(10):
            self.assertEqual(r.pick(rs, exclude={"a"}).replica_id, "c")  # type: ignore[union-attr]
        self.assertIsNone(r.pick(rs, exclude={"a", "c"}))
        self.assertIsNone(r.pick([]))

    def test_same_tuple_again(self) -> None:
        """
        The routing table's own immutable routes, handed out again, are
        picked from as the first time: excluded and cooling replicas are
        still skipped, and a new tuple with a draining replica is looked at
        anew.
        """
        clock = Clock()
        r = Router(clock, failure_threshold=1)
        rs = tuple(routes("a", "b"))
        self.assertEqual({r.pick(rs).replica_id for _ in range(4)}, {"a", "b"})  # type: ignore[union-attr]
        self.assertEqual(r.pick(rs, exclude={"a"}).replica_id, "b")  # type: ignore[union-attr]
        r.failed("b")
        self.assertEqual({r.pick(rs).replica_id for _ in range(4)}, {"a"})  # type: ignore[union-attr]
        clock.advance(r.cooldown)
        drained = tuple(routes("a", "b", draining=("a",)))
        self.assertEqual({r.pick(drained).replica_id for _ in range(4)}, {"b"})  # type: ignore[union-attr]
        self.assertEqual({r.pick(rs).replica_id for _ in range(4)}, {"a", "b"})  # type: ignore[union-attr]

    def test_all_free_at_a_glance(self) -> None:
        """
        L{Router.all_free} is C{True} only for the immutable routes last
        picked among, none draining, none with signals, none cooling down.
        """
        clock = Clock()
        r = Router(clock, failure_threshold=1)
        rs = tuple(routes("a", "b"))
        self.assertFalse(r.all_free(rs))  # not seen yet
        r.pick(rs)
        self.assertTrue(r.all_free(rs))
        self.assertFalse(r.all_free(tuple(routes("a", "b"))))  # not the same routes
        r.failed("a")
        self.assertFalse(r.all_free(rs))
        clock.advance(r.cooldown)
        r.cooling("a")  # its cool-down over
        self.assertTrue(r.all_free(rs))
        drained = tuple(routes("a", "b", draining=("a",)))
        r.pick(drained)
        self.assertFalse(r.all_free(drained))
        listed = routes("a", "b")
        r.pick(listed)
        self.assertFalse(r.all_free(listed))

    def test_load_spread_under_concurrency(self) -> None:
        """
        Requests that stay in flight spread evenly over the replicas.
        """
        r = Router(Clock())
        rs = routes("a", "b", "c", "d")
        for _ in range(40):
            r.begin(r.pick(rs).replica_id)  # type: ignore[union-attr]
        self.assertEqual(r.snapshot(), {"a": 10, "b": 10, "c": 10, "d": 10})


class BreakerTests(SynchronousTestCase):
    def test_cool_down_after_repeated_failures(self) -> None:
        """
        C{failure_threshold} failures in a row take a replica out of
        rotation for C{cooldown} seconds; then it is back.
        """
        clock = Clock()
        r = Router(clock, failure_threshold=3, cooldown=10)
        self.assertFalse(r.failed("a"))
        self.assertFalse(r.failed("a"))
        self.assertTrue(r.failed("a"))
        self.assertTrue(r.cooling("a"))
        self.assertEqual(r.cooling_replicas(), ["a"])
        for _ in range(5):
            self.assertEqual(r.pick(routes("a", "b")).replica_id, "b")  # type: ignore[union-attr]
        self.assertIsNone(r.pick(routes("a")))
        clock.advance(10)
        self.assertFalse(r.cooling("a"))
        self.assertEqual(r.pick(routes("a")).replica_id, "a")  # type: ignore[union-attr]

    def test_probation(self) -> None:
        """
        A replica back from a cool-down goes out again on its next failure;
        a success clears its record.
        """
        clock = Clock()
        r = Router(clock, failure_threshold=3, cooldown=10)
        for _ in range(3):
            r.failed("a")
        clock.advance(10)
        self.assertFalse(r.cooling("a"))
        self.assertTrue(r.failed("a"))
        clock.advance(10)
        self.assertFalse(r.cooling("a"))
        r.succeeded("a")
        self.assertFalse(r.failed("a"))
        self.assertFalse(r.cooling("a"))

    def test_success_resets_the_run(self) -> None:
        """
        Failures separated by a success do not add up.
        """
        r = Router(Clock(), failure_threshold=2)
        r.failed("a")
        r.succeeded("a")
        self.assertFalse(r.failed("a"))
        self.assertFalse(r.cooling("a"))

    def test_forget(self) -> None:
        """
        Breaker state of replicas gone from the table is dropped.
        """
        r = Router(Clock(), failure_threshold=1)
        r.failed("a")
        r.failed("b")
        r.forget({"b"})
        self.assertFalse(r.cooling("a"))
        self.assertTrue(r.cooling("b"))

    def test_threshold_validated(self) -> None:
        """
        A threshold under one is refused.
        """
        self.assertRaises(ValueError, Router, Clock(), 0)


class RingTests(SynchronousTestCase):
    def test_ring_follows_the_routes(self) -> None:
        """
        The ring is that of the routes given: the same routing-table tuple
        again gives the same ring, and a new tuple (the table changed) the
        ring of its own replica ids, also when it is asked for in turn with
        the old one.
        """
        router = Router(Clock())
        a = tuple(routes("a", "b"))
        b = tuple(routes("a", "b", "c"))
        ring_a = router.ring(a)
        self.assertEqual(ring_a.replica_ids, {"a", "b"})
        self.assertIs(router.ring(a), ring_a)
        self.assertEqual(router.ring(b).replica_ids, {"a", "b", "c"})
        self.assertEqual(router.ring(a).replica_ids, {"a", "b"})
        self.assertEqual(router.ring(list(b)).replica_ids, {"a", "b", "c"})
