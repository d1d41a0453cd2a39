"""
Tests for the reconciler's core (DESIGN §6.7): commands sent after the
handler returns, the routing projection, pass budgets, the faults of issue
10 (freeze lift, ports of shards that may still run), and lifecycle paths
that nothing reached before, all on a C{Clock}.
"""

from __future__ import annotations

import tomllib
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.core.catalog import parse_catalog
from llmgw.control.core.kept import KeptState
from llmgw.control.shell.reconciler import Reconciler
from llmgw.control.state.interfaces import ReportedShard, ShardReport
from llmgw.control.state.inventory import Inventory
from llmgw.routing import EngineSignals
from llmgw.states import ReplicaState, ShardState
from llmgw.testing.simfleet import FakeDispatcher, sim_node
from tests.reconciler_harness import ONE_GPU, Fleet, catalog


def kinds(f: Fleet, kind: str) -> list[dict[str, Any]]:
    return [e for e in f.rec.events() if e["kind"] == kind]


class ReentrantDispatcher(FakeDispatcher):
    """
    A dispatcher that fails the test if it is called while the reconciler
    is inside one of its sink methods.
    """

    inside = False

    def _check(self, node_id: str) -> None:
        assert not self.inside, "dispatched from inside a sink handler"
        super()._check(node_id)


class DeferredDispatchTests(SynchronousTestCase):
    def test_commands_wait_for_the_handler(self) -> None:
        """
        A failure report's stops, and an adoption's stops of unclaimed
        shards, go out only after the sink method returned, on the next
        turn of the clock.
        """
        f = Fleet({"big": ("two-node", 1)}, nodes=2, grace=0)
        f.step()
        f.make_ready()
        leader, other = sorted(f.dispatcher.starts, key=lambda c: c.rank)
        f.dispatcher.clear()
        f.rec.on_shard_status(ShardReport(leader.node_id, leader.replica_id, leader.shard_id,
                                          "failed", exit_code=1, error="boom"))
        self.assertEqual(f.dispatcher.stops, [])
        f.clock.advance(0)
        self.assertEqual(f.dispatcher.stops, [(other.node_id, other.shard_id)])

    def test_never_reentrant(self) -> None:
        """
        Over a whole life (placement, readiness, failure, adoption of
        unknown shards) the dispatcher is never called from inside a sink
        method.
        """
        clock = Clock()
        inv = Inventory()
        for i in range(3):
            inv.upsert(sim_node(f"n{i}", gpus=8, address=f"10.0.0.{i}",
                                fabrics={"ib0": f"192.168.0.{i}"}))
        d = ReentrantDispatcher(connected={"n0", "n1", "n2"})
        rec = Reconciler(catalog({"big": ("two-node", 1)}), inv, clock, d, adoption_grace=0,
                         fleet_state=KeptState(None))
        original = {name: getattr(rec, name) for name in ("adopt", "node_registered", "on_shard_status")}

        def guarded(name: str) -> Any:
            def call(*a: Any) -> Any:
                d.inside = True
                try:
                    return original[name](*a)
                finally:
                    d.inside = False
            return call

        for name in original:
            setattr(rec, name, guarded(name))
        ghost = ReportedShard("n0", "ghost", "r-x", "other", "one", 0, (1,), 20500, "ready")
        rec.adopt("n0", [ghost])
        rec.node_registered("n0")
        clock.advance(1)
        rec.run_pass()
        for c in list(d.starts):
            rec.on_shard_status(ShardReport(c.node_id, c.replica_id, c.shard_id, "ready"))
        clock.advance(0)
        leader, c = sorted(d.starts, key=lambda s: s.rank)
        rec.on_shard_status(ShardReport(leader.node_id, leader.replica_id, leader.shard_id, "failed"))
        clock.advance(0)
        self.assertIn(("n0", "ghost"), d.stops)
        self.assertIn((c.node_id, c.shard_id), d.stops)


class RoutingProjectionTests(SynchronousTestCase):
    def test_revision_follows_what_is_routed(self) -> None:
        """
        The routing table knows the catalog's models from the start, lists a
        replica once it is ready (revision up), flags it when it drains
        (revision up), and a pass that changes nothing routed keeps the
        revision.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=2, grace=0)
        table = f.rec.routing_table
        self.assertTrue(table.knows_model("demo"))
        f.step()
        rev = table.revision
        f.make_ready()
        self.assertGreater(table.revision, rev)
        [route] = table.routes("demo")
        cmd = f.dispatcher.starts[0]
        self.assertEqual((route.replica_id, route.draining), (cmd.replica_id, False))
        self.assertTrue(route.address.endswith(f":{cmd.port}"))
        rev = table.revision
        f.step(1.0, 3)
        self.assertEqual(table.revision, rev)
        f.rec.scale("demo", 0)
        f.step()
        [route] = table.routes("demo")
        self.assertTrue(route.draining)
        self.assertGreater(table.revision, rev)
        self.assertEqual(table.models(), [])

    def test_engine_signals_in_routes(self) -> None:
        """
        Engine figures for a ready replica's leader appear in its published
        route (revision up); figures for a shard the node does not hold
        change nothing.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=2, grace=0)
        f.step()
        f.make_ready()
        [cmd] = f.dispatcher.starts
        table = f.rec.routing_table
        rev = table.revision
        other = next(n for n in f.ids if n != cmd.node_id)
        f.rec.shard_signals(other, cmd.shard_id, EngineSignals(sampled_at=1.0, waiting=9))
        f.clock.advance(0)
        self.assertEqual(table.revision, rev)
        signals = EngineSignals(sampled_at=f.clock.seconds(), waiting=3, running=5)
        f.rec.shard_signals(cmd.node_id, cmd.shard_id, signals)
        f.clock.advance(0)
        self.assertGreater(table.revision, rev)
        [route] = table.routes("demo")
        self.assertEqual(route.signals, signals)

    def test_long_poll_woken(self) -> None:
        """
        A watcher waiting on the current revision is answered when a replica
        becomes ready.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=1, grace=0)
        f.step()
        d = f.rec.routing_table.wait_newer(f.rec.routing_table.revision)
        self.assertNoResult(d)
        f.make_ready()
        self.assertEqual(self.successResultOf(d), f.rec.routing_table.revision)


class PassBudgetTests(SynchronousTestCase):
    def test_pass_stops_at_budget_and_goes_on(self) -> None:
        """
        With a timer that makes every placement cost 5 ms, a pass with a
        20 ms budget places a few replicas and leaves the rest to the next
        pass, which the running service schedules at once; the end result
        is the same placement as one unbounded pass.
        """
        ticks = [0.0]

        def timer() -> float:
            ticks[0] += 0.005
            return ticks[0]

        def build(budget: float) -> Fleet:
            return Fleet({"demo": ("one", 12)}, nodes=4, grace=0, timer=timer, pass_budget=budget)

        bounded = build(0.020)
        bounded.rec.startService()
        self.addCleanup(bounded.rec.stopService)
        bounded.clock.advance(1.0)
        # Continuation passes ran at once, at the same clock time.
        self.assertGreaterEqual(bounded.rec.passes, 3)
        self.assertFalse(bounded.rec.pass_unfinished)
        self.assertEqual(len(bounded.dispatcher.starts), 12)
        placed_at = {e["time"] for e in kinds(bounded, "replica_placed")}
        self.assertEqual(placed_at, {1.0})
        unbounded = build(1e9)
        unbounded.step()
        key = [(c.node_id, c.gpu_indices, c.port) for c in unbounded.dispatcher.starts]
        self.assertEqual([(c.node_id, c.gpu_indices, c.port) for c in bounded.dispatcher.starts], key)
        self.assertEqual(kinds(bounded, "unplaceable"), [])


    def test_whole_fleet_change_is_taken_within_budgets(self) -> None:
        """
        With a timer that charges 10 us for every look at a node's
        inventory, after every one of 3,000 nodes changed (all registered
        again) and a deployment grew, no pass goes more than a chunk over
        its 20 ms budget: placement hears of the changed nodes over several
        passes, each run at once. The replicas end up where one unbounded
        pass puts them.
        """
        def build(budget: float) -> tuple[Fleet, list[float]]:
            ticks = [0.0]
            f = Fleet({"demo": ("one", 300), "other": ("one", 300)}, nodes=3000, gpus=1, fabric="",
                      grace=0, timer=lambda: ticks[0], pass_budget=budget)
            peek = f.inventory.peek

            def charged(node_id: str) -> Any:
                ticks[0] += 1e-5
                return peek(node_id)

            f.inventory.peek = charged  # type: ignore[method-assign]
            return f, ticks

        placements = []
        for budget in (0.020, 1e9):
            f, _ = build(budget)
            f.rec.startService()
            self.addCleanup(f.rec.stopService)
            f.clock.advance(1.0)
            f.make_ready()
            f.dispatcher.clear()
            for node_id in f.ids:
                f.register(node_id, f.running(node_id))
            f.rec.scale("demo", 600)
            f.rec.max_pass_duration = 0.0
            passes = f.rec.passes
            f.clock.advance(1.0)
            self.assertFalse(f.rec.pass_unfinished)
            if budget < 1:
                self.assertGreater(f.rec.passes - passes, 2)
                # A chunk is 128 nodes: 1.28 ms of looks.
                self.assertLessEqual(f.rec.max_pass_duration, 0.020 + 0.0013)
            placements.append(sorted((c.replica_id, c.node_id, c.gpu_indices) for c in f.dispatcher.starts))
        self.assertEqual(len(placements[0]), 300)
        self.assertEqual(placements[0], placements[1])


class FreezeLiftTests(SynchronousTestCase):
    def test_freeze_lift_gives_a_fresh_lost_clock(self) -> None:
        """
        At 1,000 nodes, 501 go silent (replacements freeze) for longer than
        lost_after. The first one back lifts the freeze; the other 500 are
        not declared lost for silence the freeze covered, and when they
        register seconds later nothing is replaced or stopped.
        """
        f = Fleet({"demo": ("one", 1000)}, nodes=1000, gpus=1, fabric="", grace=0)
        f.step()
        f.make_ready()
        f.dispatcher.clear()
        silent = f.ids[:501]
        for n in silent:
            f.alive.discard(n)
        f.step(1.0, 400)
        self.assertTrue(f.rec.frozen)
        self.assertEqual(kinds(f, "node_lost"), [])
        first = silent[0]
        f.alive.add(first)
        f.inventory.touch(first, f.clock.seconds())
        f.register(first, f.running(first))
        f.step()
        self.assertFalse(f.rec.frozen)
        self.assertEqual(kinds(f, "node_lost"), [])
        f.step(1.0, 10)
        for n in silent[1:]:
            f.alive.add(n)
            f.inventory.touch(n, f.clock.seconds())
            self.assertEqual(f.register(n, f.running(n)), [])
        f.step(1.0, 5)
        self.assertEqual(kinds(f, "node_lost"), [])
        self.assertEqual((f.dispatcher.starts, f.dispatcher.stops), ([], []))
        self.assertEqual(len(f.ready_replicas("demo")), 1000)

    def test_still_silent_after_the_lift_is_lost_later(self) -> None:
        """
        A node that stays silent after the freeze lifts is lost lost_after
        seconds after the lift, not before.
        """
        f = Fleet({"demo": ("one", 4)}, nodes=4, gpus=1, fabric="", grace=0)
        f.step()
        f.make_ready()
        for n in f.ids[:3]:
            f.alive.discard(n)
        f.step(1.0, 400)
        self.assertTrue(f.rec.frozen)
        for n in f.ids[:2]:
            f.alive.add(n)
            f.inventory.touch(n, f.clock.seconds())
            f.register(n, f.running(n))
        f.step()
        self.assertFalse(f.rec.frozen)
        lifted = f.clock.seconds()
        f.step(1.0, 290)
        self.assertEqual(kinds(f, "node_lost"), [])
        f.step(1.0, 15)
        [lost] = kinds(f, "node_lost")
        self.assertEqual(lost["node"], f.ids[2])
        self.assertGreaterEqual(lost["time"], lifted + 300)


def shared_host_fleet(nodes: int = 2, **kw: Any) -> Fleet:
    """
    C{nodes} nodes on one host address (agents of a local fleet, say).
    """
    inv = Inventory()
    for i in range(nodes):
        inv.upsert(sim_node(f"node-{i:05d}", gpus=1, address="127.0.0.1"))
    return Fleet({"demo": ("one", 1)}, inventory=inv, **kw)


class PortTests(SynchronousTestCase):
    def test_lost_nodes_ports_stay_reserved(self) -> None:
        """
        When a node is lost its shard may still run: on a shared host the
        replacement does not get its port; once the node registers again
        without the shard, the port is free again.
        """
        f = shared_host_fleet(2, grace=0)
        f.step()
        f.make_ready()
        [first] = f.dispatcher.starts
        f.dispatcher.clear()
        f.alive.discard(first.node_id)
        f.step(1.0, 320)
        self.assertEqual(len(kinds(f, "node_lost")), 1)
        [replacement] = f.dispatcher.starts
        self.assertNotEqual(replacement.node_id, first.node_id)
        self.assertNotEqual(replacement.port, first.port)
        self.assertTrue(f.rec.ports.in_use("127.0.0.1", first.port))
        f.alive.add(first.node_id)
        f.inventory.touch(first.node_id, f.clock.seconds())
        f.register(first.node_id, [])
        self.assertFalse(f.rec.ports.in_use("127.0.0.1", first.port))

    def test_unconfirmed_stop_keeps_port(self) -> None:
        """
        A stop never confirmed forgets the shard after its grace, but its
        port stays reserved until the agent reports it stopped.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=1, gpus=1, fabric="", grace=0)
        f.step()
        f.make_ready()
        [cmd] = f.dispatcher.starts
        f.rec.scale("demo", 0)
        f.step()
        f.step(1.0, 20)  # drain timeout: told to stop
        self.assertEqual(f.dispatcher.stops, [(cmd.node_id, cmd.shard_id)])
        f.step(1.0, 40)
        [ev] = kinds(f, "shard_stop_unconfirmed")
        self.assertEqual(ev["shard"], cmd.shard_id)
        self.assertNotIn(cmd.shard_id, f.rec.shard_recs)
        host = f.inventory.peek(cmd.node_id).address  # type: ignore[union-attr]
        self.assertTrue(f.rec.ports.in_use(host, cmd.port))
        f.rec.on_shard_status(ShardReport(cmd.node_id, cmd.replica_id, cmd.shard_id, "stopped"))
        self.assertFalse(f.rec.ports.in_use(host, cmd.port))

    def test_reported_ports_never_offered(self) -> None:
        """
        A restarted control plane: the first agent reports a shard that
        nothing claims on port 20000 (the bottom of the range); a placement
        on the same host never gets that port while it runs.
        """
        f = shared_host_fleet(2, grace=0, register=False)
        stray = ReportedShard("node-00000", "old-s0", "old", "gone", "one", 0, (0,), 20000, "ready")
        self.assertEqual(f.register("node-00000", [stray]), [stray])
        self.assertEqual(f.dispatcher.stops, [("node-00000", "old-s0")])
        f.register("node-00001", [])
        f.step()
        [start] = f.dispatcher.starts
        self.assertNotEqual(start.port, 20000)
        self.assertEqual(f.rec.shard_node("old-s0"), "node-00000")
        f.rec.on_shard_status(ShardReport("node-00000", "old", "old-s0", "stopped"))
        self.assertFalse(f.rec.ports.in_use("127.0.0.1", 20000))


class LifecycleTests(SynchronousTestCase):
    def test_profile_change_evacuates(self) -> None:
        """
        A catalog whose profile for a deployment changed replaces its
        replicas by a rollout that surges where there is room: the new one
        is placed while the old one serves, and the old one drains only
        once the new one is ready.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=2, grace=0)
        f.step()
        f.make_ready()
        [old] = f.dispatcher.starts
        f.dispatcher.clear()
        changed = parse_catalog(tomllib.loads(
            ONE_GPU.replace("gpu_memory_mb = 1000\ncommand", "gpu_memory_mb = 2000\ncommand", 1)
            + '\n[[deployments]]\nmodel = "demo"\nprofile = "one"\nreplicas = 1\n'))
        f.rec.apply_catalog(changed)
        self.assertEqual(len(kinds(f, "rollout_started")), 1)
        f.step()
        [new] = f.dispatcher.starts
        self.assertNotEqual(new.replica_id, old.replica_id)
        self.assertEqual(f.dispatcher.drains, [])
        self.assertEqual([r.replica_id for r in f.rec.routes("demo")], [old.replica_id])
        f.make_ready([new])
        f.step()
        self.assertEqual(f.dispatcher.drains, [(old.node_id, old.shard_id)])
        self.assertEqual(f.ready_replicas("demo"), [new.replica_id])

    def test_stopped_nobody_asked_for(self) -> None:
        """
        A ready shard that reports STOPPED unasked tears its replica down
        (logged as a warning), and the deployment is placed again.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=2, grace=0)
        f.step()
        f.make_ready()
        [cmd] = f.dispatcher.starts
        f.dispatcher.clear()
        f.report(cmd, "stopped", error="")
        [ev] = kinds(f, "shard_stopped")
        self.assertEqual(ev["reason"], "stopped without being told to")
        self.assertEqual(f.rec.routes("demo"), [])
        self.assertNotIn(cmd.replica_id, f.rec.replica_recs)
        f.step()
        self.assertEqual(len(f.dispatcher.starts), 1)

    def test_stopping_report_holds_resources(self) -> None:
        """
        A ready shard reported stopping (its process group not empty yet)
        is no longer routed, keeps its GPU and port, and its replica is
        torn down once it reports stopped.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=1, gpus=1, fabric="", grace=0)
        f.step()
        f.make_ready()
        [cmd] = f.dispatcher.starts
        f.report(cmd, "stopping")
        self.assertEqual(f.rec.routes("demo"), [])
        self.assertEqual(f.rec.routing_table.routes("demo"), ())
        self.assertEqual(f.rec.metrics_snapshot()["shards"]["stopping"], 1)
        self.assertEqual(f.rec.metrics_snapshot()["shards"]["ready"], 0)
        f.step()
        self.assertEqual(len(f.dispatcher.starts), 1, "no GPU was free for a second replica")
        f.report(cmd, "stopped")
        self.assertNotIn(cmd.replica_id, f.rec.replica_recs)
        f.step()
        self.assertEqual(len(f.dispatcher.starts), 2)

    def test_node_removed(self) -> None:
        """
        A node removed from the inventory is forgotten with its shards, and
        its replicas are replaced elsewhere.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=2, grace=0)
        f.step()
        f.make_ready()
        [cmd] = f.dispatcher.starts
        f.dispatcher.clear()
        f.inventory.remove(cmd.node_id)
        f.alive.discard(cmd.node_id)
        f.dispatcher.connected.discard(cmd.node_id)
        f.step()
        self.assertNotIn(cmd.node_id, list(f.rec.known_nodes()))
        self.assertNotIn(cmd.shard_id, f.rec.shard_recs)
        f.step()
        [new] = f.dispatcher.starts
        self.assertNotEqual(new.node_id, cmd.node_id)

    def test_uncordon_after_evacuation(self) -> None:
        """
        Uncordoning a draining node before its replicas moved stops the
        move: the replica stays, nothing new is placed, nothing drains.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=1, gpus=2, fabric="", grace=0)
        f.step()
        f.make_ready()
        [cmd] = f.dispatcher.starts
        f.dispatcher.clear()
        f.rec.drain_node(cmd.node_id)
        self.assertEqual(len(kinds(f, "replica_evacuating")), 1)
        f.rec.uncordon(cmd.node_id)
        f.step(1.0, 3)
        self.assertEqual((f.dispatcher.starts, f.dispatcher.drains), ([], []))
        self.assertEqual(f.ready_replicas("demo"), [cmd.replica_id])
        [rep] = [r for r in f.rec.replicas() if r["id"] == cmd.replica_id]
        self.assertIsNone(rep["evacuating"])


class StatesTests(SynchronousTestCase):
    def test_states_are_their_strings(self) -> None:
        """
        The shared enums compare equal to, and serialise as, the strings the
        admin API has always shown, and a replica's state comes from them.
        """
        self.assertEqual(ShardState.READY, "ready")
        self.assertEqual(f"{ReplicaState.STOPPING}", "stopping")
        f = Fleet({"demo": ("one", 1)}, nodes=1, grace=0)
        f.step()
        [rep] = f.rec.replicas()
        self.assertEqual(rep["state"], "pending")
        self.assertIs(type(rep["state"]), str)

    def test_failure_record(self) -> None:
        """
        A failed shard's record is the deployment's last failure, with an
        empty crash class when nothing classified it.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=1, grace=0)
        f.step()
        [cmd] = f.dispatcher.starts
        f.report(cmd, "failed", exit_code=3, error="boom", last_output="oops")
        [dep] = f.rec.deployments()
        self.assertEqual(dep["last_failure"], {
            "node": cmd.node_id, "replica": cmd.replica_id, "shard": cmd.shard_id,
            "exit_code": 3, "signal": 0, "error": "boom", "last_output": "oops",
            "time": f.clock.seconds(), "crash_class": "",
        })
