"""
Rollouts of a changed launch spec (L{llmgw.control.core.rolling}) through
the reconciler, on simulated nodes and a C{Clock}.
"""

from __future__ import annotations

import tomllib
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.core.catalog import Catalog, CatalogError, parse_catalog
from llmgw.control.core.kept import KeptState
from llmgw.control.core.rollout import spec_data, spec_from_data, spec_of
from llmgw.control.state.interfaces import AdminError
from tests.reconciler_harness import ONE_GPU, Fleet

DEPLOYMENT = '\n[[deployments]]\nmodel = "demo"\nprofile = "one"\nreplicas = {n}\n{extra}'


def version(timeout: int, replicas: int = 2, extra: str = "") -> Catalog:
    """
    The harness's catalog with profile C{one}'s startup timeout set to
    C{timeout}: each timeout is another launch spec.
    """
    text = ONE_GPU.replace("startup_timeout_s = 60", f"startup_timeout_s = {timeout}", 1)
    return parse_catalog(tomllib.loads(text + DEPLOYMENT.format(n=replicas, extra=extra)))


def kinds(f: Fleet, kind: str) -> list[dict[str, Any]]:
    return [e for e in f.rec.events() if e["kind"] == kind]


def full_fleet(nodes: int = 2, replicas: int = 2, **kw: Any) -> Fleet:
    """
    C{replicas} ready replicas of C{demo} (startup timeout 60) on
    C{nodes} one-GPU nodes.
    """
    f = Fleet({}, nodes=nodes, gpus=1, fabric="", grace=0, cat=version(60, replicas), **kw)
    f.step()
    f.make_ready()
    f.step()
    return f


def timeout_of(f: Fleet, rid: str) -> int:
    return [c.startup_timeout_s for c in f.dispatcher.starts if c.replica_id == rid][-1]


def versions(f: Fleet) -> dict[str, int]:
    """The startup timeout each live replica was started with, by replica."""
    return {rid: timeout_of(f, rid) for rid in f.rec.replica_ids("demo")}


def drain_out(f: Fleet) -> None:
    """Let a drain run to its timeout (no in-flight source) and confirm the stops."""
    f.step(11.0)
    f.confirm_stops()
    f.step()


class FullFleetTests(SynchronousTestCase):
    def test_one_down_replaced_then_next(self) -> None:
        """
        On two full one-GPU nodes, a profile change takes one old replica
        down (drained, then stopped), places its replacement on the freed
        GPU and, once it is ready, does the same with the next; one
        replica serves throughout and both end on the new version.
        """
        f = full_fleet()
        old = set(f.rec.replica_ids("demo"))
        f.rec.apply_catalog(version(61))
        [started] = kinds(f, "rollout_started")
        self.assertIn("2 replica(s)", started["reason"])
        f.step()
        self.assertEqual(len(f.dispatcher.drains), 1)
        self.assertEqual(len(f.ready_replicas("demo")), 1)
        f.step()
        # Only one at a time: the other old replica still serves.
        self.assertEqual(len(f.dispatcher.drains), 1)
        drain_out(f)
        new = set(f.rec.replica_ids("demo")) - old
        self.assertEqual(len(new), 1)
        self.assertEqual(timeout_of(f, new.pop()), 61)
        self.assertEqual(f.rec.deployments()[0]["rollout"]["state"], "progressing")
        f.make_ready()
        f.step()
        self.assertEqual(len(kinds(f, "rollout_step")), 1)
        self.assertEqual(f.rec.deployments()[0]["rollout"]["updated"], 1)
        self.assertEqual(len(f.dispatcher.drains), 2)
        self.assertGreaterEqual(len(f.ready_replicas("demo")), 1)
        drain_out(f)
        f.make_ready()
        f.step()
        self.assertEqual(sorted(versions(f).values()), [61, 61])
        self.assertFalse(old & set(f.rec.replica_ids("demo")))
        ro = f.rec.deployments()[0]["rollout"]
        self.assertEqual((ro["state"], ro["updated"], ro["total"]), ("done", 2, 2))
        self.assertEqual(len(kinds(f, "rollout_done")), 1)

    def test_not_done_before_the_last_replacement_is_ready(self) -> None:
        """
        Once the last old replica is stopped on a full fleet the rollout is
        still progressing: it places the last replacement itself, is done
        only when that one is ready (every step counted), and fails if
        that one fails before it is ready.
        """
        f = full_fleet()
        f.rec.apply_catalog(version(61))
        f.step()
        drain_out(f)
        f.make_ready()
        f.step()
        drain_out(f)
        ro = f.rec.deployments()[0]["rollout"]
        self.assertEqual((ro["state"], ro["updated"]), ("progressing", 1), ro)
        self.assertEqual(kinds(f, "rollout_done"), [])
        last = [c for c in f.dispatcher.starts if c.startup_timeout_s == 61][-1]
        self.assertNotIn(last.replica_id, {c.replica_id for c in f.dispatcher.starts[:-1]})
        f.make_ready([last])
        f.step()
        ro = f.rec.deployments()[0]["rollout"]
        self.assertEqual((ro["state"], ro["updated"], ro["total"]), ("done", 2, 2), ro)
        self.assertEqual(len(kinds(f, "rollout_step")), 2)

    def test_last_replacement_failing_fails_the_rollout(self) -> None:
        """
        The last replacement on a full fleet failing before it is ready
        fails the rollout, as the first's would.
        """
        f = full_fleet()
        f.rec.apply_catalog(version(61))
        f.step()
        drain_out(f)
        f.make_ready()
        f.step()
        drain_out(f)
        last = [c for c in f.dispatcher.starts if c.startup_timeout_s == 61][-1]
        f.report(last, "starting")
        f.report(last, "failed", exit_code=3, error="bad flag")
        f.step()
        ro = f.rec.deployments()[0]["rollout"]
        self.assertEqual(ro["state"], "failed", ro)
        self.assertIn("bad flag", ro["reason"])

    def test_surge_with_a_spare_gpu(self) -> None:
        """
        With a spare GPU the new replica is placed while both old ones
        serve, and an old one drains only once it is ready.
        """
        f = full_fleet(nodes=3)
        f.dispatcher.clear()
        f.rec.apply_catalog(version(61))
        f.step()
        [new] = f.dispatcher.starts
        self.assertEqual(new.startup_timeout_s, 61)
        self.assertEqual(f.dispatcher.drains, [])
        self.assertEqual(len(f.ready_replicas("demo")), 2)
        f.make_ready([new])
        f.step()
        self.assertEqual(len(f.dispatcher.drains), 1)
        self.assertEqual(len(f.ready_replicas("demo")), 2)

    def test_failure_stops_and_restores_the_slot(self) -> None:
        """
        A new replica that fails before it is ready fails the rollout with
        an event saying why; the other old replica is kept (never
        drained), and the slot taken down for the new one is placed back
        with the old version.
        """
        f = full_fleet()
        f.rec.apply_catalog(version(61))
        f.step()
        drain_out(f)
        [new] = [c for c in f.dispatcher.starts if c.startup_timeout_s == 61]
        f.report(new, "starting")
        f.report(new, "failed", exit_code=3, error="bad flag")
        f.step()
        [failed] = kinds(f, "rollout_failed")
        self.assertIn("bad flag", failed["reason"])
        ro = f.rec.deployments()[0]["rollout"]
        self.assertEqual(ro["state"], "failed")
        self.assertIn("bad flag", ro["reason"])
        f.confirm_stops()
        f.step()
        self.assertEqual(len(kinds(f, "rollout_slot_restored")), 1)
        f.make_ready()
        f.step(passes=20)
        self.assertEqual(sorted(versions(f).values()), [60, 60])
        self.assertEqual(len(f.dispatcher.drains), 1)
        self.assertEqual(len(f.ready_replicas("demo")), 2)


class ControlTests(SynchronousTestCase):
    def test_pause_and_resume(self) -> None:
        """
        A paused rollout starts no step (the old replicas all serve) and
        goes on when resumed; pausing one that is not progressing is a 409.
        """
        f = full_fleet(nodes=3)
        f.rec.apply_catalog(version(61))
        f.dispatcher.clear()
        status = f.rec.rollout_pause("demo")
        self.assertEqual(status["rollout"]["state"], "paused")
        self.assertIn("paused", status["text"])
        f.step(passes=3)
        self.assertEqual(f.dispatcher.starts, [])
        err = self.assertRaises(AdminError, f.rec.rollout_pause, "demo")
        self.assertEqual(err.status, 409)
        f.rec.rollout_resume("demo")
        f.step()
        self.assertEqual(len(f.dispatcher.starts), 1)
        self.assertEqual([e["kind"] for e in f.rec.events() if e["kind"].startswith("rollout_")],
                         ["rollout_started", "rollout_paused", "rollout_resumed"])

    def test_undo_rolls_back(self) -> None:
        """
        Undo after a rollout returns every replica to the previous launch
        spec, the same way (one at a time on a full fleet), and new
        replicas are placed from it although the catalog says otherwise.
        """
        f = full_fleet()
        f.rec.apply_catalog(version(61))
        for _ in range(3):
            f.step()
            drain_out(f)
            f.make_ready()
        f.step()
        self.assertEqual(sorted(versions(f).values()), [61, 61])
        status = f.rec.rollout_undo("demo")
        self.assertTrue(status["pinned"])
        self.assertEqual(status["rollout"]["state"], "progressing")
        self.assertTrue(status["rollout"]["undo"])
        for _ in range(3):
            f.step()
            drain_out(f)
            f.make_ready()
        f.step()
        self.assertEqual(sorted(versions(f).values()), [60, 60])
        self.assertEqual(f.rec.rollout_status("demo")["rollout"]["state"], "done")

    def test_no_rollout_is_409(self) -> None:
        """Control of a deployment that has had no rollout is refused with 409."""
        f = full_fleet()
        err = self.assertRaises(AdminError, f.rec.rollout_undo, "demo")
        self.assertEqual(err.status, 409)

    def test_kept_across_restart(self) -> None:
        """
        An undo's pinned spec and a pause are kept in the fleet state: a
        control plane started on it places from the pinned spec and starts
        the deployment's next rollout paused.
        """
        path = self.mktemp()
        kept = KeptState(path)
        f = full_fleet(fleet_state=kept)
        f.rec.apply_catalog(version(61))
        for _ in range(3):
            f.step()
            drain_out(f)
            f.make_ready()
        f.rec.rollout_undo("demo")
        f.rec.rollout_pause("demo")
        self.assertEqual(kept.rollouts["demo"]["paused"], True)
        restarted = KeptState(path)
        g = Fleet({}, nodes=2, gpus=1, fabric="", grace=0, cat=version(61), fleet_state=restarted)
        self.assertEqual(g.rec.rollout_status("demo")["version"], spec_of(version(60), "demo").version)
        g.step()
        self.assertEqual({c.startup_timeout_s for c in g.dispatcher.starts}, {60})
        self.assertTrue(g.rec.rollout_status("demo")["paused"])


class SpecTests(SynchronousTestCase):
    def test_spec_round_trip(self) -> None:
        """A launch spec kept as JSON reads back equal, with the same version."""
        spec = spec_of(version(61), "demo")
        assert spec is not None
        back = spec_from_data(spec_data(spec))
        self.assertEqual(back, spec)
        self.assertEqual(back.version, spec.version)
        self.assertNotEqual(spec.version, spec_of(version(60), "demo").version)  # type: ignore[union-attr]

    def test_limits_checked(self) -> None:
        """A catalog with max_surge and max_unavailable both 0 is refused, naming them."""
        e = self.assertRaises(CatalogError, version, 61, 2, "max_surge = 0\nmax_unavailable = 0\n")
        self.assertIn("max_unavailable", str(e))
        self.assertEqual(version(61, 2, "max_surge = 2\n").deployments["demo"].max_surge, 2)
