"""
The control plane's published routing table: the reconciler's
C{routing_table} follows its replicas (ready ones routed, draining ones
marked, declared models known) with a revision that moves on every change,
and that table's wire form gives a standalone gateway the same routes.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from llmgw.routing import snapshot_from_json, snapshot_to_json
from tests.reconciler_harness import Fleet
from tests.test_reconciler import FakeInFlight


class PublishedTests(SynchronousTestCase):
    def test_follows_readiness_and_drain(self) -> None:
        """
        Ready replicas appear as they report ready, each change raising the
        revision; a replica drained by a scale-down stays listed, marked
        draining, until it stops; the same routes come out of the wire form.
        """
        inflight = FakeInFlight()
        f = Fleet({"demo": ("one", 2)}, nodes=2, grace=0, in_flight=inflight)
        table = f.rec.routing_table
        self.assertTrue(table.knows_model("demo"))
        self.assertEqual(table.routes("demo"), ())
        f.step()
        before = table.revision
        f.make_ready(f.dispatcher.starts[:1])
        self.assertEqual(len(table.routes("demo")), 1)
        self.assertGreater(table.revision, before)
        f.make_ready()
        self.assertEqual(list(table.routes("demo")), f.rec.routes("demo"))
        self.assertEqual(len(table.routes("demo")), 2)
        self.assertEqual(table.models(), ["demo"])
        steady = table.revision
        f.step(1.0, 3)
        self.assertEqual(table.revision, steady)  # nothing changed, nothing published

        f.rec.scale("demo", 1)
        inflight.counts.update({r.replica_id: 1 for r in table.routes("demo")})
        f.step()
        draining = [r for r in table.routes("demo") if r.draining]
        self.assertEqual(len(draining), 1)
        self.assertEqual(list(table.routes("demo")), f.rec.routes("demo"))
        wire, problems = snapshot_from_json(snapshot_to_json(table, f.clock.seconds()), f.clock.seconds())
        self.assertEqual(problems, [])
        self.assertEqual(list(wire.routes("demo")), list(table.routes("demo")))
        self.assertEqual(wire.revision, table.revision)

        inflight.counts.clear()
        f.step()
        f.confirm_stops()
        self.assertEqual([r.draining for r in table.routes("demo")], [False])

    def test_catalog_change_publishes_known(self) -> None:
        """
        A model added to the catalog is known (503, not 404) as soon as the
        catalog is applied.
        """
        from tests.reconciler_harness import catalog

        f = Fleet({"demo": ("one", 1)}, nodes=1, grace=0)
        self.assertFalse(f.rec.routing_table.knows_model("new"))
        f.rec.apply_catalog(catalog({"demo": ("one", 1), "new": ("one", 1)}))
        self.assertTrue(f.rec.routing_table.knows_model("new"))
