"""
Tests for L{llmgw.control.state.placement}: pure decisions over plain data.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.state.placement import (
    NodeCapacity,
    NoPortFree,
    Placer,
    PortBook,
    Request,
    Slot,
    place_all,
)


def node(node_id: str, free: list[int], fabrics: dict[str, str] | None = None, host: str = "") -> NodeCapacity:
    return NodeCapacity(
        id=node_id,
        host=host or node_id,
        fabrics=fabrics or {},
        free=[(mb, i) for i, mb in enumerate(free)],
    )


class PlacementTests(SynchronousTestCase):
    def test_best_fit_node(self) -> None:
        """
        A single-GPU replica goes to the node with the fewest free GPUs that
        fit, leaving emptier nodes whole for larger models.
        """
        [slots] = place_all([node("a", [80] * 8), node("b", [80] * 2)], [Request("m", gpu_memory_mb=10)])
        assert slots is not None
        self.assertEqual(slots[0].node_id, "b")

    def test_best_fit_gpu(self) -> None:
        """
        On a node, the GPU with the least free memory that still covers the
        profile is chosen.
        """
        [slots] = place_all([node("a", [80, 20, 50])], [Request("m", gpu_memory_mb=40)])
        assert slots is not None
        self.assertEqual(slots[0].gpu_indices, (2,))

    def test_memory_excludes(self) -> None:
        """
        GPUs whose free memory is below the profile's need are not used;
        when none fits, nothing is placed.
        """
        self.assertEqual(place_all([node("a", [10, 20])], [Request("m", gpu_memory_mb=30)]), [None])

    def test_gpus_per_shard(self) -> None:
        """
        A shard needing several GPUs takes them all from one node.
        """
        [slots] = place_all(
            [node("a", [80]), node("b", [80, 80, 80])], [Request("m", gpus_per_shard=2, gpu_memory_mb=1)]
        )
        assert slots is not None
        self.assertEqual((slots[0].node_id, slots[0].gpu_indices), ("b", (0, 1)))

    def test_spread(self) -> None:
        """
        Replicas of one deployment spread across nodes before any node gets
        a second one, even against best fit.
        """
        nodes = [node("a", [80] * 2), node("b", [80] * 8), node("c", [80] * 8)]
        got = place_all(nodes, [Request("m")] * 4)
        self.assertEqual([s[0].node_id for s in got if s], ["a", "b", "c", "a"])

    def test_spread_counts_existing(self) -> None:
        """
        Shards already placed count for spreading.
        """
        got = place_all([node("a", [80] * 2), node("b", [80] * 8)], [Request("m")], spread={"m": {"a": 1}})
        self.assertEqual(got[0][0].node_id, "b")  # type: ignore[index]

    def test_kept_placer_spreads_after_shards_go(self) -> None:
        """
        A kept placer spreads again once a deployment's shards are gone:
        with one replica on each of two nodes, both replicas failed and
        their shards dropped, the two replacements go to different nodes,
        not both to the one whose entry happens to come up first.
        """
        spread: dict[str, dict[str, int]] = {}
        caps = {n: node(n, [80, 80]) for n in ("a", "b")}
        placer = Placer(caps.values(), spread, PortBook(), live_spread=True)

        def place() -> str:
            [slot] = placer.place(Request("m", gpu_memory_mb=1)) or []
            counts = spread.setdefault("m", {})
            counts[slot.node_id] = counts.get(slot.node_id, 0) + 1
            free = [f for f in caps[slot.node_id].free if f[1] not in slot.gpu_indices]
            placer.update(slot.node_id, NodeCapacity(slot.node_id, slot.node_id, {}, free))
            return slot.node_id

        self.assertEqual({place(), place()}, {"a", "b"})
        # Both shards gone: the nodes hold none of the deployment's again.
        spread["m"].clear()
        for n, cap in caps.items():
            placer.update(n, cap)
        self.assertEqual({place(), place()}, {"a", "b"})

    def test_multi_shard_distinct_nodes_on_fabric(self) -> None:
        """
        A multi-shard replica gets distinct nodes that share the profile's
        fabric; nodes off the fabric are not used.
        """
        nodes = [
            node("a", [80] * 8, {"ib0": "x"}),
            node("b", [80] * 8),
            node("c", [80] * 8, {"ib0": "y"}),
        ]
        [slots] = place_all(nodes, [Request("m", shards=2, gpus_per_shard=4, fabric="ib0")])
        assert slots is not None
        self.assertEqual([(s.node_id, s.rank) for s in slots], [("a", 0), ("c", 1)])

    def test_all_or_nothing(self) -> None:
        """
        When only some shards of a replica fit, none is placed and nothing
        is taken: a smaller request still gets the capacity afterwards.
        """
        ports = PortBook()
        placer = Placer([node("a", [80] * 8, {"ib0": "x"})], {}, ports)
        self.assertIsNone(placer.place(Request("m", shards=2, fabric="ib0")))
        self.assertEqual(ports.used, {})
        slots = placer.place(Request("m", gpus_per_shard=8))
        self.assertIsNotNone(slots)

    def test_deterministic(self) -> None:
        """
        The same inputs give the same placement, whatever the input order.
        """
        nodes = [node(f"n{i}", [80] * (i % 4 + 1)) for i in range(20)]
        reqs = [Request("m"), Request("k", gpus_per_shard=2)] * 5
        one = place_all(nodes, reqs)
        two = place_all(list(reversed([node(f"n{i}", [80] * (i % 4 + 1)) for i in range(20)])), reqs)
        self.assertEqual(one, two)

    def test_taken_within_pass(self) -> None:
        """
        GPUs given earlier in a pass are not given again.
        """
        got = place_all([node("a", [80, 80])], [Request("m"), Request("k"), Request("j")])
        self.assertEqual([s[0].gpu_indices if s else None for s in got], [(0,), (1,), None])

    def test_input_not_changed(self) -> None:
        """
        The placer never changes the capacities it was given, so callers
        may cache them.
        """
        cap = node("a", [80, 80])
        place_all([cap], [Request("m")])
        self.assertEqual(len(cap.free), 2)

    def test_ports_per_host(self) -> None:
        """
        Nodes on one host share its ports; ports already used there are
        skipped.
        """
        ports = PortBook(100, 110)
        ports.take("h", 100)
        got = place_all([node("a", [80], host="h"), node("b", [80], host="h")], [Request("m")] * 2, ports=ports)
        self.assertEqual(sorted(s[0].port for s in got if s), [101, 102])

    def test_large_fleet_scans_little(self) -> None:
        """
        Placing 1,000 replicas of 10 deployments over 1,000 uniform nodes
        looks at a few candidates per deployment for each placement, not
        the whole fleet each time.
        """
        nodes = [node(f"n{i:04d}", [80] * 4) for i in range(1000)]
        placer = Placer(nodes, {}, PortBook())
        for i in range(1000):
            self.assertIsNotNone(placer.place(Request(f"d{i % 10}")))
        self.assertLess(placer.scanned, 1000 * 11)


class PortBookTests(SynchronousTestCase):
    def test_cursor_moves_on(self) -> None:
        """
        A released port is not handed out again at once.
        """
        ports = PortBook(1, 3)
        p = ports.allocate("h")
        ports.release("h", p)
        self.assertNotEqual(ports.allocate("h"), p)

    def test_exhausted(self) -> None:
        """
        A host whose range is full raises L{NoPortFree}.
        """
        ports = PortBook(1, 2)
        ports.allocate("h")
        ports.allocate("h")
        self.assertRaises(NoPortFree, ports.allocate, "h")
        self.assertEqual(ports.allocate("other"), 1)


NODE_IDS = [f"n{i}" for i in range(6)]
free_lists = st.lists(st.sampled_from([20, 80]), max_size=4)
requests = st.builds(
    Request,
    group=st.sampled_from(["a", "b", "c"]),
    shards=st.integers(1, 2),
    gpus_per_shard=st.integers(1, 2),
    gpu_memory_mb=st.sampled_from([0, 40]),
    fabric=st.just("ib0"),
)
steps = st.lists(
    st.one_of(
        st.tuples(st.just("place"), requests),
        st.tuples(st.just("update"), st.sampled_from(NODE_IDS), st.one_of(st.none(), free_lists)),
        st.tuples(st.just("drop"), st.sampled_from(NODE_IDS), st.sampled_from(["a", "b", "c"])),
    ),
    max_size=40,
)


class KeptPlacerDuplicateTests(SynchronousTestCase):
    def test_one_node_never_takes_two_shards(self) -> None:
        """
        A kept placer whose heap holds two equal entries for one node (a
        node's entry that came back to an earlier value) still puts a
        replica's shards on distinct nodes, taking no GPU twice: found by
        the property below.
        """
        truth = {"n1": [(20, 0), (20, 1)], "n5": [(20, 0)]}
        spread: dict[str, dict[str, int]] = {}

        def cap(n: str) -> NodeCapacity:
            return NodeCapacity(n, n, {"ib0": n}, sorted(truth[n]))

        kept = Placer([cap(n) for n in truth], spread, PortBook(1, 100000), live_spread=True)

        def place(shards: int, mb: int) -> list[Slot] | None:
            slots = kept.place(Request("b", shards, 1, mb, fabric="ib0"))
            for s in slots or ():
                truth[s.node_id] = [(m, i) for m, i in truth[s.node_id] if i not in s.gpu_indices]
                spread.setdefault("b", {})[s.node_id] = spread.get("b", {}).get(s.node_id, 0) + 1
                kept.update(s.node_id, cap(s.node_id))
            return slots

        self.assertEqual(len(place(2, 0) or ()), 2)
        spread["b"]["n1"] -= 1
        truth["n1"] = [*truth["n1"], (80, 0)]
        kept.update("n1", cap("n1"))
        self.assertEqual([s.node_id for s in place(1, 40) or ()], ["n1"])
        # Only n1 has a GPU left: two shards need two nodes.
        self.assertIsNone(place(2, 0))


class KeptPlacerProperties(SynchronousTestCase):
    @settings(max_examples=150, deadline=None)
    @given(start=st.lists(free_lists, min_size=len(NODE_IDS), max_size=len(NODE_IDS)), ops=steps)
    def test_kept_placer_places_exactly_what_a_fresh_one_can(self, start: list[list[int]],
                                                             ops: list[Any]) -> None:
        """
        A placer kept across random placements, node changes and shards
        going away (as the reconciler keeps it, told of each changed node)
        places a replica exactly when one built afresh from the same nodes
        can, on nodes holding as few of the deployment's shards as the
        fresh one's, and only on GPUs that are free and large enough, all
        shards on distinct nodes of the fabric, or nothing at all.
        """
        truth: dict[str, list[tuple[int, int]] | None] = {
            n: [(mb, i) for i, mb in enumerate(f)] for n, f in zip(NODE_IDS, start, strict=True)
        }
        spread: dict[str, dict[str, int]] = {}

        def cap(n: str) -> NodeCapacity | None:
            free = truth[n]
            return None if free is None else NodeCapacity(n, n, {"ib0": n}, list(free))

        kept = Placer([c for n in NODE_IDS if (c := cap(n)) is not None], spread,
                      PortBook(1, 100000), live_spread=True)
        for op in ops:
            if op[0] == "update":
                _, n, free = op
                truth[n] = None if free is None else [(mb, i) for i, mb in enumerate(free)]
                kept.update(n, cap(n))
            elif op[0] == "drop":
                _, n, group = op
                if spread.get(group, {}).get(n, 0) > 0:
                    spread[group][n] -= 1
                    if truth[n] is not None:
                        used = {i for _, i in truth[n] or []}
                        spare = next(i for i in range(16) if i not in used)
                        truth[n] = [*(truth[n] or []), (80, spare)]
                    kept.update(n, cap(n))
            else:
                req = op[1]
                fresh = Placer([c for n in NODE_IDS if (c := cap(n)) is not None],
                               {g: dict(v) for g, v in spread.items()}, PortBook(1, 100000))
                wanted = fresh.place(req)
                slots = kept.place(req)
                self.assertEqual(slots is not None, wanted is not None, f"{req}: kept and fresh placers differ")
                if slots is None or wanted is None:
                    continue
                # Spread as a fresh placer would: nodes holding as few of
                # the group's shards (best fit among them may differ).
                held = spread.get(req.group, {})
                self.assertEqual(sorted(held.get(s.node_id, 0) for s in slots),
                                 sorted(held.get(s.node_id, 0) for s in wanted), f"{req}: spread differs")
                self.assertEqual(len(slots), req.shards)
                self.assertEqual(len({s.node_id for s in slots}), req.shards)
                for s in slots:
                    free = dict((i, mb) for mb, i in truth[s.node_id] or [])
                    self.assertEqual(len(s.gpu_indices), req.gpus_per_shard)
                    for i in s.gpu_indices:
                        self.assertGreaterEqual(free.pop(i), req.gpu_memory_mb)
                    truth[s.node_id] = sorted((mb, i) for i, mb in free.items())
                    counts = spread.setdefault(req.group, {})
                    counts[s.node_id] = counts.get(s.node_id, 0) + 1
                    kept.update(s.node_id, cap(s.node_id))
