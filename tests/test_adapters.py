"""
LoRA adapters in the catalog and the control plane
(L{llmgw.control.core.adapters}): what C{[[adapters]]} accepts and
refuses, what a replica of the base launches with, the rollout a changed
set of fixed adapters starts, and the adapters each replica's route
carries from launch and heartbeats.
"""

from __future__ import annotations

import dataclasses
import tomllib
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from twisted.trial.unittest import SynchronousTestCase

from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.core.adapterloads import TOUCH_S
from llmgw.control.core.adapters import VLLM_RUNTIME_ENV
from llmgw.control.core.catalog import Catalog, CatalogError, parse_catalog
from llmgw.control.core.rollout import spec_data, spec_from_data, spec_of
from llmgw.control.service import follow_catalog_policies
from llmgw.control.shell.metrics import ControlCollector
from llmgw.ctl.render import render_replicas
from llmgw.routing import Demand, Route, RoutingSnapshot, snapshot_from_json, snapshot_to_json
from llmgw.shards import ShardSpec
from tests.reconciler_harness import Fleet
from tests.reconciler_harness import catalog as reconciler_catalog
from tests.test_fetching_control import FakeAgents

SHA = "ab" * 32

BASE = """
[profiles.cpp]
engine = "llamacpp"

[profiles.v]
engine = "vllm"
max_loras = 2

[profiles.custom]
engine = "llamacpp"
command = ["llama-server", "-m", "/m/base.gguf", "--port", "{port}"]

[profiles.plain]
command = ["serve", "{port}"]

[[deployments]]
model = "tiny"
profile = "cpp"
source = "file:///m/tiny.gguf"

[[deployments]]
model = "big"
profile = "v"
source = "hf://org/big"

[[deployments]]
model = "own"
profile = "custom"

[[deployments]]
model = "other"
profile = "plain"
"""


def catalog(extra: str) -> Catalog:
    return parse_catalog(tomllib.loads(BASE + extra))


def adapter(name: str, base: str, source: str = "file:///m/a.gguf", **more: str) -> str:
    fields = "".join(f'{k} = "{v}"\n' for k, v in more.items())
    return f'\n[[adapters]]\nname = "{name}"\nbase = "{base}"\nsource = "{source}"\n{fields}'


class CatalogTests(SynchronousTestCase):
    def refused(self, extra: str) -> str:
        return str(self.assertRaises(CatalogError, catalog, extra))

    def test_adapters_parsed(self) -> None:
        """
        Each C{[[adapters]]} entry becomes an adapter with its base and its
        source (an https one with its checksum), by name.
        """
        c = catalog(adapter("sql", "tiny") + adapter("chat", "big", "https://h.example/c.gguf", sha256=SHA))
        self.assertEqual(sorted(c.adapters), ["chat", "sql"])
        self.assertEqual(c.adapters["chat"].base, "big")
        self.assertEqual(c.adapters["chat"].source.sha256, SHA)
        self.assertEqual(c.adapter_bases(), {"chat": "big", "sql": "tiny"})

    def test_errors_name_entry_and_field(self) -> None:
        """
        A malformed entry is refused with the entry and the field named.
        """
        cases = {
            adapter("a", "tiny") + 'scale = "2"\n': "adapter 'a': unknown field 'scale'",
            '\n[[adapters]]\nbase = "tiny"\nsource = "file:///x"\n': "adapters[0]: field 'name' is required",
            adapter("a", "nobody"): "adapter 'a': field 'base' names 'nobody', which is no deployment's model",
            adapter("tiny", "big", "hf://o/l"): "adapter 'tiny': field 'name' is also a deployment's model",
            adapter("a", "tiny") + adapter("a", "tiny"): "adapter 'a': field 'name' is declared twice",
            adapter("a", "other"): "runs engine 'generic', which serves no adapters",
            adapter("a b", "tiny"): "adapter 'a b': field 'name' must be",
            adapter("a", "tiny", "https://h.example/a.gguf"): "adapter 'a': field 'sha256'",
        }
        for extra, message in cases.items():
            self.assertIn(message, self.refused(extra))
        self.assertIn("must be an array of tables", str(self.assertRaises(
            CatalogError, parse_catalog, {**tomllib.loads(BASE), "adapters": {"a": 1}})))

    def test_vllm_base_needs_max_loras(self) -> None:
        """
        A vLLM base's profile must say how many adapters a replica holds.
        """
        text = BASE.replace("max_loras = 2\n", "") + adapter("a", "big", "hf://o/l")
        self.assertIn("sets no 'max_loras'", str(self.assertRaises(CatalogError, parse_catalog, tomllib.loads(text))))

    def test_vllm_launch_enables_runtime_loading(self) -> None:
        """
        A vLLM profile with C{max_loras} runs with runtime LoRA updating on
        and C{--enable-lora --max-loras N}; no adapter is in its spec.
        """
        c = catalog(adapter("a", "big", "hf://o/l"))
        spec = c.profiles["v"].launch(0, c.deployments["big"])
        self.assertEqual(spec.argv[-3:], ("--enable-lora", "--max-loras", "2"))
        self.assertEqual(dict(spec.env), dict(VLLM_RUNTIME_ENV))
        self.assertEqual(spec.adapters, ())

    def test_llamacpp_starts_with_sorted_adapters(self) -> None:
        """
        A llama.cpp replica starts with all of its base's adapters, sorted
        by name (the ids requests select them by), whether llmgw writes its
        command or the profile gives one.
        """
        c = catalog(adapter("zeta", "tiny", "file:///m/z.gguf") + adapter("alpha", "tiny")
                    + adapter("mine", "own", "file:///m/mine.gguf"))
        spec = c.profiles["cpp"].launch(0, c.deployments["tiny"])
        self.assertEqual([n for n, _ in spec.adapters], ["alpha", "zeta"])
        self.assertEqual(spec.adapters[1][1].path, "/m/z.gguf")
        own = c.profiles["custom"].launch(0, c.deployments["own"])
        self.assertEqual([n for n, _ in own.adapters], ["mine"])
        self.assertEqual(c.profiles["cpp"].launch(0, c.deployments["tiny"]).argv,
                         catalog("").profiles["cpp"].launch(0, catalog("").deployments["tiny"]).argv)

    def test_spec_carries_adapters_on_the_wire_and_disk(self) -> None:
        """
        A shard spec's adapters survive its C{StartShard} message and the
        agent's state file (asdict, then read back).
        """
        c = catalog(adapter("a", "tiny") + adapter("b", "tiny", "https://h.example/b.gguf", sha256=SHA))
        spec = dataclasses.replace(c.profiles["cpp"].launch(0, c.deployments["tiny"]), shard_id="s", replica_id="r",
                                   model="tiny", port=1)
        wire = pb.StartShard.FromString(spec.to_message().SerializeToString())
        self.assertEqual(ShardSpec.from_message(wire), spec)
        self.assertEqual(ShardSpec(**dataclasses.asdict(spec)), spec)

    def test_changed_fixed_adapters_change_the_launch_spec(self) -> None:
        """
        A llama.cpp deployment's adapters are part of what launches its
        replicas: another set is another version (rolled make-before-break),
        kept specs read back equal; a vLLM base's adapters are not.
        """
        one, two = catalog(adapter("a", "tiny")), catalog(adapter("a", "tiny") + adapter("b", "tiny"))
        old, new = spec_of(one, "tiny"), spec_of(two, "tiny")
        assert old is not None and new is not None
        self.assertFalse(old.runs_as(new, "cpp"))
        self.assertEqual(spec_from_data(spec_data(new)), new)
        self.assertEqual(spec_of(one, "big"), spec_of(catalog(adapter("v", "big", "hf://o/l")), "big"))
        self.assertNotIn("adapters", spec_data(spec_of(catalog(""), "tiny")))  # type: ignore[arg-type]


class RoutesTests(SynchronousTestCase):
    def test_routes_document_carries_adapters(self) -> None:
        """
        C{GET /api/v1/routes} carries each route's adapters and how they
        are selected, and the adapter -> base map; read back the same.
        """
        routes = [Route("r1", "tiny", "10.0.0.1:1", adapters=("a", "b"), lora_ids=True),
                  Route("r2", "big", "10.0.0.2:1", adapters=("v",))]
        snap = RoutingSnapshot(routes, ["tiny", "big"], 3, adapters={"a": "tiny", "b": "tiny", "v": "big"})
        back, problems = snapshot_from_json(snapshot_to_json(snap, 0.0), 0.0)
        self.assertEqual(problems, [])
        self.assertEqual(back.all_routes(), snap.all_routes())
        self.assertEqual(back.adapters, snap.adapters)

    def test_bad_adapter_entries_are_problems(self) -> None:
        """
        A malformed adapters entry is reported, not routed by.
        """
        doc: dict[str, Any] = {"revision": 1, "known": [], "routes": [
            {"replica": "r", "model": "m", "address": "h:1", "adapters": "a"}], "adapters": {"a": 3}}
        snap, problems = snapshot_from_json(doc, 0.0)
        self.assertEqual(len(problems), 2)
        self.assertEqual(snap.adapters, {})
        self.assertEqual(snap.all_routes()[0].adapters, ())


class ReconcilerAdapterTests(SynchronousTestCase):
    """
    The adapters a replica holds, from its launch and its heartbeats, in
    its route, its view, C{ctl replicas} and the control plane's metrics.
    """

    EXTRA = """
[profiles.cpp]
engine = "llamacpp"
command = ["llama-server", "-m", "/m/b.gguf", "--port", "{port}"]

[[deployments]]
model = "tiny"
profile = "cpp"

[[deployments]]
model = "vb"
profile = "one"

[[adapters]]
name = "sql"
base = "tiny"
source = "file:///m/sql.gguf"

[[adapters]]
name = "chat"
base = "tiny"
source = "file:///m/chat.gguf"
"""

    def fleet(self) -> Fleet:
        fleet = Fleet({}, nodes=2, cat=reconciler_catalog({}, self.EXTRA))
        follow_catalog_policies(fleet.rec)
        fleet.past_grace()
        fleet.make_ready()
        fleet.step()
        return fleet

    def test_fixed_adapters_routed_from_the_start(self) -> None:
        """
        A llama.cpp replica's route names its adapters in id order, selected
        by position, before any heartbeat; the routing table maps each
        adapter to its base; the start command carries them.
        """
        fleet = self.fleet()
        [route] = fleet.rec.routes("tiny")
        self.assertEqual((route.adapters, route.lora_ids), (("chat", "sql"), True))
        self.assertEqual(fleet.rec.routing_table.snapshot().adapters, {"chat": "tiny", "sql": "tiny"})
        [cmd] = [c for c in fleet.dispatcher.starts if c.model == "tiny"]
        self.assertEqual([n for n, _ in cmd.adapters], ["chat", "sql"])

    def test_heartbeat_sets_held_adapters(self) -> None:
        """
        A leader's heartbeat says which adapters its engine holds (a runtime
        set): route, view, C{ctl replicas} and C{/metrics} follow; an empty
        report leaves a fixed set as it started.
        """
        fleet = self.fleet()
        rec = fleet.rec
        [vb] = [c for c in fleet.dispatcher.starts if c.model == "vb"]
        [tiny] = [c for c in fleet.dispatcher.starts if c.model == "tiny"]
        rec.record_engine_signals(vb.node_id, [pb.ShardSignals(shard_id=vb.shard_id, adapters=["x", "y"])])
        if tiny.node_id != vb.node_id:
            rec.record_engine_signals(tiny.node_id, [pb.ShardSignals(shard_id=tiny.shard_id)])
        else:
            rec.record_engine_signals(vb.node_id, [pb.ShardSignals(shard_id=vb.shard_id, adapters=["x", "y"]),
                                                   pb.ShardSignals(shard_id=tiny.shard_id)])
        [route] = rec.routes("vb")
        self.assertEqual((route.adapters, route.lora_ids), (("x", "y"), False))
        self.assertEqual(rec.routes("tiny")[0].adapters, ("chat", "sql"))
        views = {v["model"]: v for v in rec.replicas()}
        self.assertEqual(views["vb"]["adapters"], ["x", "y"])
        self.assertIn("ADAPTERS", render_replicas(rec.replicas()))
        self.assertIn("x,y", render_replicas(rec.replicas()))
        registry = CollectorRegistry(auto_describe=False)
        registry.register(ControlCollector(FakeAgents([]), lambda: rec))
        text = generate_latest(registry).decode()
        self.assertIn(f'llmgw_replica_adapter{{adapter="x",model="vb",replica="{vb.replica_id}"}} 1.0', text)

    def test_new_fixed_adapter_replaces_make_before_break(self) -> None:
        """
        A llama.cpp base given another adapter has its replica replaced
        make-before-break: the new one (with both adapters) starts while
        the old serves, and the old drains once the new is ready.
        """
        fleet = self.fleet()
        [old] = fleet.ready_replicas("tiny")
        fleet.dispatcher.clear()
        extra = self.EXTRA + '\n[[adapters]]\nname = "more"\nbase = "tiny"\nsource = "file:///m/more.gguf"\n'
        fleet.rec.apply_catalog(reconciler_catalog({}, extra))
        fleet.step()
        [new] = fleet.dispatcher.starts
        self.assertEqual([n for n, _ in new.adapters], ["chat", "more", "sql"])
        self.assertEqual(fleet.dispatcher.drains, [])
        self.assertEqual(fleet.ready_replicas("tiny"), [old])
        fleet.make_ready([new])
        fleet.step()
        self.assertEqual(len(fleet.dispatcher.drains), 1)
        routes = {r.replica_id: r for r in fleet.rec.routes("tiny")}
        self.assertEqual(routes[new.replica_id].adapters, ("chat", "more", "sql"))
        self.assertTrue(routes[old].draining)

    def test_no_adapters_keeps_the_replicas_table(self) -> None:
        """
        C{ctl replicas} of a fleet without adapters has no adapters column.
        """
        self.assertNotIn("ADAPTERS", render_replicas([{"id": "r", "model": "m", "shards": []}]))


class FixedDemand:
    def __init__(self, figures: dict[str, Demand]):
        self.figures = figures

    def demand(self) -> dict[str, Demand]:
        return dict(self.figures)


class AdapterLoadingTests(SynchronousTestCase):
    """
    Adapters of an engine that loads them while it runs (vLLM) are loaded
    onto more replicas of their base when those holding one are busy.
    """

    EXTRA = """
[profiles.vl]
engine = "vllm"
max_loras = 2
gpus_per_shard = 1
command = ["vllm", "serve", "/m", "--port", "{port}"]

[[deployments]]
model = "vb"
profile = "vl"
replicas = 2

[[adapters]]
name = "x"
base = "vb"
source = "hf://org/x"
"""

    def setUp(self) -> None:
        self.fleet = Fleet({}, nodes=2, cat=reconciler_catalog({}, self.EXTRA))
        self.fleet.past_grace()
        self.fleet.make_ready()
        self.fleet.step()
        self.demand = FixedDemand({})
        self.fleet.rec.set_demand_source(self.demand)
        self.leaders = {c.replica_id: c for c in self.fleet.dispatcher.starts}

    def hold(self, replica_id: str, *adapters: str) -> None:
        cmd = self.leaders[replica_id]
        self.fleet.rec.record_engine_signals(cmd.node_id, [pb.ShardSignals(shard_id=cmd.shard_id,
                                                                           adapters=list(adapters))])

    def test_no_demand_no_load(self) -> None:
        """
        An adapter nobody asks for is loaded nowhere.
        """
        self.fleet.step()
        self.assertEqual(self.fleet.dispatcher.adapter_loads, [])

    def test_loaded_where_none_holds_it_then_where_busy(self) -> None:
        """
        Demand for an adapter no replica holds loads it on one (the one
        holding fewest adapters), once until it is seen held; holders that
        keep up get no more, only a reminder every TOUCH_S that it is in
        use; busy holders get one more replica.
        """
        first, second = sorted(self.leaders)
        self.hold(first, "y")
        self.demand.figures = {"x": Demand(0, 1)}
        self.fleet.step()
        self.fleet.step()
        cmd = self.leaders[second]
        self.assertEqual(self.fleet.dispatcher.adapter_loads, [(cmd.node_id, cmd.shard_id, "x")])
        self.assertTrue(any(e["kind"] == "adapter_load" for e in self.fleet.rec.events(0.0)))
        self.hold(second, "x")
        self.demand.figures = {"x": Demand(2, 0)}
        self.fleet.step()
        # The holder keeps up: it is only reminded the adapter is in use.
        held = (cmd.node_id, cmd.shard_id, "x")
        self.assertEqual(self.fleet.dispatcher.adapter_loads, [held, held])
        self.demand.figures = {"x": Demand(9, 0)}
        self.fleet.step()
        other = self.leaders[first]
        self.assertEqual(self.fleet.dispatcher.adapter_loads[2:], [(other.node_id, other.shard_id, "x")])
        self.hold(first, "y", "x")
        self.fleet.step(TOUCH_S)
        self.assertEqual(sorted(self.fleet.dispatcher.adapter_loads[3:]),
                         sorted([held, (other.node_id, other.shard_id, "x")]))

    def test_gateway_reports_kept_for_adapters(self) -> None:
        """
        A standalone gateway's demand for an adapter counts (for loading),
        as an autoscaled deployment's does.
        """
        self.fleet.rec.set_demand_source(None)
        self.fleet.rec.report_demand("gw1", {"x": Demand(0, 3), "nobody": Demand(5, 5)})
        self.assertEqual(self.fleet.rec.demand(), {"x": Demand(0, 3), "vb": Demand(0, 3)})
        self.fleet.step()
        self.assertEqual(len(self.fleet.dispatcher.adapter_loads), 1)

    def test_adapter_demand_counts_for_its_base(self) -> None:
        """
        Requests for an adapter count for its base's autoscaling too.
        """
        self.demand.figures = {"x": Demand(3, 1), "vb": Demand(1, 0)}
        self.assertEqual(self.fleet.rec.demand()["vb"], Demand(4, 1))
        self.assertEqual(self.fleet.rec.demand()["x"], Demand(3, 1))
