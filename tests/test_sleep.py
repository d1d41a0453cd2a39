"""
Sleeping and waking engines (DESIGN §22): the catalog's fields, the
engines' calls, the agent putting an idle engine to sleep and reporting it,
what travels to the gateway, and the gateway waking a sleeping replica
for requests no awake one can take. Driven by a Clock and fakes, then once
on loopback against the engine simulator's sleep endpoints.

vLLM's sleep mode and SGLang's memory saver need a GPU: these tests run
against the simulator taught their documented shapes
(L{llmgw.testing.sleepsim}), not against the engines.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry
from twisted.internet import defer, reactor
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmgw import sleepmodes
from llmgw.agent.scrape import HttpFetcher, Sample, Scraper
from llmgw.agent.shard import READY, Shard
from llmgw.agent.sleep import Sleeper
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.core.catalog import CatalogError, parse_catalog
from llmgw.control.state.signals import from_message, signals_json
from llmgw.gateway.admission import FREE, NONE, capacity
from llmgw.gateway.policy import PolicyConfig
from llmgw.gateway.router import Router
from llmgw.gateway.waking import AWAKE, NEEDS_WAKE, WAKES_ON_REQUEST, Waker, http_post
from llmgw.routing import (
    EngineSignals,
    Route,
    RoutingSnapshot,
    snapshot_from_json,
    snapshot_to_json,
)
from llmgw.shards import ShardSpec
from llmgw.testing.fakemodel import APP_HOOKS, FakeModelConfig, listen
from llmgw.testing.sleepsim import SleepSim, SleepSimConfig, install


def catalog(profile: dict[str, Any], deployment: dict[str, Any]) -> Any:
    return parse_catalog({"profiles": {"p": profile},
                          "deployments": [{"model": "m", "profile": "p", **deployment}]})


class CatalogTests(SynchronousTestCase):
    def test_vllm_sleep_flags(self) -> None:
        """
        A vLLM profile with a sleep level and a deployment with
        sleep_after_s launch with sleep mode on (its flag and the
        environment that serves its endpoints), and the spec carries the
        level and the idleness.
        """
        c = catalog({"engine": "vllm", "sleep_level": 2},
                    {"source": "hf://org/repo", "sleep_after_s": 30})
        spec = c.profiles["p"].launch(0, c.deployments["m"])
        self.assertIn("--enable-sleep-mode", spec.argv)
        self.assertEqual(spec.env["VLLM_SERVER_DEV_MODE"], "1")
        self.assertEqual((spec.sleep_level, spec.sleep_after_s), (2, 30.0))

    def test_llamacpp_sleeps_by_itself(self) -> None:
        """
        llama.cpp keeps its own idle timer: the command llmgw writes gives
        it --sleep-idle-seconds from sleep_after_s.
        """
        c = catalog({"engine": "llamacpp", "sleep_level": 1},
                    {"source": "hf://org/repo", "file": "m.gguf", "sleep_after_s": 12})
        argv = c.profiles["p"].launch(0, c.deployments["m"]).argv
        i = argv.index("--sleep-idle-seconds")
        self.assertEqual(argv[i + 1], "12")

    def test_no_sleep_without_sleep_after(self) -> None:
        """
        A profile that can sleep, under a deployment that does not ask,
        launches as before: no flags, level 0 in the spec.
        """
        c = catalog({"engine": "vllm", "sleep_level": 1}, {"source": "hf://org/repo"})
        spec = c.profiles["p"].launch(0, c.deployments["m"])
        self.assertNotIn("--enable-sleep-mode", spec.argv)
        self.assertEqual(spec.sleep_level, 0)

    def test_refusals(self) -> None:
        """
        sleep_after_s needs a profile that sleeps and must come before the
        scale to zero; a generic engine cannot sleep; level 2 is vLLM's.
        """
        cases = [
            ({"engine": "vllm"}, {"source": "hf://o/r", "sleep_after_s": 5}, "sleep_level"),
            ({"command": ["x"], "sleep_level": 1}, {}, "engine that sleeps"),
            ({"engine": "sglang", "sleep_level": 2}, {"source": "hf://o/r"}, "vLLM's alone"),
            ({"engine": "vllm", "sleep_level": 1},
             {"source": "hf://o/r", "sleep_after_s": 600, "min_replicas": 0, "max_replicas": 1,
              "scale_to_zero_after_s": 300}, "before 'scale_to_zero_after_s'"),
            ({"engine": "vllm"}, {"source": "hf://o/r", "min_resident_s": -1}, "min_resident_s"),
        ]
        for profile, deployment, words in cases:
            e = self.assertRaises(CatalogError, catalog, profile, deployment)
            self.assertIn(words, str(e))

    def test_eviction_fields(self) -> None:
        """
        evictable, priority and min_resident_s are read; the defaults are
        a deployment never evicted.
        """
        c = catalog({"command": ["x"]}, {"evictable": True, "priority": 5, "min_resident_s": 20,
                                         "min_replicas": 0, "max_replicas": 1})
        rules = c.deployments["m"].multiplex
        self.assertEqual((rules.evictable, rules.priority, rules.min_resident_s), (True, 5, 20.0))
        plain = catalog({"command": ["x"]}, {}).deployments["m"].multiplex
        self.assertFalse(plain.evictable)

    def test_spec_travels(self) -> None:
        """
        A spec's sleep fields go to a StartShard and back unchanged.
        """
        spec = ShardSpec(shard_id="s", replica_id="r", model="m", profile="p", argv=["x"],
                         gpu_indices=[0], port=1, engine="vllm", sleep_level=1, sleep_after_s=7.5)
        self.assertEqual(ShardSpec.from_message(spec.to_message()), spec)


class WireTests(SynchronousTestCase):
    def test_heartbeat_to_route(self) -> None:
        """
        A heartbeat's sleeping flag and wake path reach the control plane's
        signals, its admin view, and the routes document a standalone
        gateway reads.
        """
        msg = pb.ShardSignals(shard_id="s", age_s=1.0, running=0.0, sleeping=True, wake_path="/wake_up")
        entry = from_message(msg, now=100.0)
        assert entry.signals is not None
        self.assertEqual((entry.signals.sleeping, entry.signals.wake_path), (True, "/wake_up"))
        self.assertIs(signals_json(entry, 100.0)["sleeping"], True)  # type: ignore[index]
        snap = RoutingSnapshot(routes=(Route("r1", "m", "h:1", signals=entry.signals),), known=frozenset({"m"}))
        back, problems = snapshot_from_json(snapshot_to_json(snap, 100.0), 200.0)
        self.assertEqual(problems, [])
        sig = back.routes("m")[0].signals
        assert sig is not None
        self.assertEqual((sig.sleeping, sig.wake_path), (True, "/wake_up"))

    def test_bad_wake_path(self) -> None:
        """
        A wake path that is not a path is refused in a routes document, and
        dropped from a heartbeat.
        """
        doc = {"revision": 1, "known": ["m"], "routes": [
            {"replica": "r", "model": "m", "address": "h:1", "signals": {"age_s": 0, "wake_path": "http://x"}}]}
        _, problems = snapshot_from_json(doc, 0.0)
        self.assertEqual(len(problems), 1)
        entry = from_message(pb.ShardSignals(shard_id="s", age_s=0.0, sleeping=True, wake_path="x"), 0.0)
        assert entry.signals is not None
        self.assertEqual(entry.signals.wake_path, "")


class FakeSupervisor:
    def __init__(self) -> None:
        self.shards: dict[str, Shard] = {}
        self.probe_host = "127.0.0.1"

    def add(self, engine: str, level: int = 1, after: float = 10.0, port: int = 8001) -> Shard:
        shard = Shard(ShardSpec(shard_id="s", replica_id="r", model="m", profile="p", argv=["x"],
                                gpu_indices=[], port=port, engine=engine, metrics_path="/metrics",
                                sleep_level=level, sleep_after_s=after), READY)
        self.shards["s"] = shard
        return shard

    def live_shards(self) -> list[Shard]:
        return [s for s in self.shards.values() if s.live]


class FakeCall:
    def __init__(self) -> None:
        self.calls: list[tuple[bytes, str, bytes | None]] = []
        self.pending: list[defer.Deferred[bytes]] = []

    def __call__(self, method: bytes, url: str, body: bytes | None) -> defer.Deferred[bytes]:
        self.calls.append((method, url, body))
        d: defer.Deferred[bytes] = defer.Deferred()
        self.pending.append(d)
        return d

    def answer(self, body: bytes = b"") -> None:
        self.pending.pop(0).callback(body)


class SleeperCase(SynchronousTestCase):
    """A sleeper on a Clock, a fake supervisor, scraper samples set by hand and a fake engine call."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.sup = FakeSupervisor()
        self.scraper = Scraper(self.clock, self.sup, lambda url: defer.Deferred())  # type: ignore[arg-type]
        self.call = FakeCall()
        self.sleeper = Sleeper(self.clock, self.sup, self.scraper, self.call)  # type: ignore[arg-type]
        self.changes: list[str] = []
        self.sleeper.on_change = self.changes.append


class SleeperTests(SleeperCase):

    def seen(self, running: float) -> None:
        self.scraper.samples["s"] = Sample(EngineSignals(self.clock.seconds(), waiting=0.0, running=running,
                                                         generated_tokens=5.0))

    def status(self, sleeping: bool) -> None:
        self.assertEqual(self.call.calls[-1][:2], (b"GET", "http://127.0.0.1:8001/is_sleeping"))
        self.call.answer(b'{"is_sleeping": %s}' % (b"true" if sleeping else b"false"))

    def test_vllm_idle_sleeps(self) -> None:
        """
        A vLLM shard idle for sleep_after_s is put to sleep at its level,
        the control plane is told at once, and heartbeats say so with the
        path that wakes it.
        """
        self.sup.add("vllm", level=2, after=10.0)
        self.seen(0.0)
        self.sleeper.tick()
        self.status(False)
        self.clock.advance(9.0)
        self.seen(0.0)
        self.sleeper.tick()
        self.status(False)
        self.assertEqual(len(self.call.calls), 2)
        self.clock.advance(1.0)
        self.seen(0.0)
        self.sleeper.tick()
        self.assertEqual(self.call.calls[-1][:2], (b"POST", "http://127.0.0.1:8001/sleep?level=2"))
        self.call.answer()
        self.assertEqual(self.changes, ["s"])
        self.assertEqual(self.sleeper.state_of("s"), (True, "/wake_up"))
        self.scraper.sleep_state = self.sleeper.state_of
        [msg] = self.scraper.heartbeat_signals()
        self.assertEqual((msg.sleeping, msg.wake_path), (True, "/wake_up"))

    def test_busy_resets(self) -> None:
        """
        Requests running restart the idle timer: a shard busy a second
        before the threshold is not put to sleep.
        """
        self.sup.add("vllm", after=10.0)
        self.seen(0.0)
        self.sleeper.tick()
        self.status(False)
        self.clock.advance(9.0)
        self.seen(2.0)
        self.sleeper.tick()
        self.status(False)
        self.clock.advance(9.0)
        self.seen(0.0)
        self.sleeper.tick()
        self.status(False)
        self.assertNotIn(b"POST", [c[0] for c in self.call.calls])

    def test_woken_restarts_timer(self) -> None:
        """
        A shard the agent sees awake again (a gateway woke it) is not put
        back to sleep before another whole idle period.
        """
        self.sup.add("vllm", after=10.0)
        self.seen(0.0)
        self.sleeper.tick()
        self.status(True)
        self.clock.advance(30.0)
        self.seen(0.0)
        self.sleeper.tick()
        self.status(False)
        self.assertEqual(self.changes, ["s"])
        self.clock.advance(5.0)
        self.seen(0.0)
        self.sleeper.tick()
        self.status(False)
        self.assertNotIn(b"POST", [c[0] for c in self.call.calls])

    def test_sglang_has_no_status(self) -> None:
        """
        SGLang cannot say whether it sleeps: the agent keeps its own word
        after releasing its memory, and takes tokens generated since as the
        sign that it was woken.
        """
        self.sup.add("sglang", after=5.0)
        self.seen(0.0)
        self.sleeper.tick()
        self.assertEqual(self.call.calls, [])
        self.clock.advance(5.0)
        self.seen(0.0)
        self.sleeper.tick()
        self.assertEqual(self.call.calls[-1], (b"POST", "http://127.0.0.1:8001/release_memory_occupation", b"{}"))
        self.call.answer()
        self.assertEqual(self.sleeper.state_of("s"), (True, "/resume_memory_occupation"))
        self.clock.advance(1.0)
        self.scraper.samples["s"] = Sample(EngineSignals(self.clock.seconds(), waiting=0.0, running=0.0,
                                                         generated_tokens=9.0))
        self.sleeper.tick()
        self.assertEqual(self.sleeper.state_of("s"), (False, "/resume_memory_occupation"))

    def test_llamacpp_only_watched(self) -> None:
        """
        llama.cpp sleeps by itself: the agent only reads /props, and a
        request wakes it (no wake path).
        """
        self.sup.add("llamacpp", after=5.0)
        self.seen(0.0)
        self.sleeper.tick()
        self.assertEqual(self.call.calls[-1][:2], (b"GET", "http://127.0.0.1:8001/props"))
        self.call.answer(b'{"is_sleeping": true, "model_path": "x"}')
        self.clock.advance(60.0)
        self.seen(0.0)
        self.sleeper.tick()
        self.call.answer(b'{"is_sleeping": true}')
        self.assertEqual([c[0] for c in self.call.calls], [b"GET", b"GET"])
        self.assertEqual(self.sleeper.state_of("s"), (True, ""))

    def test_failed_sleep_waits(self) -> None:
        """
        An engine that refuses to sleep (sleep mode off) is not asked again
        every second, but after another idle period.
        """
        self.sup.add("sglang", after=5.0)
        self.seen(0.0)
        self.sleeper.tick()
        self.clock.advance(5.0)
        self.sleeper.tick()
        self.call.pending.pop().errback(ValueError("HTTP 404"))
        self.clock.advance(1.0)
        self.sleeper.tick()
        self.assertEqual(len(self.call.calls), 1)
        self.assertEqual(self.sleeper.state_of("s"), (False, "/resume_memory_occupation"))
        # An idle sleep nobody asked for: nothing for the control plane.
        self.assertEqual(self.changes, [])
        self.assertEqual(self.sleeper.take_refusal("s"), "")


def route(rid: str, sleeping: bool | None, wake: str = "/wake_up", at: float = 0.0) -> Route:
    return Route(rid, "m", f"h:{rid}", signals=EngineSignals(at, running=0.0, sleeping=sleeping, wake_path=wake))


class WakerTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.posts: list[tuple[str, defer.Deferred[None]]] = []
        self.awake: list[str] = []
        self.registry = CollectorRegistry()

        def post(url: str, body: bytes) -> defer.Deferred[None]:
            d: defer.Deferred[None] = defer.Deferred()
            self.posts.append((url, d))
            return d

        self.waker = Waker(self.clock, post, self.registry, on_awake=self.awake.append)

    def test_states(self) -> None:
        """
        Awake, asleep until a wake call (vLLM, SGLang), asleep and woken by
        a request (llama.cpp).
        """
        self.assertEqual(self.waker.state(route("a", False)), AWAKE)
        self.assertEqual(self.waker.state(route("a", None)), AWAKE)
        self.assertEqual(self.waker.state(route("a", True)), NEEDS_WAKE)
        self.assertEqual(self.waker.state(route("a", True, wake="")), WAKES_ON_REQUEST)

    def test_wake_once_and_time_it(self) -> None:
        """
        A model whose awake replicas cannot take its requests gets one
        sleeping replica woken (one call however often asked); the answer
        makes it awake here before the control plane says so, dispatches
        the queue and is timed.
        """
        routes = [route("a", True), route("b", True)]
        self.assertTrue(self.waker.needed("m", routes))
        self.assertTrue(self.waker.needed("m", routes))
        self.assertEqual([u for u, _ in self.posts], ["http://h:a/wake_up"])
        self.clock.advance(1.5)
        self.posts[0][1].callback(None)
        self.assertEqual(self.awake, ["m"])
        self.assertEqual(self.waker.state(routes[0]), AWAKE)
        self.assertEqual(self.waker.state(routes[1]), NEEDS_WAKE)
        total = self.registry.get_sample_value("llmgw_gateway_wake_seconds_sum",
                                               {"model": "m", "outcome": "woken"})
        self.assertEqual(total, 1.5)

    def test_fresh_sleep_wins(self) -> None:
        """
        Signals sampled more than the agent's look after the wake that say
        the replica sleeps (the agent put it back to sleep) win over the
        gateway's word; those sampled sooner may predate the wake.
        """
        self.waker.needed("m", [route("a", True)])
        self.clock.advance(1.0)
        self.posts[0][1].callback(None)
        self.assertEqual(self.waker.state(route("a", True, at=2.5)), AWAKE)
        self.assertEqual(self.waker.state(route("a", True, at=3.5)), NEEDS_WAKE)

    def test_failed_wake(self) -> None:
        """
        A failed wake leaves the replica asleep and counted; the next look
        tries again.
        """
        routes = [route("a", True)]
        self.waker.needed("m", routes)
        self.posts[0][1].errback(ValueError("HTTP 500"))
        self.assertEqual(self.waker.failed, 1)
        self.assertEqual(self.waker.state(routes[0]), NEEDS_WAKE)
        self.waker.needed("m", routes)
        self.assertEqual(len(self.posts), 2)

    def test_capacity_and_routing(self) -> None:
        """
        A replica asleep until woken gives the model no capacity and is
        never picked; awake replicas are picked before ones a request
        wakes; those are picked when no awake one is left.
        """
        cfg = PolicyConfig()
        never = lambda rid: False  # noqa: E731
        self.assertEqual(capacity([route("a", True)], never, 0.0, cfg, self.waker.asleep), NONE)
        self.assertEqual(capacity([route("a", True, wake="")], never, 0.0, cfg, self.waker.asleep), FREE)
        router = Router(self.clock)
        router.asleep = self.waker.state
        self.assertIsNone(router.pick([route("a", True), route("b", True)]))
        mixed = [route("a", True, wake=""), route("b", False), route("c", True)]
        self.assertEqual({router.pick(mixed).replica_id for _ in range(6)}, {"b"})  # type: ignore[union-attr]
        self.assertEqual(router.pick([route("a", True, wake=""), route("c", True)]).replica_id, "a")  # type: ignore[union-attr]

    def test_routing_after_awake_routes(self) -> None:
        """
        The router looks past routes it found with no replica asleep (a
        request's path skips that scan) only for those very routes: the
        next table's routes, where a replica sleeps until woken, are looked
        at again, and the sleeper is never picked; the awake ones still are.
        """
        router = Router(self.clock)
        router.asleep = self.waker.state
        awake = (route("a", False), route("b", None))
        self.assertIn(router.pick(awake).replica_id, {"a", "b"})  # type: ignore[union-attr]
        later = (route("a", True), route("b", None))
        self.assertEqual({router.pick(later).replica_id for _ in range(6)}, {"b"})  # type: ignore[union-attr]
        self.assertIsNone(router.pick((route("a", True),)))
        self.assertEqual({router.pick(awake).replica_id for _ in range(6)}, {"a", "b"})  # type: ignore[union-attr]


class SimStateTests(SynchronousTestCase):
    def test_times(self) -> None:
        """
        The simulator falls asleep in sleep_s, wakes in wake_s from level 1
        and reload_s from level 2, and says it sleeps until awake.
        """
        clock = Clock()
        sim = SleepSim(clock, SleepSimConfig(sleep_s=0.5, wake_s=1.5, reload_s=6.0))
        done: list[float] = []
        sim.sleep(1).addCallback(lambda _: done.append(clock.seconds()))
        self.assertTrue(sim.sleeping)
        clock.advance(0.5)
        sim.wake().addCallback(lambda _: done.append(clock.seconds()))
        clock.advance(1.5)
        self.assertFalse(sim.sleeping)
        sim.sleep(2)
        clock.advance(0.5)
        sim.wake().addCallback(lambda _: done.append(clock.seconds()))
        clock.advance(5.9)
        self.assertTrue(sim.sleeping)
        clock.advance(0.1)
        self.assertEqual(done, [0.5, 2.0, 8.5])


class LoopbackTests(TestCase):
    """
    The agent's calls and the gateway's wake against the simulator's
    endpoints over HTTP on loopback (sleep and wake in tens of ms).
    """

    timeout = 20

    def setUp(self) -> None:
        self.sims: list[SleepSim] = []
        self.fetcher = HttpFetcher(reactor)
        self.addCleanup(self.fetcher.close)

    def serve(self, mode: str) -> int:
        config = SleepSimConfig(mode, sleep_s=0.02, wake_s=0.05, reload_s=0.1)
        hook = lambda app: self.sims.append(install(app, config))  # noqa: E731
        APP_HOOKS.append(hook)
        try:
            port = listen(reactor, FakeModelConfig(model="m"))
        finally:
            APP_HOOKS.remove(hook)
        self.addCleanup(port.stopListening)
        return int(port.getHost().port)

    @defer.inlineCallbacks
    def test_vllm_endpoints(self) -> Any:
        """
        Asleep through POST /sleep?level=1, generation refused meanwhile,
        /is_sleeping says so, and the gateway's wake call wakes it.
        """
        port = self.serve("vllm")
        base = f"http://127.0.0.1:{port}"
        yield self.fetcher.call(b"POST", base + sleepmodes.mode("vllm").sleep_path.format(level=1), b"")  # type: ignore[union-attr]
        body = yield self.fetcher.get(base + "/is_sleeping")
        self.assertTrue(sleepmodes.read_status("vllm", body))
        yield self.assertFailure(self.fetcher.call(b"POST", base + "/v1/completions", b'{"model": "m"}'), ValueError)
        yield http_post(reactor)(base + "/wake_up", b"{}")
        body = yield self.fetcher.get(base + "/is_sleeping")
        self.assertFalse(sleepmodes.read_status("vllm", body))
        self.assertEqual((self.sims[0].sleeps, self.sims[0].wakes, self.sims[0].refused), (1, 1, 1))

    @defer.inlineCallbacks
    def test_sglang_endpoints(self) -> Any:
        """
        SGLang's release and resume of memory occupation, each with a JSON
        object.
        """
        port = self.serve("sglang")
        base = f"http://127.0.0.1:{port}"
        yield self.fetcher.call(b"POST", base + "/release_memory_occupation", b"{}")
        self.assertTrue(self.sims[0].sleeping)
        yield http_post(reactor)(base + "/resume_memory_occupation", b"{}")
        self.assertFalse(self.sims[0].sleeping)


class ControlPlaneTests(SynchronousTestCase):
    def setUp(self) -> None:
        from tests.reconciler_harness import Fleet

        self.fleet = Fleet({"m": ("one", 1)}, nodes=1)
        self.fleet.past_grace()
        self.fleet.make_ready()
        self.fleet.step()
        [self.cmd] = self.fleet.dispatcher.starts

    def heartbeat(self, sleeping: bool) -> None:
        self.fleet.rec.record_engine_signals(self.cmd.node_id, [pb.ShardSignals(
            shard_id=self.cmd.shard_id, running=0.0, age_s=0.0, sleeping=sleeping, wake_path="/wake_up")])

    def test_asleep_shown_and_told(self) -> None:
        """
        A leader's sleep reaches the route, the replicas view (and so
        C{ctl replicas} and the page), /metrics, and each change is an
        event; waking says how long it slept.
        """
        from prometheus_client import generate_latest

        from llmgw.control.state.signals import EngineSignalsCollector
        from llmgw.ctl.fleet import render_replicas

        rec = self.fleet.rec
        self.heartbeat(False)
        self.heartbeat(True)
        [r] = rec.routes("m")
        self.assertTrue(r.signals is not None and r.signals.sleeping)
        [view] = rec.replicas()
        self.assertIs(view["sleeping"], True)
        self.assertIn("ready (asleep)", render_replicas(rec.replicas()))
        registry = CollectorRegistry(auto_describe=False)
        registry.register(EngineSignalsCollector(rec.engine_signal_rows, self.fleet.clock.seconds))
        self.assertIn("llmgw_engine_sleeping{", generate_latest(registry).decode())
        self.fleet.clock.advance(42)
        self.heartbeat(False)
        kinds = [(e.kind, e.reason) for e in rec.event_log.since() if e.kind.startswith("replica_a")]
        self.assertEqual([k for k, _ in kinds], ["replica_asleep", "replica_awake"])
        self.assertIn("after 42.0s asleep", kinds[1][1])


class GatewayWakeTests(SynchronousTestCase):
    def test_request_waits_for_the_wake(self) -> None:
        """
        Through the gateway's front: a request whose model has only a
        replica asleep until woken waits (nothing sent upstream), the wake
        call goes at once, and when it answers the request is sent on and
        answered; the wake is timed in the gateway's metrics.
        """
        from tests.test_gateway_admission import OK, Gw
        from tests.test_gateway_resource import parse

        gw = Gw()
        posts: list[tuple[str, defer.Deferred[None]]] = []

        def post(url: str, body: bytes) -> defer.Deferred[None]:
            d: defer.Deferred[None] = defer.Deferred()
            posts.append((url, d))
            return d

        waker = gw.gateway.admission.waker
        assert waker is not None
        waker.post = post
        gw.ready("r1", signals=EngineSignals(gw.clock.seconds(), running=0.0, sleeping=True, wake_path="/wake_up"))
        client = gw.send()
        self.assertEqual((client.value(), gw.new_upstreams()), (b"", []))
        self.assertEqual([u for u, _ in posts], ["http://10.0.0.1:8000/wake_up"])
        gw.clock.advance(1.5)
        posts[0][1].callback(None)
        gw.clock.advance(0)
        [(conn, _)] = gw.new_upstreams()
        conn.dataReceived(OK)
        self.assertEqual(parse(client.value())[0], 200)
        self.assertEqual(gw.sample("llmgw_gateway_wake_seconds_sum", model="demo", outcome="woken"), 1.5)
