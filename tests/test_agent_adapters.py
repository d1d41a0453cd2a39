"""
LoRA adapters on a node (L{llmgw.agent.adapters}): a llama.cpp shard's
adapters come through the node's model cache as its weights do, pinned
while it runs, and reach its argv as C{--lora PATH} each, in the spec's
order; heartbeats name the adapters each engine holds.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.adapters import AdapterError, AdapterFiles, RuntimeAdapters, lora_args, max_loras
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.shards import source_message
from llmgw.sourcespec import parse_source
from llmgw.testing.enginesim import SimLoras
from llmgw.testing.fakefetch import FakeFetcher, StepRunner
from tests.supervisor_harness import SupervisorCase, spec
from tests.test_supervisor_fetch import MODEL, FetchCase

LORA = {"sql.gguf": b"GGUF-lora" + b"\0" * 20}


class AdapterFetchTests(FetchCase):
    def setUp(self) -> None:
        super().setUp()
        self.fetcher = FakeFetcher({"hf://org/tiny@main": dict(MODEL), "hf://org/lora@main": dict(LORA)})
        self.runner = StepRunner()
        self.sup = self.make()

    def test_adapters_fetched_pinned_and_given(self) -> None:
        """
        A shard whose spec lists adapters waits for them after its weights,
        then starts with C{--lora PATH} for each, in order (a file:// one
        where it is); they stay pinned until its process group is empty.
        """
        adapters = (("sql", parse_source("hf://org/lora", file="sql.gguf")),
                    ("local", parse_source("file:///m/local.gguf")))
        shard = self.sup.start(self.fetched_spec(adapters=adapters))
        self.assertEqual(shard.state, "fetching")
        self.runner.drain()
        self.assertEqual(shard.state, "starting")
        (call,) = self.spawner.calls
        args = call["args"]
        first = args.index("--lora")
        self.assertEqual(args[first + 2:], ["--lora", "/m/local.gguf"])
        self.assertEqual((Path(args[first + 1]) / "sql.gguf").read_bytes(), LORA["sql.gguf"])
        self.assertEqual(self.pins(), frozenset({"s1"}))
        self.assertEqual(len([m for m in self.cache.models() if m.pinned_by]), 2)
        self.assertEqual(self.sup.weights.adapters.held(shard.spec), ["sql", "local"])
        self.sup.stop("s1")
        shard.process.end(0)
        self.assertEqual(self.pins(), frozenset())

    def test_adapters_alone_fetched(self) -> None:
        """
        A shard whose command names its weights itself (a profile's own
        command) still gets its adapters through the cache.
        """
        shard = self.sup.start(spec(argv=["{python}", "-m", "server", "--port", "{port}"],
                                    adapters=(("sql", parse_source("hf://org/lora", file="sql.gguf")),)))
        self.assertEqual(shard.state, "fetching")
        self.runner.drain()
        (call,) = self.spawner.calls
        self.assertEqual(call["args"][-2], "--lora")

    def test_local_adapters_need_no_fetch(self) -> None:
        """
        file:// adapters need no fetch: the shard starts at once with their paths.
        """
        shard = self.sup.start(spec(adapters=(("a", parse_source("file:///m/a.gguf")),
                                              ("b", parse_source("file:///m/b.gguf")))))
        self.assertEqual(shard.state, "starting")
        (call,) = self.spawner.calls
        self.assertEqual(call["args"][-4:], ["--lora", "/m/a.gguf", "--lora", "/m/b.gguf"])

    def test_no_adapters_no_flags(self) -> None:
        """
        A shard without adapters runs its argv as it was.
        """
        self.sup.start(spec())
        (call,) = self.spawner.calls
        self.assertNotIn("--lora", call["args"])


class HelperTests(SynchronousTestCase):
    def test_lora_args(self) -> None:
        """
        One C{--lora} per path, in order; none for a spec without adapters.
        """
        self.assertEqual(lora_args(["/a", "/b"]), ["--lora", "/a", "--lora", "/b"])
        self.assertEqual(AdapterFiles(None).args(spec()), [])


class RuntimeAdapterTests(SynchronousTestCase):
    """
    vLLM's runtime loading needs a GPU: these run against the engine
    simulator's rendering of vLLM's documented LoRA endpoints
    (L{llmgw.testing.enginesim.SimLoras}).
    """

    def setUp(self) -> None:
        self.engine = SimLoras(max_loras=2)
        self.urls: list[str] = []

        def post(url: str, body: bytes) -> Deferred[tuple[int, bytes]]:
            self.urls.append(url)
            path = "/" + url.split("/", 3)[3]
            if not self.engine.handles(path):
                return succeed((404, b'{"detail":"Not Found"}'))
            status, _, answer = self.engine.handle(path, body)
            return succeed((status, answer))

        self.files = AdapterFiles(None)
        self.runtime = RuntimeAdapters(self.files, post, lambda: "10.0.0.5")
        self.spec = spec(port=8100, argv=["vllm", "serve", "/w", "--enable-lora", "--max-loras", "2"])

    def ensure(self, name: str) -> None:
        self.successResultOf(self.runtime.ensure(self.spec, name, parse_source(f"file:///a/{name}")))

    def test_least_recently_asked_for_unloaded(self) -> None:
        """
        At most C{max_loras} adapters are loaded; a new one unloads the
        least recently asked for first; heartbeats name what is held.
        """
        self.assertEqual(max_loras(self.spec), 2)
        self.ensure("a")
        self.ensure("b")
        self.ensure("a")
        self.ensure("c")
        self.assertEqual(self.engine.loaded, {"a": "/a/a", "c": "/a/c"})
        self.assertEqual(self.files.held(self.spec), ["a", "c"])
        self.assertEqual([c for c in self.engine.calls], [
            ("/v1/load_lora_adapter", "a"), ("/v1/load_lora_adapter", "b"),
            ("/v1/unload_lora_adapter", "b"), ("/v1/load_lora_adapter", "c")])
        self.assertTrue(all(u.startswith("http://10.0.0.5:8100/v1/") for u in self.urls))

    def test_refusal_is_an_error(self) -> None:
        """
        An engine without runtime updating (the paths unknown) refuses: the
        adapter is not counted as held.
        """
        self.engine.enabled = False
        d = self.runtime.ensure(self.spec, "a", parse_source("file:///a/a"))
        self.assertIn("404", str(self.failureResultOf(d, AdapterError).value))
        self.assertEqual(self.files.held(self.spec), [])

    def test_sim_shapes(self) -> None:
        """
        The simulator answers as vLLM documents: success texts, 400 for a
        repeated load or a missing field, 404 for unloading one not loaded.
        """
        sim = SimLoras()
        self.assertEqual(sim.handle(SimLoras.LOAD, b'{"lora_name": "a", "lora_path": "/p"}')[::2],
                         (200, b"Success: LoRA adapter 'a' added successfully."))
        self.assertEqual(sim.handle(SimLoras.LOAD, b'{"lora_name": "a", "lora_path": "/p"}')[0], 400)
        self.assertEqual(sim.handle(SimLoras.LOAD, b'{"lora_name": "b"}')[0], 400)
        self.assertTrue(sim.serves("a"))
        self.assertEqual(sim.models("base")[0]["parent"], "base")
        self.assertEqual(sim.handle(SimLoras.UNLOAD, b'{"lora_name": "b"}')[0], 404)
        self.assertEqual(sim.handle(SimLoras.UNLOAD, b'{"lora_name": "a"}')[::2],
                         (200, b"Success: LoRA adapter 'a' removed successfully."))
        self.assertFalse(SimLoras(enabled=False).handles(SimLoras.LOAD))


class LoadCommandTests(SupervisorCase):
    """
    A C{LoadAdapter} from the control plane, carried out on a running
    vLLM shard (against the engine simulator's LoRA endpoints).
    """

    def engine_post(self, engine: SimLoras) -> Any:
        def post(url: str, body: bytes) -> Deferred[tuple[int, bytes]]:
            status, _, answer = engine.handle("/" + url.split("/", 3)[3], body)
            return succeed((status, answer))
        return post

    def test_loaded_into_a_ready_shard(self) -> None:
        """
        The adapter is loaded into the shard's engine, at the address the
        agent advertises, and named in what the shard holds.
        """
        engine = SimLoras(max_loras=1)
        shard = self.start_ready(argv=["vllm", "serve", "/w", "--port", "{port}", "--max-loras", "1"])
        files = self.sup.weights.adapters
        files.runtime = RuntimeAdapters(files, self.engine_post(engine), lambda: self.sup.probe_host)
        files.load(self.sup, pb.LoadAdapter(shard_id="s1", name="x",
                                            source=source_message(parse_source("file:///a/x"))))
        self.assertEqual(engine.loaded, {"x": "/a/x"})
        self.assertEqual(files.held(shard.spec), ["x"])

    def test_dropped_where_it_cannot_run(self) -> None:
        """
        A load for a shard that is not here, or whose engine loads no
        adapters while it runs, is dropped.
        """
        self.start_ready()
        files = self.sup.weights.adapters
        for shard_id in ("s1", "nope"):
            files.load(self.sup, pb.LoadAdapter(shard_id=shard_id, name="x",
                                                source=source_message(parse_source("file:///a/x"))))
        self.assertIsNone(files.runtime)
        self.assertEqual(files.loaded, {})


class HeartbeatTests(SynchronousTestCase):
    def test_heartbeat_names_held_adapters(self) -> None:
        """
        Each scraped shard's heartbeat entry names the adapters its engine
        holds: those it started with, or those loaded into it since.
        """
        from llmgw.agent.scrape import Scraper
        from tests.test_scrape import VLLM, FakeFetch, FakeSupervisor

        sup: Any = FakeSupervisor()
        sup.weights = type("Weights", (), {"adapters": AdapterFiles(None)})()
        fixed = sup.add("a")
        fixed.spec = dataclasses.replace(fixed.spec, adapters=(("sql", parse_source("file:///m/sql.gguf")),))
        sup.add("b", port=8002)
        sup.weights.adapters.loaded["b"] = ["x", "y"]
        fetch = FakeFetch()
        scraper = Scraper(Clock(), sup, fetch)
        scraper.tick()
        for url in list(fetch.urls):
            fetch.answer(url, VLLM.encode())
        held = {m.shard_id: list(m.adapters) for m in scraper.heartbeat_signals()}
        self.assertEqual(held, {"a": ["sql"], "b": ["x", "y"]})
