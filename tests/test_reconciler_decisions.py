"""
The reconciler's decisions called without its shell (DESIGN §6.7): each
takes the context, an input and the time, and returns what to send and log
in an outcome, sending nothing itself; and the shell's growth hook, through
which the control plane freezes its collector's heap.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.core import deadlines, lifecycle, nodes, placing, reports
from llmgw.control.core.commands import Drain, Start, Stop
from llmgw.control.core.outcome import Outcome
from llmgw.control.shell.reconciler import GROWTH_STEP
from llmgw.control.state.interfaces import (
    AdminError,
    ReportedShard,
    ShardReport,
    UnknownDeployment,
    UnknownNode,
)
from tests.reconciler_harness import Fleet


def placed(f: Fleet) -> Fleet:
    """A fleet past its grace with one placement decided and sent."""
    f.step()
    return f


class DecisionTests(SynchronousTestCase):
    def test_placing_returns_starts(self) -> None:
        """
        The scale-and-place step returns one start per missing replica in
        its outcome and sends nothing: the dispatcher has heard nothing
        until the shell flushes.
        """
        f = Fleet({"demo": ("one", 3)}, nodes=2, grace=0)
        rec = f.rec
        out = Outcome()
        p = placing.Placing(rec.ctx)
        unfinished = placing.reconcile(rec.ctx, f.clock.seconds(), p.placer,
                                       lambda: p.sync(rec.ctx, set(f.ids), lambda: False),
                                       lambda: False, out)
        self.assertFalse(unfinished)
        self.assertEqual([type(c) for c in out.commands], [Start] * 3)
        self.assertEqual([e.kind for e in out.events], ["replica_placed"] * 3)
        self.assertEqual(f.dispatcher.starts, [])
        self.assertEqual(len(rec.state.by_model["demo"]), 3)

    def test_failed_shard_returns_stops_and_backoff(self) -> None:
        """
        A failed shard of a two-shard replica: the outcome stops the other
        shard (the failed one has ended), logs the failure and the backoff,
        and the deployment's backoff counts one failure.
        """
        f = placed(Fleet({"big": ("two-node", 1)}, nodes=2, grace=0))
        first, second = f.dispatcher.starts
        f.make_ready()
        out = Outcome()
        reports.shard_status(f.rec.ctx, ShardReport(first.node_id, first.replica_id, first.shard_id,
                                                    "failed", exit_code=3), f.clock.seconds(), out)
        self.assertEqual(out.commands, [Stop(second.node_id, second.shard_id)])
        self.assertEqual([e.kind for e in out.events], ["shard_failed", "backoff", "replica_stopping"])
        self.assertEqual(f.rec.deps["big"].backoff.failures, 1)
        self.assertEqual(f.dispatcher.stops, [])

    def test_drain_node_returns_evacuation_not_commands(self) -> None:
        """
        Draining a node marks its replicas to be moved off and sends
        nothing yet (make-before-break): the outcome has events only.
        """
        f = placed(Fleet({"demo": ("one", 2)}, nodes=2, gpus=1, grace=0))
        node = f.dispatcher.starts[0].node_id
        out = Outcome()
        nodes.drain(f.rec.ctx, node, out)
        self.assertEqual(out.commands, [])
        self.assertEqual([e.kind for e in out.events],
                         ["node_cordoned", "node_draining", "replica_evacuating"])

    def test_drain_timeout_returns_stops(self) -> None:
        """
        A draining replica past its drain timeout (10 s in the harness's
        profile) is torn down by the deadline check: its stop is in the
        outcome, not before the timeout.
        """
        f = placed(Fleet({"demo": ("one", 1)}, nodes=1, gpus=1, grace=0))
        f.make_ready()
        cmd = f.dispatcher.starts[0]
        rep = f.rec.state.replicas[cmd.replica_id]
        out = Outcome()
        lifecycle.start_drain(f.rec.ctx, rep, "test", f.clock.seconds(), out)
        self.assertEqual(out.commands, [Drain(cmd.node_id, cmd.shard_id)])
        early = Outcome()
        deadlines.check(f.rec.ctx, None, f.clock.seconds() + 9, early)
        self.assertEqual(early.commands, [])
        late = Outcome()
        deadlines.check(f.rec.ctx, None, f.clock.seconds() + 10, late)
        self.assertEqual(late.commands, [Stop(cmd.node_id, cmd.shard_id)])

    def test_refused_first_start_tears_down(self) -> None:
        """
        A first start its node could not be sent is an input: the outcome
        logs the refusal and the teardown, and stops the replica's shard.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=1, gpus=1, grace=0)
        out = Outcome()
        p = placing.Placing(f.rec.ctx)
        placing.reconcile(f.rec.ctx, 0.0, p.placer, lambda: p.sync(f.rec.ctx, set(f.ids), lambda: False),
                          lambda: False, out)
        (start,) = out.commands
        assert isinstance(start, Start)
        refusal = Outcome()
        reports.refused(f.rec.ctx, start, "not connected", 0.0, refusal)
        self.assertEqual([e.kind for e in refusal.events], ["dispatch_refused", "replica_stopping"])
        self.assertEqual(refusal.commands, [Stop(start.node_id, start.shard_id)])

    def test_admin_input_errors(self) -> None:
        """
        An operator's bad input is refused with an error naming it: an
        unknown node, a model no deployment serves, a count below zero.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=1)
        self.assertRaises(UnknownNode, nodes.known, f.rec.ctx, "nope")
        self.assertRaises(UnknownDeployment, placing.check_scale, f.rec.ctx, "other", 1)
        err = self.assertRaises(AdminError, placing.check_scale, f.rec.ctx, "demo", -1)
        self.assertIn("-1", str(err))


class GrowthHookTests(SynchronousTestCase):
    def test_called_after_growth_only(self) -> None:
        """
        The growth hook runs at the end of the pass in which the fleet grew
        by GROWTH_STEP shards or more since its last call, once, and not in
        passes that change nothing.
        """
        calls: list[int] = []
        f = Fleet({"demo": ("one", GROWTH_STEP + 10)}, nodes=GROWTH_STEP // 8 + 2, gpus=8, grace=0,
                  clock=Clock())
        f.rec.after_growth = lambda: calls.append(len(f.rec.state.shards))
        f.step()
        self.assertEqual(len(f.rec.state.shards), GROWTH_STEP + 10)
        self.assertEqual(len(calls), 1)
        self.assertGreaterEqual(calls[0], GROWTH_STEP)
        f.make_ready()
        f.step(1.0, 3)
        self.assertEqual(len(calls), 1)


STATES = ["starting", "ready", "draining", "stopping", "stopped", "failed"]
reports_ = st.lists(
    st.tuples(
        st.sampled_from(["report", "adopt", "deadline", "lost", "drain"]),
        st.integers(0, 3),  # node
        st.integers(0, 12),  # shard: one held, or (past the held ones) one nobody holds
        st.sampled_from(STATES),
        st.integers(0, 3),  # rank of an adopted shard
    ),
    max_size=30,
)


class DecisionProperties(SynchronousTestCase):
    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(reports_)
    def test_outcomes_name_what_exists(self, seq: list[tuple[str, int, int, str, int]]) -> None:
        """
        Whatever agents report, true or not (a held shard's state, one
        reported by the wrong node, one nobody holds, an adoption of
        anything), fed straight to the decisions: every command they return
        names a node in the inventory and a shard the fleet state holds or
        reserves on that node, and no replica ever holds two shards of one
        rank. (A stop may also name the shard the node itself just said it
        runs: one nothing claims there is stopped.)
        """
        f = placed(Fleet({"demo": ("one", 4), "big": ("two-node", 1)}, nodes=4, grace=0))
        ctx = f.rec.ctx
        now = f.clock.seconds()
        for kind, n, s, state, rank in seq:
            now += 7
            node = f.ids[n]
            held = sorted(ctx.state.shards)
            out = Outcome()
            said = ""
            if kind == "report":
                if s < len(held):
                    shard = ctx.state.shards[held[s]]
                    sid, rid = shard.id, shard.replica_id
                else:
                    sid, rid = f"stray-{s}", f"stray-r{s}"
                said = sid
                reports.shard_status(ctx, ShardReport(node, rid, sid, state), now, out)
            elif kind == "adopt":
                rid = held and ctx.state.shards[held[s % len(held)]].replica_id or "x"
                rid = rid if s % 2 else f"demo-adopted-{s}"
                shard = ReportedShard(node, f"{rid}-s{rank}", rid, "demo", "one", rank, (rank,),
                                      21000 + s, state if state in ("starting", "ready") else "ready", 1)
                said = shard.shard_id
                reports.adopt(ctx, node, [shard], now, out)
                reports.registered(ctx, node, now, out)
            elif kind == "deadline":
                deadlines.check(ctx, None, now, out)
            elif kind == "lost":
                nodes.lost(ctx, node, 400.0, now, out)
            else:
                nodes.drain(ctx, node, out)
            for cmd in out.commands:
                self.assertIn(cmd.node_id, f.inventory)
                holder = ctx.state.shards.get(cmd.shard_id)
                reserved = ctx.state.reserved.get(cmd.shard_id)
                self.assertTrue(
                    (holder is not None and holder.node_id == cmd.node_id)
                    or (reserved is not None and reserved.node_id == cmd.node_id)
                    or (isinstance(cmd, Stop) and cmd.shard_id == said),
                    f"{cmd} names a shard not held or reserved on its node, after {seq}",
                )
            for rep in ctx.state.replicas.values():
                self.assertEqual(sorted(rep.shards), sorted({sh.rank for sh in rep.shards.values()}))
                for rank_, sh in rep.shards.items():
                    self.assertEqual(sh.rank, rank_)
