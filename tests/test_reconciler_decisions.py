"""
The reconciler's decisions called without its shell (DESIGN §6.7): each
takes the context, an input and the time, and returns what to send and log
in an outcome, sending nothing itself; and the shell's growth hook, through
which the control plane freezes its collector's heap.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control import deadlines, lifecycle, nodes, placing, reports
from llmgw.control.commands import Drain, Start, Stop
from llmgw.control.interfaces import AdminError, ShardReport, UnknownDeployment, UnknownNode
from llmgw.control.outcome import Outcome
from llmgw.control.reconciler import GROWTH_STEP
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
