"""
End to end with real inference engines.

llama.cpp's C{llama-server} (built by C{.ci/build-llama-server}, which
C{.ci/run} runs first) serves a tiny random-weight model written at test
time, under the local fleet started as a user starts it: ready only once
the engine answers, chat and streamed chat through the gateway with the
C{openai} client, its metrics in the admin API through heartbeats, a
SIGKILLed engine failed and replaced with no engine process left, and the
fleet's stop leaving none. Skipped, saying why, only when the binary is
absent.

vLLM's CPU build gets the same test when C{LLMGW_TEST_VLLM=1} (and
C{LLMGW_VLLM_MODEL}, a small local model directory or Hugging Face id it
can load, e.g. the tiny random Llama that C{python -m llmgw.testing.tinyhf
DIR} writes); it is not in CI (3.5 GB, 30-60 s to start). See
docs/operations.md, "Real engines in tests".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from twisted.internet import defer
from twisted.trial.unittest import SkipTest, SynchronousTestCase, TestCase

from llmgw.agent.state import StateDir
from llmgw.testing.engines import find_llama_server, llama_server_missing_reason
from llmgw.testing.ports import free_port, port_block, wait_bound, with_ports
from tests.test_local_e2e import llmgw_command, processes_mentioning

ROOT = Path(__file__).resolve().parent.parent
DEADLINE = 90.0

LLAMA_CATALOG = """
[profiles.llama-tiny]
engine = "llamacpp"
gpus_per_shard = 1
command = [{binary}, "-m", {model}, "--host", "{{host}}", "--port", "{{port}}", "--metrics",
           "--alias", "{{model}}", "-c", "512", "-np", "2", "-t", "1", "--no-warmup"]

[[deployments]]
model = "tiny"
profile = "llama-tiny"
replicas = 1
"""

# No command: llmgw writes llama-server's from the engine, the source and args.
LLAMA_SOURCE_CATALOG = """
[profiles.llama-cpu]
engine = "llamacpp"
gpus_per_shard = 1
program = {binary}

[[deployments]]
model = "tiny"
profile = "llama-cpu"
replicas = 1
source = {source}
args = ["-c", "512", "-np", "2", "-t", "1", "--no-warmup", "-ngl", "0"]
"""

VLLM_CATALOG = """
[profiles.vllm-cpu]
engine = "vllm"
gpus_per_shard = 1
startup_timeout_s = 300
command = [{python}, "-m", "vllm.entrypoints.openai.api_server", "--model", {model},
           "--served-model-name", "{{model}}", "--host", "{{host}}", "--port", "{{port}}",
           "--max-model-len", "512", "--dtype", "float32"]
env = {{ VLLM_CPU_KVCACHE_SPACE = "1", LLMGW_TEST_DIR = {marker} }}

[[deployments]]
model = "tiny"
profile = "vllm-cpu"
replicas = 1
"""


class RealEngineFleet:
    """
    A local fleet (a real process) with one agent and one deployment.
    """

    def __init__(self, case: SynchronousTestCase, catalog: Callable[[Path], str],
                 env: dict[str, str] | None = None, heartbeat: float = 1):
        self.case = case
        self.dir = Path(case.mktemp()).resolve()
        self.dir.mkdir(parents=True)
        self.catalog = self.dir / "catalog.toml"
        # Shard ports from a block of test ports, away from the range other
        # local fleets on this machine (other tests, a developer's own) use.
        self.catalog.write_text(with_ports(catalog(self.dir), *port_block(case)))
        self.log = open(self.dir / "fleet.log", "w+b")  # noqa: SIM115
        case.addCleanup(self.log.close)
        case.addCleanup(self.kill_everything)
        env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
        # The gateway's and admin's ports again if another process bound one first.
        for _ in range(3):
            self.gateway_port, self.admin_port = free_port(), free_port()
            self.log.truncate(0)
            self.proc = subprocess.Popen(
                [*llmgw_command(), "local", "--agents", "1", "--catalog", str(self.catalog),
                 "--gateway", f"127.0.0.1:{self.gateway_port}", "--admin",
                 f"127.0.0.1:{self.admin_port}", "--heartbeat", f"{heartbeat:g}"],
                cwd=self.dir, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
            if wait_bound(self.proc, [self.admin_port, self.gateway_port], self.output, DEADLINE):
                break

    def kill_everything(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for pid in engine_processes(self.dir):
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")

    def wait(self, what: str, check: Callable[[], Any], timeout: float = DEADLINE) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = check()
            except OSError:
                value = None
            if value:
                return value
            if self.proc.poll() is not None:
                self.case.fail(f"the fleet exited ({self.proc.returncode}) while waiting for "
                               f"{what}:\n{self.output()[-4000:]}")
            if time.monotonic() > deadline:
                self.case.fail(f"timed out waiting for {what}:\n{self.output()[-4000:]}")
            time.sleep(0.2)

    def admin(self, path: str, raw: bool = False) -> Any:
        url = f"http://127.0.0.1:{self.admin_port}{path}"
        with urllib.request.urlopen(url, timeout=5) as response:
            body = response.read()
        return body.decode() if raw else json.loads(body)

    def ready_replicas(self) -> dict[str, dict[str, Any]]:
        replicas = self.admin("/api/v1/replicas")["replicas"]
        return {r["id"]: r for r in replicas if r["state"] == "ready"}

    def chat(self, max_tokens: int = 4) -> Any:
        """
        One chat through the gateway with the C{openai} client: its reply.
        """
        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{self.gateway_port}/v1", api_key="none",
                        timeout=30, max_retries=0)
        return client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=max_tokens,
            extra_body={"ignore_eos": True})

    def stop(self) -> None:
        """
        SIGTERM the fleet; it must end within a minute leaving no engine process.
        """
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.case.fail(f"the fleet did not stop on SIGTERM:\n{self.output()[-4000:]}")
        self.case.assertEqual(engine_processes(self.dir), [])

    def shard_pids(self) -> dict[str, int]:
        pids = {}
        for state in (self.dir / "local-state").glob("agent-*"):
            for record in StateDir(state).load_all():
                pids[record.spec.replica_id] = record.pid
        return pids


def engine_processes(directory: Path) -> list[int]:
    """
    Live processes that mention C{directory} in their command line or
    environment: the fleet, and every engine process a shard started
    (llama-server names the model in the directory; vLLM's workers inherit
    the profile's LLMGW_TEST_DIR).
    """
    needle = str(directory).encode()
    pids = set(processes_mentioning(str(directory)))
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in environ and state != "Z":
            pids.add(int(entry.name))
    return sorted(pids)


def health(address: str) -> int:
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


class RealEngineTests(SynchronousTestCase):
    def run_engine(self, catalog: Callable[[Path], str], signals_expected: tuple[str, ...],
                   start_s: float = DEADLINE) -> None:
        from openai import OpenAI

        fleet = RealEngineFleet(self, catalog)
        ready = fleet.wait("a ready replica", lambda: fleet.ready_replicas(), start_s)
        [(replica_id, replica)] = ready.items()
        address = replica["shards"][0]["address"]
        # Ready means the engine answers: its own health check says so.
        self.assertEqual(health(address), 200)
        self.assertIn("is ready (health check on port", fleet.output())

        client = OpenAI(base_url=f"http://127.0.0.1:{fleet.gateway_port}/v1", api_key="none",
                        timeout=30, max_retries=0)
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True})
        self.assertEqual(reply.choices[0].finish_reason, "length")
        self.assertEqual(reply.usage.completion_tokens, 8)
        self.assertTrue(reply.choices[0].message.content.strip())
        chunks = list(client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8,
            temperature=0, stream=True, extra_body={"ignore_eos": True}))
        self.assertGreater(len([c for c in chunks if c.choices and c.choices[0].delta.content]), 1)
        self.assertEqual(chunks[-1].choices[0].finish_reason if chunks[-1].choices else "length",
                         "length")

        def signals() -> dict[str, Any] | None:
            rep = fleet.admin("/api/v1/replicas")["replicas"]
            sig = next((r["shards"][0]["signals"] for r in rep if r["id"] == replica_id), None)
            if sig and sig["age_s"] is not None and all(sig[k] for k in signals_expected):
                return sig  # type: ignore[no-any-return]
            return None

        sig = fleet.wait("the engine's metrics in the admin API", signals)
        self.assertEqual(sig["running"], 0.0)
        self.assertLess(sig["age_s"], 5.0)
        self.assertIsNone(sig["error"])
        metrics = fleet.admin("/metrics", raw=True)
        self.assertIn(f'llmgw_engine_requests_running{{model="tiny",replica="{replica_id}"', metrics)
        table = subprocess.run(
            [*llmgw_command(), "ctl", "replicas", "--admin-url", f"http://127.0.0.1:{fleet.admin_port}"],
            capture_output=True, text=True, timeout=30, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        self.assertIn("WAITING", table.stdout, table.stderr)

        victim_pid = fleet.shard_pids()[replica_id]
        os.kill(victim_pid, signal.SIGKILL)
        replaced = fleet.wait(
            "the killed engine replaced and ready",
            lambda: (lambda r: len(r) == 1 and replica_id not in r and r)(fleet.ready_replicas()),
            start_s)
        events = fleet.admin("/api/v1/events")["events"]
        self.assertTrue(any(e.get("replica") == replica_id and "fail" in e["kind"]
                            for e in events), events)
        # Exactly one engine runs: the replacement (and its children, if any).
        [new_id] = replaced
        new_pid = fleet.shard_pids()[new_id]
        engines = [p for p in engine_processes(fleet.dir) if p != fleet.proc.pid]
        self.assertNotIn(victim_pid, engines)
        self.assertTrue(engines)
        self.assertEqual({os.getpgid(p) for p in engines}, {new_pid})
        again = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "again"}], max_tokens=4,
            extra_body={"ignore_eos": True})
        self.assertEqual(again.usage.completion_tokens, 4)

        fleet.proc.send_signal(signal.SIGTERM)
        try:
            fleet.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.fail(f"the fleet did not stop on SIGTERM:\n{fleet.output()[-4000:]}")
        self.assertEqual(engine_processes(fleet.dir), [])

    def test_llama_server(self) -> None:
        """
        llama-server with the tiny model: ready once it answers, chat and
        streamed chat through the gateway, metrics (running, deferred,
        prefix-cache tokens) in the admin API, /metrics and ctl; a SIGKILL
        gives a failure and a replacement and leaves no engine process; the
        fleet's stop leaves none.
        """
        binary = find_llama_server()
        if binary is None:
            raise SkipTest(llama_server_missing_reason())
        from llmgw.testing.tinygguf import write

        def catalog(directory: Path) -> str:
            # The model lives in the fleet's directory, so the engine's
            # command line names it: processes_mentioning() finds it.
            model = write(directory / "tiny.gguf")
            return LLAMA_CATALOG.format(binary=json.dumps(str(binary)), model=json.dumps(str(model)))

        self.run_engine(catalog, ("prefix_cache_queries",))

    def test_llama_server_by_source(self) -> None:
        """
        A deployment that names a local GGUF by file:// source, with a
        llamacpp profile that names llama-server as its program and has no
        command, becomes ready and answers a chat through the gateway; the
        engine runs the command llmgw wrote (the model's path, the shard's
        port, the deployment's name and args); the fleet's stop leaves no
        engine process.
        """
        binary = find_llama_server()
        if binary is None:
            raise SkipTest(llama_server_missing_reason())

        from llmgw.testing.tinygguf import write

        models: list[Path] = []

        def catalog(directory: Path) -> str:
            models.append(write(directory / "tiny.gguf"))
            return LLAMA_SOURCE_CATALOG.format(binary=json.dumps(str(binary)),
                                               source=json.dumps(models[0].as_uri()))

        fleet = RealEngineFleet(self, catalog)
        ready = fleet.wait("a ready replica", lambda: fleet.ready_replicas())
        [(replica_id, replica)] = ready.items()
        address = replica["shards"][0]["address"]
        self.assertEqual(health(address), 200)
        cmdline = Path(f"/proc/{fleet.shard_pids()[replica_id]}/cmdline").read_bytes()
        self.assertEqual(cmdline.split(b"\0")[:-1], [os.fsencode(a) for a in (
            str(binary), "-m", str(models[0]), "--host", address.rsplit(":", 1)[0], "--port",
            address.rsplit(":", 1)[1], "--alias", "tiny", "--metrics", "-c", "512", "-np", "2",
            "-t", "1", "--no-warmup", "-ngl", "0")])
        self.assertEqual(fleet.chat(4).usage.completion_tokens, 4)
        fleet.stop()

    def test_vllm_cpu(self) -> None:
        """
        The same with vLLM's CPU build (opt-in: LLMGW_TEST_VLLM=1 and
        LLMGW_VLLM_MODEL), started as python -m
        vllm.entrypoints.openai.api_server.
        """
        if os.environ.get("LLMGW_TEST_VLLM") != "1":
            raise SkipTest("opt-in: set LLMGW_TEST_VLLM=1 and LLMGW_VLLM_MODEL (vllm-cpu "
                           "installed in this interpreter); not run in CI")
        model = os.environ.get("LLMGW_VLLM_MODEL")
        if not model:
            raise SkipTest("LLMGW_VLLM_MODEL is not set: give a small model vLLM can load "
                           "(python -m llmgw.testing.tinyhf DIR writes one)")
        # vLLM's workers do not name the fleet's directory; the marker does.
        def catalog(directory: Path) -> str:
            return VLLM_CATALOG.format(python=json.dumps(sys.executable), model=json.dumps(model),
                                       marker=json.dumps(str(directory)))

        # vLLM compiles the model at each start: a minute on 2 idle cores,
        # more on a loaded machine (the profile allows 300 s too).
        self.run_engine(catalog, ("prefix_cache_queries",), start_s=300.0)


class LlamaServerReadinessTests(TestCase):
    """
    The supervisor's readiness rule against the real engine, probing fast.
    """

    timeout = 60

    @defer.inlineCallbacks
    def test_ready_only_after_the_engine_answers(self) -> Any:
        """
        Every health check before the shard became ready failed (nothing
        listening yet, or 503 while the model loads) and the one that made
        it ready answered 200; a chat works at once; the stop leaves no
        process. The engine is held back until a check has failed (its
        shell waits for a file the first failed check writes), so the
        first check never finds it already up, however the machine is
        loaded.
        """
        binary = find_llama_server()
        if binary is None:
            raise SkipTest(llama_server_missing_reason())
        from twisted.internet import reactor

        from llmgw.agent.probe import HttpProber
        from llmgw.agent.state import ShardSpec
        from llmgw.agent.supervisor import Supervisor
        from llmgw.testing.tinygguf import write

        directory = Path(self.mktemp()).resolve()
        directory.mkdir(parents=True)
        model = write(directory / "tiny.gguf")
        results: list[str] = []
        real = HttpProber(reactor, timeout=2)

        gate = directory / "go"

        def failed(f: Any) -> Any:
            results.append(f.getErrorMessage())
            gate.touch()
            return f

        class Recording:
            def probe(self, url: str) -> Any:
                d = real.probe(url)
                d.addCallbacks(lambda r: (results.append("ok"), r)[1], failed)
                return d

        sup = Supervisor(reactor, lambda *a, **kw: reactor.spawnProcess(*a, **kw),
                         StateDir(directory / "state"), prober=Recording(),
                         probe_interval_starting=0.02,
                         base_env={k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ})
        ready: defer.Deferred[int] = defer.Deferred()
        ended: defer.Deferred[None] = defer.Deferred()

        def listen(shard: Any) -> None:
            if shard.state == "ready" and not ready.called:
                ready.callback(len(results))
            if shard.state in ("stopped", "failed") and not ended.called:
                ended.callback(None)

        sup.add_listener(listen)
        port = free_port()
        shard = sup.start(ShardSpec(
            shard_id="llama", replica_id="r", model="tiny", profile="p", gpu_indices=[],
            port=port, stop_grace_s=5, startup_timeout_s=30,
            argv=["/bin/sh", "-c",
                  f'while [ ! -e "{gate}" ]; do sleep 0.05; done; exec "$0" "$@"',
                  str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", "{port}",
                  "-c", "512", "-np", "1", "-t", "1"]))
        self.addCleanup(lambda: engine_processes(directory) and [
            os.killpg(p, signal.SIGKILL) for p in engine_processes(directory)])
        # On a failure before the stop below, no probe timer outlives the test.
        self.addCleanup(sup.stopService)
        probes_at_ready = yield ready.addTimeout(30, reactor)
        self.assertEqual(results[probes_at_ready - 1], "ok")
        self.assertNotIn("ok", results[: probes_at_ready - 1])
        self.assertGreater(probes_at_ready, 1, "the first check came before the engine answered")
        self.assertEqual(health(f"127.0.0.1:{port}"), 200)
        body = json.dumps({"model": "tiny", "max_tokens": 2,
                           "messages": [{"role": "user", "content": "hi"}]}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                         {"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            self.assertEqual(json.loads(response.read())["usage"]["completion_tokens"], 2)
        sup.stop(shard.shard_id)
        yield ended.addTimeout(15, reactor)
        self.assertEqual(shard.state, "stopped")
        self.assertEqual(engine_processes(directory), [])


class TinyHfModelTests(SynchronousTestCase):
    """
    C{llmgw.testing.tinyhf}, the model the vLLM test is documented with
    (skipped where C{transformers} is not installed, as in CI).
    """

    def test_model_directory(self) -> None:
        """
        The directory loads with transformers' own loaders as a Llama of two
        heads of 32 (the smallest head vLLM's CPU attention takes), its chat
        template renders, the words decode with spaces between them, and the
        special tokens' output rows are zero (no reply can end early).
        """
        try:
            import torch
            from transformers import AutoConfig, AutoTokenizer
        except ImportError as e:
            raise SkipTest(f"needs torch and transformers (vLLM's venv): {e}") from None
        from safetensors.torch import load_file

        from llmgw.testing.tinyhf import SPECIAL, words, write

        directory = write(Path(self.mktemp()))
        config = AutoConfig.from_pretrained(directory)
        self.assertEqual((config.model_type, config.num_attention_heads, config.head_dim,
                          config.num_hidden_layers), ("llama", 2, 32, 2))
        tokenizer = AutoTokenizer.from_pretrained(directory)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}],
                                               tokenize=False, add_generation_prompt=True)
        self.assertEqual(prompt, "<|user|>hello\n<|assistant|>")
        ids = [len(SPECIAL) + i for i in (0, 1, 2)]
        self.assertEqual(tokenizer.decode(ids), " ".join(w[1:] for w in words()[:3]))
        head = load_file(str(directory / "model.safetensors"))["lm_head.weight"]
        self.assertEqual(head.shape, (len(SPECIAL) + len(words()), 64))
        self.assertTrue(torch.all(head[: len(SPECIAL)] == 0))
        self.assertTrue(torch.all(head[len(SPECIAL):].abs().sum(dim=1) > 0))
