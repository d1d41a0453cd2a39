"""
Autoscaling through the real reconciler: the decision of
L{llmgw.control.core.autoscale} fed by its passes and applied by its ordinary
scale path, against simulated nodes and a fake dispatcher.
"""

from __future__ import annotations

import json
import tomllib

from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer

from llmgw.control.core.catalog import parse_catalog
from llmgw.control.core.kept import KeptState
from llmgw.control.state.interfaces import AdminError
from llmgw.routing import Demand, IDemand, IInFlight
from tests.reconciler_harness import ONE_GPU, Fleet


def autoscaled(extra: str, path: str | None = None, fixed: bool = False) -> object:
    text = ONE_GPU + f'\n[[deployments]]\nmodel = "auto"\nprofile = "one"\n{extra}\n'
    if fixed:
        text += '\n[[deployments]]\nmodel = "fixed"\nprofile = "one"\nreplicas = 1\n'
    return parse_catalog(tomllib.loads(text), path=path)


@implementer(IInFlight)
class InFlight:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def in_flight(self, replica_id: str) -> int:
        return self.counts.get(replica_id, 0)


class AutoscaleReconcilerTests(SynchronousTestCase):
    def fleet(self, extra: str, nodes: int = 4, gpus: int = 8, **kw: object) -> Fleet:
        self.inflight = InFlight()
        f = Fleet({}, nodes=nodes, gpus=gpus, grace=0, cat=autoscaled(extra), in_flight=self.inflight,
                  **kw)  # type: ignore[arg-type]
        f.step()
        return f

    def active(self, f: Fleet) -> int:
        return len(f.rec.state.active.get("auto", ()))

    def kinds(self, f: Fleet) -> list[str]:
        return [e.kind for e in f.rec.event_log if e.kind.startswith(("autoscale", "unplaceable"))]

    def test_from_zero_and_back_to_zero(self) -> None:
        """
        A deployment with C{min_replicas = 0} has no replica; a gateway's
        report of a held request places one in the next pass; once the
        demand is gone for C{scale_to_zero_after_s} the replica is drained
        and stopped, and the deployment is at zero again.
        """
        f = self.fleet("min_replicas = 0\nmax_replicas = 4\ntarget_in_flight = 2\nscale_to_zero_after_s = 60")
        f.step(passes=10)
        self.assertEqual(f.dispatcher.starts, [])
        f.rec.report_demand("gw-1", {"auto": Demand(in_flight=0, waiting=1)})
        f.step()
        self.assertEqual(len(f.dispatcher.starts), 1)
        f.make_ready()
        self.assertEqual(len(f.ready_replicas("auto")), 1)
        rid = f.ready_replicas("auto")[0]
        # The held request is now served: in flight through this gateway.
        for _ in range(30):
            f.rec.report_demand("gw-1", {"auto": Demand(in_flight=1, waiting=0)})
            f.step()
        self.assertEqual(self.active(f), 1)
        # Its answer is sent: the gateway reports nothing in flight.
        f.rec.report_demand("gw-1", {})
        f.step(passes=59)
        self.assertEqual(self.active(f), 1)
        f.step(passes=2)
        self.assertEqual(self.active(f), 0)
        self.assertIn(rid, [e.replica for e in f.rec.event_log if e.kind == "replica_draining"])
        f.step()
        f.confirm_stops()
        self.assertEqual(f.rec.replica_ids("auto"), [])
        self.assertEqual(self.kinds(f), ["autoscale_up", "autoscale_to_zero"])
        reasons = [e.reason for e in f.rec.event_log if e.kind.startswith("autoscale")]
        self.assertIn("deployment auto: from 0 to 1", reasons[0])
        self.assertIn("nothing in flight or queued", reasons[1])

    def test_up_on_in_flight_down_after_the_window_by_draining(self) -> None:
        """
        The embedded gateway's in-flight counts over the target place more
        replicas at once; when they fall, nothing is drained before the
        stabilization window, then the surplus is drained.
        """
        f = self.fleet("min_replicas = 1\nmax_replicas = 4\ntarget_in_flight = 2\nstabilization_s = 120")
        f.make_ready()
        first = f.ready_replicas("auto")[0]
        self.inflight.counts[first] = 7
        f.step()
        self.assertEqual(self.active(f), 4)
        f.make_ready()
        self.inflight.counts[first] = 1
        f.step(passes=110)
        self.assertEqual(self.active(f), 4)
        self.assertEqual(f.rec.state.draining, set())
        f.step(passes=15)
        self.assertEqual(self.active(f), 1)
        self.assertEqual(len(f.rec.state.draining) + len(f.dispatcher.stops), 3)
        self.assertEqual(f.rec.desired["auto"], 1)
        self.assertEqual(self.kinds(f), ["autoscale_up", "autoscale_down"])

    def test_capacity_bound(self) -> None:
        """
        With room for two replicas only, a load asking for six places two,
        and the want of room is one event from the autoscaler (and one from
        placement), not one a pass.
        """
        f = self.fleet("min_replicas = 1\nmax_replicas = 8\ntarget_in_flight = 1", nodes=1, gpus=2)
        f.rec.report_demand("gw-1", {"auto": Demand(in_flight=6, waiting=0)})
        f.step()
        for _ in range(20):
            f.rec.report_demand("gw-1", {"auto": Demand(in_flight=20, waiting=0)})
            f.step()
        self.assertEqual(self.active(f), 2)
        self.assertEqual(f.rec.desired["auto"], 6)
        self.assertEqual(self.kinds(f), ["autoscale_up", "unplaceable", "autoscale_capacity"])

    def test_reports_expire_and_sum(self) -> None:
        """
        Reports from several gateways add up; a gateway that stops reporting
        counts for nothing after a few seconds.
        """
        f = self.fleet("min_replicas = 0\nmax_replicas = 8\ntarget_in_flight = 1\nscale_to_zero_after_s = 600")
        f.rec.report_demand("gw-1", {"auto": Demand(2, 1)})
        f.rec.report_demand("gw-2", {"auto": Demand(1, 0)})
        self.assertEqual(f.rec.demand(), {"auto": Demand(3, 1)})
        f.step(passes=6)
        self.assertEqual(f.rec.demand(), {})
        self.assertEqual(f.rec.desired["auto"], 4)

    def test_demand_source_replaces_in_flight(self) -> None:
        """
        An embedded gateway that offers L{IDemand} is read for its demand,
        in-flight and queued, instead of its in-flight counts.
        """
        @implementer(IDemand)
        class Source:
            def demand(self) -> dict[str, Demand]:
                return {"auto": Demand(0, 3)}

        f = self.fleet("min_replicas = 0\nmax_replicas = 8\ntarget_in_flight = 1\nscale_to_zero_after_s = 60")
        f.rec.set_demand_source(Source())
        f.rec.report_demand("gw-1", {"auto": Demand(1, 0)})
        self.assertEqual(f.rec.demand(), {"auto": Demand(1, 3)})
        f.step()
        self.assertEqual(self.active(f), 4)

    def test_reports_keep_only_autoscaled_models(self) -> None:
        """
        A report's figures for models that do not autoscale (or do not
        exist) are not kept.
        """
        f = self.fleet("min_replicas = 0\nmax_replicas = 2\ntarget_in_flight = 1")
        f.rec.report_demand("gw-1", {"auto": Demand(1, 0), "made-up": Demand(5, 5)})
        self.assertEqual(f.rec.demand(), {"auto": Demand(1, 0)})

    def test_failing_demand_source_holds_counts(self) -> None:
        """
        A demand source that raises changes no count and stops nothing
        else in the pass: it is logged, and the next pass that can read
        demand scales as usual.
        """
        @implementer(IDemand)
        class Source:
            broken = True

            def demand(self) -> dict[str, Demand]:
                if self.broken:
                    raise RuntimeError("gateway gone wrong")
                return {"auto": Demand(0, 2)}

        f = self.fleet("min_replicas = 1\nmax_replicas = 8\ntarget_in_flight = 1")
        source = Source()
        f.rec.set_demand_source(source)
        f.step()
        self.assertEqual(self.active(f), 1)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        source.broken = False
        f.step()
        self.assertEqual(self.active(f), 2)

    def test_engine_waiting_scales_up(self) -> None:
        """
        With C{target_waiting}, the engines' waiting figures in heartbeats
        ask for more replicas; stale figures are left out.
        """
        from llmgw.routing import EngineSignals

        f = self.fleet("min_replicas = 1\nmax_replicas = 4\ntarget_waiting = 2")
        f.make_ready()
        rid = f.ready_replicas("auto")[0]
        shard = f.rec.state.replicas[rid].shards[0]
        f.rec.shard_signals(shard.node_id, shard.id, EngineSignals(f.clock.seconds() - 60, waiting=6))
        f.step()
        self.assertEqual(self.active(f), 1)
        f.rec.shard_signals(shard.node_id, shard.id, EngineSignals(f.clock.seconds(), waiting=6))
        f.step()
        self.assertEqual(self.active(f), 3)

    def test_adopted_replicas_are_kept_after_a_restart(self) -> None:
        """
        A control plane that restarts finds three replicas of a deployment
        that autoscales from one: it keeps them through its grace and the
        stabilization window that follows, not scaling down at once.
        """
        f = self.fleet("min_replicas = 1\nmax_replicas = 4\ntarget_in_flight = 2\nstabilization_s = 100")
        first = f.ready_replicas("auto") or [r for r in f.rec.replica_ids("auto")]
        self.inflight.counts[first[0]] = 6
        f.step()
        f.make_ready()
        running = {n: f.running(n) for n in f.ids}
        again = Fleet({}, nodes=4, grace=30, cat=autoscaled(
            "min_replicas = 1\nmax_replicas = 4\ntarget_in_flight = 2\nstabilization_s = 100"),
            register=False, in_flight=InFlight())
        for node_id, shards in running.items():
            again.register(node_id, shards)
        again.step(passes=60)
        self.assertEqual(len(again.rec.state.active["auto"]), 3)
        self.assertEqual(again.dispatcher.stops, [])
        again.step(passes=100)
        self.assertEqual(len(again.rec.state.active["auto"]), 1)


    def test_catalog_reload_keeps_the_count(self) -> None:
        """
        A catalog reload (here with a longer window) keeps what the
        autoscaler holds: nothing is drained, no event is made of it.
        """
        f = self.fleet("min_replicas = 1\nmax_replicas = 4\ntarget_in_flight = 2\nstabilization_s = 100")
        f.rec.report_demand("gw-1", {"auto": Demand(6, 0)})
        f.step()
        f.make_ready()
        self.assertEqual(self.active(f), 3)
        f.rec.apply_catalog(autoscaled(  # type: ignore[arg-type]
            "min_replicas = 1\nmax_replicas = 4\ntarget_in_flight = 2\nstabilization_s = 200"))
        f.step(passes=3)
        self.assertEqual(self.active(f), 3)
        self.assertEqual(f.rec.desired["auto"], 3)
        self.assertEqual(f.rec.state.draining, set())
        self.assertEqual(self.kinds(f), ["autoscale_up"])


class ScaleCommandTests(SynchronousTestCase):
    def test_fixed_count_refused_on_autoscaled(self) -> None:
        """
        C{ctl scale MODEL N} on an autoscaled deployment is refused with a
        message that names the bounds command.
        """
        f = Fleet({}, grace=0, cat=autoscaled("min_replicas = 1\nmax_replicas = 4\ntarget_in_flight = 2"))
        e = self.assertRaises(AdminError, f.rec.scale, "auto", 3)
        self.assertIn("--min N --max M", str(e))

    def test_bounds_refused_on_fixed(self) -> None:
        """
        Bounds on a deployment with a fixed count are refused, saying so.
        """
        f = Fleet({}, grace=0, cat=autoscaled("min_replicas = 1\nmax_replicas = 4\ntarget_in_flight = 2",
                                              fixed=True))
        e = self.assertRaises(AdminError, f.rec.scale_bounds, "fixed", 1, 2)
        self.assertIn("fixed count", str(e))
        e = self.assertRaises(AdminError, f.rec.scale_bounds, "auto", 3, 2)
        self.assertIn("at least min", str(e))

    def test_bounds_apply_and_are_kept(self) -> None:
        """
        New bounds move the count into them in the next pass and are kept
        in the state file, so a restart keeps them; an edit of the catalog's
        own bounds supersedes them.
        """
        path = self.mktemp()
        extra = "min_replicas = 1\nmax_replicas = 4\ntarget_in_flight = 2"
        cat = autoscaled(extra, path=path)
        f = Fleet({}, grace=0, cat=cat, fleet_state=KeptState.beside(path))
        f.step()
        f.rec.scale_bounds("auto", 3, 6)
        f.step()
        self.assertEqual(len(f.rec.state.active["auto"]), 3)
        kept = json.loads(open(path + ".scale.json").read())
        self.assertEqual(kept["bounds"]["auto"]["min"], 3)
        again = KeptState.beside(path)
        self.assertEqual(again.load(), [])
        policy = again.policy(cat.deployments["auto"])  # type: ignore[attr-defined]
        self.assertEqual((policy.min_replicas, policy.max_replicas), (3, 6))
        edited = autoscaled("min_replicas = 2\nmax_replicas = 4\ntarget_in_flight = 2", path=path)
        policy = again.policy(edited.deployments["auto"])  # type: ignore[attr-defined]
        self.assertEqual((policy.min_replicas, policy.max_replicas), (2, 4))
        view = next(d for d in f.rec.deployments() if d["model"] == "auto")
        self.assertEqual((view["autoscale"]["min_replicas"], view["autoscale"]["max_replicas"]), (3, 6))
        self.assertEqual(view["desired"], 3)
