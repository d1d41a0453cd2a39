"""
Tests for placement that follows the weights: the model index
(L{llmgw.control.state.modelindex}), the placer's preference for nodes that
hold a deployment's model, prefetch and pulls
(L{llmgw.control.core.prefetching}), and StartShard's model peers.
"""

from __future__ import annotations

import tomllib

from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.core.catalog import CatalogError, parse_catalog
from llmgw.control.core.commands import weights_key
from llmgw.control.shell import modelviews
from llmgw.control.state.interfaces import AdminError, UnknownNode
from llmgw.control.state.modelindex import FETCHING, HOLDS, LACKS, CachedCopy, CacheRoom, ModelIndex
from llmgw.control.state.placement import NodeCapacity, Placer, PortBook, Request
from llmgw.sourcespec import parse_source

from .reconciler_harness import Fleet

SOURCE = "hf://org/tiny@v1"
KEY = weights_key(parse_source(SOURCE))
GIB = 1 << 30

CATALOG = """
[profiles.llama]
engine = "llamacpp"
gpus_per_shard = 1
gpu_memory_mb = 1000
startup_timeout_s = 60

[[deployments]]
model = "tiny"
profile = "llama"
source = "hf://org/tiny@v1"
file = "tiny.gguf"
replicas = {replicas}
prefetch = {prefetch}
"""


def catalog(replicas: int = 1, prefetch: int = 0) -> object:
    return parse_catalog(tomllib.loads(CATALOG.format(replicas=replicas, prefetch=prefetch)))


def tiny_key() -> str:
    return weights_key(parse_source(SOURCE, file="tiny.gguf"))


def cap(node_id: str, gpus: int = 2) -> NodeCapacity:
    return NodeCapacity(id=node_id, host=node_id, free=[(80_000, i) for i in range(gpus)])


def copy(state: str = "complete", size: int = GIB, key: str = KEY) -> CachedCopy:
    return CachedCopy(key=key, source=SOURCE, size=size, state=state, last_used=100.0)


class ModelIndexTests(SynchronousTestCase):
    def test_index_follows_reports_and_drops(self) -> None:
        """
        A report puts a node under the model's complete or fetching nodes;
        a new report replaces the old, and a dropped node leaves the index.
        """
        index = ModelIndex()
        self.assertTrue(index.report("a", [copy("partial")]))
        self.assertEqual(index.rank(KEY, "a"), FETCHING)
        self.assertIsNone(index.size(KEY))
        self.assertTrue(index.report("a", [copy("complete", 5)], CacheRoom(10, 5), "a:9000"))
        self.assertEqual((index.rank(KEY, "a"), index.size(KEY)), (HOLDS, 5))
        self.assertEqual(index.holders(KEY), {"a"})
        self.assertFalse(index.report("a", [copy("complete", 5)]), "nothing placement reads changed")
        self.assertTrue(index.drop("a"))
        self.assertEqual((index.rank(KEY, "a"), index.holders(KEY), index.peers(KEY)), (LACKS, set(), []))

    def test_peers_exclude_target_and_are_bounded(self) -> None:
        """
        Peers are the peer addresses of nodes holding the model complete,
        never the target's own, at most four; nodes without a listener or
        with a partial copy are not peers.
        """
        index = ModelIndex()
        for i in range(6):
            index.report(f"n{i}", [copy()], peer_address=f"10.0.0.{i}:7000")
        index.report("quiet", [copy()])
        index.report("half", [copy("partial")], peer_address="10.0.1.1:7000")
        peers = index.peers(KEY, exclude="n0")
        self.assertEqual(peers, ["10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000", "10.0.0.4:7000"])

    def test_too_small_needs_known_size_and_capacity(self) -> None:
        """
        A cache is too small only when its capacity and the model's size
        are both known and the size is larger.
        """
        index = ModelIndex()
        index.report("small", [], CacheRoom(capacity=GIB // 2))
        self.assertFalse(index.too_small(KEY, "small"), "size unknown: no refusal")
        index.report("big", [copy(size=GIB)], CacheRoom(capacity=4 * GIB))
        self.assertTrue(index.too_small(KEY, "small"))
        self.assertFalse(index.too_small(KEY, "unknown"), "capacity unknown: no refusal")


class PlacerWeightsTests(SynchronousTestCase):
    def placer(self, index: ModelIndex, *nodes: NodeCapacity) -> Placer:
        return Placer(nodes, {}, PortBook(), weights=index)

    def test_prefers_holder_then_fetching(self) -> None:
        """
        Among nodes that fit equally, the one holding the model complete is
        chosen, then one fetching it, before the others (which best fit
        alone would pick by id).
        """
        index = ModelIndex()
        index.report("c", [copy("partial")])
        index.report("d", [copy("complete")])
        p = self.placer(index, cap("a"), cap("b"), cap("c"), cap("d"))
        order = [p.place(Request("m", weights=KEY))[0].node_id for _ in range(3)]  # type: ignore[index]
        self.assertEqual(order, ["d", "c", "a"])

    def test_spread_still_first(self) -> None:
        """
        Replicas of one deployment still spread: the second goes to another
        node even though only the first node holds the model.
        """
        index = ModelIndex()
        index.report("b", [copy()])
        p = self.placer(index, cap("a"), cap("b"))
        got = [p.place(Request("m", weights=KEY))[0].node_id for _ in range(2)]  # type: ignore[index]
        self.assertEqual(got, ["b", "a"])

    def test_cache_too_small_refused(self) -> None:
        """
        A node whose cache capacity is below the model's known size is never
        chosen, even when it is the only one.
        """
        index = ModelIndex()
        index.report("holder", [copy(size=GIB)])
        index.report("small", [], CacheRoom(capacity=GIB // 4))
        p = self.placer(index, cap("small"))
        self.assertIsNone(p.place(Request("m", weights=KEY)))

    def test_index_change_reaches_kept_heaps(self) -> None:
        """
        A node that comes to hold the model after the group's candidates
        were gathered is preferred at the next placement (update() gives it
        a better entry), with no stale duplicate placed twice.
        """
        index = ModelIndex()
        p = self.placer(index, cap("a", 4), cap("b", 4))
        first = p.place(Request("m", weights=KEY))
        assert first is not None
        self.assertEqual(first[0].node_id, "a")
        index.report("b", [copy()])
        p.update("b", cap("b", 4))
        second = p.place(Request("m", weights=KEY))
        assert second is not None
        self.assertEqual(second[0].node_id, "b")
        third = p.place(Request("m", weights=KEY))
        assert third is not None
        self.assertEqual(third[0].node_id, "b", "b holds the weights; spread is equal again (1 each)")


class FleetWeightsTests(SynchronousTestCase):
    def fleet(self, nodes: int = 4, replicas: int = 1, prefetch: int = 0) -> Fleet:
        f = Fleet({}, nodes=nodes, gpus=2, cat=catalog(replicas, prefetch))  # type: ignore[arg-type]
        return f

    def test_catalog_prefetch_validated(self) -> None:
        """
        prefetch must be a whole number of at least 0, and needs a source.
        """
        with self.assertRaises(CatalogError) as e:
            catalog(prefetch=-1)
        self.assertIn("'prefetch' must be at least 0", str(e.exception))
        self.assertEqual(catalog(prefetch=2).deployments["tiny"].prefetch, 2)  # type: ignore[attr-defined]

    def test_placement_prefers_node_reporting_weights(self) -> None:
        """
        Through the reconciler: a node whose cache report says it holds the
        deployment's model gets the replica, and its StartShard names the
        other holders' peer addresses, not its own.
        """
        f = self.fleet()
        target, other = f.ids[2], f.ids[3]
        f.inventory.apply_cache(target, [copy(key=tiny_key())], CacheRoom(10 * GIB, 9 * GIB), "t:7000")
        f.inventory.apply_cache(other, [copy(key=tiny_key())], None, "o:7000")
        f.past_grace()
        [start] = f.dispatcher.starts
        self.assertIn(start.node_id, (target, other))
        self.assertEqual(start.model_peers, ("o:7000",) if start.node_id == target else ("t:7000",))

    def test_lost_node_leaves_index(self) -> None:
        """
        A node that is lost no longer counts as holding anything.
        """
        f = self.fleet(nodes=20)
        node = f.ids[0]
        f.inventory.apply_cache(node, [copy(key=tiny_key())])
        f.alive.discard(node)
        f.step(1.0, 301)
        self.assertIn(node, f.rec.state.lost)
        self.assertEqual(f.inventory.models.holders(tiny_key()), set())

    def test_prefetch_picks_extra_nodes_and_drops(self) -> None:
        """
        prefetch = 2 tells two nodes that do not run the deployment to keep
        its weights (holders first), pinned under prefetch:MODEL; when the
        catalog lowers it to 0, each is sent a DropModel.
        """
        f = self.fleet(nodes=5, replicas=1, prefetch=2)
        f.inventory.apply_cache(f.ids[4], [copy("complete", key=tiny_key())])
        f.inventory.apply_cache(f.ids[3], [copy("partial", key=tiny_key())])
        f.past_grace()
        [start] = f.dispatcher.starts
        self.assertEqual(start.node_id, f.ids[4], "the node holding the weights runs it")
        sent = {(n, pin) for n, _, _, pin in f.dispatcher.prefetches}
        self.assertEqual(len(sent), 2)
        self.assertNotIn(start.node_id, {n for n, _ in sent})
        self.assertIn((f.ids[3], "prefetch:tiny"), sent, "the node fetching it is preferred")
        f.rec.apply_catalog(catalog(1, 0))  # type: ignore[arg-type]
        f.step(5.0)
        self.assertEqual({(n, pin) for n, _, pin in f.dispatcher.model_drops}, sent)
        self.assertEqual({k for _, k, _ in f.dispatcher.model_drops}, {tiny_key()})

    def test_prefetch_dropped_when_deployment_goes(self) -> None:
        """
        A deployment removed from the catalog has its prefetch copies
        unpinned.
        """
        f = self.fleet(nodes=3, replicas=0, prefetch=1)
        f.past_grace()
        [(node, _, _, _)] = f.dispatcher.prefetches
        f.rec.apply_catalog(parse_catalog(tomllib.loads(CATALOG.split("[[deployments]]")[0])))
        f.step(5.0)
        self.assertEqual(f.dispatcher.model_drops, [(node, tiny_key(), "prefetch:tiny")])

    def test_pull_named_and_chosen(self) -> None:
        """
        A pull of named nodes sends each an unpinned PrefetchModel; without
        names it picks a node as prefetch would; an unknown node is refused.
        """
        f = self.fleet(nodes=3, replicas=0)
        f.past_grace()
        self.assertEqual(f.rec.pull_model("tiny", [f.ids[1]]), [f.ids[1]])
        f.clock.advance(0)
        self.assertEqual([(n, pin) for n, _, _, pin in f.dispatcher.prefetches], [(f.ids[1], "")])
        self.assertEqual(len(f.rec.pull_model("tiny", [])), 1)
        self.assertRaises(UnknownNode, f.rec.pull_model, "tiny", ["nope"])
        f.dispatcher.connected.discard(f.ids[2])
        self.assertRaises(AdminError, f.rec.pull_model, "tiny", [f.ids[2]])

    def test_models_view(self) -> None:
        """
        The admin view lists each model with the nodes holding it, its
        size, and the deployments that use it.
        """
        f = self.fleet(nodes=2)
        f.inventory.apply_cache(f.ids[0], [copy(key=tiny_key(), size=123)], CacheRoom(1000, 877), "a:1")
        view = modelviews.models(f.rec.ctx)
        [row] = view["models"]
        self.assertEqual((row["key"], row["size"], row["deployments"]), (tiny_key(), 123, ["tiny"]))
        self.assertEqual([(n["node"], n["state"]) for n in row["nodes"]], [(f.ids[0], "complete")])
        self.assertEqual(view["nodes"][f.ids[0]], {"capacity": 1000, "free": 877, "peer_address": "a:1"})
