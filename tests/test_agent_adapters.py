"""
LoRA adapters on a node (L{llmgw.agent.adapters}): a llama.cpp shard's
adapters come through the node's model cache as its weights do, pinned
while it runs, and reach its argv as C{--lora PATH} each, in the spec's
order; heartbeats name the adapters each engine holds.
"""

from __future__ import annotations

from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.adapters import AdapterFiles, lora_args
from llmgw.sourcespec import parse_source
from llmgw.testing.fakefetch import FakeFetcher, StepRunner
from tests.supervisor_harness import spec
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
