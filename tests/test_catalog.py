"""
Tests for L{llmgw.control.core.catalog}.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.core.autoscale import DEFAULT_TARGET_IN_FLIGHT
from llmgw.control.core.catalog import (
    Catalog,
    CatalogError,
    Deployment,
    diff,
    fill,
    load_catalog,
    parse_catalog,
)
from llmgw.control.core.kept import KeptState

EXAMPLE = Path(__file__).parent.parent / "llmgw" / "demo-catalog.toml"

GOOD = """
[profiles.fake-1gpu]
shards = 1
gpus_per_shard = 1
gpu_memory_mb = 1000
fabric = ""
command = ["{python}", "-m", "llmgw.testing.fakemodel", "--port", "{port}", "--model", "{model}"]
env = {}
health_path = "/health"
startup_timeout_s = 60
drain_timeout_s = 10

[[deployments]]
model = "demo"
profile = "fake-1gpu"
replicas = 2
"""


def parse(text: str) -> Catalog:
    return parse_catalog(tomllib.loads(text))


class CatalogTests(SynchronousTestCase):
    def assertRefused(self, text: str, *fragments: str) -> None:
        with self.assertRaises(CatalogError) as ctx:
            parse(text)
        for fragment in fragments:
            self.assertIn(fragment, str(ctx.exception))

    def test_issue_shape(self) -> None:
        """
        The catalog shape of the issue parses into a profile and a
        deployment with every field kept.
        """
        cat = parse(GOOD)
        profile = cat.profiles["fake-1gpu"]
        self.assertEqual(profile.gpu_memory_mb, 1000)
        self.assertEqual(profile.command[0], "{python}")
        self.assertEqual(profile.drain_timeout_s, 10)
        self.assertEqual(cat.deployments["demo"], Deployment("demo", "fake-1gpu", 2))
        self.assertEqual(cat.profile_for("demo"), profile)

    def test_example_file(self) -> None:
        """
        The shipped demo catalog loads, and remembers its path.
        """
        cat = load_catalog(EXAMPLE)
        self.assertEqual(cat.deployments["demo"].replicas, 2)
        self.assertEqual(cat.path, str(EXAMPLE))
        self.assertEqual(cat.port_range, (20000, 20999))

    def test_unknown_profile_field(self) -> None:
        """
        An unknown field in a profile is refused naming the profile and the
        field.
        """
        self.assertRefused(GOOD.replace("env = {}", "gpus = 2"), "profile 'fake-1gpu'", "'gpus'")

    def test_wrong_type(self) -> None:
        """
        A field of the wrong type is refused naming it; a boolean is not a
        count.
        """
        self.assertRefused(GOOD.replace("gpus_per_shard = 1", 'gpus_per_shard = "1"'), "'gpus_per_shard'", "integer")
        self.assertRefused(GOOD.replace("replicas = 2", "replicas = true"), "deployment 'demo'", "'replicas'")

    def test_fabric_required(self) -> None:
        """
        A multi-shard profile without a fabric is refused.
        """
        self.assertRefused(GOOD.replace("shards = 1", "shards = 2"), "profile 'fake-1gpu'", "'fabric'")

    def test_unknown_placeholder(self) -> None:
        """
        A command with a placeholder that is not known is refused, naming
        the placeholder.
        """
        self.assertRefused(GOOD.replace('"{model}"]', '"{modle}"]'), "'command'", "{modle}")

    def test_unknown_profile_reference(self) -> None:
        """
        A deployment naming a profile that does not exist is refused.
        """
        self.assertRefused(GOOD.replace('profile = "fake-1gpu"', 'profile = "nope"'), "deployment 'demo'", "'profile'", "nope")

    def test_duplicate_model(self) -> None:
        """
        Two deployments of one model are refused.
        """
        self.assertRefused(GOOD + GOOD.split("[[deployments]]")[1].join(["[[deployments]]", ""]), "declared twice")

    def test_negative_replicas(self) -> None:
        """
        A negative replica count is refused; zero is allowed.
        """
        self.assertRefused(GOOD.replace("replicas = 2", "replicas = -1"), "'replicas'")
        self.assertEqual(parse(GOOD.replace("replicas = 2", "replicas = 0")).deployments["demo"].replicas, 0)

    def test_missing_command(self) -> None:
        """
        A profile without a command is refused.
        """
        text = "\n".join(line for line in GOOD.splitlines() if not line.startswith("command"))
        self.assertRefused(text, "'command'", "required")

    def test_bad_toml_file(self) -> None:
        """
        A file that is not TOML is refused naming the file.
        """
        path = Path(self.mktemp())
        path.write_text("[profiles\n")
        with self.assertRaises(CatalogError) as ctx:
            load_catalog(path)
        self.assertIn(str(path), str(ctx.exception))
        self.assertIn("TOML", str(ctx.exception))

    def test_missing_file(self) -> None:
        """
        A missing file is refused with a clear message.
        """
        with self.assertRaises(CatalogError) as ctx:
            load_catalog(self.mktemp())
        self.assertIn("cannot be read", str(ctx.exception))

    def test_fill_leaves_python(self) -> None:
        """
        Filling placeholders leaves C{{python}} for the agent.
        """
        self.assertEqual(fill("{python} --port {port}", {"port": "1"}), "{python} --port 1")

    def test_diff(self) -> None:
        """
        The diff names added, removed and changed deployments, and a
        deployment whose profile content changed counts as changed.
        """
        old = parse(GOOD)
        new = parse(GOOD.replace("startup_timeout_s = 60", "startup_timeout_s = 90")
                    + '[[deployments]]\nmodel = "other"\nprofile = "fake-1gpu"\n')
        d = diff(old, new)
        self.assertEqual(d["added"], ["other"])
        self.assertEqual(d["changed"], ["demo"])
        self.assertEqual(d["profiles_changed"], ["fake-1gpu"])


AUTOSCALED = GOOD.replace("replicas = 2\n", "")


class AutoscaleCatalogTests(SynchronousTestCase):
    def assertRefused(self, fields: str, *fragments: str) -> None:
        with self.assertRaises(CatalogError) as ctx:
            parse(AUTOSCALED + fields)
        for fragment in fragments:
            self.assertIn(fragment, str(ctx.exception))

    def test_autoscaled_deployment(self) -> None:
        """
        Bounds, a target and the idle and stabilization times make an
        autoscaled deployment that starts from its C{min_replicas}.
        """
        dep = parse(AUTOSCALED + "min_replicas = 0\nmax_replicas = 4\ntarget_in_flight = 8\n"
                                 "scale_to_zero_after_s = 120\nstabilization_s = 60.5\n").deployments["demo"]
        self.assertEqual(dep.replicas, 0)
        assert dep.autoscale is not None
        self.assertEqual((dep.autoscale.min_replicas, dep.autoscale.max_replicas), (0, 4))
        self.assertEqual(dep.autoscale.target_in_flight, 8.0)
        self.assertIsNone(dep.autoscale.target_waiting)
        self.assertEqual((dep.autoscale.scale_to_zero_after_s, dep.autoscale.stabilization_s), (120.0, 60.5))

    def test_defaults(self) -> None:
        """
        C{min_replicas} defaults to 1 and the stabilization window to
        300 s; a fixed deployment has no autoscaling.
        """
        dep = parse(AUTOSCALED + "max_replicas = 3\ntarget_waiting = 2\n").deployments["demo"]
        assert dep.autoscale is not None
        self.assertEqual((dep.replicas, dep.autoscale.min_replicas, dep.autoscale.stabilization_s), (1, 1, 300.0))
        self.assertIsNone(parse(GOOD).deployments["demo"].autoscale)

    def test_default_target(self) -> None:
        """
        A deployment that scales to zero but names no target is given
        C{target_in_flight} L{DEFAULT_TARGET_IN_FLIGHT} (8), not refused;
        one that names C{target_waiting} alone keeps that target alone.
        """
        dep = parse(AUTOSCALED + "min_replicas = 0\nmax_replicas = 4\nscale_to_zero_after_s = 600\n"
                    ).deployments["demo"]
        assert dep.autoscale is not None
        self.assertEqual(dep.autoscale.target_in_flight, DEFAULT_TARGET_IN_FLIGHT)
        self.assertEqual(DEFAULT_TARGET_IN_FLIGHT, 8.0)
        self.assertIsNone(dep.autoscale.target_waiting)
        self.assertEqual((dep.autoscale.min_replicas, dep.autoscale.scale_to_zero_after_s), (0, 600.0))
        only_waiting = parse(AUTOSCALED + "max_replicas = 3\ntarget_waiting = 2\n").deployments["demo"]
        assert only_waiting.autoscale is not None
        self.assertIsNone(only_waiting.autoscale.target_in_flight)

    def test_refusals(self) -> None:
        """
        Contradictory or out-of-range autoscaling fields are refused with a
        message naming the deployment and the field.
        """
        self.assertRefused("replicas = 2\nmax_replicas = 3\ntarget_in_flight = 1\n",
                           "deployment 'demo'", "'replicas' fixes", "min_replicas")
        self.assertRefused("min_replicas = 1\ntarget_in_flight = 1\n", "'max_replicas' is required")
        self.assertRefused("min_replicas = 4\nmax_replicas = 3\ntarget_in_flight = 1\n", "below 'min_replicas'")
        self.assertRefused("max_replicas = 0\nmin_replicas = 0\ntarget_in_flight = 1\n", "'max_replicas' must be at least 1")
        self.assertRefused("max_replicas = 3\ntarget_in_flight = 0\n", "'target_in_flight' must be a number above 0")
        self.assertRefused("max_replicas = 3\ntarget_waiting = -1.5\n", "'target_waiting'")
        self.assertRefused("max_replicas = 3\ntarget_in_flight = 1\nscale_to_zero_after_s = 60\n",
                           "only with min_replicas = 0")
        self.assertRefused("min_replicas = 0\nmax_replicas = 3\ntarget_in_flight = 1\nscale_to_zero_after_s = 0\n",
                           "'scale_to_zero_after_s' must be a number of seconds of at least 1")
        self.assertRefused("max_replicas = 3\ntarget_in_flight = 1\nstabilization_s = -1\n", "'stabilization_s'")
        self.assertRefused("max_replicas = 3\ntarget_in_flight = \"4\"\n", "'target_in_flight' must be a number")
        self.assertRefused("max_replicas = 2.5\ntarget_in_flight = 4\n", "'max_replicas' must be an integer")

    def test_bounds_in_the_state_file(self) -> None:
        """
        An operator's bounds survive a reload of the state file; a file
        without them (older) loads with none.
        """
        path = Path(self.mktemp())
        dep = parse(AUTOSCALED + "max_replicas = 3\ntarget_in_flight = 1\n").deployments["demo"]
        assert dep.autoscale is not None
        state = KeptState(path)
        state.set_bounds("demo", 2, 5, dep.autoscale)
        again = KeptState(path)
        self.assertEqual(again.load(), [])
        policy = again.policy(dep)
        assert policy is not None
        self.assertEqual((policy.min_replicas, policy.max_replicas), (2, 5))
        self.assertEqual(again.desired(dep), 2)
        path.write_text(json.dumps({"replicas": {}}))
        self.assertEqual(again.load(), [])
        self.assertEqual(again.policy(dep), dep.autoscale)
