"""
Ending the adoption grace early (L{Reconciler.end_adoption_grace}), as the
local fleet does once every one of its agents has registered; and the
outbox going on past a command whose sending fails unexpectedly.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from tests.reconciler_harness import Fleet


class EndGraceTests(SynchronousTestCase):
    def test_places_at_once_after_end(self) -> None:
        """
        Within a 30 s grace nothing is placed; once the grace is ended
        a pass places at once, with an event that says why.
        """
        f = Fleet({"demo": ("one", 2)}, nodes=2, grace=30.0)
        f.rec.startService()
        self.addCleanup(f.rec.stopService)
        f.step(1.0, 3)
        self.assertEqual(f.dispatcher.starts, [])
        f.rec.end_adoption_grace("every expected agent has registered")
        # A pass right away, not at the next interval's.
        f.clock.advance(0)
        f.rec.flush()
        self.assertEqual(len(f.dispatcher.starts), 2)
        kinds = [e["kind"] for e in f.rec.events()]
        self.assertIn("adoption_grace_ended", kinds)

    def test_after_grace_changes_nothing(self) -> None:
        """
        Past the grace, ending it again neither moves it nor logs an event.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=1, grace=2.0)
        f.rec.startService()
        self.addCleanup(f.rec.stopService)
        f.past_grace()
        end = f.rec.grace_end
        f.rec.end_adoption_grace("again")
        self.assertEqual(f.rec.grace_end, end)
        self.assertNotIn("adoption_grace_ended", [e["kind"] for e in f.rec.events()])


class OutboxFailureTests(SynchronousTestCase):
    def test_one_failing_send_does_not_drop_the_batch(self) -> None:
        """
        A command whose sending raises something unexpected is logged and
        handled as refused; the other commands of the same batch are
        still sent.
        """
        f = Fleet({"demo": ("one", 2)}, nodes=2, grace=0)
        bad = f.ids[0]
        f.dispatcher.refuse[bad] = RuntimeError("the stream broke oddly")
        f.step()
        self.assertTrue(f.dispatcher.starts)
        self.assertNotIn(bad, {c.node_id for c in f.dispatcher.starts})
        self.assertTrue(self.flushLoggedErrors(RuntimeError))
