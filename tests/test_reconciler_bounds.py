"""
What bounds a single reconcile pass's work (DESIGN §14): node checks that
fall due together are judged a batch per pass, the rest by passes that
follow at once; placement stops early enough that the pass, with the
events it logs and the commands it sends, stays within its budget.
"""

from __future__ import annotations

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.core import nodes

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


class PlacingBudgetTests(SynchronousTestCase):
    def charged_fleet(self, replicas: int, send_cost: float) -> tuple[Fleet, list[float]]:
        """
        A fleet whose passes take time only in sending commands: each start
        sent costs C{send_cost} on the reconciler's timer.
        """
        ticks = [0.0]
        f = Fleet({"demo": ("one", replicas)}, nodes=50, gpus=8, fabric="", grace=0,
                  timer=lambda: ticks[0], pass_budget=0.020)
        start = f.dispatcher.start_shard

        def charged(command: Any) -> None:
            ticks[0] += send_cost
            start(command)

        f.dispatcher.start_shard = charged  # type: ignore[method-assign]
        return f, ticks

    def test_sending_cost_is_learned_and_kept_within_budget(self) -> None:
        """
        When each start sent costs 0.2 ms, a pass that placed 20 replicas
        teaches the reconciler what its commands and events cost; scaled to
        400, placement then stops early enough that no pass, sending
        included, goes over its 20 ms budget, over several passes that
        follow at once, and all 400 are placed.
        """
        f, _ = self.charged_fleet(20, 0.0002)
        f.step()
        self.assertEqual(len(f.dispatcher.starts), 20)
        self.assertGreater(f.rec.tail_cost, 20e-6)
        f.rec.scale("demo", 400)
        f.rec.max_pass_duration = 0.0
        passes = f.rec.passes
        f.step()
        self.assertEqual(len(f.dispatcher.starts), 400)
        self.assertGreater(f.rec.passes - passes, 3)
        self.assertLessEqual(f.rec.max_pass_duration, 0.020)

    def test_a_pass_that_went_over_is_not_repeated(self) -> None:
        """
        The first pass, before any cost is measured, may go over its
        budget; the passes after it do not.
        """
        f, _ = self.charged_fleet(400, 0.0002)
        f.rec.run_pass()
        self.assertGreater(f.rec.last_pass_duration, 0.020)
        self.assertTrue(f.rec.pass_unfinished)
        longest = 0.0
        while f.rec.pass_unfinished:
            f.rec.run_pass()
            longest = max(longest, f.rec.last_pass_duration)
        self.assertEqual(len(f.dispatcher.starts), 400)
        self.assertLessEqual(longest, 0.020)


class ConnectedLookTests(SynchronousTestCase):
    def test_a_burst_asks_for_connected_nodes_once(self) -> None:
        """
        Passes that follow an unfinished one at once use the connected
        nodes the first asked the dispatcher for (a look at every
        connection); a pass a second later asks again, so a node gone
        meanwhile is not placed on.
        """
        ticks = [0.0]

        def timer() -> float:
            ticks[0] += 0.005
            return ticks[0]

        f = Fleet({"demo": ("one", 12)}, nodes=4, gpus=8, fabric="", grace=0, timer=timer,
                  pass_budget=0.020)
        asked = []
        look = f.dispatcher.connected_nodes

        def counted() -> list[str]:
            asked.append(f.clock.seconds())
            return look()

        f.dispatcher.connected_nodes = counted  # type: ignore[method-assign]
        passes = f.rec.passes
        f.step()
        self.assertGreaterEqual(f.rec.passes - passes, 3)
        self.assertEqual(asked, [1.0])
        self.assertEqual(len(f.dispatcher.starts), 12)
        gone = f.ids[0]
        f.dispatcher.connected.discard(gone)
        f.rec.scale("demo", 24)
        f.dispatcher.clear()
        f.step()
        self.assertEqual(asked[1:], [2.0])
        self.assertEqual(len(f.dispatcher.starts), 12)
        self.assertNotIn(gone, {c.node_id for c in f.dispatcher.starts})

    def test_a_refused_start_makes_the_next_pass_ask_again(self) -> None:
        """
        A start refused because its node is no longer connected makes the
        next pass, even one that continues a burst, ask the dispatcher
        afresh; until then the burst used what it had asked.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=1, gpus=8, fabric="", grace=0)
        asked = []
        look = f.dispatcher.connected_nodes

        def counted() -> list[str]:
            asked.append(f.clock.seconds())
            return look()

        f.dispatcher.connected_nodes = counted  # type: ignore[method-assign]
        f.step()
        self.assertEqual(asked, [1.0])
        # Gone without the reconciler having looked since: its start is refused.
        f.dispatcher.connected.discard(f.ids[0])
        f.rec.scale("demo", 2)
        f.rec.pass_unfinished = True  # as a pass continuing a burst
        f.rec.run_pass()
        self.assertEqual(asked, [1.0])
        self.assertEqual(len(kinds(f, "dispatch_refused")), 1)
        f.rec.pass_unfinished = True
        f.rec.run_pass()
        self.assertEqual(asked, [1.0, 1.0])
        self.assertEqual(len(kinds(f, "dispatch_refused")), 1)
