"""
The agent's side of a lend (DESIGN §22): a start on GPUs that a sleeping
leader of its own holds waits for that engine to say, asked there and then,
that it still sleeps; it is refused if the engine is awake or cannot say,
and a lender that wakes beside a running borrower is a warning. Against a
fake call (a Clock, no sockets), and once against an engine's sleep
endpoint served on loopback through the agent's own HTTP client.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.task import Clock
from twisted.logger import Logger
from twisted.trial.unittest import TestCase
from twisted.web import resource, server

from llmgw.agent.scrape import HttpFetcher, Sample, Scraper
from llmgw.agent.shard import Shard
from llmgw.agent.sleep import CONFIRM_TIMEOUT_S, Sleeper, SleepState
from llmgw.agent.state import ShardSpec, StateDir
from llmgw.agent.supervisor import Supervisor
from llmgw.engines import EngineSignals
from tests.supervisor_harness import FakeOps, FakeProber, FakeSpawner, SupervisorCase, spec
from tests.test_sleep import FakeCall

IS_SLEEPING = "http://127.0.0.1:8001/is_sleeping"


class ConfirmTests(SupervisorCase):
    def setUp(self) -> None:
        super().setUp()
        self.call = FakeCall()
        self.scraper = Scraper(self.clock, self.sup, lambda url: defer.Deferred())
        self.sleeper = Sleeper(self.clock, self.sup, self.scraper, self.call)  # type: ignore[arg-type]
        self.sup.lends = self.sleeper.lends
        self.sup.confirm = self.sleeper.confirm
        self.sup.add_listener(self.sleeper.reported)
        self.changes: list[str] = []
        self.sleeper.on_change = self.changes.append
        self.logged: list[dict[str, Any]] = []
        self.sleeper.log = Logger(observer=self.logged.append)

    def lender(self, engine: str = "vllm") -> Shard:
        """A ready leader on GPU 0, port 8001, seen asleep."""
        shard = self.start_ready(shard_id="old", engine=engine, sleep_level=1, sleep_after_s=10)
        self.sleeper.states["old"] = SleepState(busy_at=0.0, sleeping=True, slept_at=self.clock.seconds())
        return shard

    def borrower(self) -> ShardSpec:
        return spec("new", port=8002)

    def held(self) -> set[str]:
        return {s.shard_id for s in self.sup.held_shards()}

    def test_started_once_the_engine_says_it_sleeps(self) -> None:
        """
        A start on a sleeping leader's GPU asks its engine there and then
        (not trusting the last look) and starts only once it says it still
        sleeps; a second start of the same shard meanwhile asks nothing more.
        """
        self.lender()
        spawned = len(self.spawner.calls)
        self.assertIsNone(self.sup.start(self.borrower()))
        self.assertIsNone(self.sup.start(self.borrower()))
        self.assertEqual([c[:2] for c in self.call.calls], [(b"GET", IS_SLEEPING)])
        self.assertEqual((len(self.spawner.calls), self.held()), (spawned, {"old"}))
        self.call.answer(b'{"is_sleeping": true}')
        self.assertEqual(len(self.spawner.calls), spawned + 1)
        self.assertEqual(self.held(), {"old", "new"})
        self.assertEqual(self.sleeper.confirming, {})

    def test_refused_when_awake(self) -> None:
        """
        An engine that answers awake (a gateway woke it after the lend)
        refuses the start with a failure naming the GPU and the shard; the
        sleeper is taken as awake at once and the control plane told.
        """
        self.lender()
        spawned = len(self.spawner.calls)
        self.sup.start(self.borrower())
        self.call.answer(b'{"is_sleeping": false}')
        self.assertEqual(len(self.spawner.calls), spawned)
        [(sid, state, error, _, _)] = [r for r in self.reports if r[0] == "new"]
        self.assertEqual((sid, state), ("new", "failed"))
        self.assertIn("GPU 0 is in use by shard old, whose engine is awake", error)
        self.assertIs(self.sleeper.states["old"].sleeping, False)
        self.assertEqual(self.changes, ["old"])
        self.assertEqual(self.held(), {"old"})

    def test_refused_when_it_cannot_say(self) -> None:
        """
        An engine that fails to answer, or answers nothing within
        CONFIRM_TIMEOUT_S, refuses the start: its sleep is not known.
        """
        self.lender()
        self.sup.start(self.borrower())
        self.call.pending.pop().errback(ValueError("HTTP 500"))
        self.sup.start(spec("new2", port=8003))
        self.clock.advance(CONFIRM_TIMEOUT_S - 0.01)
        self.assertEqual([r[0] for r in self.reports if r[1] == "failed"], ["new"])
        self.clock.advance(0.01)
        errors = {r[0]: r[2] for r in self.reports if r[1] == "failed"}
        self.assertIn("could not say whether it still sleeps (HTTP 500)", errors["new"])
        self.assertIn(f"(no answer within {CONFIRM_TIMEOUT_S:g}s)", errors["new2"])
        self.assertEqual(self.held(), {"old"})

    def test_stopped_while_asking(self) -> None:
        """
        A borrower told to stop while its lender's engine is asked is
        reported stopped and never started, whatever the answer.
        """
        self.lender()
        spawned = len(self.spawner.calls)
        self.sup.start(self.borrower())
        self.sup.stop("new")
        self.call.answer(b'{"is_sleeping": true}')
        self.assertEqual(len(self.spawner.calls), spawned)
        self.assertEqual([r[1] for r in self.reports if r[0] == "new"], ["stopped"])
        self.assertEqual(self.held(), {"old"})

    def test_sglang_by_its_figures(self) -> None:
        """
        SGLang cannot say it sleeps: the agent's own word stands, unless
        its newest figures (newer than its sleep) show tokens generated
        since, which refuses the start.
        """
        self.lender(engine="sglang")
        self.sleeper.states["old"].tokens_at_sleep = 5.0
        self.clock.advance(1)
        self.scraper.samples["old"] = Sample(EngineSignals(self.clock.seconds(), running=0.0, waiting=0.0,
                                                           generated_tokens=9.0))
        self.sup.start(self.borrower())
        self.assertEqual(self.call.calls, [])
        self.assertEqual([r[1] for r in self.reports if r[0] == "new"], ["failed"])
        self.scraper.samples.clear()
        self.sleeper.states["old"] = SleepState(busy_at=0.0, sleeping=True)
        self.sup.start(spec("new2", port=8003))
        self.assertEqual(self.held(), {"old", "new2"})

    def test_not_asked_for_other_gpus(self) -> None:
        """
        A start on GPUs no sleeping shard holds starts at once, nothing
        asked.
        """
        self.lender()
        self.assertIsNotNone(self.sup.start(spec("other", gpus=(1,), port=8003)))
        self.assertEqual(self.call.calls, [])

    def test_lender_woken_beside_its_borrower(self) -> None:
        """
        A lender seen awake while its borrower runs on its GPUs is logged
        as a warning naming both, and the control plane is told at once
        (where it raises displaced_awake).
        """
        self.lender()
        self.sup.start(self.borrower())
        self.call.answer(b'{"is_sleeping": true}')
        self.sleeper.tick()
        self.assertEqual(self.call.calls[-1][:2], (b"GET", IS_SLEEPING))
        self.call.answer(b'{"is_sleeping": false}')
        self.assertEqual(self.changes, ["old"])
        [warning] = [e for e in self.logged if e["log_level"].name == "warn"]
        self.assertIn("woke while its GPUs", warning["log_format"])
        self.assertEqual((warning["shard"], warning["others"]), ("old", "new"))


class _Sleeping(resource.Resource):
    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.sleeping = True

    def render_GET(self, request: Any) -> bytes:  # noqa: N802
        return b'{"is_sleeping": %s}' % (b"true" if self.sleeping else b"false")


class LoopbackTests(TestCase):
    @defer.inlineCallbacks
    def test_asks_the_engine_on_loopback(self) -> Any:
        """
        Through the agent's own HTTP client, against an engine's
        C{/is_sleeping} served on loopback: a start beside a sleeping
        engine goes ahead, one beside the same engine awake is refused.
        """
        engine = _Sleeping()
        listening = reactor.listenTCP(0, server.Site(engine), interface="127.0.0.1")  # type: ignore[attr-defined]
        self.addCleanup(listening.stopListening)
        fetcher = HttpFetcher(reactor)
        self.addCleanup(fetcher.pool.closeCachedConnections)
        ops = FakeOps()
        sup = Supervisor(Clock(), FakeSpawner(ops), StateDir(self.mktemp()), gpu_indices=[0, 1], ops=ops,
                         prober=FakeProber(), python="/usr/bin/python3", base_env={})
        sleeper = Sleeper(reactor, sup, None, fetcher.call)  # type: ignore[arg-type]
        sup.lends, sup.confirm = sleeper.lends, sleeper.confirm
        sup.add_listener(sleeper.reported)
        done: dict[str, defer.Deferred[str]] = {"new": defer.Deferred(), "new2": defer.Deferred()}
        sup.add_listener(lambda s: s.shard_id in done and not done[s.shard_id].called
                         and done[s.shard_id].callback(s.state))
        port = listening.getHost().port
        free = [p for p in (20001, 20002) if p != port] + [20003]
        sup.start(spec("old", gpus=(0, 1), port=port, engine="vllm", sleep_level=1))
        sleeper.states["old"] = SleepState(busy_at=0.0, sleeping=True)
        self.assertIsNone(sup.start(spec("new", gpus=(0,), port=free[0])))
        self.assertEqual((yield done["new"]), "starting")
        engine.sleeping = False
        self.assertIsNone(sup.start(spec("new2", gpus=(1,), port=free[1])))
        self.assertEqual((yield done["new2"]), "failed")
        self.assertEqual({s.shard_id for s in sup.held_shards()}, {"old", "new"})
