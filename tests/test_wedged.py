"""
Wedged replicas: the pure verdict on a shard's signal history (on a
L{Clock}), and the reconciler's response (out of routing in the same pass,
a C{hung} failure, a replacement).
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.core.catalog import CatalogError, parse_profile
from llmgw.control.core.wedged import Progress, observe, stall
from llmgw.control.state.signals import ShardSignals, from_message
from llmgw.crash import CrashClass
from tests.reconciler_harness import Fleet, catalog


class History:
    """
    A shard's samples as heartbeats bring them, on a L{Clock}; each sample
    is fresh when it arrives unless the scrapes fail.
    """

    def __init__(self, stall_after_s: float = 5.0) -> None:
        self.clock = Clock()
        self.stall_after_s = stall_after_s
        self.progress: Progress | None = None
        self.entry: ShardSignals | None = None

    def sample(self, running: float, tokens: float | None, error: str = "",
               age: float = 0.0) -> None:
        msg = pb.ShardSignals(shard_id="s", running=running, age_s=age, error=error)
        if tokens is not None:
            msg.generated_tokens = tokens
        self.entry = from_message(msg, self.clock.seconds())
        self.progress = observe(self.progress, self.entry)

    def failing(self, error: str = "no answer in time") -> None:
        """
        A heartbeat whose scrape failed: the last figures, older, and why.
        """
        assert self.entry is not None and self.entry.signals is not None
        self.entry = ShardSignals(self.entry.signals, error)
        self.progress = observe(self.progress, self.entry)

    def verdict(self) -> object:
        if self.progress is None or self.entry is None:
            return None
        return stall(self.progress, self.entry, self.clock.seconds(), self.stall_after_s)


class VerdictTests(SynchronousTestCase):
    def test_flat_counter_while_running(self) -> None:
        """
        Requests running and the generated-token counter flat: wedged once
        the counter has stood still for stall_after_s, not a moment before;
        the evidence names the running requests and the flat time.
        """
        h = History(stall_after_s=5)
        h.sample(running=2, tokens=100)
        for _ in range(4):
            h.clock.advance(1)
            h.sample(running=2, tokens=100)
            self.assertIsNone(h.verdict())
        h.clock.advance(1)
        h.sample(running=2, tokens=100)
        evidence = h.verdict()
        self.assertIsNotNone(evidence)
        self.assertEqual((evidence.running, evidence.flat_s), (2.0, 5.0))  # type: ignore[attr-defined]
        self.assertIn("2 requests running, generated tokens flat for 5.0s",
                      evidence.describe(5))  # type: ignore[attr-defined]

    def test_moving_counter_restarts_the_watch(self) -> None:
        """
        A counter that moves, however slowly, is progress: never wedged.
        """
        h = History(stall_after_s=3)
        for n in range(20):
            h.clock.advance(2)
            h.sample(running=1, tokens=float(n))
            self.assertIsNone(h.verdict())

    def test_idle_never_wedged(self) -> None:
        """
        An engine with nothing running may keep its counter flat for ever.
        """
        h = History(stall_after_s=2)
        for _ in range(30):
            h.clock.advance(1)
            h.sample(running=0, tokens=42)
            self.assertIsNone(h.verdict())
        self.assertIsNone(h.progress)

    def test_idle_in_between_restarts(self) -> None:
        """
        A stretch with nothing running ends the watch: a request after it
        is judged from its own start, not from the counter's last move.
        """
        h = History(stall_after_s=5)
        h.sample(running=1, tokens=10)
        h.clock.advance(3)
        h.sample(running=0, tokens=10)
        h.clock.advance(3)
        h.sample(running=1, tokens=10)
        h.clock.advance(4)
        h.sample(running=1, tokens=10)
        self.assertIsNone(h.verdict())
        h.clock.advance(1)
        h.sample(running=1, tokens=10)
        self.assertIsNotNone(h.verdict())

    def test_scrape_failures_count_as_flat_while_running(self) -> None:
        """
        An engine that stops answering its metrics while its last sample
        had requests running is flat from its counter's last move, up to
        now: wedged after stall_after_s with the scrape error as evidence.
        """
        h = History(stall_after_s=4)
        h.sample(running=3, tokens=7)
        h.clock.advance(1)
        h.sample(running=3, tokens=8)
        h.clock.advance(3)
        h.failing()
        self.assertIsNone(h.verdict())
        h.clock.advance(1)
        h.failing()
        evidence = h.verdict()
        self.assertIsNotNone(evidence)
        self.assertEqual(evidence.flat_s, 4.0)  # type: ignore[attr-defined]
        self.assertIn("its metrics do not answer: no answer in time",
                      evidence.describe(4))  # type: ignore[attr-defined]

    def test_scrape_failures_when_idle(self) -> None:
        """
        Scrapes that fail while the last sample had nothing running are no
        evidence: the engine is not judged.
        """
        h = History(stall_after_s=2)
        h.sample(running=0, tokens=5)
        for _ in range(10):
            h.clock.advance(1)
            h.failing()
            self.assertIsNone(h.verdict())

    def test_stale_sample_without_error_not_extrapolated(self) -> None:
        """
        A sample that is merely old (heartbeats late, scrapes answering) is
        judged up to its own time, not up to now.
        """
        h = History(stall_after_s=3)
        h.sample(running=1, tokens=5)
        h.clock.advance(10)
        self.assertIsNone(h.verdict())

    def test_off(self) -> None:
        """
        stall_after_s = 0 turns the check off.
        """
        h = History(stall_after_s=0)
        h.sample(running=1, tokens=5)
        h.clock.advance(3600)
        h.sample(running=1, tokens=5)
        self.assertIsNone(h.verdict())

    def test_no_counter_not_judged(self) -> None:
        """
        An engine without a generated-token counter (or an agent too old to
        send it) is never judged wedged.
        """
        h = History(stall_after_s=1)
        h.sample(running=1, tokens=None)
        h.clock.advance(100)
        h.sample(running=1, tokens=None)
        self.assertIsNone(h.progress)
        self.assertIsNone(h.verdict())

    def test_prompt_tokens_are_progress(self) -> None:
        """
        A long prefill moves the prompt-token counter while no output token
        comes: that is progress too.
        """
        progress = None
        for n in range(10):
            msg = pb.ShardSignals(shard_id="s", running=1, age_s=0, generated_tokens=3,
                                  prefix_cache_queries=100.0 * n)
            entry = from_message(msg, float(n))
            progress = observe(progress, entry)
            assert progress is not None
            self.assertIsNone(stall(progress, entry, float(n), 2))


class ProfileFieldTests(SynchronousTestCase):
    def test_default_and_checked(self) -> None:
        """
        A profile's stall_after_s is 15 s unless set; 0 is allowed (off),
        a negative or non-number value is refused, naming the field.
        """
        base = {"command": ["x"]}
        self.assertEqual(parse_profile("p", base).stall_after_s, 15.0)
        self.assertEqual(parse_profile("p", {**base, "stall_after_s": 0}).stall_after_s, 0)
        self.assertEqual(parse_profile("p", {**base, "stall_after_s": 2.5}).stall_after_s, 2.5)
        for bad in (-1, "10", True):
            e = self.assertRaises(CatalogError, parse_profile, "p", {**base, "stall_after_s": bad})
            self.assertIn("stall_after_s", str(e))


STALL_PROFILE = """
[profiles.watched]
gpus_per_shard = 1
gpu_memory_mb = 1000
stall_after_s = 3
command = ["x", "--port", "{port}"]
"""


class ReconcilerTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.fleet = Fleet({}, nodes=2, cat=catalog({"m": ("watched", 2)}, extra=STALL_PROFILE))
        self.fleet.past_grace()
        self.fleet.make_ready()
        self.fleet.step()
        self.starts = list(self.fleet.dispatcher.starts)
        self.assertEqual(len(self.fleet.rec.routes("m")), 2)

    def heartbeat(self, cmd: object, running: float, tokens: float) -> None:
        self.fleet.rec.record_engine_signals(cmd.node_id, [  # type: ignore[attr-defined]
            pb.ShardSignals(shard_id=cmd.shard_id, running=running,  # type: ignore[attr-defined]
                            generated_tokens=tokens, age_s=0)])

    def test_wedged_replaced_as_hung(self) -> None:
        """
        A replica whose counter stays flat with requests running leaves the
        routes in the pass that finds it, gets a replica_wedged event with
        the evidence, fails with class hung (shown in the deployment's last
        failure), is stopped, and a replacement is placed; the healthy
        replica beside it is untouched.
        """
        wedged, healthy = self.starts
        for n in range(3):
            self.heartbeat(wedged, running=2, tokens=50)
            self.heartbeat(healthy, running=2, tokens=50 + 10 * n)
            self.fleet.step()
            self.assertEqual(len(self.fleet.rec.routes("m")), 2)
        self.heartbeat(wedged, running=2, tokens=50)
        self.heartbeat(healthy, running=2, tokens=100)
        self.fleet.step()
        routes = self.fleet.rec.routes("m")
        self.assertEqual([r.replica_id for r in routes], [healthy.replica_id])
        events = self.fleet.rec.events()
        [ev] = [e for e in events if e["kind"] == "replica_wedged"]
        self.assertEqual((ev["replica"], ev["crash_class"]), (wedged.replica_id, "hung"))
        self.assertIn("2 requests running, generated tokens flat for 3.0s", ev["reason"])
        self.assertIn((wedged.node_id, wedged.shard_id), self.fleet.dispatcher.stops)
        [dep] = [d for d in self.fleet.rec.deployments() if d["model"] == "m"]
        self.assertEqual(dep["last_failure"]["crash_class"], str(CrashClass.HUNG))
        # The stop confirmed, a new replica is placed in its stead.
        before = len(self.fleet.dispatcher.starts)
        self.fleet.confirm_stops()
        self.fleet.step(1.0, 10)
        self.assertGreater(len(self.fleet.dispatcher.starts), before)

    def test_busy_replica_kept(self) -> None:
        """
        Replicas whose counters move, and idle ones, stay routed however
        long it lasts.
        """
        busy, idle = self.starts
        for n in range(20):
            self.heartbeat(busy, running=4, tokens=float(n))
            self.heartbeat(idle, running=0, tokens=9)
            self.fleet.step()
        self.assertEqual(len(self.fleet.rec.routes("m")), 2)
        self.assertFalse([e for e in self.fleet.rec.events() if e["kind"] == "replica_wedged"])


class AgentMeasureTests(SynchronousTestCase):
    def entry(self, flat: float | None, error: str = "") -> ShardSignals:
        msg = pb.ShardSignals(shard_id="s", running=2, age_s=0, generated_tokens=40, error=error)
        if flat is not None:
            msg.flat_for_s = flat
        return from_message(msg, 100.0)

    def test_agents_flat_for_s_is_the_stall(self) -> None:
        """
        An agent's flat_for_s is the standstill judged, whatever the control
        plane has seen of the samples itself (here: one sample, nothing to
        reckon from): under the threshold kept, at it wedged, with the
        agent's figure in the evidence.
        """
        entry = self.entry(2.9)
        progress = observe(None, entry)
        assert progress is not None
        self.assertIsNone(stall(progress, entry, 100.0, 3))
        entry = self.entry(3.0)
        evidence = stall(progress, entry, 100.0, 3)
        assert evidence is not None
        self.assertEqual(evidence.flat_s, 3.0)

    def test_bad_figures_dropped(self) -> None:
        """
        A negative or non-finite flat_for_s is not trusted: the control
        plane's own reckoning applies, as for an older agent.
        """
        for bad in (-1.0, float("inf"), float("nan")):
            self.assertIsNone(self.entry(bad).flat_for_s)
        self.assertIsNone(self.entry(None).flat_for_s)


class HeartbeatDecisionTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.fleet = Fleet({}, nodes=2, cat=catalog({"m": ("watched", 2)}, extra=STALL_PROFILE))
        self.fleet.past_grace()
        self.fleet.make_ready()
        self.fleet.step()
        self.starts = list(self.fleet.dispatcher.starts)

    def heartbeat(self, cmd: object, flat: float, tokens: float = 50) -> None:
        self.fleet.rec.record_engine_signals(cmd.node_id, [  # type: ignore[attr-defined]
            pb.ShardSignals(shard_id=cmd.shard_id, running=2,  # type: ignore[attr-defined]
                            generated_tokens=tokens, age_s=0, flat_for_s=flat)])

    def test_out_of_routing_on_the_heartbeat(self) -> None:
        """
        The heartbeat whose flat_for_s reaches the profile's stall_after_s
        takes the replica out of the routes as it is handled, with no pass
        run and no time passed; one under it changes nothing.
        """
        wedged, healthy = self.starts
        self.heartbeat(wedged, flat=2.9)
        self.assertEqual(len(self.fleet.rec.routes("m")), 2)
        self.heartbeat(wedged, flat=3.0)
        self.assertEqual([r.replica_id for r in self.fleet.rec.routes("m")], [healthy.replica_id])
        [ev] = [e for e in self.fleet.rec.events() if e["kind"] == "replica_wedged"]
        self.assertIn("flat for 3.0s (stall_after_s 3)", ev["reason"])
        self.assertEqual(ev["crash_class"], "hung")
