"""
The collector tuning of llmgw's own processes: the reconciler's growth
hook freezes the heap only while the tuning runs.
"""

from __future__ import annotations

import gc

from twisted.trial.unittest import SynchronousTestCase

from llmgw.collector import CollectorTuning


class FreezeGrownTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.addCleanup(gc.set_threshold, *gc.get_threshold())
        self.addCleanup(gc.unfreeze)

    def test_freezes_while_tuned(self) -> None:
        """
        While started, freeze_grown moves objects made since start into the
        frozen generation; after stop the heap is unfrozen and the call does
        nothing.
        """
        tuning = CollectorTuning(50_000)
        tuning.startService()
        frozen = gc.get_freeze_count()
        kept = [[i] for i in range(1000)]
        tuning.freeze_grown()
        self.assertGreaterEqual(gc.get_freeze_count(), frozen + len(kept))
        tuning.stopService()
        self.assertEqual(gc.get_freeze_count(), 0)
        tuning.freeze_grown()
        self.assertEqual(gc.get_freeze_count(), 0)

    def test_off_never_freezes(self) -> None:
        """
        With the tuning off (a threshold of 0), freeze_grown never freezes.
        """
        tuning = CollectorTuning(0)
        tuning.startService()
        gc.unfreeze()
        tuning.freeze_grown()
        self.assertEqual(gc.get_freeze_count(), 0)
        tuning.stopService()
