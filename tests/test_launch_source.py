"""
Tests for the agent's start of a shard whose command llmgw wrote from a
model source: the engine's program looked up on the shard's PATH, the
weights' path filled in for a file:// source, and a clear refusal on an
agent without a model cache for sources that need fetching.
"""

from __future__ import annotations

import os
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent import launch
from llmgw.agent.launch import LAUNCHER
from llmgw.engineargv import build_argv
from llmgw.sourcespec import ModelSource, parse_source
from tests.supervisor_harness import SupervisorCase, spec


def executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def engine_argv(program: str = "llama-server") -> list[str]:
    return list(build_argv("llamacpp", weights="{weights}", host="{host}", port="{port}",
                           served_name="m", tensor_parallel=1, program=program))


class FindProgramTests(SynchronousTestCase):
    def test_on_path(self) -> None:
        """
        A bare name is the first executable of that name on the PATH given
        (not the agent's own); a path is used as it is.
        """
        first, second = Path(self.mktemp()), Path(self.mktemp())
        first.mkdir()
        second.mkdir()
        (first / "llama-server").write_text("not executable")
        found = executable(second / "llama-server")
        self.assertEqual(launch.find_program("llama-server", f"{first}:{second}"), str(found))
        self.assertEqual(launch.find_program(str(found), ""), str(found))

    def test_missing(self) -> None:
        """
        A program on no directory of the PATH, or a path that is not an
        executable file, is refused naming it, the PATH searched and the
        profile field that names it.
        """
        with self.assertRaises(launch.ProgramMissing) as ctx:
            launch.find_program("llama-server", "/nonexistent/bin")
        msg = str(ctx.exception)
        self.assertIn("engine program 'llama-server' is not on this agent's PATH (/nonexistent/bin)",
                      msg)
        self.assertIn("the profile's 'program'", msg)
        with self.assertRaises(launch.ProgramMissing) as ctx:
            launch.find_program("/nonexistent/llama-server", "/usr/bin")
        self.assertIn("is not an executable file", str(ctx.exception))


class WeightsRefusalTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = Path(self.mktemp()).resolve()
        self.dir.mkdir()
        self.model = self.dir / "tiny.gguf"
        self.model.write_bytes(b"GGUF")
        executable(self.dir / "llama-server")
        self.env = {"PATH": str(self.dir)}

    def refusal(self, source: ModelSource | None, argv: list[str] | None = None) -> str | None:
        s = spec(argv=engine_argv() if argv is None else argv, source=source)
        return launch.weights_refusal(s, self.env, "/usr/bin/python3")

    def test_file_source(self) -> None:
        """
        A file:// source whose path is on the node, with its program on the
        PATH, may start; its weights are its path. A spec without a source
        is not looked at.
        """
        source = parse_source(self.model.as_uri())
        self.assertIsNone(self.refusal(source))
        self.assertEqual(launch.local_weights(spec(source=source)), str(self.model))
        self.assertIsNone(self.refusal(None, ["/no/such/program"]))
        self.assertEqual(launch.local_weights(spec()), "")

    def test_refusals(self) -> None:
        """
        A file:// path that is not here, a program not on the PATH (also
        for a source that is fetched, before any fetch) and a malformed
        source are refused, each saying which.
        """
        # Sources the node's cache fetches pass, their program checked first.
        self.assertIsNone(self.refusal(parse_source("hf://org/repo@main", file="x.gguf")))
        self.assertIsNone(self.refusal(parse_source("https://h/x.gguf", sha256="a" * 64)))
        self.assertIn("engine program 'nope' is not on this agent's PATH",
                      self.refusal(parse_source("hf://org/repo"), engine_argv("nope")) or "")
        self.assertEqual(self.refusal(parse_source("file:///nonexistent/x.gguf")),
                         "model /nonexistent/x.gguf (source file:///nonexistent/x.gguf) is not on "
                         "this node")
        missing = self.refusal(parse_source(self.model.as_uri()), engine_argv("vllm-nope"))
        self.assertIn("engine program 'vllm-nope' is not on this agent's PATH", missing or "")
        bad = self.refusal(ModelSource(scheme="hf", repo="../../etc"))
        self.assertIn("the model source is not usable", bad or "")

    def test_fill_weights(self) -> None:
        """
        {weights} is filled only in a spec with a source; a hand-written
        command keeps the text.
        """
        source = parse_source(self.model.as_uri())
        argv = launch.fill_argv(spec(argv=engine_argv(), source=source, port=9000), "/py",
                                "127.0.0.1", str(self.model))
        self.assertEqual(argv[:7], ["llama-server", "-m", str(self.model), "--host", "127.0.0.1",
                                    "--port", "9000"])
        self.assertEqual(launch.fill_argv(spec(argv=["x", "{weights}"]), "/py", "h", "/w"),
                         ["x", "{weights}"])


class SupervisorSourceTests(SupervisorCase):
    """
    The supervisor starting shards with a model source.
    """

    def setUp(self) -> None:
        self.dir = Path(self.mktemp()).resolve()
        self.dir.mkdir()
        self.model = self.dir / "tiny.gguf"
        self.model.write_bytes(b"GGUF")
        self.program = executable(self.dir / "llama-server")
        super().setUp()

    def test_file_source_spawns_with_its_path(self) -> None:
        """
        A file:// source starts the engine with the model's path where
        {weights} was, and the record on disk keeps the source.
        """
        source = parse_source(self.model.as_uri())
        self.sup.start(spec(argv=engine_argv(str(self.program)), source=source, port=8010))
        (call,) = self.spawner.calls
        log_path = str(self.state.log_path("s1"))
        self.assertEqual(call["args"][:5], ["/usr/bin/python3", "-I", "-c", LAUNCHER, log_path])
        self.assertEqual(call["args"][5:8], [str(self.program), "-m", str(self.model)])
        (record,) = self.state.load_all()
        self.assertEqual(record.spec.source, source)

    def test_refused_as_config(self) -> None:
        """
        A source that needs fetching on an agent without a model cache, and
        a program missing from the shard's PATH, fail the start as a
        configuration failure (a retry cannot help), logged, with nothing
        spawned.
        """
        hf = self.sup.start(spec("a", argv=engine_argv(str(self.program)), port=8011,
                                 source=parse_source("hf://org/repo", file="x.gguf")))
        self.assertEqual((hf.state, hf.crash_class), ("failed", "config"))
        self.assertIn("this agent has no model cache", hf.error)
        # The harness's shard PATH is /usr/bin, where no llama-server is.
        if not os.path.exists("/usr/bin/llama-server"):
            nope = self.sup.start(spec("b", argv=engine_argv(), port=8012,
                                       source=parse_source(self.model.as_uri())))
            self.assertEqual((nope.state, nope.crash_class), ("failed", "config"))
            self.assertIn("is not on this agent's PATH (/usr/bin)", nope.error)
        self.assertEqual(self.spawner.calls, [])
