"""
Making room by sleep (DESIGN §22): when a model's requests wait and no GPU
is free, an idle evictable replica whose engine sleeps is put to sleep
(C{SleepShard}) rather than taken, and lending then places the model on
its GPU; a replica not heard asleep in time, a busy one, or one whose
engine llmgw cannot put to sleep is taken as before. The agent's side:
L{llmgw.agent.sleep.Sleeper.sleep_now}.
"""

from __future__ import annotations

import struct
import tomllib
from dataclasses import replace

from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.scrape import Sample
from llmgw.agent.shard import READY, Shard
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.core import lending, swapping
from llmgw.control.core.catalog import parse_catalog
from llmgw.routing import Demand, EngineSignals
from llmgw.wire import FrameError, ack, decode
from tests.reconciler_harness import ONE_GPU, Fleet
from tests.test_agent_client import Harness, frame
from tests.test_sleep import SleeperCase

SLEEPY = """
[profiles.sleepy]
gpus_per_shard = 1
gpu_memory_mb = 1000
engine = "vllm"
sleep_level = 1
command = ["x"]
startup_timeout_s = 60
drain_timeout_s = 10
"""


def catalog(a_profile: str = "sleepy", a_priority: int = 0, resident: float = 0) -> str:
    text = ONE_GPU + SLEEPY
    for model, profile, priority, extra in (("a", a_profile, a_priority, "sleep_after_s = 300\n" if a_profile == "sleepy" else ""),
                                            ("want", "one", 0, "")):
        text += (f'\n[[deployments]]\nmodel = "{model}"\nprofile = "{profile}"\nmin_replicas = 0\nmax_replicas = 1\n'
                 f'scale_to_zero_after_s = 3600\nevictable = true\npriority = {priority}\n'
                 f'min_resident_s = {resident}\n'
                 + extra)
    return text


class SleepToMakeRoomTests(SynchronousTestCase):
    def setup(self, running: float = 0.0, **kw: str | int) -> Fleet:
        """One node of one GPU; a's replica ready, awake, C{running} requests by its figures."""
        f = Fleet({}, nodes=1, gpus=1, grace=0, cat=parse_catalog(tomllib.loads(catalog(**kw))))  # type: ignore[arg-type]
        self.a = f.bring_up("a")
        self.signal(f, sleeping=False, running=running)
        f.rec.report_demand("gw", {})
        f.step(passes=5)
        return f

    def signal(self, f: Fleet, sleeping: bool, running: float = 0.0) -> None:
        shard = f.rec.replica_recs[self.a].shards[0]
        f.rec.record_engine_signals(shard.node_id, [pb.ShardSignals(
            shard_id=shard.id, running=running, waiting=0.0, age_s=0.0, sleeping=sleeping, wake_path="/wake_up")])
        f.clock.advance(0)

    def want(self, f: Fleet, passes: int = 1) -> None:
        for _ in range(passes):
            f.rec.report_demand("gw", {"want": Demand(0, 3)})
            f.step()

    def events(self, f: Fleet, *kinds: str) -> list[tuple[str, str]]:
        return [(e.kind, e.replica or "") for e in f.rec.event_log.since() if e.kind in kinds]

    def test_slept_then_lent(self) -> None:
        """
        An idle replica whose engine sleeps is told to sleep, not drained:
        its count stays, a C{swap_sleep} event says why; once its
        heartbeat says it sleeps, lending places the wanted model on its
        GPU, and nothing was taken.
        """
        f = self.setup()
        shard = f.rec.replica_recs[self.a].shards[0]
        self.want(f)
        self.assertEqual(f.dispatcher.sleeps, [(shard.node_id, shard.id)])
        self.assertEqual(self.events(f, "swap", "swap_sleep"), [("swap_sleep", self.a)])
        self.assertEqual(f.rec.replica_recs[self.a].phase.value, "active")
        self.assertEqual(f.rec.ctx.desired["a"], 1)
        # Its requests may wait for the sleep's bound, a drain and a start.
        self.assertEqual(f.rec.ctx.room["want"], swapping.SLEEP_BOUND_S + 10 + 60)
        # Not asleep yet: asked once, nothing else done.
        self.want(f, passes=3)
        self.assertEqual(len(f.dispatcher.sleeps), 1)
        self.assertEqual([c for c in f.dispatcher.starts if c.model == "want"], [])
        self.signal(f, sleeping=True)
        self.want(f)
        f.step(seconds=lending.LEND_GRACE_S)  # a lend's borrower starts after the grace
        [start] = [c for c in f.dispatcher.starts if c.model == "want"]
        self.assertEqual(tuple(start.gpu_indices), shard.gpus)
        self.assertEqual(self.events(f, "gpu_lent", "replica_displaced"),
                         [("gpu_lent", start.replica_id), ("replica_displaced", self.a)])
        self.assertEqual(self.events(f, "swap", "swap_sleep_failed"), [])
        self.assertEqual(f.dispatcher.drains, [])
        self.assertEqual(f.rec.swapping.sleeping, {})

    def test_not_asleep_in_time(self) -> None:
        """
        A replica not heard asleep within the bound (the agent refused, or
        is too old to know the command) is taken instead, and not asked
        to sleep again.
        """
        f = self.setup()
        self.want(f)
        self.assertEqual(len(f.dispatcher.sleeps), 1)
        self.want(f, passes=int(swapping.SLEEP_BOUND_S) - 2)
        self.assertEqual(self.events(f, "swap", "swap_sleep_failed"), [])
        self.want(f, passes=3)
        self.assertEqual(self.events(f, "swap", "swap_sleep_failed"),
                         [("swap_sleep_failed", ""), ("swap", self.a)])
        self.assertEqual(f.rec.replica_recs[self.a].phase.value, "draining")
        self.assertEqual(len(f.dispatcher.sleeps), 1)
        self.assertEqual(f.rec.ctx.desired["a"], 0)

    def refused(self, f: Fleet, why: str) -> None:
        shard = f.rec.replica_recs[self.a].shards[0]
        f.rec.record_engine_signals(shard.node_id, [pb.ShardSignals(
            shard_id=shard.id, running=0.0, waiting=0.0, age_s=0.0, sleeping=False, wake_path="/wake_up",
            sleep_refused=why)])
        f.clock.advance(0)

    def test_refused_at_once(self) -> None:
        """
        A replica whose agent says it will not sleep it is taken at the
        next pass, not at the bound, the agent's reason in the event, and
        it is not asked to sleep again.
        """
        f = self.setup()
        self.want(f)
        self.assertEqual(len(f.dispatcher.sleeps), 1)
        self.refused(f, "busy: 1 request(s) running, 0 waiting")
        self.want(f)
        self.assertEqual(self.events(f, "swap", "swap_sleep_failed"),
                         [("swap_sleep_failed", ""), ("swap", self.a)])
        [failed] = [e for e in f.rec.event_log.since() if e.kind == "swap_sleep_failed"]
        self.assertIn(f"{self.a}: busy: 1 request(s) running", failed.reason)
        self.assertNotIn("within", failed.reason)
        self.assertEqual(f.rec.replica_recs[self.a].phase.value, "draining")
        self.assertEqual(len(f.dispatcher.sleeps), 1)
        self.assertEqual(f.rec.ctx.sleep_refused, {})

    def test_late_refusal_forgotten(self) -> None:
        """
        A refusal heard while no sleep of that replica is waited for (it
        came after the bound, or from an earlier ask) fails nothing later:
        the next swap by sleep waits for its own answer.
        """
        f = self.setup()
        self.refused(f, "busy: 1 request(s) running, 0 waiting")
        self.want(f)
        self.assertEqual(len(f.dispatcher.sleeps), 1)
        self.want(f, passes=3)
        self.assertEqual(self.events(f, "swap", "swap_sleep_failed"), [])
        self.assertEqual(f.rec.replica_recs[self.a].phase.value, "active")

    def test_refusal_of_another_node_ignored(self) -> None:
        """
        A node speaks only for its own shards: a refusal it sends for a
        shard on another node changes nothing.
        """
        f = self.setup()
        self.want(f)
        shard = f.rec.replica_recs[self.a].shards[0]
        f.rec.record_engine_signals("someone-else", [pb.ShardSignals(shard_id=shard.id, sleep_refused="no")])
        self.want(f, passes=2)
        self.assertEqual(self.events(f, "swap", "swap_sleep_failed"), [])

    def test_busy_is_taken(self) -> None:
        """
        A replica with requests running by its figures is not put to sleep
        (a sleep would stall them): taken as before, once they drain.
        """
        f = self.setup(running=2.0)
        self.want(f)
        self.assertEqual(f.dispatcher.sleeps, [])
        self.assertEqual(self.events(f, "swap", "swap_sleep"), [("swap", self.a)])

    def test_engine_that_does_not_sleep(self) -> None:
        """
        A replica whose profile does not sleep is taken as before.
        """
        f = self.setup(a_profile="one")
        self.want(f)
        self.assertEqual(f.dispatcher.sleeps, [])
        self.assertEqual(self.events(f, "swap", "swap_sleep"), [("swap", self.a)])

    def test_min_resident(self) -> None:
        """
        A replica ready for less than its min_resident_s is neither put to
        sleep nor taken.
        """
        f = self.setup(resident=1000)
        self.want(f, passes=3)
        self.assertEqual(f.dispatcher.sleeps, [])
        self.assertEqual(self.events(f, "swap", "swap_sleep"), [])

    def test_less_important_is_taken(self) -> None:
        """
        A replica less important than the wanting model is taken, not
        slept: lending gives a sleeper's GPU only to a borrower no more
        important, so its sleep would make no room.
        """
        f = self.setup(a_priority=-1)
        self.want(f)
        self.assertEqual(f.dispatcher.sleeps, [])
        self.assertEqual(self.events(f, "swap", "swap_sleep"), [("swap", self.a)])


class AgentSleepNowTests(SleeperCase):
    def seen(self, running: float) -> None:
        self.scraper.samples["s"] = Sample(EngineSignals(self.clock.seconds(), waiting=0.0, running=running))

    def test_sleeps_at_once(self) -> None:
        """
        An idle vLLM leader asked to sleep is put to sleep at once at its
        level, long before its own sleep_after_s, through the idle
        sleeper's call, and the change is told at once (a heartbeat).
        """
        self.sup.add("vllm", level=1, after=300.0)
        self.seen(0.0)
        self.assertIsNone(self.sleeper.sleep_now("s"))
        self.assertEqual(self.call.calls, [(b"POST", "http://127.0.0.1:8001/sleep?level=1", b"")])
        self.call.answer()
        self.assertEqual(self.sleeper.state_of("s"), (True, "/wake_up"))
        self.assertTrue(self.sleeper.lends(self.sup.shards["s"]))
        # Asked again while asleep: nothing more to do.
        self.assertIsNone(self.sleeper.sleep_now("s"))
        self.assertEqual(len(self.call.calls), 1)

    def test_refusals(self) -> None:
        """
        An unknown shard, an engine llmgw cannot put to sleep (llama.cpp
        sleeps by its own timer), a follower, a busy shard and one with no
        figures yet are refused with a reason, and no call is made. Each
        refusal of a shard that runs here is told at once (a heartbeat),
        its reason once.
        """
        self.assertIn("no such shard", self.sleeper.sleep_now("s") or "")
        self.assertEqual((self.changes, self.sleeper.take_refusal("s")), ([], ""))
        self.sup.add("llamacpp")
        self.seen(0.0)
        self.assertIn("not one llmgw puts to sleep", self.sleeper.sleep_now("s") or "")
        self.assertEqual(self.changes, ["s"])
        self.assertIn("not one llmgw puts to sleep", self.sleeper.take_refusal("s"))
        self.assertEqual(self.sleeper.take_refusal("s"), "")
        shard = self.sup.add("vllm")
        self.sup.shards["s"] = Shard(replace(shard.spec, rank=1), READY)
        self.assertIn("rank 1", self.sleeper.sleep_now("s") or "")
        self.sup.add("sglang")
        del self.scraper.samples["s"]
        self.assertIn("no figures", self.sleeper.sleep_now("s") or "")
        self.seen(2.0)
        self.assertIn("2 request(s) running", self.sleeper.sleep_now("s") or "")
        self.assertEqual(self.call.calls, [])
        self.assertEqual(self.changes, ["s"] * 4)
        # The newest reason is the one told.
        self.assertIn("2 request(s) running", self.sleeper.take_refusal("s"))

    def test_refusal_in_heartbeat(self) -> None:
        """
        A refusal goes out in the shard's signals of the next heartbeat
        only; one kept for a shard that is gone is forgotten.
        """
        self.scraper.sleep_refused = self.sleeper.take_refusal
        self.sup.add("vllm", level=1)
        self.seen(3.0)
        self.sleeper.sleep_now("s")
        [msg] = self.scraper.heartbeat_signals()
        self.assertIn("3 request(s) running", msg.sleep_refused)
        [msg] = self.scraper.heartbeat_signals()
        self.assertEqual(msg.sleep_refused, "")
        self.sleeper.sleep_now("s")
        del self.sup.shards["s"]
        self.sleeper.tick()
        self.assertEqual(self.sleeper.refused, {})

    def test_failed_call(self) -> None:
        """
        A sleep call that fails leaves the shard awake, and the control
        plane is told why at once (it then falls back to taking a replica).
        """
        self.sup.add("sglang")
        self.seen(0.0)
        self.assertIsNone(self.sleeper.sleep_now("s"))
        self.assertEqual(self.changes, [])
        self.call.pending.pop(0).errback(RuntimeError("503"))
        self.assertEqual(self.sleeper.state_of("s"), (False, "/resume_memory_occupation"))
        self.assertEqual(self.changes, ["s"])
        self.assertEqual(self.sleeper.take_refusal("s"), "its engine's sleep call failed: 503")


class SleepShardStreamTests(SynchronousTestCase):
    def test_dispatched(self) -> None:
        """
        A SleepShard from the current epoch reaches the agent's sleeper;
        one from an older control plane is refused.
        """
        h = Harness(self)
        asked: list[str] = []
        h.core.sleep_shard = asked.append
        proto, _ = h.connect()
        proto.dataReceived(frame(ack("register")))
        proto.dataReceived(frame(pb.ControlMessage(start=pb.StartShard(shard_id="x", epoch=10))))
        proto.dataReceived(frame(pb.ControlMessage(sleep=pb.SleepShard(shard_id="s1", epoch=10))))
        proto.dataReceived(frame(pb.ControlMessage(sleep=pb.SleepShard(shard_id="s2", epoch=9))))
        self.assertEqual(asked, ["s1"])

    def test_unknown_member_to_an_older_agent(self) -> None:
        """
        What an agent older than SleepShard makes of it: a member of the
        oneof it does not know decodes as an empty message, refused as a
        frame (logged) while the stream goes on.
        """
        # Field 99 (tag 99 << 3 | 2 as a varint), length 2, holding a string field 1 of length 0.
        unknown = b"\x9a\x06\x02\x0a\x00"
        self.assertRaises(FrameError, decode, pb.ControlMessage, unknown)
        h = Harness(self)
        proto, transport = h.connect()
        proto.dataReceived(frame(ack("register")))
        proto.dataReceived(struct.pack("!I", len(unknown)) + unknown)
        self.assertFalse(transport.disconnecting)
        self.assertTrue(proto.is_registered)


PAIRS = """
[profiles.pair]
shards = 2
gpus_per_shard = 1
gpu_memory_mb = 1000
fabric = "ib0"
command = ["x"]
startup_timeout_s = 60
drain_timeout_s = 10

[profiles.sleepy-pair]
shards = 2
gpus_per_shard = 1
gpu_memory_mb = 1000
fabric = "ib0"
engine = "vllm"
sleep_level = 1
command = ["x"]
startup_timeout_s = 60
drain_timeout_s = 10
"""


class SleepSpreadTests(SynchronousTestCase):
    def test_spread_replica_slept_then_lent(self) -> None:
        """
        A two-node replica whose engine sleeps is put to sleep through its
        leader alone (one SleepShard), and once its leader says it sleeps
        a two-shard model borrows its GPUs on both nodes.
        """
        text = ONE_GPU + PAIRS
        for model, profile, extra in (("a", "sleepy-pair", "sleep_after_s = 300\n"), ("want", "pair", "")):
            text += (f'\n[[deployments]]\nmodel = "{model}"\nprofile = "{profile}"\nmin_replicas = 0\n'
                     f'max_replicas = 1\nscale_to_zero_after_s = 3600\nevictable = true\nmin_resident_s = 0\n'
                     + extra)
        f = Fleet({}, nodes=2, gpus=1, grace=0, cat=parse_catalog(tomllib.loads(text)))
        a = f.bring_up("a")
        leader = f.rec.replica_recs[a].shards[0]

        def signal(sleeping: bool) -> None:
            f.rec.record_engine_signals(leader.node_id, [pb.ShardSignals(
                shard_id=leader.id, running=0.0, waiting=0.0, age_s=0.0, sleeping=sleeping, wake_path="/wake_up")])
            f.clock.advance(0)

        signal(False)
        f.rec.report_demand("gw", {})
        f.step(passes=5)
        f.rec.report_demand("gw", {"want": Demand(0, 2)})
        f.step()
        self.assertEqual(f.dispatcher.sleeps, [(leader.node_id, leader.id)])
        signal(True)
        f.rec.report_demand("gw", {"want": Demand(0, 2)})
        f.step()
        f.step(seconds=lending.LEND_GRACE_S)  # a lend's borrower starts after the grace
        placed = sorted((c.node_id, c.rank) for c in f.dispatcher.starts if c.model == "want")
        self.assertEqual(len({node for node, _ in placed}), 2)
        self.assertEqual([e.kind for e in f.rec.event_log.since() if e.kind in ("swap", "swap_sleep")],
                         ["swap_sleep"])
