"""
Tests for L{llmgw.control.shell.reconciler}: pure logic with a C{Clock} and a fake
dispatcher, at fleet sizes that matter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from twisted.internet.task import Clock
from twisted.logger import Logger, LogLevel, formatEvent
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from llmgw.control.core.kept import KeptState
from llmgw.control.shell.reconciler import Reconciler
from llmgw.control.state.interfaces import (
    AdminError,
    IFleetAdmin,
    IRoutingTable,
    IStatusSink,
    NotKeepingUp,
    ReportedShard,
    ShardReport,
    UnknownDeployment,
    UnknownNode,
)
from llmgw.control.state.inventory import Inventory
from tests.reconciler_harness import ONE_GPU, Fleet, catalog


class FakeInFlight:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def in_flight(self, replica_id: str) -> int:
        return self.counts.get(replica_id, 0)


class InterfaceTests(SynchronousTestCase):
    def test_provides(self) -> None:
        """
        The reconciler provides the status sink, routing table and fleet
        admin interfaces.
        """
        rec = Fleet({}, nodes=1).rec
        verifyObject(IStatusSink, rec)
        verifyObject(IRoutingTable, rec)
        verifyObject(IFleetAdmin, rec)


class PlacementTests(SynchronousTestCase):
    def test_nothing_before_grace(self) -> None:
        """
        Nothing is placed until the adoption grace has passed; then the
        desired replicas are placed in one pass on distinct nodes.
        """
        f = Fleet({"demo": ("one", 2)}, nodes=4, grace=30)
        f.step(1.0, 29)
        self.assertEqual(f.dispatcher.starts, [])
        f.step(1.0, 2)
        self.assertEqual(len(f.dispatcher.starts), 2)
        self.assertEqual(len({c.node_id for c in f.dispatcher.starts}), 2)

    def test_command_placeholders(self) -> None:
        """
        Every placeholder but C{{python}} is filled per shard; the leader
        of a multi-shard replica is rank 0's fabric address and port.
        """
        f = Fleet({"big": ("two-node", 1)}, nodes=2, grace=0)
        f.step()
        cmds = sorted(f.dispatcher.starts, key=lambda c: c.rank)
        self.assertEqual(len(cmds), 2)
        leader = cmds[0]
        fabric_addr = f.inventory.peek(leader.node_id).fabrics["ib0"]  # type: ignore[union-attr]
        self.assertEqual(leader.leader_address, f"{fabric_addr}:{leader.port}")
        self.assertEqual(
            list(cmds[1].argv),
            ["{python}", "-m", "srv", "--rank", "1", "--world", "2", "--leader",
             leader.leader_address, "--gpus", ",".join(map(str, cmds[1].gpu_indices))],
        )
        self.assertEqual(cmds[1].env, {"MASTER": leader.leader_address})
        self.assertEqual(len(cmds[1].gpu_indices), 4)
        self.assertNotEqual(cmds[0].node_id, cmds[1].node_id)

    def test_ready_and_routes(self) -> None:
        """
        A replica is routed once all its shards report ready, at its leader's
        host and port; a steady pass then sends nothing.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=2, grace=0)
        f.step()
        [cmd] = f.dispatcher.starts
        self.assertEqual(f.rec.routes("demo"), [])
        f.report(cmd, "starting")
        self.assertEqual(f.rec.replicas()[0]["state"], "starting")
        f.report(cmd, "ready")
        [route] = f.rec.routes("demo")
        host = f.inventory.peek(cmd.node_id).address  # type: ignore[union-attr]
        self.assertEqual(route.address, f"{host}:{cmd.port}")
        self.assertEqual(f.rec.models(), ["demo"])
        self.assertTrue(f.rec.knows_model("demo"))
        self.assertFalse(f.rec.knows_model("other"))
        f.dispatcher.clear()
        f.step(1.0, 5)
        self.assertEqual((f.dispatcher.starts, f.dispatcher.stops), ([], []))

    def test_cordon(self) -> None:
        """
        A cordoned node gets no new placement; its running replicas stay.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=2, grace=0)
        f.rec.cordon("node-00000")
        f.rec.scale("demo", 4)
        f.step()
        self.assertEqual({c.node_id for c in f.dispatcher.starts}, {"node-00001"})
        self.assertRaises(UnknownNode, f.rec.cordon, "nope")

    def test_dispatch_refused(self) -> None:
        """
        A start the dispatcher refuses tears the replica down; the next
        pass places it again.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=1, grace=0)
        f.dispatcher.refuse["node-00000"] = NotKeepingUp("slow")
        f.step()
        self.assertEqual(f.rec.replica_recs, {})
        self.assertIn("dispatch_refused", [e["kind"] for e in f.rec.events()])
        del f.dispatcher.refuse["node-00000"]
        f.step()
        self.assertEqual(len(f.dispatcher.starts), 1)

    def test_suspect_node_gets_nothing(self) -> None:
        """
        Nothing new is placed on a suspect node.
        """
        f = Fleet({"demo": ("one", 0)}, nodes=2, grace=0)
        f.alive.discard("node-00000")
        f.step(1.0, 16)
        self.assertEqual(f.rec.nodes()[0]["state"], "suspect")
        f.rec.scale("demo", 3)
        f.step()
        self.assertEqual({c.node_id for c in f.dispatcher.starts}, {"node-00001"})


class ExpiryTests(SynchronousTestCase):
    def test_suspect_then_lost_replaced(self) -> None:
        """
        Over 1,000 nodes: a silent node turns suspect at 15 s (its replicas
        still routed), lost at 300 s; its multi-shard replica is replaced
        elsewhere and the surviving shard on the other node is stopped.
        """
        f = Fleet({"big": ("two-node", 1), "demo": ("one", 50)}, nodes=1000, grace=0)
        f.step()
        f.make_ready()
        big = f.rec.replica_ids("big")[0]
        victim = f.rec.replica_recs[big].shards[0].node_id
        other = f.rec.replica_recs[big].shards[1]
        f.dispatcher.clear()
        f.alive.discard(victim)
        f.step(1.0, 16)
        states = {n["id"]: n["state"] for n in f.rec.nodes()}
        self.assertEqual(states[victim], "suspect")
        self.assertEqual([r.replica_id for r in f.rec.routes("big")], [big])
        self.assertEqual(f.dispatcher.starts, [])
        f.step(1.0, 290)
        self.assertEqual({n["id"]: n["state"] for n in f.rec.nodes()}[victim], "lost")
        self.assertIn((other.node_id, other.id), f.dispatcher.stops)
        new = [c for c in f.dispatcher.starts if c.model == "big"]
        self.assertEqual(len(new), 2)
        self.assertNotIn(victim, {c.node_id for c in new})
        self.assertEqual(f.rec.routes("big"), [])
        f.make_ready()
        self.assertEqual(len(f.ready_replicas("big")), 1)

    def test_lost_node_returns_shards_stopped(self) -> None:
        """
        A lost node that comes back with its shards: they are not claimed
        (their replica was replaced) and so are stopped; nothing else moves.
        """
        f = Fleet({"demo": ("one", 2)}, nodes=4, grace=0)
        f.step()
        f.make_ready()
        victim = f.dispatcher.starts[0].node_id
        running = f.running(victim)
        f.alive.discard(victim)
        f.step(1.0, 301)
        f.make_ready()
        self.assertEqual(len(f.ready_replicas("demo")), 2)
        f.dispatcher.clear()
        f.alive.add(victim)
        f.inventory.touch(victim, f.clock.seconds())
        unclaimed = f.register(victim, running)
        self.assertEqual(unclaimed, running)
        self.assertEqual(f.dispatcher.stops, [(victim, s.shard_id) for s in running])
        self.assertEqual({n["id"]: n["state"] for n in f.rec.nodes()}[victim], "ready")
        f.dispatcher.clear()
        f.step(1.0, 5)
        self.assertEqual((f.dispatcher.starts, f.dispatcher.stops), ([], []))
        self.assertEqual(len(f.ready_replicas("demo")), 2)

    def test_suspect_node_returns_claimed(self) -> None:
        """
        A node that was only suspect keeps its replicas when it comes back.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=2, grace=0)
        f.step()
        f.make_ready()
        victim = f.dispatcher.starts[0].node_id
        running = f.running(victim)
        f.alive.discard(victim)
        f.step(1.0, 20)
        f.alive.add(victim)
        self.assertEqual(f.rec.adopt(victim, running), [])
        f.rec.node_registered(victim)
        f.dispatcher.clear()
        f.step(1.0, 5)
        self.assertEqual((f.dispatcher.starts, f.dispatcher.stops), ([], []))

    def test_freeze_when_half_suspect(self) -> None:
        """
        Over 1,000 nodes: when more than half turn suspect at once,
        replacements freeze (no node is declared lost, nothing is placed),
        loudly; once they are heard from again, work resumes.
        """
        f = Fleet({"demo": ("one", 100)}, nodes=1000, grace=0)
        f.step()
        f.make_ready()
        f.dispatcher.clear()
        silent = set(f.ids[:600])
        f.alive -= silent
        f.step(1.0, 400)
        self.assertTrue(f.rec.frozen)
        self.assertTrue(f.rec.status()["replacements_frozen"])
        self.assertEqual(f.rec.metrics_snapshot()["nodes"]["lost"], 0)
        self.assertEqual((f.dispatcher.starts, f.dispatcher.stops), ([], []))
        kinds = [e["kind"] for e in f.rec.events()]
        self.assertIn("replacements_frozen", kinds)
        f.alive |= silent
        f.step(1.0, 2)
        self.assertFalse(f.rec.frozen)
        self.assertIn("replacements_resumed", [e["kind"] for e in f.rec.events()])
        self.assertEqual(f.rec.metrics_snapshot()["nodes"]["suspect"], 0)
        self.assertEqual(f.dispatcher.starts, [])

    def test_fresh_clock_after_start(self) -> None:
        """
        Nodes known before the reconciler starts get a fresh clock: none is
        suspect for silence this process did not observe.
        """
        clock = Clock()
        clock.advance(1000)
        inv = Inventory()
        f = Fleet({}, nodes=3, inventory=None, clock=clock)
        for n in f.ids:
            f.inventory.touch(n, 0.0)
        inv = f.inventory
        rec = Reconciler(catalog({}), inv, clock, f.dispatcher, adoption_grace=0)
        rec.run_pass()
        rec.startService()
        self.addCleanup(rec.stopService)
        clock.advance(10)
        self.assertEqual(rec.metrics_snapshot()["nodes"]["suspect"], 0)
        clock.advance(10)
        self.assertEqual(rec.metrics_snapshot()["nodes"]["suspect"], 3)


class ExpiryRoundingTests(SynchronousTestCase):
    def test_deadline_rounding_does_not_spin(self) -> None:
        """
        A node whose deadline, in floating point, falls due a hair before its
        silence reaches suspect_after is neither marked suspect early nor
        re-queued at a time already due (which would spin the pass forever).
        """
        import signal

        def hung(signum: int, frame: Any) -> None:
            raise AssertionError("the reconcile pass did not return")

        previous = signal.signal(signal.SIGALRM, hung)
        self.addCleanup(signal.signal, signal.SIGALRM, previous)
        self.addCleanup(signal.alarm, 0)
        clock = Clock()
        clock.advance(253.27262316257625)
        f = Fleet({"demo": ("one", 0)}, nodes=1, grace=0, clock=clock, suspect_after=15.0)
        f.alive.clear()
        signal.alarm(5)
        for _ in range(40):
            clock.advance(0.5)
            f.rec.run_pass()
        signal.alarm(0)
        self.assertEqual(f.rec.nodes()[0]["state"], "suspect")


class RestartTests(SynchronousTestCase):
    def test_restart_adopts_everything(self) -> None:
        """
        Over 1,000 nodes: a new control plane whose agents report their
        shards (multi-shard replicas across nodes included) makes zero new
        placements and zero stops, and adopts every replica as it was.
        """
        f = Fleet({"demo": ("one", 400), "big": ("two-node", 20)}, nodes=1000, grace=0)
        f.step()
        f.make_ready()
        before = {r["id"]: r for r in f.rec.replicas()}
        reports = {n: f.running(n) for n in f.ids}
        g = Fleet({"demo": ("one", 400), "big": ("two-node", 20)}, inventory=f.inventory,
                  clock=f.clock, register=False, grace=30, epoch=2)
        for node_id in f.ids:
            self.assertEqual(g.rec.adopt(node_id, reports[node_id]), [])
            g.rec.node_registered(node_id)
        g.step(1.0, 40)
        self.assertEqual((g.dispatcher.starts, g.dispatcher.stops, g.dispatcher.drains), ([], [], []))
        after = {r["id"]: r for r in g.rec.replicas()}
        self.assertEqual(set(after), set(before))
        for rid, r in after.items():
            self.assertEqual(r["state"], "ready")
            self.assertEqual(r["shards"], before[rid]["shards"])
        self.assertEqual(len(g.ready_replicas("big")), 20)

    def test_adopted_surplus_scaled_down(self) -> None:
        """
        Adopted replicas beyond the desired count are scaled down normally.
        """
        f = Fleet({"demo": ("one", 3)}, nodes=3, grace=0)
        f.step()
        f.make_ready()
        reports = {n: f.running(n) for n in f.ids}
        g = Fleet({"demo": ("one", 2)}, inventory=f.inventory, clock=f.clock, register=False, grace=5)
        for n in f.ids:
            g.rec.adopt(n, reports[n])
            g.rec.node_registered(n)
        g.step(1.0, 6)
        self.assertEqual(len(g.dispatcher.drains), 1)
        self.assertEqual(g.dispatcher.starts, [])

    def test_incomplete_replica_replaced(self) -> None:
        """
        A multi-shard replica whose other shard nobody reports within the
        adoption grace is torn down and placed again.
        """
        f = Fleet({"big": ("two-node", 1)}, nodes=2, grace=0)
        f.step()
        f.make_ready()
        leader = f.dispatcher.starts[0].node_id
        reports = f.running(leader)
        g = Fleet({"big": ("two-node", 1)}, inventory=f.inventory, clock=f.clock, register=False, grace=10)
        g.rec.adopt(leader, reports)
        g.rec.node_registered(leader)
        g.step(1.0, 5)
        self.assertEqual(g.rec.replicas()[0]["state"], "pending")
        g.step(1.0, 6)
        self.assertEqual(len(g.dispatcher.stops), 1)
        self.assertIn("replica_incomplete", [e["kind"] for e in g.rec.events()])

    def test_unknown_model_unclaimed(self) -> None:
        """
        A shard whose model is not in the catalog is handed back unclaimed.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=1, grace=0)
        f.step()
        f.make_ready()
        reports = f.running("node-00000")
        g = Fleet({"other": ("one", 1)}, inventory=f.inventory, clock=f.clock, register=False)
        self.assertEqual(g.rec.adopt("node-00000", reports), reports)

    def test_registered_without_shard(self) -> None:
        """
        A node that registers without a shard the control plane holds there
        has lost it: the replica is replaced.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=2, grace=0)
        f.step()
        f.make_ready()
        node_id = f.dispatcher.starts[0].node_id
        f.rec.adopt(node_id, [])
        f.rec.node_registered(node_id)
        self.assertIn("shard_missing", [e["kind"] for e in f.rec.events()])
        f.clock.advance(10)
        f.step()
        self.assertEqual(len(f.dispatcher.starts), 2)

    def test_missing_shard_backs_off_and_takes_late_status(self) -> None:
        """
        A shard gone missing while its node was away counts as a failure
        (the deployment backs off), and the failed status the agent kept for
        the control plane still fills in the exit code and last output.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=2, grace=0)
        f.step()
        f.make_ready()
        first = f.dispatcher.starts[0]
        f.rec.adopt(first.node_id, [])
        f.rec.node_registered(first.node_id)
        [dep] = f.rec.deployments()
        self.assertEqual(dep["failures"], 1)
        self.assertIsNotNone(dep["backoff_until"])
        self.assertEqual(f.rec.shard_node(first.shard_id), first.node_id)
        f.rec.on_shard_status(ShardReport(
            node_id=first.node_id, replica_id=first.replica_id, shard_id=first.shard_id,
            state="failed", exit_code=3, last_output="Traceback: boom"))
        [dep] = f.rec.deployments()
        self.assertEqual((dep["last_failure"]["exit_code"], dep["last_failure"]["last_output"]),
                         (3, "Traceback: boom"))
        self.assertEqual(dep["failures"], 1)
        f.step()
        self.assertEqual(len(f.dispatcher.starts), 1)
        f.clock.advance(10)
        f.step()
        self.assertEqual(len(f.dispatcher.starts), 2)

    def test_adopted_rank_outside_world(self) -> None:
        """
        A reported shard whose rank is outside its replica's world is not
        adopted, and routing never breaks on a replica without a leader.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=1, grace=30, register=False)
        bad = ReportedShard(node_id="node-00000", shard_id="s1", replica_id="r1", model="demo",
                            profile="one", rank=1, gpu_indices=(0,), port=20000, state="ready")
        self.assertEqual(f.rec.adopt("node-00000", [bad]), [bad])
        self.assertEqual(f.rec.routes("demo"), [])


class FailureTests(SynchronousTestCase):
    def test_failure_replaces_whole_replica(self) -> None:
        """
        A failed shard tears down its whole replica (the other shard is
        stopped), the failure is visible with its exit code and output, and
        the deployment is placed again after its backoff.
        """
        f = Fleet({"big": ("two-node", 1)}, nodes=4, grace=0)
        f.step()
        f.make_ready()
        first, second = sorted(f.dispatcher.starts, key=lambda c: c.rank)
        f.dispatcher.clear()
        f.report(first, "failed", exit_code=3, last_output="boom")
        self.assertEqual(f.dispatcher.stops, [(second.node_id, second.shard_id)])
        dep = f.rec.deployments()[0]
        self.assertEqual(dep["last_failure"]["exit_code"], 3)
        self.assertEqual(dep["last_failure"]["last_output"], "boom")
        self.assertEqual(dep["backoff_until"], f.clock.seconds() + 10)
        ev = [e for e in f.rec.events() if e["kind"] == "shard_failed"][0]
        self.assertEqual((ev["exit_code"], ev["last_output"], ev["node"]), (3, "boom", first.node_id))
        f.step(1.0, 9)
        self.assertEqual(f.dispatcher.starts, [])
        f.step(1.0, 1)
        self.assertEqual(len(f.dispatcher.starts), 2)

    def test_replacements_spread_over_nodes(self) -> None:
        """
        When every replica of a deployment fails at once, the replacements
        spread over the nodes again, though one node has room for them all:
        placement is not misled by the nodes it held the replicas on.
        """
        f = Fleet({"demo": ("one", 2)}, nodes=2, gpus=2, grace=0)
        f.step()
        first = list(f.dispatcher.starts)
        self.assertEqual(sorted(c.node_id for c in first), sorted(f.ids))
        f.dispatcher.clear()
        for cmd in first:
            f.report(cmd, "starting")
            f.report(cmd, "failed", exit_code=1)
        while len(f.dispatcher.starts) < 2:
            f.step()
        self.assertEqual(sorted(c.node_id for c in f.dispatcher.starts), sorted(f.ids))

    def test_crash_loop_backoff(self) -> None:
        """
        A crash-looping deployment waits 10 s, then twice as long after each
        failure, capped at 5 minutes; a replica ready for 10 minutes resets
        the count.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=2, grace=0)
        f.step()
        delays = []
        for _ in range(8):
            [cmd] = f.dispatcher.starts
            f.dispatcher.clear()
            f.report(cmd, "starting")
            f.report(cmd, "failed", exit_code=1)
            start = f.clock.seconds()
            while not f.dispatcher.starts:
                f.step()
            delays.append(f.clock.seconds() - start)
        self.assertEqual(delays, [10, 20, 40, 80, 160, 300, 300, 300])
        f.make_ready()
        f.step(1.0, 601)
        self.assertEqual(f.rec.deps["demo"].backoff.failures, 0)
        self.assertIn("backoff_reset", [e["kind"] for e in f.rec.events()])

    def test_served_failures_replaced_at_once(self) -> None:
        """
        A replica that was ready for 10 s or more and then failed (a kill,
        a node's engine gone) is replaced at once, however many went before
        it: it is no crash loop, and its deployment's backoff does not grow;
        one that fails sooner after becoming ready still backs off.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=2, grace=0)
        f.step()
        for _ in range(4):
            [cmd] = f.dispatcher.starts
            f.dispatcher.clear()
            f.report(cmd, "ready")
            f.step(1.0, 10)
            f.report(cmd, "stopping")
            f.report(cmd, "failed", signal=9)
            f.step()
            self.assertEqual(len(f.dispatcher.starts), 1)
        self.assertEqual(f.rec.deps["demo"].backoff.failures, 0)
        [cmd] = f.dispatcher.starts
        f.dispatcher.clear()
        f.report(cmd, "ready")
        f.step(1.0, 3)
        f.report(cmd, "failed", exit_code=1)
        f.step()
        self.assertEqual(f.dispatcher.starts, [])
        self.assertEqual(f.rec.deps["demo"].backoff.failures, 1)

    def test_startup_timeout(self) -> None:
        """
        A shard starting for longer than its profile's startup timeout
        fails and its replica is replaced.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=2, grace=0)
        f.step()
        [cmd] = f.dispatcher.starts
        f.report(cmd, "starting")
        f.step(1.0, 59)
        self.assertEqual(f.dispatcher.stops, [])
        f.step(1.0, 1)
        self.assertEqual(f.dispatcher.stops, [(cmd.node_id, cmd.shard_id)])
        self.assertIn("startup_timeout", [e["kind"] for e in f.rec.events()])

    def test_pending_resent_then_replaced(self) -> None:
        """
        A shard that never reports is re-sent, then its replica replaced.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=2, grace=0, pending_timeout=10)
        f.step()
        [cmd] = f.dispatcher.starts
        f.step(1.0, 10)
        self.assertEqual([c.shard_id for c in f.dispatcher.starts], [cmd.shard_id] * 2)
        f.step(1.0, 10)
        self.assertEqual(len(f.dispatcher.starts), 3)
        f.step(1.0, 10)
        self.assertEqual(f.dispatcher.stops, [(cmd.node_id, cmd.shard_id)])
        self.assertIn("shard_unresponsive", [e["kind"] for e in f.rec.events()])

    def test_unknown_shard_status_stopped(self) -> None:
        """
        A live status for a shard the control plane does not hold is
        answered with a stop.
        """
        from llmgw.control.state.interfaces import ShardReport

        f = Fleet({"demo": ("one", 0)}, nodes=1, grace=0)
        f.rec.on_shard_status(ShardReport("node-00000", "r", "ghost", "ready"))
        self.assertEqual(f.dispatcher.stops, [])
        f.clock.advance(0)
        self.assertEqual(f.dispatcher.stops, [("node-00000", "ghost")])

    def test_stopping_shard_keeps_gpu(self) -> None:
        """
        A shard told to stop keeps its GPU until it confirms it stopped (or
        its stop grace and some slack pass unconfirmed).
        """
        f = Fleet({"demo": ("one", 1)}, nodes=1, gpus=1, grace=0)
        f.step()
        [cmd] = f.dispatcher.starts
        f.report(cmd, "starting")
        f.rec.scale("demo", 0)
        f.step()
        self.assertEqual(f.dispatcher.stops, [(cmd.node_id, cmd.shard_id)])
        f.rec.scale("demo", 1)
        f.step(1.0, 10)
        self.assertEqual(len(f.dispatcher.starts), 1)
        f.confirm_stops()
        f.step()
        self.assertEqual(len(f.dispatcher.starts), 2)
        self.assertEqual(f.dispatcher.starts[1].gpu_indices, (0,))


class ScaleDrainTests(SynchronousTestCase):
    def test_scale_down_not_ready_first_then_drain(self) -> None:
        """
        Scaling down stops not-ready replicas first; a ready one is drained
        and then stopped as soon as the gateway has nothing in flight.
        """
        inflight = FakeInFlight()
        f = Fleet({"demo": ("one", 3)}, nodes=3, grace=0, in_flight=inflight)
        f.step()
        cmds = list(f.dispatcher.starts)
        f.make_ready(cmds[:2])
        f.dispatcher.clear()
        f.rec.scale("demo", 1)
        f.step()
        self.assertEqual(f.dispatcher.stops, [(cmds[2].node_id, cmds[2].shard_id)])
        self.assertEqual(len(f.dispatcher.drains), 1)
        drained = f.rec.shard_recs[f.dispatcher.drains[0][1]].replica_id
        inflight.counts[drained] = 2
        self.assertTrue([r for r in f.rec.routes("demo") if r.draining])
        f.step(1.0, 3)
        self.assertEqual(len(f.dispatcher.stops), 1)
        inflight.counts[drained] = 0
        f.step()
        self.assertEqual(len(f.dispatcher.stops), 2)

    def test_drain_timeout(self) -> None:
        """
        Without an in-flight source, a draining replica is stopped at its
        drain timeout.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=1, grace=0)
        f.step()
        f.make_ready()
        f.rec.scale("demo", 0)
        f.step(1.0, 10)
        self.assertEqual(f.dispatcher.stops, [])
        f.step()
        self.assertEqual(len(f.dispatcher.stops), 1)
        f.confirm_stops()
        self.assertEqual(f.rec.replicas(), [])

    def test_node_drain_make_before_break(self) -> None:
        """
        Draining a node places the replacement first; the old replica keeps
        serving until the replacement is ready, then drains.
        """
        inflight = FakeInFlight()
        f = Fleet({"demo": ("one", 1)}, nodes=2, grace=0, in_flight=inflight)
        f.step()
        f.make_ready()
        [old] = f.dispatcher.starts
        f.dispatcher.clear()
        f.rec.drain_node(old.node_id)
        self.assertTrue(f.rec.nodes()[0 if old.node_id == "node-00000" else 1]["cordoned"])
        f.step()
        [new] = f.dispatcher.starts
        self.assertNotEqual(new.node_id, old.node_id)
        f.step(1.0, 5)
        self.assertEqual((f.dispatcher.drains, f.dispatcher.stops), ([], []))
        self.assertEqual(len(f.ready_replicas("demo")), 1)
        f.make_ready([new])
        f.step()
        self.assertEqual(f.dispatcher.drains, [(old.node_id, old.shard_id)])
        f.step()
        self.assertEqual(f.dispatcher.stops, [(old.node_id, old.shard_id)])
        f.confirm_stops()
        f.step()
        self.assertIn("node_drained", [e["kind"] for e in f.rec.events()])
        self.assertEqual(f.ready_replicas("demo"), [f.rec.shard_recs[new.shard_id].replica_id])

    def test_scale_kept(self) -> None:
        """
        A scale change is written beside the catalog and a new reconciler
        reading the same catalog starts with it.
        """
        path = self.mktemp()
        Path(path).write_text("")
        cat = catalog({"demo": ("one", 2)}, path=path)
        f = Fleet({}, nodes=1, cat=cat, fleet_state=KeptState.beside(path))
        f.rec.scale("demo", 7)
        g = Fleet({}, nodes=1, cat=cat, fleet_state=KeptState.beside(path))
        self.assertEqual(g.rec.deployments()[0]["desired"], 7)
        self.assertRaises(UnknownDeployment, f.rec.scale, "nope", 1)
        self.assertRaises(AdminError, f.rec.scale, "demo", -1)


class CordonKeptTests(SynchronousTestCase):
    """
    Cordoned and draining nodes are kept in the state file beside the
    catalog and survive a restart.
    """

    def state_path(self) -> tuple[str, Any]:
        path = self.mktemp()
        Path(path).write_text("")
        return path, Path(path + ".scale.json")

    def test_cordon_kept_across_restart(self) -> None:
        """
        A cordon is written at once; a new reconciler reading the same state
        starts with the node cordoned, shows it so, and places nothing
        there, even before the node has registered again.
        """
        path, state = self.state_path()
        cat = catalog({"demo": ("one", 0)}, path=path)
        f = Fleet({}, nodes=2, cat=cat, grace=0, fleet_state=KeptState.beside(path))
        f.rec.cordon("node-00000")
        self.assertEqual(json.loads(state.read_text())["cordoned"], ["node-00000"])
        g = Fleet({}, nodes=2, cat=cat, grace=0, register=False, fleet_state=KeptState.beside(path))
        self.assertEqual(g.rec.cordoned, {"node-00000"})
        for node_id in g.ids:
            g.rec.adopt(node_id, [])
            g.rec.node_registered(node_id)
        self.assertEqual([n["cordoned"] for n in g.rec.nodes()], [True, False])
        g.rec.scale("demo", 4)
        g.step()
        self.assertEqual(len(g.dispatcher.starts), 4)
        self.assertEqual({c.node_id for c in g.dispatcher.starts}, {"node-00001"})

    def test_uncordon_before_return(self) -> None:
        """
        A node kept cordoned can be uncordoned after a restart before it
        registers again; that clears it from the file.
        """
        path, state = self.state_path()
        cat = catalog({}, path=path)
        f = Fleet({}, nodes=2, cat=cat, fleet_state=KeptState.beside(path))
        f.rec.cordon("node-00001")
        g = Fleet({}, nodes=0, cat=cat, register=False, fleet_state=KeptState.beside(path))
        self.assertRaises(UnknownNode, g.rec.uncordon, "node-00000")
        g.rec.uncordon("node-00001")
        self.assertEqual(json.loads(state.read_text())["cordoned"], [])
        self.assertEqual(KeptState.beside(path).cordoned, frozenset())

    def test_uncordon_removes_from_file(self) -> None:
        """
        Uncordoning a cordoned node and a draining one removes both from
        the file; a new reconciler places on them again.
        """
        path, state = self.state_path()
        cat = catalog({"demo": ("one", 0)}, path=path)
        f = Fleet({}, nodes=2, cat=cat, grace=0, fleet_state=KeptState.beside(path))
        f.rec.cordon("node-00000")
        f.rec.drain_node("node-00001")
        data = json.loads(state.read_text())
        self.assertEqual((data["cordoned"], data["draining"]), (["node-00000", "node-00001"], ["node-00001"]))
        f.rec.uncordon("node-00000")
        f.rec.uncordon("node-00001")
        data = json.loads(state.read_text())
        self.assertEqual((data["cordoned"], data["draining"]), ([], []))
        g = Fleet({}, nodes=2, cat=cat, grace=0, fleet_state=KeptState.beside(path))
        g.rec.scale("demo", 2)
        g.step()
        self.assertEqual({c.node_id for c in g.dispatcher.starts}, {"node-00000", "node-00001"})

    def test_drain_resumed_after_restart(self) -> None:
        """
        A node being drained when the control plane stops is still draining
        after the restart: not declared drained before it registers; once
        it registers with its replica, that replica is moved make-before-
        break (the replacement elsewhere is ready before the old one
        drains); when it has no shards left the drain ends and the file
        keeps it cordoned only.
        """
        path, state = self.state_path()
        cat = catalog({"demo": ("one", 1)}, path=path)
        f = Fleet({}, nodes=2, cat=cat, grace=0, fleet_state=KeptState.beside(path))
        f.step()
        f.make_ready()
        [old] = f.dispatcher.starts
        f.rec.drain_node(old.node_id)
        reports = {n: f.running(n) for n in f.ids}

        inflight = FakeInFlight()
        g = Fleet({}, inventory=f.inventory, clock=f.clock, cat=cat, register=False, grace=5, epoch=2,
                  fleet_state=KeptState.beside(path), in_flight=inflight)
        self.assertEqual(g.rec.draining_nodes, {old.node_id})
        g.step(1.0, 2)
        self.assertEqual(g.rec.draining_nodes, {old.node_id})
        self.assertNotIn("node_drained", [e["kind"] for e in g.rec.events()])
        for node_id in f.ids:
            self.assertEqual(g.rec.adopt(node_id, reports[node_id]), [])
            g.rec.node_registered(node_id)
        self.assertIn("replica_evacuating", [e["kind"] for e in g.rec.events()])
        g.step(1.0, 5)
        [new] = g.dispatcher.starts
        self.assertNotEqual(new.node_id, old.node_id)
        g.step(1.0, 3)
        self.assertEqual((g.dispatcher.drains, g.dispatcher.stops), ([], []))
        self.assertEqual(len(g.ready_replicas("demo")), 1)
        g.make_ready([new])
        g.step()
        self.assertEqual(g.dispatcher.drains, [(old.node_id, old.shard_id)])
        g.step()
        self.assertEqual(g.dispatcher.stops, [(old.node_id, old.shard_id)])
        g.confirm_stops()
        g.step()
        self.assertIn("node_drained", [e["kind"] for e in g.rec.events()])
        data = json.loads(state.read_text())
        self.assertEqual((data["cordoned"], data["draining"]), ([old.node_id], []))
        self.assertEqual(g.ready_replicas("demo"), [g.rec.shard_recs[new.shard_id].replica_id])

    def test_damaged_file_tolerated(self) -> None:
        """
        A state file that does not parse is logged at error level and moved
        aside; the reconciler starts with nothing cordoned and places on
        every node, and the next cordon writes a good file.
        """
        path, state = self.state_path()
        state.write_text('{"cordoned": ["node-00000"')
        logged: list[dict[str, Any]] = []
        self.patch(Reconciler, "log", Logger(observer=logged.append))  # type: ignore[arg-type]
        cat = catalog({"demo": ("one", 2)}, path=path)
        f = Fleet({}, nodes=2, cat=cat, grace=0, fleet_state=KeptState.beside(path))
        [event] = [e for e in logged if e["log_level"] == LogLevel.error]
        self.assertIn("unreadable", formatEvent(event))
        self.assertIn(str(state), formatEvent(event))
        self.assertEqual(f.rec.cordoned, set())
        f.step()
        self.assertEqual({c.node_id for c in f.dispatcher.starts}, {"node-00000", "node-00001"})
        self.assertTrue(Path(str(state) + ".unreadable").exists())
        f.rec.cordon("node-00001")
        self.assertEqual(json.loads(state.read_text())["cordoned"], ["node-00001"])

    def test_old_scale_only_file(self) -> None:
        """
        A state file from before cordons were kept (scale overrides only)
        loads as it is; a cordon then adds to it and keeps the override.
        """
        path, state = self.state_path()
        state.write_text(json.dumps({"replicas": {"demo": {"replicas": 3, "catalog_replicas": 1}}}))
        cat = catalog({"demo": ("one", 1)}, path=path)
        f = Fleet({}, nodes=2, cat=cat, fleet_state=KeptState.beside(path))
        self.assertEqual(f.rec.deployments()[0]["desired"], 3)
        self.assertEqual(f.rec.cordoned, set())
        f.rec.cordon("node-00000")
        g = Fleet({}, nodes=2, cat=cat, fleet_state=KeptState.beside(path))
        self.assertEqual(g.rec.deployments()[0]["desired"], 3)
        self.assertEqual(g.rec.cordoned, {"node-00000"})

    def test_no_catalog_nothing_kept(self) -> None:
        """
        Without a catalog file there is nowhere to keep a cordon: it holds
        for this process only, and no file is written.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=1, fleet_state=KeptState.beside(None))
        before = sorted(Path(".").iterdir())
        f.rec.cordon("node-00000")
        f.rec.drain_node("node-00000")
        self.assertEqual(f.rec.cordoned, {"node-00000"})
        self.assertEqual(sorted(Path(".").iterdir()), before)

    def test_write_failure_reported(self) -> None:
        """
        A cordon that cannot be written is in force for this process, and
        the operator is told it will not survive a restart.
        """
        missing = Path(self.mktemp()) / "catalog.toml"
        f = Fleet({}, nodes=1, fleet_state=KeptState.beside(str(missing)))
        with self.assertRaises(AdminError) as ctx:
            f.rec.cordon("node-00000")
        self.assertIn("will not survive a restart", str(ctx.exception))
        self.assertEqual(ctx.exception.status, 500)
        self.assertEqual(f.rec.cordoned, {"node-00000"})


class CatalogReloadTests(SynchronousTestCase):
    def test_bad_reload_keeps_running(self) -> None:
        """
        A bad catalog on reload is refused with the entry named, and the
        running one stays.
        """
        path = Path(self.mktemp())
        path.write_text(ONE_GPU + '[[deployments]]\nmodel = "demo"\nprofile = "one"\nreplicas = 1\n')
        f = Fleet({}, nodes=1, cat=catalog({"demo": ("one", 1)}, path=str(path)))
        path.write_text(ONE_GPU + '[[deployments]]\nmodel = "demo"\nprofile = "nope"\n')
        with self.assertRaises(AdminError) as ctx:
            f.rec.reload_catalog()
        self.assertIn("deployment 'demo'", str(ctx.exception))
        self.assertTrue(f.rec.knows_model("demo"))

    def test_reload_removes_and_adds(self) -> None:
        """
        A reload that drops a deployment drains its replicas; one that adds
        a deployment places it.
        """
        path = Path(self.mktemp())
        path.write_text(ONE_GPU + '[[deployments]]\nmodel = "demo"\nprofile = "one"\nreplicas = 1\n')
        f = Fleet({}, nodes=2, grace=0, cat=catalog({"demo": ("one", 1)}, path=str(path)))
        f.step()
        f.make_ready()
        path.write_text(ONE_GPU + '[[deployments]]\nmodel = "new"\nprofile = "one"\nreplicas = 1\n')
        summary = f.rec.reload_catalog()
        self.assertEqual((summary["added"], summary["removed"]), (["new"], ["demo"]))
        f.clock.advance(0)
        self.assertEqual(len(f.dispatcher.drains), 1)
        f.step()
        self.assertEqual([c.model for c in f.dispatcher.starts], ["demo", "new"])


class LoopAndViewTests(SynchronousTestCase):
    def test_loop_survives_exceptions(self) -> None:
        """
        A pass that raises is logged and counted; the LoopingCall goes on.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=1, grace=0)
        calls = []

        def broken() -> list[str]:
            calls.append(1)
            raise RuntimeError("kaboom")

        f.dispatcher.connected_nodes = broken  # type: ignore[method-assign]
        f.rec.startService()
        self.addCleanup(f.rec.stopService)
        f.clock.advance(1)
        f.clock.advance(1)
        self.assertEqual(len(calls), 2)
        self.assertEqual(f.rec.pass_errors, 2)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 2)

    def test_views_are_json(self) -> None:
        """
        Every admin view is plain JSON-able data with the documented keys.
        """
        f = Fleet({"demo": ("one", 2)}, nodes=2, grace=0)
        f.step()
        f.make_ready()
        json.dumps([f.rec.status(), f.rec.nodes(), f.rec.deployments(), f.rec.replicas(), f.rec.events()])
        node = f.rec.nodes()[0]
        for key in ("id", "state", "connected", "cordoned", "draining", "last_seen", "gpus", "fabrics", "shards"):
            self.assertIn(key, node)
        self.assertEqual(set(f.rec.replicas()[0]["shards"][0]) >= {"id", "node", "rank", "state", "address"}, True)
        snap = f.rec.metrics_snapshot()
        self.assertEqual(snap["replicas"]["ready"], 2)
        self.assertEqual(snap["shards"]["ready"], 2)
        self.assertEqual(snap["nodes"]["ready"], 2)
        self.assertGreater(snap["events"]["replica_placed"], 0)

    def test_events_since_and_bounded(self) -> None:
        """
        Events are returned oldest first after a given time, and the log
        keeps only the newest.
        """
        f = Fleet({}, nodes=1, event_limit=3)
        for i in range(5):
            f.clock.advance(1)
            f.rec.cordon("node-00000") if i % 2 == 0 else f.rec.uncordon("node-00000")
        evs = f.rec.events()
        self.assertEqual(len(evs), 3)
        self.assertEqual([e["time"] for e in f.rec.events(since=4)], [5])


class MetricsTests(SynchronousTestCase):
    def test_snapshot_renders(self) -> None:
        """
        The reconciler's metrics snapshot renders through the control
        plane's Prometheus collector: replicas, passes and the freeze flag.
        """
        from prometheus_client import generate_latest

        from llmgw.control.shell.metrics import make_registry, register_control_metrics
        from llmgw.testing.fleet import FakeAgents

        f = Fleet({"demo": ("one", 2)}, nodes=2, grace=0)
        f.step()
        f.make_ready()
        registry = make_registry()
        register_control_metrics(registry, FakeAgents(), lambda: f.rec)
        text = generate_latest(registry).decode()
        self.assertIn('llmgw_replicas{state="ready"} 2.0', text)
        self.assertIn('llmgw_nodes{state="ready"} 2.0', text)
        self.assertIn("llmgw_replacements_frozen 0.0", text)
        self.assertIn("llmgw_reconcile_pass_seconds_count 1.0", text)
