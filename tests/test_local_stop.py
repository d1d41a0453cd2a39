"""
The local fleet's orderly stop: its shards are stopped by the agents
directly, and the control plane is told to expect that, so a SIGTERM logs
no "stopped without being told to" warnings; a shard that stops unasked
while the fleet runs is still warned about.
"""

from __future__ import annotations

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmgw.local import stops_expected
from tests.reconciler_harness import Fleet


def warnings(f: Fleet) -> list[dict[str, Any]]:
    return [e for e in f.rec.events() if e["kind"] == "shard_stopped"]


class OrderlyStopTests(SynchronousTestCase):
    def ready_fleet(self) -> Fleet:
        f = Fleet({"demo": ("one", 3)}, nodes=2, grace=0)
        f.step()
        f.make_ready()
        f.rec.stopService()
        return f

    def test_orderly_stop_is_quiet(self) -> None:
        """
        After L{stops_expected}, shards reported stopping and then stopped
        (the agents' own stop at shutdown) are forgotten with no
        C{shard_stopped} warning.
        """
        f = self.ready_fleet()
        starts = list(f.dispatcher.starts)
        self.assertEqual(len(starts), 3)
        stops_expected(f.rec)
        for cmd in starts:
            f.report(cmd, "stopping")
            f.report(cmd, "stopped")
        self.assertEqual(warnings(f), [])
        self.assertEqual(f.rec.shard_recs, {})

    def test_unexpected_stop_still_warns(self) -> None:
        """
        Without it, a shard that reports stopped unasked is warned about,
        as before.
        """
        f = self.ready_fleet()
        f.report(f.dispatcher.starts[0], "stopped")
        [ev] = warnings(f)
        self.assertEqual(ev["reason"], "stopped without being told to")
