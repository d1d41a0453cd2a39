"""
Swapping on demand for replicas spread over several nodes (DESIGN §22):
the pure choice of the nodes and of what to take there (mixed shapes, a
taken replica freeing its GPUs on every node it holds, nothing taken when
no choice suffices), and the reconciler making room for a two-shard model
on simulated nodes, then placing it on the freed GPUs.

A multi-node engine sleeps as one: the control plane reads its sleep from
the leader and counts every shard's GPUs as reclaimable, and a follower's
agent never sleeps or wakes its shard on its own.
"""

from __future__ import annotations

import tomllib

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.scrape import Sample, Scraper
from llmgw.agent.shard import READY, Shard
from llmgw.agent.sleep import Sleeper
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.core import swapping
from llmgw.control.core.catalog import parse_catalog
from llmgw.control.core.sleeping import asleep, sleeping_gpus
from llmgw.control.core.swapping import Resident, choose
from llmgw.routing import Demand, EngineSignals
from llmgw.shards import ShardSpec
from tests.reconciler_harness import ONE_GPU, Fleet


def res(rid: str, gpus: dict[str, int], priority: int = 0, used: float = 0.0, asleep: bool = False,
        model: str | None = None) -> Resident:
    return Resident(rid, model or rid, min(gpus), gpus, asleep, priority, used, 0.0)


def ids(chosen: tuple[tuple[str, ...], list[Resident]] | None) -> tuple[tuple[str, ...], list[str]] | None:
    return None if chosen is None else (chosen[0], [r.id for r in chosen[1]])


class ChooseShardsTests(SynchronousTestCase):
    def test_one_replica_spanning_both_nodes(self) -> None:
        """
        A replica spread over two nodes frees GPUs on both: taking it alone
        gives a two-shard replica its two nodes, rather than two one-node
        replicas, even when those were used longer ago (fewest first).
        """
        spare = {"m": 1, "s1": 1, "s2": 1}
        both = res("m", {"n1": 1, "n2": 1}, used=9)
        singles = [res("s1", {"n1": 1}, used=1), res("s2", {"n2": 1}, used=1)]
        self.assertEqual(ids(choose({"n1": 0, "n2": 0}, 1, [both, *singles], spare, shards=2)),
                         (("n1", "n2"), ["m"]))

    def test_lowest_priority_first_across_shapes(self) -> None:
        """
        Mixed shapes: a replica of lower priority goes before the others
        whatever their shape; among one priority, the node that needs the
        fewest taken next, then the least recently used.
        """
        residents = [
            res("a1", {"n1": 1}, used=0), res("a2", {"n1": 1}, used=0, model="a1"),
            res("b", {"n2": 2}, used=9),
            res("c", {"n3": 1}, used=0),
            res("d", {"n3": 1, "n4": 2}, priority=1),
        ]
        spare = {"a1": 2, "b": 1, "c": 1, "d": 1}
        free = {"n1": 0, "n2": 0, "n3": 1, "n4": 0}
        self.assertEqual(ids(choose(free, 2, residents, spare, shards=2)), (("n2", "n3"), ["c", "b"]))
        # Three shards: n1 takes both of a1's replicas before d (priority 1) is touched.
        self.assertEqual(ids(choose(free, 2, residents, spare, shards=3)), (("n1", "n2", "n3"), ["a1", "a2", "c", "b"]))

    def test_needless_given_back(self) -> None:
        """
        A replica taken for one node that a later taking (spread over both)
        made needless is kept: only the spread one goes.
        """
        low = res("low", {"n1": 1})
        wide = res("wide", {"n1": 1, "n2": 1}, priority=1)
        self.assertEqual(ids(choose({"n1": 0, "n2": 0}, 1, [low, wide], {"low": 1, "wide": 1}, shards=2)),
                         (("n1", "n2"), ["wide"]))

    def test_nothing_suffices(self) -> None:
        """
        When no choice frees enough GPUs on enough distinct nodes, nothing
        is taken: not the one node's worth that could be had, not a
        replica whose deployment is at its min_replicas, not GPUs on a node
        that may not hold a shard.
        """
        self.assertIsNone(choose({"n1": 0, "n2": 0}, 1, [res("a", {"n1": 1})], {"a": 1}, shards=2))
        self.assertIsNone(choose({"n1": 0, "n2": 0}, 1, [res("a", {"n1": 1}), res("m", {"n1": 1, "n2": 1})],
                                 {"a": 1, "m": 0}, shards=2))
        # n3 is not eligible (another fabric, cordoned): a replica there frees nothing that counts.
        self.assertIsNone(choose({"n1": 0, "n2": 0}, 1, [res("m", {"n1": 1, "n3": 1})], {"m": 1}, shards=2))
        # Two replicas of one model on the two nodes, but only one may go.
        twins = [res("t1", {"n1": 1}, model="t"), res("t2", {"n2": 1}, model="t")]
        self.assertIsNone(choose({"n1": 0, "n2": 0}, 1, twins, {"t": 1}, shards=2))
        self.assertEqual(ids(choose({"n1": 0, "n2": 0}, 1, twins, {"t": 2}, shards=2)), (("n1", "n2"), ["t1", "t2"]))

    def test_next_cheapest_when_the_cheapest_strands(self) -> None:
        """
        The cheapest first step may leave another node that cannot be
        completed (its deployment gave its one spare replica already): the
        next cheapest is tried, so a set that suffices is found. Past its
        limit, the search follows the greedy path alone.
        """
        residents = [res("t1", {"n1": 1}, model="t"), res("t2", {"n2": 1}, model="t"), res("x", {"n1": 1}, used=5)]
        spare = {"t": 1, "x": 1}
        self.assertEqual(ids(choose({"n1": 0, "n2": 0}, 1, residents, spare, shards=2)), (("n1", "n2"), ["t2", "x"]))
        self.patch(swapping, "SEARCH_LIMIT", 1)
        self.assertIsNone(choose({"n1": 0, "n2": 0}, 1, residents, spare, shards=2))

    def test_fewest_on_one_node(self) -> None:
        """
        On one node too, fewer replicas taken beat less recently used ones:
        one that frees two GPUs goes rather than two that free one each.
        """
        residents = [res("s1", {"n1": 1}, used=0), res("s2", {"n1": 1}, used=1), res("d", {"n1": 2}, used=5)]
        self.assertEqual(ids(choose({"n1": 0}, 2, residents, {"s1": 1, "s2": 1, "d": 1})), (("n1",), ["d"]))

    def test_free_nodes_used_first(self) -> None:
        """
        Nodes that already have room hold shards at no cost: only the
        missing nodes' worth is taken, and the answer names the freed node
        before the free ones.
        """
        chosen = choose({"n1": 1, "n2": 1, "n3": 0}, 1, [res("a", {"n3": 1})], {"a": 1}, shards=2)
        self.assertIsNone(chosen)  # two nodes free already: nothing to take
        chosen = choose({"n1": 1, "n2": 0, "n3": 0}, 1, [res("a", {"n3": 1}), res("b", {"n2": 1}, used=5)],
                        {"a": 1, "b": 1}, shards=2)
        self.assertEqual(ids(chosen), (("n1", "n3"), ["a"]))

    def test_sleeping_spread_replica_preferred(self) -> None:
        """
        Between two spread replicas used as long ago, the sleeping one
        goes: every shard's GPUs of a sleeping replica count as asleep.
        """
        awake = res("awake", {"n1": 1, "n2": 1})
        dozing = res("dozing", {"n1": 1, "n2": 1}, asleep=True)
        self.assertEqual(ids(choose({"n1": 0, "n2": 0}, 1, [awake, dozing], {"awake": 1, "dozing": 1}, shards=2)),
                         (("n1", "n2"), ["dozing"]))


@st.composite
def instances(draw: st.DrawFn) -> tuple[dict[str, int], int, list[Resident], dict[str, int], int]:
    nodes = [f"n{i}" for i in range(draw(st.integers(1, 4)))]
    free = {n: draw(st.integers(0, 1)) for n in nodes}
    residents = []
    for i in range(draw(st.integers(0, 6))):
        # Some shards on a node that may not hold one (n9).
        where = draw(st.lists(st.sampled_from([*nodes, "n9"]), min_size=1, max_size=2, unique=True))
        residents.append(Resident(f"r{i}", draw(st.sampled_from("abc")), where[0],
                                  {n: draw(st.integers(1, 2)) for n in where}, draw(st.booleans()),
                                  draw(st.integers(0, 2)), float(draw(st.integers(0, 3))), float(i)))
    spare = {m: draw(st.integers(0, 2)) for m in "abc"}
    return free, draw(st.integers(1, 2)), residents, spare, draw(st.integers(1, 3))


class ChooseProperties(SynchronousTestCase):
    @given(instances())
    @settings(max_examples=300, deadline=None)
    def test_answers_hold(self, case: tuple[dict[str, int], int, list[Resident], dict[str, int], int]) -> None:
        """
        Whatever the fleet: an answer names C{shards} distinct eligible
        nodes that each have the GPUs once the taken replicas are gone,
        takes no deployment below its spare, takes something, and takes
        nothing needless (each taken replica is needed for enough nodes).
        """
        free, need, residents, spare, shards = case
        chosen = choose(free, need, residents, spare, shards)
        if chosen is None:
            return
        nodes, taken = chosen

        def room(rs: list[Resident]) -> dict[str, int]:
            return {n: free[n] + sum(r.gpus.get(n, 0) for r in rs) for n in free}

        self.assertTrue(taken)
        self.assertEqual(len(set(nodes)), shards)
        got = room(taken)
        self.assertTrue(all(n in free and got[n] >= need for n in nodes))
        for model in "abc":
            self.assertLessEqual(sum(1 for r in taken if r.model == model), spare[model])
        for r in taken:
            less = room([t for t in taken if t is not r])
            self.assertLess(sum(1 for n in less.values() if n >= need), shards)


PAIR = """
[profiles.pair]
shards = 2
gpus_per_shard = 1
gpu_memory_mb = 1000
fabric = "ib0"
command = ["{python}", "-m", "srv", "--rank", "{rank}", "--leader", "{leader}"]
startup_timeout_s = 60
drain_timeout_s = 10
"""


def fleet(deployments: dict[str, tuple[str, int]], resident: float = 60) -> Fleet:
    text = ONE_GPU + PAIR
    for model, (profile, priority) in deployments.items():
        text += (f'\n[[deployments]]\nmodel = "{model}"\nprofile = "{profile}"\nmin_replicas = 0\n'
                 f'max_replicas = 1\nscale_to_zero_after_s = 3600\nevictable = true\npriority = {priority}\n'
                 f'min_resident_s = {resident}\n')
    f = Fleet({}, nodes=2, gpus=1, grace=0, cat=parse_catalog(tomllib.loads(text)))
    f.step()
    return f


class SwapShardsReconcilerTests(SynchronousTestCase):
    def fill(self, f: Fleet, *models: str) -> None:
        for model in models:
            f.rec.report_demand("gw", {model: Demand(1, 0)})
            f.step()
        f.make_ready()
        f.step(passes=100)

    def swaps(self, f: Fleet) -> list[str]:
        return [e.replica for e in f.rec.event_log.since() if e.kind == "swap"]

    def wanted(self, f: Fleet) -> list[tuple[str, int, tuple[int, ...]]]:
        return sorted((c.node_id, c.rank, tuple(c.gpu_indices)) for c in f.dispatcher.starts
                      if c.replica_id.startswith("want"))

    def test_spread_replica_taken_for_spread_model(self) -> None:
        """
        A two-shard model whose requests wait on a full fleet takes the
        two-shard evictable replica that holds both nodes: it drains and
        stops on both, the gateways are told how long room takes, and the
        wanted model is placed with one shard on each node's freed GPU.
        """
        f = fleet({"big": ("pair", 0), "want": ("pair", 5)})
        self.fill(f, "big")
        [big] = f.ready_replicas("big")
        f.rec.report_demand("gw", {"want": Demand(0, 3)})
        f.step()
        self.assertEqual(self.swaps(f), [big])
        self.assertEqual(f.rec.replica_recs[big].phase.value, "draining")
        self.assertEqual(f.rec.ctx.room, {"want": 70.0})
        limits = f.rec.routing_table.queue_limits("want")
        assert limits is not None
        self.assertEqual(limits.room_s, 70.0)
        [reason] = [e.reason for e in f.rec.event_log.since() if e.kind == "swap"]
        self.assertIn("on nodes", reason)
        f.step(passes=12)
        self.assertEqual(len(f.dispatcher.stops), 2)
        f.confirm_stops()
        f.rec.report_demand("gw", {"want": Demand(0, 3)})
        f.step()
        placed = self.wanted(f)
        self.assertEqual([(rank, gpus) for _, rank, gpus in placed], [(0, (0,)), (1, (0,))])
        self.assertEqual(len({node for node, _, _ in placed}), 2)
        self.assertEqual(f.rec.ctx.desired["big"], 0)
        self.assertEqual(f.rec.ctx.room, {"want": 70.0})
        f.make_ready([c for c in f.dispatcher.starts if c.replica_id.startswith("want")])
        f.step()
        self.assertEqual(f.rec.ctx.room, {})
        self.assertEqual(len(f.ready_replicas("want")), 1)
        self.assertEqual(len(self.swaps(f)), 1)

    def test_one_node_replicas_taken_for_spread_model(self) -> None:
        """
        Mixed shapes: a two-shard model takes a one-GPU replica on each of
        the two nodes, then is placed across them.
        """
        f = fleet({"a": ("one", 0), "b": ("one", 0), "want": ("pair", 5)})
        self.fill(f, "a", "b")
        held = f.ready_replicas("a") + f.ready_replicas("b")
        self.assertEqual(len({f.rec.replica_recs[r].shards[0].node_id for r in held}), 2)
        f.rec.report_demand("gw", {"want": Demand(0, 1)})
        f.step()
        self.assertEqual(sorted(self.swaps(f)), sorted(held))
        f.step(passes=12)
        f.confirm_stops()
        f.rec.report_demand("gw", {"want": Demand(0, 1)})
        f.step()
        self.assertEqual(len({node for node, _, _ in self.wanted(f)}), 2)

    def test_sleeping_spread_replica_taken(self) -> None:
        """
        Of two two-node replicas last used at the same time, the one whose
        leader says its engine sleeps is taken: its sleep covers both of
        its nodes.
        """
        text = ONE_GPU + PAIR
        for model, priority in (("big1", 0), ("big2", 0), ("want", 5)):
            text += (f'\n[[deployments]]\nmodel = "{model}"\nprofile = "pair"\nmin_replicas = 0\n'
                     f'max_replicas = 1\nscale_to_zero_after_s = 3600\nevictable = true\npriority = {priority}\n'
                     'min_resident_s = 60\n')
        f = Fleet({}, nodes=4, gpus=1, grace=0, cat=parse_catalog(tomllib.loads(text)))
        f.step()
        f.rec.report_demand("gw", {"big1": Demand(1, 0), "big2": Demand(1, 0)})
        f.step()
        f.make_ready()
        f.step(passes=100)
        [dozing] = f.ready_replicas("big2")
        leader = f.rec.replica_recs[dozing].shards[0]
        f.rec.record_engine_signals(leader.node_id, [pb.ShardSignals(
            shard_id=leader.id, running=0.0, age_s=0.0, sleeping=True, wake_path="/wake_up")])
        f.rec.report_demand("gw", {"want": Demand(0, 1)})
        f.step()
        self.assertEqual(self.swaps(f), [dozing])
        [reason] = [e.reason for e in f.rec.event_log.since() if e.kind == "swap"]
        self.assertIn("asleep", reason)

    def test_not_enough_nodes_takes_nothing(self) -> None:
        """
        When only one node's worth may be taken (the other node holds a
        more important model), no replica is taken at all: half the room
        would serve nobody. Nor are the gateways told to keep its
        requests for room (room_s) that no set of replicas could make.
        """
        f = fleet({"a": ("one", 0), "b": ("one", 9), "want": ("pair", 5)})
        self.fill(f, "a", "b")
        for _ in range(5):
            f.rec.report_demand("gw", {"want": Demand(0, 1)})
            f.step()
        self.assertEqual(self.swaps(f), [])
        self.assertEqual(len(f.ready_replicas("a")), 1)
        self.assertTrue(f.rec.ctx.deps["want"].unplaceable)
        self.assertEqual(f.rec.ctx.room, {})
        limits = f.rec.routing_table.queue_limits("want")
        self.assertFalse(limits is not None and limits.room_s)

    def test_room_while_a_stay_runs_for_spread_model(self) -> None:
        """
        A two-shard model whose only set is replicas still within their
        min_resident_s: nothing is taken yet, its requests are told of
        room, and once the stays are over the set is taken.
        """
        f = fleet({"a": ("one", 0), "b": ("one", 0), "want": ("pair", 5)}, resident=600)
        self.fill(f, "a", "b")
        f.rec.report_demand("gw", {"want": Demand(0, 1)})
        f.step()
        self.assertEqual(self.swaps(f), [])
        self.assertEqual(f.rec.ctx.room, {"want": 70.0})
        f.step(seconds=600)
        f.rec.report_demand("gw", {"want": Demand(0, 1)})
        f.step()
        self.assertEqual(len(self.swaps(f)), 2)


class SpreadSleepTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.fleet = fleet({"big": ("pair", 0)})
        SwapShardsReconcilerTests().fill(self.fleet, "big")
        [self.rid] = self.fleet.ready_replicas("big")
        self.rep = self.fleet.rec.replica_recs[self.rid]

    def heartbeat(self, rank: int, sleeping: bool) -> None:
        shard = self.rep.shards[rank]
        self.fleet.rec.record_engine_signals(shard.node_id, [pb.ShardSignals(
            shard_id=shard.id, running=0.0, age_s=0.0, sleeping=sleeping, wake_path="/wake_up")])

    def test_every_shard_reclaimable(self) -> None:
        """
        A two-node replica whose leader sleeps is asleep as a whole: the
        GPUs of both shards count as reclaimable, and the event names both
        nodes.
        """
        self.heartbeat(0, False)
        self.assertEqual(sleeping_gpus(self.rep), {})
        self.heartbeat(0, True)
        self.assertTrue(asleep(self.rep))
        gpus = sleeping_gpus(self.rep)
        self.assertEqual(gpus, {s.node_id: s.gpus for s in self.rep.shards.values()})
        self.assertEqual(len(gpus), 2)
        [reason] = [e.reason for e in self.fleet.rec.event_log.since() if e.kind == "replica_asleep"]
        self.assertIn("2 GPU(s) on " + ", ".join(sorted(gpus)), reason)

    def test_follower_signals_do_not_decide(self) -> None:
        """
        A follower's own signals never put its replica to sleep (nor wake
        it): only the leader's are read.
        """
        self.heartbeat(1, False)
        self.heartbeat(1, True)
        self.assertIsNone(asleep(self.rep))
        self.assertEqual(sleeping_gpus(self.rep), {})
        self.heartbeat(0, False)
        self.heartbeat(0, True)
        self.heartbeat(1, False)
        self.assertTrue(asleep(self.rep))
        kinds = [e.kind for e in self.fleet.rec.event_log.since() if e.kind.startswith("replica_a")]
        self.assertEqual(kinds, ["replica_asleep"])


class FakeSupervisor:
    def __init__(self) -> None:
        self.shards: dict[str, Shard] = {}
        self.probe_host = "127.0.0.1"

    def live_shards(self) -> list[Shard]:
        return [s for s in self.shards.values() if s.live]


class FollowerSleeperTests(SynchronousTestCase):
    def test_follower_never_slept_nor_asked(self) -> None:
        """
        A follower shard (rank 1), even one whose spec names a sleep level
        (an older control plane's), is never asked whether it sleeps, never
        put to sleep however long it idles, and its heartbeats say nothing
        of sleep: the leader's engine sleeps for every rank.
        """
        clock = Clock()
        sup = FakeSupervisor()
        sup.shards["f"] = Shard(ShardSpec(shard_id="f", replica_id="r", model="m", profile="p", argv=["x"],
                                          gpu_indices=[], port=8002, rank=1, engine="vllm",
                                          metrics_path="/metrics", sleep_level=1, sleep_after_s=5.0), READY)
        scraper = Scraper(clock, sup, lambda url: defer.Deferred())  # type: ignore[arg-type]
        calls: list[tuple[bytes, str]] = []

        def call(method: bytes, url: str, body: bytes | None) -> defer.Deferred[bytes]:
            calls.append((method, url))
            return defer.Deferred()

        sleeper = Sleeper(clock, sup, scraper, call)  # type: ignore[arg-type]
        scraper.sleep_state = sleeper.state_of
        for _ in range(30):
            scraper.samples["f"] = Sample(EngineSignals(clock.seconds(), waiting=0.0, running=0.0))
            sleeper.tick()
            clock.advance(1.0)
        self.assertEqual(calls, [])
        self.assertEqual(sleeper.state_of("f"), (None, ""))
        self.assertFalse(any(m.HasField("sleeping") for m in scraper.heartbeat_signals()))

    def test_followers_launch_without_sleep(self) -> None:
        """
        The control plane gives a sleep level and idleness to a replica's
        leader alone: a follower's spec carries none.
        """
        profile = {"engine": "vllm", "sleep_level": 1, "shards": 2, "fabric": "ib0",
                   "command": ["vllm", "serve", "--enable-sleep-mode"], "worker_command": ["vllm", "serve", "--headless"]}
        c = parse_catalog({"profiles": {"p": profile},
                           "deployments": [{"model": "m", "profile": "p", "sleep_after_s": 30}]})
        leader, follower = (c.profiles["p"].launch(rank, c.deployments["m"]) for rank in (0, 1))
        self.assertEqual((leader.sleep_level, leader.sleep_after_s), (1, 30.0))
        self.assertEqual((follower.sleep_level, follower.sleep_after_s), (0, 0.0))
