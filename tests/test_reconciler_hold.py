"""
Tests for the hold on a deployment whose shard failed with a configuration
error: nothing is placed for it until its profile changes
on a catalog reload or an operator retries; other crash classes back off as
before. All on a C{Clock}; the decision itself (L{on_failure}) also gets
property tests.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.core.failures import Hold, ShardFailure, on_failure
from llmgw.control.state.interfaces import UnknownDeployment
from tests.reconciler_harness import Fleet, catalog

FIXED = """
[profiles.fixed]
gpus_per_shard = 1
gpu_memory_mb = 500
command = ["{python}", "-m", "llmgw.testing.fakemodel", "--port", "{port}", "--model", "{model}", "--fixed"]
"""


def kinds(f: Fleet, kind: str) -> list[dict[str, Any]]:
    return [e for e in f.rec.events() if e["kind"] == kind]


def demo(f: Fleet) -> dict[str, Any]:
    [d] = [d for d in f.rec.deployments() if d["model"] == "demo"]
    return d


def fail(f: Fleet, crash_class: str) -> None:
    [cmd] = f.dispatcher.starts
    f.dispatcher.clear()
    f.report(cmd, "starting")
    f.report(cmd, "failed", exit_code=2, error="unrecognized arguments: --bogus",
             last_output="error: unrecognized arguments: --bogus\n", crash_class=crash_class)


class HoldTests(SynchronousTestCase):
    def held_fleet(self) -> tuple[Fleet, float]:
        f = Fleet({"demo": ("one", 1)}, nodes=2, grace=0)
        f.step()
        fail(f, "config")
        return f, f.clock.seconds()

    def test_config_failure_holds(self) -> None:
        """
        A shard failing with crash class config holds its deployment: for
        an hour nothing is placed for it, and the deployments view shows
        the hold (reason, class, since) and the failure's class; the
        shard_failed event carries the class.
        """
        f, failed_at = self.held_fleet()
        f.step(1.0, 3600)
        self.assertEqual(f.dispatcher.starts, [])
        d = demo(f)
        self.assertEqual(d["ready"], 0)
        held = d["held"]
        self.assertEqual(set(held), {"reason", "crash_class", "since"})
        self.assertEqual(held["crash_class"], "config")
        self.assertEqual(held["since"], failed_at)
        self.assertIn("unrecognized arguments: --bogus", held["reason"])
        self.assertEqual(d["last_failure"]["crash_class"], "config")
        [ev] = kinds(f, "shard_failed")
        self.assertEqual(ev["crash_class"], "config")
        self.assertEqual(len(kinds(f, "deployment_held")), 1)
        self.assertNotIn("crash_class", kinds(f, "replica_placed")[0])

    def test_retry_places_at_once(self) -> None:
        """
        Reconciler.retry clears the hold and the backoff: the next pass
        places a replica, and the view shows neither.
        """
        f, _ = self.held_fleet()
        f.step(1.0, 5)
        f.rec.retry("demo")
        d = demo(f)
        self.assertIsNone(d["held"])
        self.assertIsNone(d["backoff_until"])
        self.assertEqual(d["failures"], 0)
        f.step()
        self.assertEqual(len(f.dispatcher.starts), 1)
        self.assertEqual(len(kinds(f, "deployment_released")), 1)

    def test_retry_unknown_model(self) -> None:
        """
        retry of a model no deployment serves raises UnknownDeployment; of
        a deployment that is not held it changes nothing.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=1, grace=0)
        self.assertRaises(UnknownDeployment, f.rec.retry, "nope")
        f.rec.retry("demo")
        self.assertEqual(kinds(f, "deployment_released"), [])
        self.assertIsNone(demo(f)["held"])

    def test_profile_change_releases(self) -> None:
        """
        A catalog reload that changes the held deployment's profile lifts
        the hold: the next pass places with the new profile.
        """
        f, _ = self.held_fleet()
        f.step(1.0, 5)
        f.rec.apply_catalog(catalog({"demo": ("fixed", 1)}, extra=FIXED))
        self.assertIsNone(demo(f)["held"])
        f.step()
        [cmd] = f.dispatcher.starts
        self.assertIn("--fixed", cmd.argv)

    def test_reload_without_profile_change_keeps_hold(self) -> None:
        """
        A catalog reload that leaves the profile as it was keeps the hold.
        """
        f, _ = self.held_fleet()
        f.rec.apply_catalog(catalog({"demo": ("one", 1), "other": ("one", 0)}))
        f.step(1.0, 600)
        self.assertEqual(f.dispatcher.starts, [])
        self.assertIsNotNone(demo(f)["held"])

    def test_other_classes_back_off(self) -> None:
        """
        An out-of-memory failure does not hold: the deployment backs off
        10 s as before and is placed again.
        """
        f = Fleet({"demo": ("one", 1)}, nodes=2, grace=0)
        f.step()
        fail(f, "oom")
        self.assertIsNone(demo(f)["held"])
        self.assertEqual(demo(f)["last_failure"]["crash_class"], "oom")
        f.step(1.0, 9)
        self.assertEqual(f.dispatcher.starts, [])
        f.step(1.0, 1)
        self.assertEqual(len(f.dispatcher.starts), 1)


classes = st.sampled_from(["config", "oom", "port_in_use", "engine_crash", "killed", "unknown", ""])
failures = st.lists(st.tuples(classes, st.booleans(), st.booleans()), max_size=30)


class OnFailureProperties(SynchronousTestCase):
    @given(failures)
    def test_hold_follows_counted_config_failures(self, seq: list[tuple[str, bool, bool]]) -> None:
        """
        Over any sequence of failures (each of some class, counted or not)
        and releases: the deployment is held exactly when a counted config
        failure came since the last release, held since the first such
        failure, and every counted failure, and only those, backs off.
        """
        held: Hold | None = None
        first: float | None = None
        for t, (crash_class, counts, release) in enumerate(seq):
            if release:
                held, first = None, None
                continue
            failure = ShardFailure("n", "r", "s", 1, None, "bad flag", "", float(t), crash_class)
            out = on_failure(failure, "demo", held, counts)
            self.assertEqual(out.backoff, counts)
            if counts and crash_class == "config" and first is None:
                first = float(t)
                self.assertTrue(out.new_hold)
            else:
                self.assertFalse(out.new_hold)
            held = out.hold
            self.assertEqual(held is not None, first is not None)
            if held is not None:
                self.assertEqual((held.since, held.crash_class), (first, "config"))
