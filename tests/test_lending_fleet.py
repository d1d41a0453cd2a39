"""
Lending a sleeping replica's GPU, end to end on a real local fleet (the
control plane, one agent with one simulated GPU and the gateway as
processes, each engine the engine simulator with vLLM's sleep endpoints,
L{llmgw.testing.sleepsim}). vLLM's own sleep mode needs a GPU, so CI runs
the simulator taught its documented shapes instead.
"""

from __future__ import annotations

import json
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

ROOT = Path(__file__).resolve().parent.parent
COMMAND = [
    "{python}", "-m", "llmgw.testing.sleepsim", "--sleep-mode", "vllm", "--sleep-ms", "100",
    "--wake-ms", "200", "--port", "{port}", "--model", "{model}", "--host", "{host}", "--engine-sim",
    "--startup-delay", "0.5", "--tokens", "4",
]


#: An SGLang-shaped engine without its sleep endpoints, as SGLang started
#: without its memory saver: asked to sleep, the call fails.
NO_SLEEP = [
    "{python}", "-m", "llmgw.testing.fakemodel", "--metrics", "sglang", "--port", "{port}", "--model", "{model}",
    "--host", "{host}", "--engine-sim", "--startup-delay", "0.5", "--tokens", "4",
]


def profile(name: str, engine: str, command: list[str]) -> str:
    return (f'[profiles.{name}]\nengine = "{engine}"\ngpus_per_shard = 1\ngpu_memory_mb = 1000\n'
            f"command = {json.dumps(command)}\nenv = {{ PYTHONPATH = {json.dumps(str(ROOT))} }}\n"
            "startup_timeout_s = 60\ndrain_timeout_s = 5\nstop_grace_s = 2\nsleep_level = 1\n")


def catalog(a_profile: str = "sim", a_sleep_after: int = 2) -> str:
    text = profile("sim", "vllm", COMMAND) + profile("nosleep", "sglang", NO_SLEEP)
    for model, sleep_after in (("a", a_sleep_after), ("b", 0)):
        text += (f'\n[[deployments]]\nmodel = "{model}"\nprofile = "{a_profile if model == "a" else "sim"}"\n'
                 f"min_replicas = 0\nmax_replicas = 1\n"
                 f"scale_to_zero_after_s = 3600\nstabilization_s = 0\nevictable = true\nmin_resident_s = 1\n"
                 f"queue_timeout_s = 60\n" + (f"sleep_after_s = {sleep_after}\n" if sleep_after else ""))
    return text


class LendingFleetTests(SynchronousTestCase):
    def fleet(self, text: str | None = None) -> tuple[Any, Any]:
        """A local fleet of one agent with one simulated GPU on C{text} (L{catalog}), and the chat call to ask it."""
        sys.path.insert(0, str(ROOT))
        from bench.multiplex import chat
        from bench.survival import LocalFleet

        directory = Path(self.mktemp()).resolve()
        directory.mkdir(parents=True)
        path = directory / "catalog.toml"
        path.write_text(text if text is not None else catalog())
        fleet = LocalFleet(directory, path, agents=1, gpus="sim:1x24GiB")
        self.addCleanup(fleet.close)
        return fleet, chat
    def test_b_on_a_sleeping_gpu_then_a_back(self) -> None:
        """
        On one simulated GPU: model a's replica serves, then sleeps; a
        request for b places b on a's GPU (a's process kept, a displaced:
        no route); a request for a then takes b back, a is restored and
        woken by the gateway, and answered by the same replica.
        """
        fleet, chat = self.fleet()

        def replicas(model: str) -> list[dict[str, Any]]:
            return [r for r in fleet.admin("/api/v1/replicas")["replicas"] if r["model"] == model]

        def kinds() -> list[tuple[str, str]]:
            return [(e["kind"], e.get("replica") or "") for e in fleet.admin("/api/v1/events?since=0")["events"]]

        status, _, _ = chat(fleet.gateway_port, "a", 90)
        self.assertEqual(status, 200)
        [a] = fleet.wait("a asleep", lambda: [r for r in replicas("a") if r.get("sleeping")], 30)
        status, _, _ = chat(fleet.gateway_port, "b", 90)
        self.assertEqual(status, 200)
        [b] = replicas("b")
        self.assertEqual(b["shards"][0]["gpus"], a["shards"][0]["gpus"])
        [a_now] = replicas("a")
        self.assertEqual(a_now["displaced_by"], [b["id"]])
        self.assertIn(("gpu_lent", b["id"]), kinds())
        self.assertIn(("replica_displaced", a["id"]), kinds())
        # b's min_resident_s (1 s) is over by the time a's request is seen.
        status, _, _ = chat(fleet.gateway_port, "a", 90)
        self.assertEqual(status, 200)
        seen = kinds()
        self.assertIn(("swap", b["id"]), seen)
        self.assertIn(("replica_restored", a["id"]), seen)
        [a_after] = replicas("a")
        self.assertEqual((a_after["id"], a_after["displaced_by"]), (a["id"], []))

    def test_refused_sleep_gives_way_at_once(self) -> None:
        """
        Model a's idle replica is asked to sleep to make room for b, and
        its engine's sleep call fails (an SGLang without its memory
        saver): the agent says so in its next heartbeat and the control
        plane takes a at once, the agent's reason in its event, rather
        than waiting out its bound; b is placed and answered.
        """
        fleet, chat = self.fleet(catalog(a_profile="nosleep", a_sleep_after=600))

        def events() -> list[dict[str, Any]]:
            return fleet.admin("/api/v1/events?since=0")["events"]  # type: ignore[no-any-return]

        status, _, _ = chat(fleet.gateway_port, "a", 90)
        self.assertEqual(status, 200)
        status, _, _ = chat(fleet.gateway_port, "b", 90)
        self.assertEqual(status, 200)
        seen = [(e["kind"], e.get("replica") or "", e.get("reason", "")) for e in events()]
        kinds = [k for k, _, _ in seen if k in ("swap_sleep", "swap_sleep_failed", "swap")]
        self.assertEqual(kinds, ["swap_sleep", "swap_sleep_failed", "swap"], seen)
        [failed] = [reason for kind, _, reason in seen if kind == "swap_sleep_failed"]
        self.assertIn("were not put to sleep by their agents", failed)
        self.assertIn("sleep call failed", failed)

    def test_lender_woken_during_the_lend(self) -> None:
        """
        The race a lend closes: model a's sleeping replica is woken (its
        engine's wake called straight, as a gateway holding the routing
        table from just before the lend would) right after its GPU is lent
        to b. b's first replica never starts beside it: the lend is
        cancelled while b's start waits (or, heard too late, b's agent
        asks a's engine and refuses the start); once a sleeps again b is
        lent the GPU and served.
        """
        fleet, chat = self.fleet()

        def events() -> list[dict[str, Any]]:
            return fleet.admin("/api/v1/events?since=0")["events"]  # type: ignore[no-any-return]

        status, _, _ = chat(fleet.gateway_port, "a", 90)
        self.assertEqual(status, 200)
        [a] = fleet.wait("a asleep", lambda: [r for r in fleet.admin("/api/v1/replicas")["replicas"]
                                              if r["model"] == "a" and r.get("sleeping")], 30)
        answers: list[int] = []
        thread = threading.Thread(target=lambda: answers.append(chat(fleet.gateway_port, "b", 90)[0]))
        thread.start()
        self.addCleanup(thread.join, 100)
        [lent] = fleet.wait("b lent a's GPU", lambda: [e for e in events() if e["kind"] == "gpu_lent"], 30)
        first = lent["replica"]
        woken = urllib.request.Request(f"http://{a['shards'][0]['address']}/wake_up", data=b"", method="POST")
        with urllib.request.urlopen(woken, timeout=10) as response:
            self.assertEqual(response.status, 200)
        thread.join(100)
        self.assertEqual(answers, [200])
        seen = events()
        stopped_it = [e for e in seen if e.get("replica") == first and (
            e["kind"] == "lend_cancelled" or (e["kind"] == "shard_failed" and "awake" in e.get("reason", "")))]
        self.assertTrue(stopped_it, [(e["kind"], e.get("replica"), e.get("reason")) for e in seen])
        self.assertNotIn(("replica_ready", first), [(e["kind"], e.get("replica")) for e in seen])
