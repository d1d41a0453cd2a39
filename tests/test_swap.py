"""
Swapping models on demand (DESIGN §22): the pure choice of what to take
(sleeping first, lowest priority, least recently used, never below
min_replicas), and the reconciler making room on a full node for a model
whose requests wait, never taking a more important model, and keeping a
swapped-in replica for its min_resident_s.
"""

from __future__ import annotations

import tomllib

from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.core.catalog import parse_catalog
from llmgw.control.core.swapping import Resident, choose
from llmgw.routing import Demand
from tests.reconciler_harness import ONE_GPU, Fleet


def res(rid: str, node: str = "n1", asleep: bool = False, priority: int = 0, used: float = 0.0,
        model: str | None = None) -> Resident:
    return Resident(rid, model or rid, node, {node: 1}, asleep, priority, used, 0.0)


class ChooseTests(SynchronousTestCase):
    def test_order(self) -> None:
        """
        The lowest priority, then the least recently used, then asleep
        before awake.
        """
        spare = {m: 1 for m in "abcd"}
        self.assertEqual(choose({"n1": 0}, 1, [res("a", used=5), res("b", used=9)], spare), (("n1",), [res("a", used=5)]))
        self.assertEqual(choose({"n1": 0}, 1, [res("a", priority=1), res("b", priority=2, used=-1)], spare)[1],  # type: ignore[index]
                         [res("a", priority=1)])
        self.assertEqual(choose({"n1": 0}, 1, [res("a", used=1), res("b", asleep=True, used=9)],
                                spare)[1][0].id, "a")  # type: ignore[index]
        self.assertEqual(choose({"n1": 0}, 1, [res("a", used=1), res("b", asleep=True, used=1)],
                                spare)[1][0].id, "b")  # type: ignore[index]

    def test_min_replicas_and_nodes(self) -> None:
        """
        A deployment at its min_replicas gives nothing; the node that needs
        the fewest and cheapest takings wins; no node that can get there:
        None.
        """
        self.assertIsNone(choose({"n1": 0}, 1, [res("a")], {"a": 0}))
        picked = choose({"n1": 0, "n2": 1}, 2, [res("a", "n1"), res("b", "n1"), res("c", "n2", used=50)],
                        {"a": 1, "b": 1, "c": 1})
        self.assertEqual(picked, (("n2",), [res("c", "n2", used=50)]))
        self.assertIsNone(choose({"n1": 0}, 2, [res("a")], {"a": 1}))


def fleet_catalog(low_priority: int = 0, resident: float = 60) -> str:
    text = ONE_GPU
    for model, priority in (("a", low_priority), ("b", low_priority), ("want", 5)):
        text += (f'\n[[deployments]]\nmodel = "{model}"\nprofile = "one"\nmin_replicas = 0\nmax_replicas = 1\n'
                 f'scale_to_zero_after_s = 3600\nevictable = true\npriority = {priority}\n'
                 f'min_resident_s = {resident}\n')
    return text


class SwapReconcilerTests(SynchronousTestCase):
    def setup(self, low_priority: int = 0) -> Fleet:
        f = Fleet({}, nodes=1, gpus=2, grace=0, cat=parse_catalog(tomllib.loads(fleet_catalog(low_priority))))
        f.step()
        # a and b fill both GPUs; a was used last, b long ago.
        f.rec.report_demand("gw", {"b": Demand(1, 0)})
        f.step()
        f.rec.report_demand("gw", {"a": Demand(1, 0)})
        f.step()
        f.make_ready()
        f.step(passes=100)
        f.rec.report_demand("gw", {"a": Demand(1, 0)})
        f.step()
        return f

    def swaps(self, f: Fleet) -> list[str]:
        return [e.replica for e in f.rec.event_log.since() if e.kind == "swap"]

    def test_makes_room(self) -> None:
        """
        Requests for a model with no replica on a full node take the least
        recently used evictable replica: it drains and stops, its count
        goes down, and the wanted model is placed on the freed GPU.
        """
        f = self.setup()
        [b] = f.ready_replicas("b")
        f.rec.report_demand("gw", {"want": Demand(0, 3)})
        f.step()
        self.assertEqual(self.swaps(f), [b])
        self.assertEqual(f.rec.replica_recs[b].phase.value, "draining")
        f.step(passes=12)
        f.confirm_stops()
        f.rec.report_demand("gw", {"want": Demand(0, 3)})
        f.step()
        wanted = [c for c in f.dispatcher.starts if c.replica_id.startswith("want")]
        self.assertEqual(len(wanted), 1)
        self.assertEqual(f.rec.ctx.desired["b"], 0)
        self.assertEqual(len(self.swaps(f)), 1)

    def test_room_told_to_gateways(self) -> None:
        """
        From the swap until the swapped-in replica is ready, the model's
        published queue limits carry C{room_s}: its profile's startup
        timeout plus the drain timeout of the replicas it may take (60 +
        10); none once it is ready.
        """
        f = self.setup()
        self.assertEqual(f.rec.ctx.room, {})
        f.rec.report_demand("gw", {"want": Demand(0, 3)})
        f.step()
        self.assertEqual(len(self.swaps(f)), 1)
        self.assertEqual(f.rec.ctx.room, {"want": 70.0})
        limits = f.rec.routing_table.queue_limits("want")
        assert limits is not None
        self.assertEqual(limits.room_s, 70.0)
        f.step(passes=12)
        f.confirm_stops()
        f.rec.report_demand("gw", {"want": Demand(0, 3)})
        f.step()
        [start] = [c for c in f.dispatcher.starts if c.replica_id.startswith("want")]
        # Placed and starting: the cold start is still part of the wait.
        self.assertEqual(f.rec.ctx.room, {"want": 70.0})
        f.make_ready([start])
        f.step()
        self.assertEqual(f.rec.ctx.room, {})
        self.assertIsNone(f.rec.routing_table.queue_limits("want"))

    def test_room_while_waiting_for_a_stay_to_end(self) -> None:
        """
        Requests waiting for a replica that may be taken once its
        min_resident_s is over are told of room too; a model no swap can
        serve (every other replica more important) is not.
        """
        f = Fleet({}, nodes=1, gpus=2, grace=0, cat=parse_catalog(tomllib.loads(fleet_catalog(0, 600))))
        f.step()
        f.rec.report_demand("gw", {"a": Demand(1, 0), "b": Demand(1, 0)})
        f.step()
        f.make_ready()
        f.step(passes=10)
        f.rec.report_demand("gw", {"want": Demand(0, 1)})
        f.step()
        self.assertEqual(self.swaps(f), [])
        self.assertEqual(f.rec.ctx.room, {"want": 70.0})
        kept = self.setup(low_priority=9)
        kept.rec.report_demand("gw", {"want": Demand(0, 3)})
        kept.step(passes=3)
        self.assertTrue(kept.rec.ctx.deps["want"].unplaceable)
        self.assertEqual(kept.rec.ctx.room, {})

    def test_more_important_kept(self) -> None:
        """
        A model never takes a more important one's replica: the less
        important waits.
        """
        f = self.setup(low_priority=9)
        f.rec.report_demand("gw", {"want": Demand(0, 3)})
        f.step(passes=3)
        self.assertEqual(self.swaps(f), [])

    def test_min_resident(self) -> None:
        """
        A replica ready for less than its min_resident_s is not taken.
        """
        f = Fleet({}, nodes=1, gpus=2, grace=0, cat=parse_catalog(tomllib.loads(fleet_catalog(0, 600))))
        f.step()
        f.rec.report_demand("gw", {"a": Demand(1, 0), "b": Demand(1, 0)})
        f.step()
        f.make_ready()
        f.step(passes=100)
        f.rec.report_demand("gw", {"want": Demand(0, 1)})
        f.step()
        self.assertEqual(self.swaps(f), [])
        f.step(passes=500)
        f.rec.report_demand("gw", {"want": Demand(0, 1)})
        f.step()
        self.assertEqual(len(self.swaps(f)), 1)


class PriorityPlacementTests(SynchronousTestCase):
    def test_more_important_placed_first(self) -> None:
        """
        Where room is short, the deployment of higher priority is placed
        first, whatever the names' order; the other waits, unplaceable.
        """
        text = ONE_GPU
        for model, priority in (("a", 0), ("b", 5)):
            text += f'\n[[deployments]]\nmodel = "{model}"\nprofile = "one"\nreplicas = 1\npriority = {priority}\n'
        f = Fleet({}, nodes=1, gpus=1, grace=0, cat=parse_catalog(tomllib.loads(text)))
        f.step()
        self.assertEqual([c.replica_id.split("-")[0] for c in f.dispatcher.starts], ["b"])
        self.assertTrue(f.rec.ctx.deps["a"].unplaceable)


class LongestWaitingFirstTests(SynchronousTestCase):
    def test_longest_waiting_gets_the_room(self) -> None:
        """
        Two deployments of one priority wait for the only GPU: the one
        whose requests found no room first has it made and is placed on
        it, though the other comes first by name.
        """
        text = ONE_GPU
        for model in ("x", "b", "z"):
            text += (f'\n[[deployments]]\nmodel = "{model}"\nprofile = "one"\nmin_replicas = 0\nmax_replicas = 1\n'
                     'scale_to_zero_after_s = 3600\nevictable = true\nmin_resident_s = 30\n')
        f = Fleet({}, nodes=1, gpus=1, grace=0, cat=parse_catalog(tomllib.loads(text)))
        f.step()
        f.rec.report_demand("gw", {"x": Demand(1, 0)})
        f.step()
        f.make_ready()
        f.step()
        # z waits first, b a second later; x is still within its stay.
        f.rec.report_demand("gw", {"z": Demand(0, 1)})
        f.step()
        self.assertEqual(f.rec.ctx.deps["z"].unplaceable_since, f.clock.seconds())
        swaps: list[str] = []
        for _ in range(40):
            f.rec.report_demand("gw", {"z": Demand(0, 1), "b": Demand(0, 1)})
            f.step()
            swaps = [e.reason for e in f.rec.event_log.since() if e.kind == "swap"]
            if swaps:
                break
        self.assertEqual(len(swaps), 1)
        self.assertIn("makes room for model z", swaps[0])
        f.step(passes=12)
        f.confirm_stops()
        f.rec.report_demand("gw", {"z": Demand(0, 1), "b": Demand(0, 1)})
        f.step()
        placed = [c.replica_id.split("-")[0] for c in f.dispatcher.starts]
        self.assertEqual(placed, ["x", "z"])
        self.assertIsNone(f.rec.ctx.deps["z"].unplaceable_since)
        self.assertIsNotNone(f.rec.ctx.deps["b"].unplaceable_since)
