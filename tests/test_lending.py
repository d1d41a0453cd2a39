"""
Lending a sleeping replica's GPUs to another model (DESIGN §22): the pure
choice (free GPUs first, priorities, the memory a sleeper keeps), the
reconciler placing a model on a sleeper's GPU, the lender displaced (out
of the routes, so no gateway wakes it), taken back for the lender's
requests and restored, and the agent accepting a shard on a sleeping
shard's GPU.
"""

from __future__ import annotations

import inspect
import tomllib

from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent import launch
from llmgw.agent.shard import READY, Shard
from llmgw.agent.sleep import SLEEP_INTERVAL, Sleeper, SleepState
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.core import lending, lifecycle
from llmgw.control.core.catalog import parse_catalog
from llmgw.control.state.interfaces import ShardCommand
from llmgw.control.state.lendable import Lender, LentGPU, choose
from llmgw.control.state.placement import NodeCapacity, Request
from llmgw.ctl.render import render_replicas
from llmgw.gateway.follower_service import FollowerService
from llmgw.gateway.waking import Waker
from llmgw.routing import Demand
from tests.reconciler_harness import ONE_GPU, Fleet
from tests.supervisor_harness import SupervisorCase, spec


def lent(index: int, free_mb: int = 70_000, priority: int = 0, since: float = 0.0,
         holders: tuple[str, ...] = ("s",)) -> LentGPU:
    return LentGPU(index, free_mb, priority, since, holders)


class ChooseTests(SynchronousTestCase):
    def test_free_first(self) -> None:
        """
        A node's free GPUs go first and only what is missing is lent; a
        node that fits without lending is left to placement.
        """
        node = NodeCapacity("n1", free=[(80_000, 1)])
        [b] = choose([Lender(node, (lent(0),))], Request("m", gpus_per_shard=2, gpu_memory_mb=1000), 0)  # type: ignore[misc]
        self.assertEqual((b.node_id, b.gpus, [g.index for g in b.lent]), ("n1", (0, 1), [0]))
        self.assertIsNone(choose([Lender(node, (lent(0),))], Request("m", gpu_memory_mb=1000), 0))

    def test_priority_memory_and_order(self) -> None:
        """
        A lent GPU goes only to a borrower no more important than its
        holders and only where its memory left covers the profile; the
        least important lender first, then the longest asleep, then the
        node that lends the fewest.
        """
        node = NodeCapacity("n1")
        req = Request("m", gpu_memory_mb=1000)
        self.assertIsNone(choose([Lender(node, (lent(0, priority=1),))], req, 2))
        self.assertIsNone(choose([Lender(node, (lent(0, free_mb=500),))], req, 0))
        [b] = choose([Lender(node, (lent(0, priority=3), lent(1, priority=1, since=9), lent(2, priority=1, since=2)))],  # type: ignore[misc]
                     req, 0)
        self.assertEqual(b.gpus, (2,))
        two = NodeCapacity("a")
        [b] = choose([Lender(two, (lent(0),)), Lender(NodeCapacity("b", free=[(80_000, 0)]), (lent(1),))],  # type: ignore[misc]
                     Request("m", gpus_per_shard=2, gpu_memory_mb=1000), 0) or [None]
        self.assertEqual((b.node_id, b.gpus), ("b", (0, 1)))

    def test_shards_and_types(self) -> None:
        """
        A multi-shard replica borrows on distinct nodes of its fabric; a
        profile's GPU types hold for lent GPUs too.
        """
        on = {"ib0": "x"}
        got = choose([Lender(NodeCapacity("a", fabrics=on), (lent(0),)), Lender(NodeCapacity("b"), (lent(0),)),
                      Lender(NodeCapacity("c", fabrics=on), (lent(1),))],
                     Request("m", shards=2, gpu_memory_mb=1000, fabric="ib0"), 0)
        self.assertEqual([(b.node_id, b.gpus) for b in got or ()], [("a", (0,)), ("c", (1,))])
        typed = NodeCapacity("a", names={0: "L4", 1: "H100"})
        [b] = choose([Lender(typed, (lent(0), lent(1)))], Request("m", gpu_memory_mb=1000, gpu_types=("H100",)), 0)  # type: ignore[misc]
        self.assertEqual(b.gpus, (1,))

    def test_preferred_types(self) -> None:
        """
        A profile's C{prefer_gpu_types} are weighed: on a node, a lent GPU
        of a preferred type before a less important lender's of another;
        among nodes, the one whose GPUs taken are of a more preferred
        type, before the least important lenders.
        """
        req = Request("m", gpu_memory_mb=1000, prefer_gpu_types=("H100", "A100"))
        typed = NodeCapacity("a", names={0: "NVIDIA L4", 1: "NVIDIA H100 80GB HBM3"})
        [b] = choose([Lender(typed, (lent(0, priority=1), lent(1, priority=5)))], req, 0)  # type: ignore[misc]
        self.assertEqual(b.gpus, (1,))
        l4, a100 = NodeCapacity("a", names={0: "NVIDIA L4"}), NodeCapacity("b", names={0: "NVIDIA A100-SXM4-80GB"})
        [b] = choose([Lender(l4, (lent(0, priority=1),)), Lender(a100, (lent(0, priority=5),))], req, 0)  # type: ignore[misc]
        self.assertEqual(b.node_id, "b")
        # Without a preference the least important lender's node wins.
        [b] = choose([Lender(l4, (lent(0, priority=1),)), Lender(a100, (lent(0, priority=5),))],  # type: ignore[misc]
                     Request("m", gpu_memory_mb=1000), 0)
        self.assertEqual(b.node_id, "a")

    def test_spread(self) -> None:
        """
        As placement spreads a deployment's replicas, a borrower goes to
        the node with the fewest of its shards before the one that lends
        fewer GPUs or has less important lenders.
        """
        a, b = NodeCapacity("a"), NodeCapacity("b")
        lenders = [Lender(a, (lent(0, priority=1),)), Lender(b, (lent(0, priority=5),))]
        req = Request("m", gpu_memory_mb=1000)
        self.assertEqual([x.node_id for x in choose(lenders, req, 0) or ()], ["a"])
        self.assertEqual([x.node_id for x in choose(lenders, req, 0, {"a": 1}) or ()], ["b"])

    def test_residual(self) -> None:
        """
        A sleeping holder is counted to keep a tenth of its GPU, at least
        1 GiB.
        """
        self.assertEqual(lending.residual_mb(80_000), 8000)
        self.assertEqual(lending.residual_mb(4096), 1024)


CATALOG = ONE_GPU + """
[profiles.big]
gpus_per_shard = 1
gpu_memory_mb = 75000
command = ["x"]
"""


def fleet_catalog(b_priority: int = 0, resident: float = 60, b_profile: str = "one", more: tuple[str, ...] = ()) -> str:
    text = CATALOG
    for model, priority, profile in (("a", 0, "one"), ("b", b_priority, b_profile), *((m, 0, "one") for m in more)):
        text += (f'\n[[deployments]]\nmodel = "{model}"\nprofile = "{profile}"\nmin_replicas = 0\n'
                 f'max_replicas = 1\nscale_to_zero_after_s = 3600\nevictable = true\npriority = {priority}\n'
                 f'min_resident_s = {resident}\n')
    return text


class LendingReconcilerTests(SynchronousTestCase):
    def setup(self, gpus: int = 1, **kw: object) -> Fleet:
        """One node; a's replica placed, ready and asleep."""
        f = Fleet({}, nodes=1, gpus=gpus, grace=0, cat=parse_catalog(tomllib.loads(fleet_catalog(**kw))))  # type: ignore[arg-type]
        self.a = f.bring_up("a")
        self.sleep(f, self.a, True)
        return f

    def sleep(self, f: Fleet, rid: str, sleeping: bool) -> None:
        shard = f.rec.replica_recs[rid].shards[0]
        f.rec.record_engine_signals(shard.node_id, [pb.ShardSignals(
            shard_id=shard.id, running=0.0, age_s=0.0, sleeping=sleeping, wake_path="/wake_up")])
        f.clock.advance(0)

    def lend(self, f: Fleet) -> ShardCommand:
        """
        Ask for b: it is lent a's GPU, and its start goes out only once the
        lend's grace is over.
        """
        f.rec.report_demand("gw", {"b": Demand(0, 2)})
        f.step()
        self.assertEqual([c for c in f.dispatcher.starts if c.model == "b"], [])
        f.step(seconds=lending.LEND_GRACE_S)
        [start] = [c for c in f.dispatcher.starts if c.model == "b"]
        return start

    def events(self, f: Fleet, *kinds: str) -> list[tuple[str, str]]:
        return [(e.kind, e.replica or "") for e in f.rec.event_log.since() if e.kind in kinds]

    def test_lend_and_restore(self) -> None:
        """
        A model with no free GPU is placed on the sleeping replica's GPU
        (its process kept); the sleeper is displaced: out of the routes
        and of the published table, shown in the replicas view. Requests
        for it take the borrower back once its min_resident_s is over, and
        when the borrower has stopped the sleeper is routed again.
        """
        f = self.setup()
        start = self.lend(f)
        a_gpus = f.rec.replica_recs[self.a].shards[0].gpus
        self.assertEqual(tuple(start.gpu_indices), a_gpus)
        b = start.replica_id
        self.assertEqual(self.events(f, "gpu_lent", "replica_displaced"),
                         [("gpu_lent", b), ("replica_displaced", self.a)])
        self.assertEqual(f.rec.routes("a"), [])
        self.assertEqual(list(f.rec.routing_table.routes("a")), [])
        self.assertNotIn("a", f.rec.routing_table.models())
        view = {r["id"]: r for r in f.rec.replicas()}
        self.assertEqual(view[self.a]["displaced_by"], [b])
        self.assertIn(f"ready (asleep) (displaced by {b})", render_replicas(f.rec.replicas()))
        # a's requests may wait for b's stay (60), drain (10) and a's wake
        # (bounded by its startup timeout, 60).
        self.assertEqual(f.rec.ctx.room, {"a": 130.0})
        self.assertIn(self.a, f.rec.replica_recs)
        f.make_ready([start])
        f.step()
        # Within b's min_resident_s, a's requests do not take it.
        f.rec.report_demand("gw", {"a": Demand(0, 1)})
        f.step()
        self.assertEqual(self.events(f, "swap"), [])
        f.step(passes=60)
        f.rec.report_demand("gw", {"a": Demand(0, 1)})
        f.step()
        self.assertEqual(self.events(f, "swap"), [("swap", b)])
        self.assertEqual(f.rec.replica_recs[b].phase.value, "draining")
        self.assertIn("a", f.rec.ctx.room)
        self.assertEqual(f.rec.routes("a"), [])
        f.step(passes=12)
        f.confirm_stops()
        f.step()
        self.assertEqual(self.events(f, "replica_restored"), [("replica_restored", self.a)])
        [route] = f.rec.routing_table.routes("a")
        self.assertEqual(route.replica_id, self.a)
        self.assertTrue(route.signals is not None and route.signals.sleeping)
        self.assertEqual(f.rec.ctx.desired["b"], 0)
        # The GPU stayed given to a all along: nothing else was placed on it.
        self.assertEqual(f.rec.state.gpus_given[start.node_id], set(a_gpus))

    def test_free_gpu_preferred(self) -> None:
        """
        With a GPU free, nothing is lent.
        """
        f = self.setup(gpus=2)
        f.rec.report_demand("gw", {"b": Demand(0, 2)})
        f.step()
        [start] = [c for c in f.dispatcher.starts if c.model == "b"]
        self.assertNotEqual(tuple(start.gpu_indices), f.rec.replica_recs[self.a].shards[0].gpus)
        self.assertEqual(self.events(f, "gpu_lent", "replica_displaced"), [])

    def test_lending_before_taking(self) -> None:
        """
        With every GPU held, a sleeper's GPU is lent rather than an idle
        awake replica taken: no drain, no swap.
        """
        f = self.setup(gpus=2, resident=0, more=("c",))
        f.rec.report_demand("gw", {"c": Demand(1, 0)})
        f.step()
        f.make_ready()
        f.step(passes=100)
        start = self.lend(f)
        self.assertEqual(tuple(start.gpu_indices), f.rec.replica_recs[self.a].shards[0].gpus)
        self.assertEqual(self.events(f, "swap"), [])
        self.assertEqual(len(f.ready_replicas("c")), 1)

    def test_no_lending_when_awake_or_more_important_or_too_big(self) -> None:
        """
        An awake replica lends nothing; a more important model is not
        lent a less important one's GPU (it takes it, by the swap rules);
        a profile that needs more than the sleeper leaves is not lent it.
        """
        f = self.setup()
        self.sleep(f, self.a, False)
        f.rec.report_demand("gw", {"b": Demand(0, 2)})
        f.step()
        self.assertEqual(self.events(f, "gpu_lent"), [])
        f = self.setup(b_priority=5, resident=0)
        f.rec.report_demand("gw", {"b": Demand(0, 2)})
        f.step()
        self.assertEqual(self.events(f, "gpu_lent"), [])
        self.assertEqual(self.events(f, "swap"), [("swap", self.a)])
        f = self.setup(b_profile="big")
        f.rec.report_demand("gw", {"b": Demand(0, 2)})
        f.step()
        self.assertEqual(self.events(f, "gpu_lent"), [])

    def test_displaced_not_taken_by_swap(self) -> None:
        """
        Taking a displaced replica would free no GPU: a swap passes it by.
        """
        f = self.setup(resident=0)
        start = self.lend(f)
        f.make_ready([start])
        f.step(passes=3)
        self.assertEqual(self.events(f, "swap"), [])
        self.assertIn(self.a, f.rec.replica_recs)

    def test_borrower_not_taken_for_a_third_model(self) -> None:
        """
        A borrower's GPU stays the sleeping lender's: a third model's swap
        does not take the borrower, which would free nothing for it.
        """
        f = self.setup(resident=0, more=("c",))
        start = self.lend(f)
        f.make_ready([start])
        f.step(passes=3)
        f.rec.report_demand("gw", {"c": Demand(0, 2)})
        f.step(passes=3)
        self.assertEqual(self.events(f, "swap"), [])
        self.assertEqual(len(f.ready_replicas("b")), 1)

    def test_found_after_restart(self) -> None:
        """
        A sleeping replica that shares a GPU with another one it is not
        known to have lent it to (both adopted after a restart, as new as
        each other) is displaced as soon as its heartbeat says it sleeps,
        the one awake taken as the borrower, before any pass; a displaced
        replica heard awake is a warning.
        """
        f = self.setup()
        b = self.lend(f).replica_id
        rep = f.rec.replica_recs[self.a]
        f.rec.state.set_displaced(rep, ())
        # Adopted: the lender looks no older than its borrower.
        rep.created_at = f.rec.replica_recs[b].created_at + 1
        self.sleep(f, self.a, True)
        self.assertEqual(rep.displaced_by, (b,))
        self.assertEqual(f.rec.routes("a"), [])
        self.assertEqual([k for k, _ in self.events(f, "replica_displaced")], ["replica_displaced"] * 2)
        self.sleep(f, self.a, False)
        self.assertEqual(self.events(f, "displaced_awake"), [("displaced_awake", self.a)])
        self.assertEqual(f.rec.routes("a"), [])

    def b_starts(self, f: Fleet) -> list[ShardCommand]:
        return [c for c in f.dispatcher.starts if c.model == "b"]

    def test_start_waits_the_grace(self) -> None:
        """
        A borrower is placed, its GPUs reserved and its lender displaced
        (out of the published table) at once, but its start goes out only
        once the lend's grace is over (less a pass's slack): not a pass
        before. A lender heard awake after that is a warning,
        displaced_awake.
        """
        f = self.setup()
        f.rec.report_demand("gw", {"b": Demand(0, 2)})
        f.step()
        [b] = [r for r in f.rec.replica_recs if r.startswith("b")]
        self.assertEqual(self.events(f, "gpu_lent", "replica_displaced"),
                         [("gpu_lent", b), ("replica_displaced", self.a)])
        self.assertNotIn("a", f.rec.routing_table.models())
        self.assertEqual(f.rec.replica_recs[b].shards[0].gpus, f.rec.replica_recs[self.a].shards[0].gpus)
        f.step(seconds=lending.LEND_GRACE_S / 2, passes=1)
        # The views say what it waits for, not only "pending".
        view = {r["id"]: r for r in f.rec.replicas()}
        self.assertEqual((view[b]["borrowing_from"], view[b]["starts_in"]), ([self.a], lending.LEND_GRACE_S / 2))
        self.assertEqual((view[self.a]["borrowing_from"], view[self.a]["starts_in"]), ([], None))
        self.assertIn(f"(borrowing from {self.a}) (starts in {lending.LEND_GRACE_S / 2:g}s)",
                      render_replicas(f.rec.replicas()))
        f.step(seconds=lending.LEND_GRACE_S / 2 - lending.PASS_SLACK_S - 0.01, passes=1)
        self.assertEqual(self.b_starts(f), [])
        f.step(seconds=0.01)
        [start] = self.b_starts(f)
        self.assertEqual(start.replica_id, b)
        view = {r["id"]: r for r in f.rec.replicas()}
        self.assertEqual((view[b]["borrowing_from"], view[b]["starts_in"]), ([self.a], None))
        self.assertEqual(f.rec.replica_recs[self.a].displaced_by, (b,))
        # Once the borrower was sent its start, the lender heard awake is a
        # warning; the lend stands.
        self.sleep(f, self.a, False)
        self.assertEqual(self.events(f, "lend_cancelled", "displaced_awake"), [("displaced_awake", self.a)])
        self.assertIn(b, f.rec.replica_recs)

    def test_woken_during_the_grace(self) -> None:
        """
        A lender heard awake before its borrower's start went out cancels
        the lend at once: the borrower is forgotten (no start, ever, on
        that GPU; its GPU and port free again), the lender routed again,
        events lend_cancelled and replica_restored and no displaced_awake.
        """
        f = self.setup()
        f.rec.report_demand("gw", {"b": Demand(0, 2)})
        f.step()
        [b] = [r for r in f.rec.replica_recs if r.startswith("b")]
        node = f.rec.replica_recs[b].shards[0].node_id
        self.sleep(f, self.a, False)
        self.assertEqual(self.events(f, "lend_cancelled", "replica_restored", "displaced_awake"),
                         [("lend_cancelled", b), ("replica_restored", self.a)])
        self.assertNotIn(b, f.rec.replica_recs)
        self.assertEqual(f.rec.replica_recs[self.a].displaced_by, ())
        self.assertEqual([r.replica_id for r in f.rec.routing_table.routes("a")], [self.a])
        self.assertEqual(f.rec.state.gpus_given[node], set(f.rec.replica_recs[self.a].shards[0].gpus))
        self.assertEqual(f.rec.state.lend_starts, {})
        f.step(passes=5)
        # a awake and within its min_resident_s: b waits, nothing lent.
        self.assertEqual(self.b_starts(f), [])
        self.assertEqual([k for k, _ in self.events(f, "gpu_lent")], ["gpu_lent"])

    def test_not_heard_asleep_at_the_grace_end(self) -> None:
        """
        A lender whose sleep is no longer known when the grace ends (its
        signals changed without a heartbeat's event) cancels the lend
        rather than starting a borrower beside it.
        """
        f = self.setup()
        f.rec.report_demand("gw", {"b": Demand(0, 2)})
        f.step()
        shard = f.rec.replica_recs[self.a].shards[0]
        f.rec.state.set_signals(shard, None)
        f.step(seconds=lending.LEND_GRACE_S)
        self.assertEqual(self.b_starts(f), [])
        self.assertEqual([k for k, _ in self.events(f, "lend_cancelled")], ["lend_cancelled"])

    def test_register_during_the_grace(self) -> None:
        """
        The borrower's node registering during the grace (its shard not
        listed: never sent) does not send its start early.
        """
        f = self.setup()
        f.rec.report_demand("gw", {"b": Demand(0, 2)})
        f.step()
        node = f.rec.replica_recs[self.a].shards[0].node_id
        f.register(node, [r for r in f.running(node) if r.model == "a"])
        self.assertEqual(self.b_starts(f), [])
        f.step(seconds=lending.LEND_GRACE_S)
        self.assertEqual(len(self.b_starts(f)), 1)

    def test_lender_stopped_during_the_grace(self) -> None:
        """
        A lender torn down during the grace still holds its GPU until its
        stop is confirmed: the borrower's start waits for that, then goes
        out (no cancel: the GPU is the borrower's now).
        """
        f = self.setup()
        f.rec.report_demand("gw", {"b": Demand(0, 2)})
        f.step()
        f.rec._decide(lifecycle.teardown, f.rec.replica_recs[self.a], "scaled to zero", f.clock.seconds())
        f.step(seconds=lending.LEND_GRACE_S, passes=2)
        self.assertEqual(self.b_starts(f), [])
        f.confirm_stops()
        f.step()
        self.assertEqual(len(self.b_starts(f)), 1)
        self.assertEqual(self.events(f, "lend_cancelled"), [])

    def test_restored_lender_not_lent_again_before_its_wake(self) -> None:
        """
        A lender whose borrower was taken for its own waiting requests is
        routed again once the borrower is gone and is not lent again, to a
        third model waiting too, nor swapped out for it, before a gateway
        can wake it; once heard awake (and asleep again) it lends again.
        """
        f = self.setup(resident=0, more=("c",))
        start = self.lend(f)
        f.make_ready([start])
        f.step()
        f.rec.report_demand("gw", {"a": Demand(0, 1), "c": Demand(0, 1)})
        f.step()
        self.assertEqual(self.events(f, "swap"), [("swap", start.replica_id)])
        f.step(passes=12)
        f.confirm_stops()
        f.rec.report_demand("gw", {"a": Demand(0, 1), "c": Demand(0, 1)})
        f.step()
        self.assertEqual(self.events(f, "replica_restored"), [("replica_restored", self.a)])
        self.assertEqual([k for k, _ in self.events(f, "gpu_lent")], ["gpu_lent"])
        self.assertEqual([r.replica_id for r in f.rec.routing_table.routes("a")], [self.a])
        # Nor swapped out for c while its requests wait to wake it.
        self.assertEqual(self.events(f, "swap"), [("swap", start.replica_id)])
        self.sleep(f, self.a, False)
        f.rec.report_demand("gw", {"a": Demand(1, 0), "c": Demand(0, 0)})
        f.step()
        self.assertEqual(f.rec.state.called_back, {})
        self.sleep(f, self.a, True)
        got = lending.lenders(f.rec.ctx, set(f.ids), 0, now=f.clock.seconds())
        self.assertEqual([g.holders for ln in got for g in ln.lent], [(self.a,)])

    def test_grace_covers_the_routes_reaching_gateways(self) -> None:
        """
        The grace outlasts a gateway's next read after a failed one (its
        follower's retry with the most jitter, then the gap between
        reads) and the agent's look at a sleeping engine.
        """
        params = inspect.signature(FollowerService).parameters
        retry, jitter, gap = (params[n].default for n in ("retry", "jitter", "min_gap"))
        self.assertGreaterEqual(lending.LEND_GRACE_S - lending.PASS_SLACK_S, retry * (1 + jitter) + gap)
        self.assertGreaterEqual(lending.LEND_GRACE_S, SLEEP_INTERVAL)

    def test_every_shard_lends(self) -> None:
        """
        A sleeping multi-shard replica lends the GPUs of all its shards,
        not only its leader's.
        """
        text = ONE_GPU + ('\n[[deployments]]\nmodel = "wide"\nprofile = "two-node"\nreplicas = 1\n')
        f = Fleet({}, nodes=2, gpus=4, grace=0, cat=parse_catalog(tomllib.loads(text)))
        f.step()
        f.make_ready()
        f.step()
        [rid] = f.ready_replicas("wide")
        self.sleep(f, rid, True)
        got = lending.lenders(f.rec.ctx, set(f.ids), 0)
        self.assertEqual([(ln.node.id, [g.index for g in ln.lent]) for ln in got],
                         [(n, [0, 1, 2, 3]) for n in sorted(f.ids)])
        # With the leader's node not eligible, only it could say the engine
        # sleeps: its followers lend nothing either.
        leader = f.rec.replica_recs[rid].shards[0].node_id
        self.assertEqual(lending.lenders(f.rec.ctx, set(f.ids) - {leader}, 0), [])


class GatewayTests(SynchronousTestCase):
    def test_displaced_not_woken(self) -> None:
        """
        A gateway routing from the published table never wakes a displaced
        replica (it has no route); once restored, it wakes it.
        """
        t = LendingReconcilerTests()
        f = t.setup(resident=0)
        t.lend(f)
        f.make_ready()
        f.step()
        posts: list[str] = []

        def post(url: str, body: bytes) -> defer.Deferred[None]:
            posts.append(url)
            return defer.Deferred()

        waker = Waker(Clock(), post)
        self.assertFalse(waker.needed("a", f.rec.routing_table.routes("a")))
        self.assertEqual(posts, [])
        f.rec.report_demand("gw", {"a": Demand(0, 1)})
        f.step(passes=12)
        f.confirm_stops()
        f.step()
        self.assertTrue(waker.needed("a", f.rec.routing_table.routes("a")))
        self.assertEqual(len(posts), 1)
        self.assertTrue(posts[0].endswith("/wake_up"))


class AgentTests(SupervisorCase):
    def test_start_on_a_sleeping_shards_gpu(self) -> None:
        """
        The agent starts a shard on a GPU a sleeping leader holds (both
        are then held), and refuses one on a GPU held by a shard awake,
        one not yet known to sleep, or one whose engine never sleeps; a
        shard of another rank of an engine that sleeps shares (its sleep
        is seen on its leader's node, which the control plane follows).
        """
        sup = self.sup
        sleeper = Sleeper(Clock(), sup, None, lambda *a: defer.Deferred())  # type: ignore[arg-type]
        sup.lends = sleeper.lends
        held = Shard(spec("old", engine="vllm", sleep_level=1, sleep_after_s=10), READY)
        new = spec("new", port=8002)

        def refused(shard: Shard) -> str | None:
            return launch.refusal(new, None, [shard], lambda port: False, sleeper.lends)

        self.assertEqual(refused(held), "GPU 0 is in use by shard old")
        sleeper.states["old"] = SleepState(busy_at=0.0, sleeping=False)
        self.assertEqual(refused(held), "GPU 0 is in use by shard old")
        sleeper.states["old"] = SleepState(busy_at=0.0, sleeping=True)
        self.assertIsNone(refused(held))
        self.assertIsNone(refused(Shard(spec("w1", rank=1, engine="vllm", sleep_level=1), READY)))
        self.assertEqual(refused(Shard(spec("plain"), READY)), "GPU 0 is in use by shard plain")
        # Through the supervisor: refused while awake; once asleep, both
        # shards are held (and so reported).
        sleeper.states.clear()
        first = sup.start(spec("old", engine="vllm", sleep_level=1, sleep_after_s=10))
        self.assertEqual(sup.start(new).state, "failed")
        sup.shards.pop("new", None)
        sleeper.states["old"] = SleepState(busy_at=0.0, sleeping=True)
        self.assertNotEqual(sup.start(new).state, "failed")
        self.assertEqual({s.shard_id for s in sup.held_shards()}, {first.shard_id, "new"})
