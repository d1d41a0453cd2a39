"""
The crash backoff of a deployment with variants is kept per variant: a
failure counts against the failed replica's variant, placement passes over
a variant in backoff to the next cheapest with room, and a replica ready
long enough forgives its own variant only. Deployments without variants
keep one backoff, as before.
"""

from __future__ import annotations

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.state.interfaces import ShardCommand
from tests.reconciler_harness import Fleet
from tests.test_gputypes import cat, inventory

VARIANTS = 'model = "m"\nreplicas = 1\nvariants = [{profile = "h100", cost = 4}, {profile = "l4", cost = 1}]\n'


def fleet(nodes: dict[str, list[str]], deployment: str = VARIANTS) -> Fleet:
    f = Fleet({}, inventory=inventory(nodes), cat=cat(deployment))
    f.past_grace()
    return f


def crash(f: Fleet, cmd: ShardCommand) -> None:
    """
    C{cmd}'s shard fails while starting (never ready: a crash loop).
    """
    f.report(cmd, "starting")
    f.report(cmd, "failed", exit_code=1)


def view(f: Fleet) -> dict[str, Any]:
    [dep] = f.rec.deployments()
    return dep


class VariantBackoffTests(SynchronousTestCase):
    def test_other_variant_placed_meanwhile(self) -> None:
        """
        A replica of the cheapest variant that crashes puts that variant in
        backoff only: its replacement goes on the next variant at once, and
        the deployment is not shown as in backoff, its variant is.
        """
        f = fleet({"n1": ["L4", "L4"], "n2": ["H100", "H100"]})
        [cmd] = f.dispatcher.starts
        self.assertEqual(cmd.profile, "l4")
        f.dispatcher.clear()
        crash(f, cmd)
        failed_at = f.clock.seconds()
        f.step()
        self.assertEqual([c.profile for c in f.dispatcher.starts], ["h100"])
        dep = view(f)
        self.assertIsNone(dep["backoff_until"])
        self.assertEqual(dep["failures"], 1)
        self.assertEqual(dep["variants_backoff"], {
            "l4": {"failures": 1, "backoff_until": failed_at + 10},
            "h100": {"failures": 0, "backoff_until": None},
        })
        self.assertEqual(f.rec.status()["deployments"]["in_backoff"], 0)

    def test_all_variants_in_backoff_block_the_deployment(self) -> None:
        """
        With every variant in backoff nothing is placed, and the
        deployment's C{backoff_until} is when the first variant comes out
        of it; its C{failures} are the variants' summed.
        """
        f = fleet({"n1": ["L4"], "n2": ["H100"]})
        [l4] = f.dispatcher.starts
        f.dispatcher.clear()
        crash(f, l4)
        l4_until = f.clock.seconds() + 10
        f.step()
        [h100] = f.dispatcher.starts
        self.assertEqual(h100.profile, "h100")
        f.dispatcher.clear()
        crash(f, h100)
        dep = view(f)
        self.assertEqual(dep["backoff_until"], l4_until)
        self.assertEqual(dep["failures"], 2)
        self.assertEqual(f.rec.status()["deployments"]["in_backoff"], 1)
        while not f.dispatcher.starts:
            f.step()
        self.assertEqual(f.clock.seconds(), l4_until)
        self.assertEqual([c.profile for c in f.dispatcher.starts], ["l4"])

    def test_own_backoff_doubles(self) -> None:
        """
        A variant that keeps crashing waits twice as long after each of its
        failures, as a deployment without variants does; the other
        variant's count stays 0.
        """
        f = fleet({"n1": ["L4", "L4"]})
        delays = []
        for _ in range(4):
            [cmd] = f.dispatcher.starts
            self.assertEqual(cmd.profile, "l4")
            f.dispatcher.clear()
            crash(f, cmd)
            start = f.clock.seconds()
            while not f.dispatcher.starts:
                f.step()
            delays.append(f.clock.seconds() - start)
        self.assertEqual(delays, [10, 20, 40, 80])
        backoffs = view(f)["variants_backoff"]
        self.assertEqual((backoffs["l4"]["failures"], backoffs["h100"]["failures"]), (4, 0))
        # No room on H100s: the deployment cannot place while l4 waits,
        # and the reason says why the cheaper variant was not tried.
        [cmd] = f.dispatcher.starts
        f.dispatcher.clear()
        crash(f, cmd)
        f.step()
        self.assertIn("profile h100", view(f)["unplaceable"])
        self.assertIn("other variants in backoff", view(f)["unplaceable"])

    def test_ready_replica_forgives_its_own_variant(self) -> None:
        """
        A replica ready long enough resets its own variant's count, not
        another variant's.
        """
        f = fleet({"n1": ["L4"], "n2": ["H100"]}, VARIANTS.replace("replicas = 1", "replicas = 2"))
        for cmd in sorted(f.dispatcher.starts, key=lambda c: c.profile):
            crash(f, cmd)
        f.dispatcher.clear()
        while len(f.dispatcher.starts) < 2:
            f.step()
        [h100] = [c for c in f.dispatcher.starts if c.profile == "h100"]
        [l4] = [c for c in f.dispatcher.starts if c.profile == "l4"]
        f.dispatcher.clear()
        f.make_ready([h100])
        crash(f, l4)
        # No more l4 replicas, that would fail in their turn unattended.
        f.rec.cordon("n1")
        f.step(1.0, 601)
        backoffs = view(f)["variants_backoff"]
        self.assertEqual((backoffs["h100"]["failures"], backoffs["l4"]["failures"]), (0, 2))
        resets = [e["reason"] for e in f.rec.events() if e["kind"] == "backoff_reset"]
        self.assertEqual(resets, ["variant h100 of m ready long enough"])


class NoVariantTests(SynchronousTestCase):
    def test_one_backoff_as_before(self) -> None:
        """
        A deployment without variants keeps one backoff: nothing is placed
        until it runs out, the view shows it, and there is no per-variant
        detail.
        """
        f = fleet({"n1": ["L4", "L4"]}, 'model = "m"\nreplicas = 1\nprofile = "l4"\n')
        [cmd] = f.dispatcher.starts
        f.dispatcher.clear()
        crash(f, cmd)
        until = f.clock.seconds() + 10
        dep = view(f)
        self.assertEqual((dep["backoff_until"], dep["failures"], dep["variants_backoff"]), (until, 1, None))
        self.assertEqual(f.rec.deps["m"].backoff.failures, 1)
        f.step(1.0, 9)
        self.assertEqual(f.dispatcher.starts, [])
        f.step()
        self.assertEqual(len(f.dispatcher.starts), 1)
