"""
Tests for L{llmgw.routing}: the published routing table, its revisions and
long-poll, and its wire form.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.routing import (
    EngineSignals,
    Route,
    RoutesDataError,
    RoutingTable,
    snapshot_from_json,
    snapshot_to_json,
)


def _r(rid: str, model: str = "m", port: int = 1, draining: bool = False) -> Route:
    return Route(rid, model, f"10.0.0.1:{port}", draining)


class RoutingTableTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.table = RoutingTable(self.clock)

    def test_revision_moves_only_on_change(self) -> None:
        """
        Publishing the same routes again keeps the revision; any change
        increases it.
        """
        self.assertTrue(self.table.publish([_r("b"), _r("a")], ["m"]))
        rev = self.table.revision
        self.assertFalse(self.table.publish([_r("a"), _r("b")], ["m"]))
        self.assertEqual(self.table.revision, rev)
        self.assertTrue(self.table.publish_model("m", [_r("a", draining=True), _r("b")]))
        self.assertGreater(self.table.revision, rev)
        self.assertEqual([r.replica_id for r in self.table.routes("m")], ["a", "b"])

    def test_models_leave_out_all_draining(self) -> None:
        """
        A model whose replicas all drain is still known but not listed.
        """
        self.table.publish([_r("a", "x", draining=True), _r("b", "y")], ["x", "y", "z"])
        self.assertEqual(self.table.models(), ["y"])
        self.assertTrue(self.table.knows_model("z"))
        self.assertFalse(self.table.knows_model("w"))

    def test_long_poll_fires_on_change(self) -> None:
        """
        A wait for a newer revision fires at the next change, with it.
        """
        d = self.table.wait_newer(self.table.revision)
        self.assertNoResult(d)
        self.table.publish([_r("a")], ["m"])
        self.assertEqual(self.successResultOf(d), self.table.revision)
        self.assertEqual(self.table.waiting(), 0)

    def test_long_poll_answers_at_once_when_behind(self) -> None:
        """
        A caller holding an older revision gets the current one at once.
        """
        self.table.publish([_r("a")], ["m"])
        self.assertEqual(self.successResultOf(self.table.wait_newer(0)), 1)

    def test_long_poll_times_out(self) -> None:
        """
        With no change the wait answers after its timeout, with the same
        revision, and leaves no timer behind.
        """
        d = self.table.wait_newer(0, timeout=30)
        self.clock.advance(29.9)
        self.assertNoResult(d)
        self.clock.advance(0.2)
        self.assertEqual(self.successResultOf(d), 0)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_cancelled_long_poll_is_forgotten(self) -> None:
        """
        A client that goes away takes its waiter and timer with it.
        """
        d = self.table.wait_newer(0)
        d.cancel()
        self.failureResultOf(d)
        self.assertEqual(self.table.waiting(), 0)
        self.assertEqual(self.clock.getDelayedCalls(), [])


class WireFormTests(SynchronousTestCase):
    def test_round_trip_keeps_routes_and_signal_age(self) -> None:
        """
        A snapshot written at one clock and read at another keeps its routes,
        and each signal keeps its age rather than its timestamp.
        """
        table = RoutingTable(Clock())
        sig = EngineSignals(sampled_at=98.0, waiting=3, running=2, kv_cache_usage=0.5)
        table.publish([Route("a", "m", "h:1", signals=sig), _r("b", "m", 2, draining=True)], ["m", "n"])
        doc = snapshot_to_json(table, now=100.0)
        snap, problems = snapshot_from_json(doc, now=5000.0)
        self.assertEqual(problems, [])
        self.assertEqual(snap.revision, table.revision)
        self.assertTrue(snap.knows_model("n"))
        a, b = snap.routes("m")
        self.assertEqual(a.signals.age(5000.0), 2.0)
        self.assertEqual((a.signals.waiting, a.signals.kv_cache_usage), (3, 0.5))
        self.assertIsNone(a.signals.prefix_cache_hits)
        self.assertTrue(b.draining)

    def test_bad_entries_cost_only_themselves(self) -> None:
        """
        A route without an address, or with a signal that is not a number,
        is reported as a problem; the rest is kept.
        """
        doc = {
            "revision": 4,
            "known": ["m", 7],
            "routes": [
                {"replica": "a", "model": "m", "address": "h:1"},
                {"replica": "b", "model": "m"},
                {"replica": "c", "model": "m", "address": "h:3", "signals": {"waiting": "lots"}},
            ],
        }
        snap, problems = snapshot_from_json(doc, now=0.0)
        self.assertEqual([r.replica_id for r in snap.routes("m")], ["a", "c"])
        self.assertIsNone(snap.routes("m")[1].signals)
        self.assertEqual(len(problems), 3)

    def test_not_a_routes_document(self) -> None:
        """
        Anything but an object with a revision and two lists is refused whole.
        """
        for doc in ([], {"revision": -1, "known": [], "routes": []}, {"revision": 1, "known": {}}):
            self.assertRaises(RoutesDataError, snapshot_from_json, doc, 0.0)
