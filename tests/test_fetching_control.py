"""
Fetching shards on the control plane's side: a shard whose agent is
putting its weights on the node is held like a starting one (no resend, no
replacement, not ready) with no deadline until it is starting; its
progress from heartbeats shows in the replicas view, C{llmgw ctl
replicas}, the watch stream's replica views and C{/metrics}.
"""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.utils import floatToGoString
from twisted.trial.unittest import SynchronousTestCase

from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.shell.metrics import ControlCollector, make_registry
from llmgw.control.state.fetches import FetchProgress
from llmgw.ctl.fleet import render_replicas
from llmgw.ctl.render import fetch_text
from llmgw.states import ReplicaState
from tests.reconciler_harness import Fleet
from tests.test_metrics import FakeAgents

GIB = 1024**3


class FetchingControlTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.fleet = Fleet({"m": ("one", 1)}, nodes=2)
        self.fleet.past_grace()
        self.fleet.step()
        [self.cmd] = self.fleet.dispatcher.starts

    def fetching(self) -> None:
        self.fleet.report(self.cmd, "fetching")

    def heartbeat(self, done: int, total: int, rate: float) -> None:
        self.fleet.rec.record_fetches(self.cmd.node_id, [
            pb.FetchProgress(shard_id=self.cmd.shard_id, done=done, total=total, rate=rate)])

    def test_held_without_deadline(self) -> None:
        """
        A fetching shard is neither resent (it was heard from) nor failed
        at its startup timeout while it fetches, and is not routed; once it
        is starting, its startup timeout runs from then.
        """
        self.fetching()
        rec = self.fleet.rec
        [replica] = rec.replicas()
        self.assertEqual((replica["state"], replica["shards"][0]["state"]),
                         (ReplicaState.FETCHING, "fetching"))
        self.fleet.step(10.0, 30)  # well past the pending (and 60 s startup) timeouts
        self.assertEqual(len(self.fleet.dispatcher.starts), 1)
        self.assertEqual(self.fleet.dispatcher.stops, [])
        self.assertEqual(rec.routes("m"), [])
        self.fleet.report(self.cmd, "starting")
        self.fleet.step(10.0, 5)
        self.assertEqual(self.fleet.dispatcher.stops, [])
        self.fleet.step(10.0, 2)
        self.assertEqual(len(self.fleet.dispatcher.stops), 1)

    def test_ready_after_fetch(self) -> None:
        """
        fetching -> starting -> ready serves, its fetch progress gone.
        """
        self.fetching()
        self.heartbeat(1, 2, 3.0)
        self.fleet.report(self.cmd, "starting")
        self.fleet.report(self.cmd, "ready")
        [replica] = self.fleet.rec.replicas()
        self.assertEqual((replica["state"], replica["shards"][0]["fetch"]), ("ready", None))
        self.assertEqual(len(self.fleet.rec.routes("m")), 1)

    def test_adopted_while_fetching(self) -> None:
        """
        A Register listing a shard as fetching claims it (it is not stopped
        as unclaimed, nor failed as missing).
        """
        self.fetching()
        running = self.fleet.running(self.cmd.node_id)
        self.assertEqual([s.state for s in running], ["fetching"])
        self.assertEqual(self.fleet.register(self.cmd.node_id, running), [])
        self.assertEqual(self.fleet.dispatcher.stops, [])
        self.assertEqual(self.fleet.rec.shard_recs[self.cmd.shard_id].state, "fetching")

    def test_progress_shown(self) -> None:
        """
        A heartbeat's progress shows on the shard in the replicas view (what
        the watch stream diffs), in `llmgw ctl replicas` and in /metrics;
        progress from another node, or for a shard not fetching, is not kept.
        """
        self.fetching()
        done, total, rate = int(1.2 * GIB), int(2.9 * GIB), 85 * 1024**2
        other = next(n for n in self.fleet.ids if n != self.cmd.node_id)
        self.fleet.rec.record_fetches(other, [
            pb.FetchProgress(shard_id=self.cmd.shard_id, done=1, total=2, rate=1)])
        self.heartbeat(done, total, rate)
        [replica] = self.fleet.rec.replicas()
        self.assertEqual(replica["shards"][0]["fetch"], {"done": done, "total": total, "rate": rate})
        table = render_replicas(self.fleet.rec.replicas())
        self.assertIn("fetching 41% 1.2 GiB/2.9 GiB 85 MiB/s", table)

        registry = make_registry()
        registry.register(ControlCollector(FakeAgents([]), lambda: self.fleet.rec))
        text = generate_latest(registry).decode()
        labels = (f'model="m",node="{self.cmd.node_id}",replica="{self.cmd.replica_id}",'
                  f'shard="{self.cmd.shard_id}"')
        self.assertIn(f"llmgw_shard_fetch_bytes{{{labels}}} {floatToGoString(done)}", text)
        self.assertIn(f"llmgw_shard_fetch_total_bytes{{{labels}}} {floatToGoString(total)}", text)
        self.assertIn(f"llmgw_shard_fetch_rate_bytes_per_second{{{labels}}} {floatToGoString(rate)}", text)
        self.assertIn('llmgw_shards{state="fetching"} 1.0', text)

        # The next heartbeat without it, or the shard starting, clears it.
        self.fleet.rec.record_fetches(self.cmd.node_id, [])
        self.assertIsNone(self.fleet.rec.replicas()[0]["shards"][0]["fetch"])
        self.heartbeat(done, total, rate)
        self.fleet.report(self.cmd, "starting")
        self.fleet.rec.record_fetches(self.cmd.node_id, [
            pb.FetchProgress(shard_id=self.cmd.shard_id, done=1, total=2, rate=1)])
        self.assertIsNone(self.fleet.rec.replicas()[0]["shards"][0]["fetch"])


class FetchTextTests(SynchronousTestCase):
    def test_forms(self) -> None:
        """
        Progress reads as percent, done/total and rate; without a total as
        bytes done; a bad rate from an agent reads as none.
        """
        self.assertEqual(fetch_text({"done": 512, "total": 1024, "rate": 0}), "50% 512 B/1.0 KiB")
        self.assertEqual(fetch_text({"done": 5 * 1024**2, "total": None, "rate": 2048}),
                         "5.0 MiB 2.0 KiB/s")
        bad = FetchProgress.from_message(pb.FetchProgress(done=1, total=0, rate=float("nan")))
        self.assertEqual(bad, FetchProgress(1, None, 0.0))
