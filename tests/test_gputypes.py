"""
Tests for GPU types (L{llmgw.gputypes}): simulated GPUs with model names,
profiles that require or prefer types, and deployments with variants
placed on the cheapest with room and scaled down from the dearest.
"""

from __future__ import annotations

import tomllib

from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.gpus import (
    GPUSpec,
    GPUSpecError,
    SimGroup,
    SimulatedGPUs,
    discover,
    parse_gpu_spec,
)
from llmgw.control.core.catalog import Catalog, CatalogError, parse_catalog
from llmgw.control.core.rollout import LaunchSpec, spec_data, spec_from_data, spec_of
from llmgw.control.state.inventory import GPUInfo, Inventory, Node
from llmgw.control.state.placement import NodeCapacity, Placer, PortBook, Request
from llmgw.ctl.render import render_deployments, render_nodes
from llmgw.gputypes import Variant, is_type
from tests.reconciler_harness import Fleet

PROFILES = """
[profiles.l4]
gpu_memory_mb = 1000
gpu_types = ["L4"]
command = ["srv", "--port", "{port}"]

[profiles.h100]
gpu_memory_mb = 1000
gpu_types = ["H100"]
command = ["srv", "--port", "{port}"]
"""


def cat(deployment: str, profiles: str = PROFILES) -> Catalog:
    return parse_catalog(tomllib.loads(profiles + "\n[[deployments]]\n" + deployment))


def typed_node(node_id: str, names: list[str], free_mb: int = 80_000) -> NodeCapacity:
    return NodeCapacity(id=node_id, host=node_id, free=[(free_mb, i) for i in range(len(names))],
                        names=dict(enumerate(names)))


def inventory(nodes: dict[str, list[str]]) -> Inventory:
    inv = Inventory()
    for i, (node_id, names) in enumerate(sorted(nodes.items())):
        inv.upsert(Node(id=node_id, address=f"10.0.0.{i + 1}", gpus=[
            GPUInfo(index=g, uuid=f"GPU-{node_id}-{g}", name=name, memory_total_mb=80_000)
            for g, name in enumerate(names)]))
    return inv


class TypeNameTests(SynchronousTestCase):
    def test_whole_words_of_the_name(self) -> None:
        """
        A type matches a run of whole words of a GPU's name, ignoring case:
        H100 is NVML's "NVIDIA H100 80GB HBM3", A100 is "NVIDIA
        A100-SXM4-80GB", "RTX 4090" a two-word type; L4 is not an L40S.
        """
        self.assertTrue(is_type("NVIDIA H100 80GB HBM3", "H100"))
        self.assertTrue(is_type("NVIDIA H100 80GB HBM3", "h100"))
        self.assertTrue(is_type("NVIDIA A100-SXM4-80GB", "A100"))
        self.assertTrue(is_type("NVIDIA GeForce RTX 4090", "RTX 4090"))
        self.assertTrue(is_type("L4", "L4"))
        self.assertFalse(is_type("NVIDIA L40S", "L4"))
        self.assertFalse(is_type("NVIDIA H100 80GB HBM3", "H10"))
        self.assertFalse(is_type("", "H100"))


class SimSpecTests(SynchronousTestCase):
    def test_named_groups(self) -> None:
        """
        C{sim:2x24GiB:L4,1x80GiB:H100} gives three GPUs in that order, each
        group's named with its model name and sized as given.
        """
        spec = parse_gpu_spec("sim:2x24GiB:L4,1x80GiB:H100")
        self.assertEqual(spec, GPUSpec("sim", 3, 24 * 1024, (SimGroup(2, 24 * 1024, "L4"),
                                                              SimGroup(1, 80 * 1024, "H100"))))
        gpus = SimulatedGPUs(spec.count, spec.size_mb, "n1", spec.groups).gpus()
        self.assertEqual([(g.index, g.name, g.memory_total_mb) for g in gpus],
                         [(0, "L4", 24576), (1, "L4", 24576), (2, "H100", 81920)])
        self.assertEqual(len({g.uuid for g in gpus}), 3)
        source = discover(spec, None, salt="n1")
        self.assertEqual([g.name for g in source.gpus()], ["L4", "L4", "H100"])
        self.assertIn("H100", source.describe())

    def test_one_unnamed_group_as_before(self) -> None:
        """
        C{sim:2x80GiB} parses as it always did, one name for all.
        """
        self.assertEqual(parse_gpu_spec("sim:2x80GiB"), GPUSpec("sim", 2, 80 * 1024))
        self.assertEqual(parse_gpu_spec("sim:1x80GiB:H100").sim_groups(), (SimGroup(1, 80 * 1024, "H100"),))

    def test_bad_groups(self) -> None:
        """
        A malformed group, or more than 64 GPUs in all, is refused with a
        message naming what was wrong.
        """
        e = self.assertRaises(GPUSpecError, parse_gpu_spec, "sim:2x24GiB:L4,zz")
        self.assertIn("'zz' is not COUNTxSIZE[:NAME]", str(e))
        e = self.assertRaises(GPUSpecError, parse_gpu_spec, "sim:40x1GiB,40x1GiB")
        self.assertIn("all groups together", str(e))
        self.assertRaises(GPUSpecError, parse_gpu_spec, "sim:1x1GiB:bad$name")


class CatalogTests(SynchronousTestCase):
    def test_profile_types(self) -> None:
        """
        A profile's C{gpu_types} and C{prefer_gpu_types} are kept as tuples.
        """
        c = cat('model = "m"\nprofile = "p"\n', PROFILES + """
[profiles.p]
command = ["srv"]
gpu_types = ["H100", "A100"]
prefer_gpu_types = ["H100"]
""")
        self.assertEqual(c.profiles["p"].gpu_types, ("H100", "A100"))
        self.assertEqual(c.profiles["p"].prefer_gpu_types, ("H100",))
        self.assertEqual(c.profiles["l4"].prefer_gpu_types, ())

    def test_bad_profile_types(self) -> None:
        """
        An empty C{gpu_types}, a type that is not a name, a repeat, or a
        value that is not a list is refused naming the profile and field.
        """
        for value, says in (("[]", "at least one"), ('["H100$"]', "not a GPU type name"),
                            ('["H100", "h100"]', "twice"), ('"H100"', "must be a list")):
            e = self.assertRaises(CatalogError, parse_catalog, tomllib.loads(
                f'[profiles.p]\ncommand = ["srv"]\ngpu_types = {value}\n'))
            self.assertIn("profile 'p': field 'gpu_types'", str(e))
            self.assertIn(says, str(e))

    def test_variants_cheapest_first(self) -> None:
        """
        A deployment's variants are kept cheapest first; its C{profile} is
        the cheapest's, and its launch spec offers the rest after it.
        """
        c = cat('model = "m"\nvariants = [{profile = "h100", cost = 4}, {profile = "l4", cost = 1}]\n')
        dep = c.deployments["m"]
        self.assertEqual(dep.variants, (Variant("l4", 1.0), Variant("h100", 4.0)))
        self.assertEqual(dep.profile, "l4")
        self.assertEqual(dep.profile_names, ("l4", "h100"))
        spec = spec_of(c, "m")
        assert spec is not None
        self.assertEqual([p.name for p in spec.choices()], ["l4", "h100"])
        self.assertEqual(spec_from_data(spec_data(spec)), spec)

    def test_spec_document_without_types_unchanged(self) -> None:
        """
        A spec whose profile names no GPU types writes no such fields, so
        versions kept from before GPU types existed keep their digest.
        """
        spec = spec_of(cat('model = "m"\nprofile = "l4"\n', PROFILES + '[profiles.x]\ncommand = ["srv"]\n'), "m")
        assert spec is not None
        plain = LaunchSpec(spec.profile.__class__(name="x", command=("srv",)))
        self.assertNotIn("gpu_types", spec_data(plain)["profile"])
        self.assertNotIn("variants", spec_data(plain))

    def test_bad_variants(self) -> None:
        """
        Variants with a profile, naming no profile, with a bad cost, a
        profile twice or an unknown field are refused naming the
        deployment and the field.
        """
        for entry, says in (
            ('profile = "l4"\nvariants = [{profile = "l4", cost = 1}]', "'profile' and 'variants' exclude"),
            ('variants = [{profile = "a100", cost = 1}]', "field 'variants' names 'a100'"),
            ('variants = [{profile = "l4", cost = -1}]', "variants[0]: field 'cost'"),
            ('variants = [{profile = "l4"}]', "variants[0]: field 'cost'"),
            ('variants = [{profile = "l4", cost = 1}, {profile = "l4", cost = 2}]', "listed twice"),
            ('variants = [{profile = "l4", cost = 1, gpus = 2}]', "unknown field 'gpus'"),
            ("variants = []", "non-empty list"),
        ):
            e = self.assertRaises(CatalogError, cat, f'model = "m"\n{entry}\n')
            self.assertIn("deployment 'm'", str(e))
            self.assertIn(says, str(e))


class PlacerTypeTests(SynchronousTestCase):
    def test_required_type_only(self) -> None:
        """
        A request with C{gpu_types} is never given a GPU of another type,
        even on a node that fits it better; with none of that type left it
        does not fit.
        """
        placer = Placer([typed_node("a", ["L4"]), typed_node("b", ["H100"] * 4)], {}, PortBook())
        req = Request("m", gpu_memory_mb=1000, gpu_types=("H100",))
        slots = placer.place(req)
        assert slots is not None
        self.assertEqual(slots[0].node_id, "b")
        mixed = Placer([typed_node("c", ["L4", "NVIDIA H100 80GB HBM3", "L4"])], {}, PortBook())
        slots = mixed.place(req)
        assert slots is not None
        self.assertEqual(slots[0].gpu_indices, (1,))
        self.assertIsNone(mixed.place(req))
        self.assertIsNone(Placer([typed_node("a", ["L4"] * 8)], {}, PortBook()).place(req))

    def test_preferred_among_fitting(self) -> None:
        """
        C{prefer_gpu_types} puts a node with the preferred type first
        (over best fit), and on a mixed node takes the preferred GPUs; with
        none left, any fitting GPU does.
        """
        placer = Placer([typed_node("a", ["L4"]), typed_node("b", ["H100"] * 4)], {}, PortBook())
        req = Request("m", gpu_memory_mb=1000, prefer_gpu_types=("H100",))
        slots = placer.place(req)
        assert slots is not None
        self.assertEqual(slots[0].node_id, "b")
        mixed = Placer([typed_node("c", ["L4", "H100"])], {}, PortBook())
        first, second = mixed.place(req), mixed.place(req)
        assert first is not None and second is not None
        self.assertEqual((first[0].gpu_indices, second[0].gpu_indices), ((1,), (0,)))

    def test_preferred_node_that_frees_up(self) -> None:
        """
        A node whose preferred GPU frees up after the group's candidates
        were gathered is chosen next (its better entry is pushed at once).
        """
        nodes = [typed_node("a", ["L4", "L4"]), typed_node("b", ["H100"], free_mb=0)]
        placer = Placer(nodes, {}, PortBook())
        req = Request("m", gpu_memory_mb=1000, prefer_gpu_types=("H100",))
        first = placer.place(req)
        assert first is not None
        self.assertEqual(first[0].node_id, "a")
        placer.update("b", typed_node("b", ["H100"]))
        second = placer.place(req)
        assert second is not None
        self.assertEqual(second[0].node_id, "b")


class VariantFleetTests(SynchronousTestCase):
    VARIANTS = 'model = "m"\nreplicas = 1\nvariants = [{profile = "h100", cost = 4}, {profile = "l4", cost = 1}]\n'

    def fleet(self, nodes: dict[str, list[str]], deployment: str = VARIANTS) -> Fleet:
        f = Fleet({}, inventory=inventory(nodes), cat=cat(deployment))
        f.past_grace()
        return f

    def profiles(self, f: Fleet) -> list[str]:
        return sorted(r.profile for r in f.rec.replica_recs.values() if r.phase == "active")

    def test_cheapest_with_room_then_the_next(self) -> None:
        """
        Replicas go on the cheapest variant while it has room, then on the
        next; each runs its own variant's profile on GPUs of its type.
        """
        f = self.fleet({"n1": ["L4", "L4"], "n2": ["H100", "H100"]})
        f.rec.scale("m", 3)
        f.step()
        self.assertEqual(self.profiles(f), ["h100", "l4", "l4"])
        for cmd in f.dispatcher.starts:
            want = "n2" if cmd.profile == "h100" else "n1"
            self.assertEqual(cmd.node_id, want)
        view = {v["profile"]: v["replicas"] for v in f.rec.deployments()[0]["variants"]}
        self.assertEqual(view, {"l4": 2, "h100": 1})
        text = render_deployments(f.rec.deployments(), f.clock.seconds())
        self.assertIn("l4($1):2 h100($4):1", text)
        self.assertIn("2x L4", render_nodes(f.rec.nodes(), f.clock.seconds()))

    def test_scale_down_dearest_first(self) -> None:
        """
        A scale down retires the dearest variant's replicas first, before
        newer ones of a cheaper variant.
        """
        f = self.fleet({"n1": ["L4", "L4"], "n2": ["H100", "H100"]})
        # The dear replicas first, so that the cheap ones are the newest.
        f.rec.cordon("n1")
        f.rec.scale("m", 2)
        f.step()
        f.rec.uncordon("n1")
        f.step(5)
        f.rec.scale("m", 4)
        f.step()
        self.assertEqual(self.profiles(f), ["h100", "h100", "l4", "l4"])
        f.make_ready()
        f.step()
        f.rec.scale("m", 2)
        f.step()
        f.confirm_stops()
        f.step(15, 2)
        f.confirm_stops()
        self.assertEqual(self.profiles(f), ["l4", "l4"])

    def test_required_type_missing_is_unplaceable(self) -> None:
        """
        A profile requiring a type no node has places nothing, and the
        deployment's unplaceable reason names the profile and the types.
        """
        f = self.fleet({"n1": ["L4", "L4"]}, 'model = "m"\nprofile = "h100"\n')
        self.assertEqual(f.dispatcher.starts, [])
        why = f.rec.deployments()[0]["unplaceable"]
        self.assertIn("profile h100 (GPU types H100)", why)
        self.assertTrue(any(e["kind"] == "unplaceable" and "GPU types H100" in e["reason"]
                            for e in f.rec.events()))

    def test_no_rollout_from_variants(self) -> None:
        """
        Replicas on different variants are one version: loading the same
        catalog again, or a change of only the costs, starts no rollout;
        a change to one variant's profile replaces only its replicas.
        """
        f = self.fleet({"n1": ["L4"], "n2": ["H100"]})
        f.rec.scale("m", 2)
        f.step()
        f.make_ready()
        f.step()
        f.rec.apply_catalog(cat(self.VARIANTS.replace("replicas = 1", "replicas = 2")))
        f.rec.apply_catalog(cat(self.VARIANTS.replace("cost = 4", "cost = 3")))
        f.step(1, 3)
        self.assertIsNone(f.rec.deployments()[0]["rollout"])
        self.assertFalse(any(e["kind"].startswith("rollout") for e in f.rec.events()))
        changed = PROFILES.replace('gpu_types = ["H100"]', 'gpu_types = ["H100"]\nenv = {X = "1"}')
        f.rec.apply_catalog(cat(self.VARIANTS, changed))
        ro = f.rec.deployments()[0]["rollout"]
        self.assertEqual(ro["total"], 1)

    def test_adopts_any_variant(self) -> None:
        """
        After a control-plane restart, shards of any of the deployment's
        variants are adopted, not refused as of a foreign profile.
        """
        f = self.fleet({"n1": ["L4"], "n2": ["H100"]})
        f.rec.scale("m", 2)
        f.step()
        f.make_ready()
        running = {n: f.running(n) for n in ("n1", "n2")}
        g = Fleet({}, inventory=inventory({"n1": ["L4"], "n2": ["H100"]}), cat=cat(self.VARIANTS),
                  register=False)
        for node_id, shards in running.items():
            self.assertEqual(g.register(node_id, shards), [])
        self.assertEqual(sorted(r.profile for r in g.rec.replica_recs.values()), ["h100", "l4"])
