"""
What the reconciler works out once rather than per item gives what working
it out each time would: a shard's start command from a launch kept per
profile, rank and deployment; the deployments short of room kept beside
their state; the waiting order by priority kept per catalog.
"""

from __future__ import annotations

import tomllib
from dataclasses import replace

from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.core import placing
from llmgw.control.core.catalog import parse_catalog
from llmgw.control.core.commands import start_command
from llmgw.control.state.fleetstate import FleetState, ReplicaRec, ShardRec
from llmgw.control.state.interfaces import ShardCommand
from llmgw.control.state.inventory import Inventory
from llmgw.control.state.placement import NodeCapacity, Placer, PortBook, Request
from llmgw.states import ShardState
from llmgw.testing.simfleet import sim_node
from tests.reconciler_harness import ONE_GPU, Fleet, catalog


def two_shards() -> tuple[ReplicaRec, list[ShardRec]]:
    rep = ReplicaRec(id="m-1", model="m", profile="two-node", world_size=2, created_at=0.0)
    shards = [ShardRec(id=f"m-1-s{rank}", replica_id=rep.id, node_id=f"n{rank}", rank=rank,
                       gpus=(0, 1, 2, 3), port=20000 + rank, host=f"10.0.0.{rank + 1}",
                       state=ShardState.PENDING, since=0.0) for rank in (0, 1)]
    rep.shards = {s.rank: s for s in shards}
    return rep, shards


class StartCommandTests(SynchronousTestCase):
    def test_as_launch_filled_in(self) -> None:
        """
        Each shard's command is the profile's launch for its rank with the
        shard's placeholders, identity, GPUs, port and leader filled in and
        addressed to its node, as copying the launch spec would make it.
        """
        cat = catalog({"m": ("two-node", 1)})
        profile, dep = cat.profiles["two-node"], cat.deployments["m"]
        rep, shards = two_shards()
        fabrics = {"ib0": "192.168.0.1"}
        for shard in shards:
            got = start_command(rep, shard, profile, fabrics, dep)
            launch = profile.launch(shard.rank, dep)
            self.assertEqual(got, ShardCommand.to_node(shard.node_id, replace(
                launch, shard_id=shard.id, replica_id=rep.id, model="m", profile="two-node",
                argv=["{python}", "-m", "srv", "--rank", str(shard.rank), "--world", "2", "--leader",
                      "192.168.0.1:20000", "--gpus", "0,1,2,3"],
                env={"MASTER": "192.168.0.1:20000"}, gpu_indices=(0, 1, 2, 3), port=shard.port,
                world_size=2, leader_address="192.168.0.1:20000")))

    def test_another_catalogs_profile(self) -> None:
        """
        A profile of the same name in another catalog (another command)
        gives its own command, and the first one's comes back with it.
        """
        rep, shards = two_shards()
        first = catalog({"m": ("two-node", 1)})
        other = parse_catalog(tomllib.loads(
            ONE_GPU.replace('"--gpus", "{gpus}"]', '"--devices", "{gpus}"]')
            + '\n[[deployments]]\nmodel = "m"\nprofile = "two-node"\nreplicas = 1\n'))
        argv = []
        for cat in (first, other, first):
            cmd = start_command(rep, shards[0], cat.profiles["two-node"], {}, cat.deployments["m"])
            argv.append(cmd.argv[-2])
        self.assertEqual(argv, ["--gpus", "--devices", "--gpus"])


class ShortOfRoomTests(SynchronousTestCase):
    def test_unplaceable_kept(self) -> None:
        """
        A deployment that found no room is among the context's unplaceable,
        and short of room, for as long as its C{unplaceable} says why (at
        its count again, it still does), until a placement has room.
        """
        f = Fleet({"m": ("one", 3)}, nodes=1, gpus=2, grace=0)
        f.step()
        ctx = f.rec.ctx
        self.assertTrue(ctx.deps["m"].unplaceable)
        self.assertEqual((ctx.unplaceable, ctx.short_of_room()), ({"m"}, True))
        f.rec.scale("m", 2)
        f.step()
        self.assertIsNone(ctx.deps["m"].unplaceable_since)
        self.assertEqual((bool(ctx.deps["m"].unplaceable), ctx.unplaceable), (True, {"m"}))
        f.rec.scale("m", 1)
        f.step()
        f.confirm_stops()
        f.step()
        f.rec.scale("m", 2)
        f.step()
        self.assertEqual(ctx.deps["m"].unplaceable, "")
        self.assertEqual((ctx.unplaceable, ctx.short_of_room()), (set(), False))

    def test_waiting_order(self) -> None:
        """
        The deployments are visited by priority then name while none waits
        for room, per the running catalog; one that waits comes first
        among its priority, as L{placing.waiting_order} orders them.
        """
        def text(priorities: dict[str, int]) -> str:
            out = ONE_GPU
            for model, priority in priorities.items():
                out += (f'\n[[deployments]]\nmodel = "{model}"\nprofile = "one"\nmin_replicas = 0\n'
                        f'max_replicas = 2\nevictable = true\npriority = {priority}\n')
            return out

        f = Fleet({}, nodes=1, gpus=1, grace=0, cat=parse_catalog(tomllib.loads(text({"a": 0, "b": 1, "c": 0}))))
        ctx = f.rec.ctx
        now = f.clock.seconds()
        self.assertEqual(list(placing.in_waiting_order(ctx, now)), ["b", "a", "c"])
        f.rec.apply_catalog(parse_catalog(tomllib.loads(text({"a": 0, "b": 0, "c": 2}))))
        self.assertEqual(list(placing.in_waiting_order(ctx, now)), ["c", "a", "b"])
        ctx.deps["b"].unplaceable, ctx.deps["b"].unplaceable_since = "no room", now - 5
        ctx.unplaceable.add("b")
        expected = sorted(ctx.catalog.deployments, key=lambda m: placing.waiting_order(ctx, m, now))
        self.assertEqual(list(placing.in_waiting_order(ctx, now)), expected)
        self.assertEqual(expected, ["c", "b", "a"])


class GPUNameTests(SynchronousTestCase):
    def test_names_per_register(self) -> None:
        """
        A node's capacity names its GPUs by index; nodes with the same GPUs
        share one map, and a node that registers again with other GPUs
        gets theirs.
        """
        inv, st = Inventory(), FleetState(PortBook(20000, 20100))
        inv.upsert(sim_node("a", gpus=2))
        inv.upsert(sim_node("b", gpus=2))
        a, b = st.node_capacity(inv, "a"), st.node_capacity(inv, "b")
        assert a is not None and b is not None
        self.assertEqual(a.names, {0: "SimGPU", 1: "SimGPU"})
        self.assertIs(a.names, b.names)
        other = sim_node("b", gpus=2)
        other.gpus[1].name = "H100"
        inv.upsert(other)
        b = st.node_capacity(inv, "b")
        assert b is not None
        self.assertEqual((b.names, st.node_capacity(inv, "a").names),  # type: ignore[union-attr]
                         ({0: "SimGPU", 1: "H100"}, {0: "SimGPU", 1: "SimGPU"}))


class FewerShardsTests(SynchronousTestCase):
    def test_node_back_with_fewer(self) -> None:
        """
        A node told to a kept placer as holding no fewer shards (C{fewer}
        false) is still looked at afresh when the placer had dropped it
        meanwhile: it went away with two shards of the group and comes
        back with none, and the next replica goes to it, not to the node
        that holds one.
        """
        spread: dict[str, dict[str, int]] = {"m": {}}
        caps = {n: NodeCapacity(n, n, {}, [(80, i) for i in range(4)]) for n in ("a", "b")}
        placer = Placer(caps.values(), spread, PortBook(), live_spread=True)

        def place() -> str:
            [slot] = placer.place(Request("m", gpu_memory_mb=1)) or []
            spread["m"][slot.node_id] = spread["m"].get(slot.node_id, 0) + 1
            return slot.node_id

        first, second, third = place(), place(), place()
        self.assertEqual({first, second}, {"a", "b"})
        other = "a" if third == "b" else "b"
        placer.update(third, None)
        del spread["m"][third]
        placer.update(third, caps[third], fewer=False)
        self.assertEqual(place(), third)
        self.assertEqual(spread["m"], {third: 1, other: 1})
