"""
Tests for L{llmgw.engineargv}: the command lines llmgw writes for vLLM,
SGLang and llama.cpp's server.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from llmgw.engineargv import LAUNCHABLE, WEIGHTS, build_argv


def argv(engine: str, **kw: object) -> list[str]:
    values: dict[str, object] = {"weights": WEIGHTS, "host": "{host}", "port": "{port}",
                                 "served_name": "{model}", "tensor_parallel": 1}
    values.update(kw)
    return list(build_argv(engine, **values))  # type: ignore[arg-type]


class BuildArgvTests(SynchronousTestCase):
    def test_vllm(self) -> None:
        """
        vllm serve WEIGHTS with the address, the served name and the tensor
        parallelism, then the deployment's args.
        """
        self.assertEqual(
            argv("vllm", tensor_parallel=8, args=("--max-model-len", "8192")),
            ["vllm", "serve", "{weights}", "--host", "{host}", "--port", "{port}",
             "--served-model-name", "{model}", "--tensor-parallel-size", "8",
             "--max-model-len", "8192"])

    def test_sglang(self) -> None:
        """
        python3 -m sglang.launch_server with --model-path, --tp-size and
        --enable-metrics (its /metrics is off without it); the program is
        the interpreter SGLang is installed in.
        """
        self.assertEqual(
            argv("sglang", tensor_parallel=2, program="/opt/sgl/bin/python"),
            ["/opt/sgl/bin/python", "-m", "sglang.launch_server", "--model-path", "{weights}",
             "--host", "{host}", "--port", "{port}", "--served-model-name", "{model}",
             "--tp-size", "2", "--enable-metrics"])
        self.assertNotIn("--enable-metrics", argv("sglang", metrics=False))

    def test_llamacpp(self) -> None:
        """
        llama-server -m WEIGHTS with --alias as the served name and
        --metrics; no parallelism flag (it spreads layers over the GPUs it
        is given); args last, so -ngl 0 keeps it on the CPU.
        """
        self.assertEqual(
            argv("llamacpp", tensor_parallel=2, args=("-ngl", "0")),
            ["llama-server", "-m", "{weights}", "--host", "{host}", "--port", "{port}",
             "--alias", "{model}", "--metrics", "-ngl", "0"])
        self.assertNotIn("--metrics", argv("llamacpp", metrics=False))

    def test_program_override(self) -> None:
        """
        A profile's program replaces the engine's executable, and nothing
        else; without one each engine's usual program is used.
        """
        self.assertEqual([argv(e)[0] for e in LAUNCHABLE], ["llama-server", "python3", "vllm"])
        self.assertEqual(argv("vllm", program="/x/vllm")[0:2], ["/x/vllm", "serve"])

    def test_refused(self) -> None:
        """
        An engine llmgw does not launch, or parallelism below 1, is a
        ValueError naming it.
        """
        with self.assertRaises(ValueError) as ctx:
            argv("generic")
        self.assertIn("engine 'generic'", str(ctx.exception))
        self.assertRaises(ValueError, argv, "vllm", tensor_parallel=0)
