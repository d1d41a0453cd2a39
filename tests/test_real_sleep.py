"""
llama.cpp's own sleep under llmgw, with the real C{llama-server} and a tiny
model written at test time: a deployment with C{sleep_after_s} on a
profile with C{sleep_level} runs the engine with C{--sleep-idle-seconds};
after that idleness the engine says C{is_sleeping} in C{/props}, the agent
reports it (the replicas view, the events), and a request routed through
the gateway wakes it and is answered. Skipped, saying why, only when the
binary is absent.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from llmgw.testing.engines import find_llama_server, llama_server_missing_reason
from tests.test_real_engine import RealEngineFleet

CATALOG = """
[profiles.llama-cpu]
engine = "llamacpp"
gpus_per_shard = 1
program = {binary}
sleep_level = 1

[[deployments]]
model = "tiny"
profile = "llama-cpu"
replicas = 1
source = {source}
sleep_after_s = 2
args = ["-c", "512", "-np", "2", "-t", "1", "--no-warmup", "-ngl", "0"]
"""


def props(address: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{address}/props", timeout=5) as response:
        data = json.loads(response.read())
    assert isinstance(data, dict)
    return data


class LlamaSleepTests(SynchronousTestCase):
    def test_sleeps_and_wakes(self) -> None:
        """
        Idle for sleep_after_s, llama-server sleeps by itself (its /props
        says so), the control plane shows the replica asleep with an
        event, and a chat through the gateway wakes it and is answered.
        """
        binary = find_llama_server()
        if binary is None:
            raise SkipTest(llama_server_missing_reason())
        from llmgw.testing.tinygguf import write

        def catalog(directory: Path) -> str:
            model = write(directory / "tiny.gguf")
            return CATALOG.format(binary=json.dumps(str(binary)), source=json.dumps(model.as_uri()))

        fleet = RealEngineFleet(self, catalog)
        ready = fleet.wait("a ready replica", lambda: fleet.ready_replicas())
        [(replica_id, replica)] = ready.items()
        address = replica["shards"][0]["address"]
        cmdline = Path(f"/proc/{fleet.shard_pids()[replica_id]}/cmdline").read_bytes().split(b"\0")
        self.assertEqual(cmdline[cmdline.index(b"--sleep-idle-seconds") + 1], b"2")
        self.assertEqual(fleet.chat(4).usage.completion_tokens, 4)
        fleet.wait("the engine asleep in /props", lambda: props(address).get("is_sleeping") is True)
        fleet.wait("the replica shown asleep",
                   lambda: fleet.ready_replicas().get(replica_id, {}).get("sleeping") is True)
        events = fleet.admin("/api/v1/events")["events"]
        self.assertIn("replica_asleep", [e["kind"] for e in events])
        started = time.monotonic()
        self.assertEqual(fleet.chat(4).usage.completion_tokens, 4)
        woke_in = time.monotonic() - started
        self.assertFalse(props(address).get("is_sleeping"))
        self.assertLess(woke_in, 30)
        fleet.stop()
