"""
What bounds a single reconcile pass's work (DESIGN §14): node checks that
fall due together are judged a batch per pass, the rest by passes that
follow at once; placement stops early enough that the pass, with the
events it logs and the commands it sends, stays within its budget.
"""

from __future__ import annotations

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmgw.control import nodes

from .reconciler_harness import Fleet


def kinds(f: Fleet, kind: str) -> list[dict[str, Any]]:
    return [e for e in f.rec.events() if e["kind"] == kind]


class ExpiryBatchTests(SynchronousTestCase):
    def run_seconds(self, f: Fleet, seconds: int, alive: set[str]) -> list[int]:
        """
        Let C{seconds} seconds go by on the running service, C{alive}
        heartbeating each second; returns the passes run in each second.
        """
        per_second = []
        for _ in range(seconds):
            now = f.clock.seconds()
            for node_id in alive:
                f.inventory.touch(node_id, now)
            before = f.rec.passes
            f.clock.advance(1.0)
            per_second.append(f.rec.passes - before)
        return per_second

    def start(self, nodes_count: int) -> Fleet:
        f = Fleet({}, nodes=nodes_count, gpus=1, fabric="", grace=0)
        f.rec.startService()
        self.addCleanup(f.rec.stopService)
        return f

    def test_checks_falling_due_together_are_batched(self) -> None:
        """
        2,500 nodes registered at once all fall due for their check in the
        same second: that second runs three passes (at most EXPIRY_BATCH
        checks each, the others following at once), and no node heard
        from turns suspect; seconds with nothing due run one pass.
        """
        self.assertEqual(nodes.EXPIRY_BATCH, 1000)
        f = self.start(2500)
        per_second = self.run_seconds(f, 16, set(f.ids))
        self.assertEqual(per_second[:14], [1] * 14)
        # Due at 15 s (suspect_after), judged in the pass at 15 s.
        self.assertEqual(per_second[14], 3)
        self.assertEqual(per_second[15], 1)
        self.assertFalse(f.rec.pass_unfinished)
        self.assertEqual(f.rec.suspect, set())
        self.assertEqual(kinds(f, "node_suspect"), [])

    def test_silent_nodes_found_within_the_same_second(self) -> None:
        """
        When 2,500 nodes fall silent together, every one of them is suspect
        at the clock time its check fell due, though over three passes,
        and the freeze (more than half suspect) is declared once.
        """
        f = self.start(2500)
        self.run_seconds(f, 16, set())
        suspect = kinds(f, "node_suspect")
        self.assertEqual(len(suspect), 2500)
        self.assertEqual({e["time"] for e in suspect}, {15.0})
        self.assertEqual(f.rec.suspect, set(f.ids))
        self.assertEqual(len(kinds(f, "replacements_frozen")), 1)
        self.assertTrue(f.rec.frozen)

    def test_batch_limit_takes_the_earliest(self) -> None:
        """
        take_due with a limit hands out the earliest deadlines first and
        keeps the others due for the next call.
        """
        f = Fleet({}, nodes=5, gpus=1, fabric="", grace=0)
        st = f.rec.state
        st.heap.clear()
        for i, node_id in enumerate(f.ids):
            st.watch(node_id, 10.0 - i)
        self.assertEqual(st.take_due(10.0, 2), [f.ids[4], f.ids[3]])
        self.assertTrue(st.due_left(10.0))
        self.assertEqual(st.take_due(10.0, 10), [f.ids[2], f.ids[1], f.ids[0]])
        self.assertFalse(st.due_left(10.0))
