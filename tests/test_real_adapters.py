"""
LoRA adapters end to end with a real engine: llama.cpp's C{llama-server}
serves a tiny base model and a tiny LoRA adapter, both written at test
time with the C{gguf} package (L{llmgw.testing.tinygguf}), under the local
fleet started as a user starts it. Skipped, saying why, only when the
binary is absent.

vLLM's runtime loading needs a GPU: it is tested against the engine
simulator (tests.test_agent_adapters), not here.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from llmgw.testing.engines import find_llama_server, llama_server_missing_reason
from tests.test_local_e2e import llmgw_command
from tests.test_real_engine import ROOT, RealEngineFleet

CATALOG = """
[profiles.llama-cpu]
engine = "llamacpp"
gpus_per_shard = 1
program = {binary}

[[deployments]]
model = "tiny"
profile = "llama-cpu"
replicas = 1
source = {base}
args = ["-c", "256", "-np", "1", "-t", "1", "--no-warmup", "-ngl", "0"]

[[deployments]]
model = "plain"
profile = "llama-cpu"
replicas = 1
source = {base}
args = ["-c", "256", "-np", "1", "-t", "1", "--no-warmup", "-ngl", "0"]

[[adapters]]
name = "sql"
base = "tiny"
source = {lora}
"""


def post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def engine_decodes(address: str) -> float:
    """
    The tokens llama-server at C{address} has decoded so far (its own metrics).
    """
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith("llamacpp:n_decode_total"):
            return float(line.split()[-1])
    raise AssertionError(f"no llamacpp:n_decode_total in {text[:500]}")


class RealAdapterTests(SynchronousTestCase):
    def test_llama_server_adapter(self) -> None:
        """
        The base's replica starts with C{--lora PATH}; its route, C{ctl
        replicas}, C{/metrics} and C{/v1/models} name the adapter; at
        temperature 0 the adapter's answer through the gateway differs from
        the base's and is the engine's own with the adapter at scale 1 (the
        base's with it at 0); requests for the adapter reach only the
        replica that holds it; the fleet's stop leaves no engine process.
        """
        binary = find_llama_server()
        if binary is None:
            raise SkipTest(llama_server_missing_reason())
        from llmgw.testing.tinygguf import write, write_lora

        files: dict[str, Path] = {}

        def catalog(directory: Path) -> str:
            files["base"] = write(directory / "tiny.gguf", spelled=True)
            files["lora"] = write_lora(directory / "sql-lora.gguf", spelled=True)
            return CATALOG.format(binary=json.dumps(str(binary)), base=json.dumps(files["base"].as_uri()),
                                  lora=json.dumps(files["lora"].as_uri()))

        fleet = RealEngineFleet(self, catalog)
        ready = fleet.wait("two ready replicas", lambda: (lambda r: len(r) == 2 and r)(fleet.ready_replicas()))
        by_model = {r["model"]: r for r in ready.values()}
        holder, other = by_model["tiny"], by_model["plain"]
        holder_address, other_address = holder["shards"][0]["address"], other["shards"][0]["address"]
        self.assertEqual((holder["adapters"], other["adapters"]), (["sql"], []))
        cmdline = Path(f"/proc/{fleet.shard_pids()[holder['id']]}/cmdline").read_bytes().split(b"\0")
        self.assertEqual(cmdline[-3:-1], [b"--lora", os.fsencode(files["lora"])])

        routes = fleet.admin("/api/v1/routes")
        self.assertEqual(routes["adapters"], {"sql": "tiny"})
        [route] = [r for r in routes["routes"] if r["model"] == "tiny"]
        self.assertEqual((route["adapters"], route["lora_ids"]), (["sql"], True))
        table = subprocess.run(
            [*llmgw_command(), "ctl", "replicas", "--admin-url", f"http://127.0.0.1:{fleet.admin_port}"],
            capture_output=True, text=True, timeout=30, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        self.assertIn("ADAPTERS", table.stdout, table.stderr)
        self.assertIn(f'llmgw_replica_adapter{{adapter="sql",model="tiny",replica="{holder["id"]}"}} 1.0',
                      fleet.admin("/metrics", raw=True))

        gateway = f"http://127.0.0.1:{fleet.gateway_port}"
        with urllib.request.urlopen(f"{gateway}/v1/models", timeout=5) as response:
            listed = json.loads(response.read())["data"]
        self.assertIn({"id": "sql", "object": "model", "created": 0, "owned_by": "llmgw", "parent": "tiny"},
                      listed)

        def ask(url: str, model: str, **extra: Any) -> str:
            reply = post(url, {"model": model, "messages": [{"role": "user", "content": "hello"}],
                               "max_tokens": 8, "temperature": 0, **extra})
            return str(reply["choices"][0]["message"]["content"])

        before = engine_decodes(other_address)
        adapted = [ask(f"{gateway}/v1/chat/completions", "sql") for _ in range(3)]
        self.assertEqual(engine_decodes(other_address), before)
        base = ask(f"{gateway}/v1/chat/completions", "tiny")
        self.assertNotEqual(adapted[0], base)
        self.assertEqual(set(adapted), {adapted[0]})
        direct = f"http://{holder_address}/v1/chat/completions"
        self.assertEqual(ask(direct, "tiny", lora=[{"id": 0, "scale": 1}]), adapted[0])
        self.assertEqual(ask(direct, "tiny", lora=[{"id": 0, "scale": 0}]), base)
        fleet.stop()
