"""
A sample of the curves in slices over several reactor turns
(L{llmgw.control.shell.series.SeriesKeeper.sample}, and the family's
C{begin}/C{write}/C{commit} in L{llmgw.control.state.series}): the same
curves as one pass, readers never seeing a sample half written, the fleet's
totals added once for the sample's time, passes that never overlap, and a
stop that leaves no call behind.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.shell.series import MAX_ANSWER_NODES, ControlSources, SeriesKeeper
from llmgw.control.state.inventory import GPUInfo, Inventory, Node
from llmgw.control.state.series import OTHER, SeriesFamily
from llmgw.gateway.keys import KeyRing
from llmgw.gateway.service import GatewayService
from llmgw.routing import Route, RoutingSnapshot


def turn(clock: Clock) -> None:
    """
    One reactor turn on C{clock}: the calls due now that were scheduled
    before it, not those they schedule (as a reactor runs a C{callLater(0)}
    made in a turn in the next one, where C{Clock.advance} would run them
    all at once).
    """
    for call in [c for c in clock.getDelayedCalls() if c.getTime() <= clock.seconds()]:
        f, args, kw = call.func, call.args, call.kw
        call.cancel()
        f(*args, **kw)


def node(node_id: str, used: list[int], total: int = 1000) -> Node:
    return Node(node_id, gpus=[GPUInfo(i, memory_total_mb=total, memory_used_mb=u) for i, u in enumerate(used)])


class FamilyPartsTests(SynchronousTestCase):
    def test_parts_equal_one_add(self) -> None:
        """
        A sample written in parts (C{begin}, several C{write}s, C{commit})
        leaves the family as one C{add} of the same rows does: values, gaps
        of names not written, names past the cap folded into C{_other}, and
        silent names dropped after a window.
        """
        whole = SeriesFamily(("rate", "p50"), points=3, max_names=3, additive=("rate",))
        parts = SeriesFamily(("rate", "p50"), points=3, max_names=3, additive=("rate",))
        samples: list[dict[str, Any]] = [
            {"a": [1.0, 0.1], "b": [2.0, None], "c": [3.0, 0.3], "d": [4.0, 0.4], OTHER: [5.0, 1.0]},
            {"a": [1.5, 0.2], "e": [7.0, 0.7]},
            {},
            {"b": [2.5, 0.5], "f": [1.0, 0.1]},
            {"b": [3.0, 0.6], "f": [2.0, 0.2], "g": [3.0, None]},
        ]
        for i, rows in enumerate(samples):
            t = 10.0 * (i + 1)
            whole.add(t, rows)
            items = list(rows.items())
            parts.begin(t)
            for k in range(0, len(items), 2):
                parts.write(dict(items[k:k + 2]))
            parts.commit()
            self.assertEqual(parts.read(0.0), whole.read(0.0))
            self.assertEqual((parts.names(), parts.refused), (whole.names(), whole.refused))

    def test_readers_see_only_committed(self) -> None:
        """
        While a sample is being written, readers see the samples before it:
        not its time, not its values (even in the slot of the oldest sample,
        which it overwrites once the rings are full: that sample is no
        longer shown), not the names new in it; all of it once committed.
        """
        fam = SeriesFamily(("v",), points=3, max_names=10, other=None)
        for t in (1.0, 2.0, 3.0):
            fam.add(t, {"a": [t]})
        fam.begin(4.0)
        fam.write({"a": [40.0], "new": [1.0]})
        self.assertTrue(fam.writing)
        self.assertEqual(fam.read(0.0), {"a": {"v": [[2, 2.0], [3, 3.0]]}})
        self.assertEqual((fam.names(), len(fam), fam.latest("a"), fam.latest("new")), (["a"], 1, 3.0, None))
        fam.commit()
        self.assertFalse(fam.writing)
        self.assertEqual(fam.read(0.0), {"a": {"v": [[2, 2.0], [3, 3.0], [4, 40.0]]}, "new": {"v": [[4, 1.0]]}})

    def test_abandoned_sample(self) -> None:
        """
        A sample abandoned (or begun again) publishes nothing: the next one
        writes its slot afresh, and a name the abandoned one wrote but the
        next does not has no value at the next's time.
        """
        fam = SeriesFamily(("v",), points=3, max_names=10, other=None)
        fam.add(1.0, {"a": [1.0], "b": [1.0]})
        fam.begin(2.0)
        fam.write({"a": [9.0], "b": [9.0], "c": [9.0]})
        fam.abandon()
        self.assertEqual(fam.read(0.0), {"a": {"v": [[1, 1.0]]}, "b": {"v": [[1, 1.0]]}})
        fam.begin(3.0)
        fam.write({"a": [3.0]})
        fam.commit()
        self.assertEqual(fam.read(0.0), {"a": {"v": [[1, 1.0], [3, 3.0]]}, "b": {"v": [[1, 1.0]]}})
        self.assertRaises(RuntimeError, fam.write, {"a": [1.0]})
        self.assertRaises(RuntimeError, fam.commit)


class SlicedKeeperTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1000)
        self.gateway = GatewayService(self.clock, RoutingSnapshot([Route("r1", "demo", "10.0.0.9:8000")]),
                                      port=0, keys=KeyRing({"team-a": "sk-team-a-0001"})).gateway
        self.inventory = Inventory()
        for i in range(20):
            self.inventory.upsert(node(f"n{i:02}", [(i * 37) % 1000, (i * 91) % 1000]))
        self.inventory.upsert(Node("cpu-only"))

    def keeper(self, slice_nodes: int, **kw: Any) -> SeriesKeeper:
        return SeriesKeeper(self.clock, ControlSources(None, self.inventory, lambda: self.gateway),
                            slice_nodes=slice_nodes, **kw)

    def traffic(self, n: int) -> None:
        for _ in range(n):
            self.gateway.metrics.count("demo", "/v1/chat/completions", 200)
            self.gateway.metrics.first_byte("demo", 0.2)
            meter = self.gateway.usage.admit("team-a", "demo")
            meter.feed(b'{"usage": {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}}')
            meter.finish(200)

    def view(self, keeper: SeriesKeeper) -> dict[str, Any]:
        return keeper.view(0.0, top=MAX_ANSWER_NODES)

    def test_sliced_equals_one_pass(self) -> None:
        """
        Sampled three nodes a turn, the curves are those of one pass over
        every node (a slice larger than the fleet), sample after sample,
        while nodes change, leave, join and pass the cap on nodes; a sample
        takes a turn per slice, and the fleet's totals are the sums over
        every node.
        """
        sliced = self.keeper(3, max_nodes=18)
        whole = self.keeper(10_000, max_nodes=18)
        for step in range(6):
            self.traffic(5 * step)
            d = sliced.sample()
            whole.sample()
            turns = 0
            while self.clock.getDelayedCalls():
                turns += 1
                turn(self.clock)
            self.assertEqual(turns, 20 // 3)
            self.assertIsNone(self.successResultOf(d))
            self.assertEqual(self.view(sliced), self.view(whole))
            self.assertEqual(sliced.nodes.refused, whole.nodes.refused)
            self.inventory.apply_heartbeat(f"n{step:02}", [1000, 999], [])
            if step == 2:
                self.inventory.remove("n05")
                self.inventory.upsert(node("n05b", [500]))
            self.clock.advance(10)
        view = self.view(sliced)
        self.assertEqual(view["nodes"]["n01"]["gpu_memory_used_pct"][0], [1000, round(100 * (37 + 91) / 2000, 2)])
        self.assertEqual(view["nodes"]["n00"]["gpu_memory_used_pct"][-1], [1050, 99.95])
        used = sum(g.memory_used_mb for n in self.inventory.list() for g in n.gpus)
        total = sum(g.memory_total_mb for n in self.inventory.list() for g in n.gpus)
        self.assertEqual(view["fleet"]["gpu_memory_used_gib"][-1], [1050, round(used / 1024, 4)])
        self.assertEqual(view["fleet"]["gpu_memory_total_gib"][-1], [1050, round(total / 1024, 4)])
        self.assertEqual(view["models"]["demo"]["requests_per_s"][-1], [1050, 2.5])

    def test_readers_during_a_pass(self) -> None:
        """
        While a sample's slices are under way, the answer is the one before
        it: same newest time, same node values, same nodes, no fleet point
        at its time (the totals are added once, when the node pass ends);
        then all of it, at its time.
        """
        keeper = self.keeper(4)
        keeper.sample()
        self.clock.advance(0)
        before = self.view(keeper)
        self.traffic(10)
        for i in range(20):
            self.inventory.apply_heartbeat(f"n{i:02}", [900, 900], [])
        self.inventory.upsert(node("n99", [10]))
        self.clock.advance(10)
        keeper.sample()
        turns = 0
        while self.clock.getDelayedCalls():
            during = self.view(keeper)
            self.assertEqual({k: v for k, v in during.items() if k != "now"},
                             {k: v for k, v in before.items() if k != "now"})
            turns += 1
            turn(self.clock)
        self.assertEqual(turns, 21 // 4)
        after = self.view(keeper)
        self.assertEqual(after["newest"], 1010)
        self.assertEqual(after["nodes_total"], 21)
        self.assertEqual(after["nodes"]["n99"]["gpu_memory_used_pct"], [[1010, 1.0]])
        self.assertEqual(after["nodes"]["n03"]["gpu_memory_used_pct"][-1], [1010, 90.0])
        self.assertEqual(after["fleet"]["gpu_memory_used_gib"][-1], [1010, round((20 * 1800 + 10) / 1024, 4)])
        self.assertEqual(after["models"]["demo"]["requests_per_s"], [[1010, 1.0]])

    def test_sample_called_during_a_pass(self) -> None:
        """
        A sample asked for while another's slices are under way finishes
        that one first, in the same turn, published whole at its own time;
        then the new one begins, at its time.
        """
        keeper = self.keeper(2)
        seen: list[Any] = []

        def second() -> None:
            seen.append(keeper.nodes.writing)
            keeper.sample()
            view = self.view(keeper)
            seen.append((view["newest"], view["nodes_total"], view["fleet"]["gpu_memory_total_gib"]))

        self.clock.callLater(5, second)
        first = keeper.sample()
        self.assertNoResult(first)
        self.clock.advance(5)
        self.successResultOf(first)
        self.assertEqual(seen, [True, (1000, 20, [[1000, round(40_000 / 1024, 4)]])])
        view = self.view(keeper)
        self.assertEqual(view["fleet"]["gpu_memory_total_gib"], [[1000, round(40_000 / 1024, 4)],
                                                                 [1005, round(40_000 / 1024, 4)]])
        self.assertEqual([len(c["gpu_memory_used_pct"]) for c in view["nodes"].values()], [2] * 20)

    def test_loop_waits_for_the_pass(self) -> None:
        """
        Running, the keeper's loop schedules its next sample only once the
        pass under way is published (the loop waits for the L{Deferred}
        C{sample} returns), so two passes never run at once; the slices
        done within the step, the next sample is on time.
        """
        keeper = self.keeper(5)
        keeper.startService()
        while keeper.nodes.writing:
            calls = self.clock.getDelayedCalls()
            self.assertEqual([c.getTime() for c in calls], [1000])
            turn(self.clock)
        self.assertEqual([c.getTime() for c in self.clock.getDelayedCalls()], [1010])
        self.clock.advance(10)
        self.assertEqual(keeper.samples, 2)
        self.assertEqual([t for t, _ in keeper.view(0.0)["fleet"]["gpu_memory_total_gib"]], [1000, 1010])
        keeper.stopService()
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_stop_cancels_the_pass(self) -> None:
        """
        Stopping the keeper while a sample's slices are under way cancels
        them: no call is left on the clock, nothing of the sample is
        published, its L{Deferred} fires; started again, the next sample is
        whole.
        """
        keeper = self.keeper(3, keep_s=20.0)
        for _ in range(3):
            keeper.sample()
            self.clock.advance(10)
        keeper.startService()
        self.assertTrue(keeper.nodes.writing)
        keeper.stopService()
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.assertFalse(keeper.nodes.writing)
        self.assertEqual(keeper.samples, 3)
        self.assertEqual(self.view(keeper)["newest"], 1020)
        self.clock.advance(5)
        keeper.startService()
        while self.clock.getDelayedCalls() and keeper.nodes.writing:
            self.clock.advance(0)
        keeper.stopService()
        self.assertEqual(self.clock.getDelayedCalls(), [])
        view = self.view(keeper)
        self.assertEqual(view["newest"], 1035)
        self.assertEqual([len(c["gpu_memory_used_pct"]) for c in view["nodes"].values()], [3] * 20)
        self.assertEqual([t for t, _ in view["fleet"]["gpu_memory_total_gib"]], [1010, 1020, 1035])

    def test_nodes_fail_part_way(self) -> None:
        """
        A read of the nodes that fails after some slices gives no node a
        point at that time, as a read failing at once does, and no fleet
        GPU memory; it is logged once, and the next sample is whole.
        """
        keeper = self.keeper(3)
        real = self.inventory.peek
        calls = [0]

        def peek(node_id: str) -> Node | None:
            calls[0] += 1
            if calls[0] > 7:
                raise OSError("gone")
            return real(node_id)

        self.inventory.peek = peek  # type: ignore[method-assign]
        keeper.sample()
        while self.clock.getDelayedCalls():
            self.clock.advance(0)
        self.assertEqual(len(self.flushLoggedErrors(OSError)), 1)
        view = self.view(keeper)
        self.assertEqual((view["nodes"], view["fleet"]["gpu_memory_total_gib"], view["newest"]), ({}, [], 1000))
        del self.inventory.peek
        self.clock.advance(10)
        keeper.sample()
        while self.clock.getDelayedCalls():
            self.clock.advance(0)
        view = self.view(keeper)
        self.assertEqual(view["nodes_total"], 20)
        self.assertEqual(view["fleet"]["gpu_memory_total_gib"], [[1010, round(40_000 / 1024, 4)]])

    def test_slice_at_least_one(self) -> None:
        """A keeper reads at least one node a turn."""
        self.assertRaises(ValueError, self.keeper, 0)
