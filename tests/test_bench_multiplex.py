"""
bench/multiplex.py's GPU accounting: a GPU held at a moment counts once.
"""

from __future__ import annotations

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from bench.multiplex import gpus_held


def replica(node: str, gpus: list[int], running: float = 0.0) -> dict[str, Any]:
    return {"shards": [{"node": node, "gpus": gpus, "signals": {"running": running, "waiting": 0.0}}]}


class GpusHeldTests(SynchronousTestCase):
    def test_lent_gpu_counts_once(self) -> None:
        """
        A sleeper's GPU lent to a busy borrower is one GPU held and busy,
        not two; a GPU of the same index on another node is another GPU.
        """
        held, busy = gpus_held([replica("n1", [0]), replica("n1", [0], running=1.0), replica("n2", [0])])
        self.assertEqual(held, {("n1", 0), ("n2", 0)})
        self.assertEqual(busy, {("n1", 0)})

    def test_no_signals_or_shards(self) -> None:
        """
        A replica with no shards or no signals yet holds what its shards
        name and is not busy.
        """
        held, busy = gpus_held([{"shards": []}, {"shards": [{"node": "n1", "gpus": [1, 2], "signals": None}]}])
        self.assertEqual((held, busy), ({("n1", 1), ("n1", 2)}, set()))
