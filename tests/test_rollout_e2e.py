"""
End to end: a profile change rolled across a full fleet under load. A real
C{llmgw local} process with two agents of one simulated GPU each serves two
replicas of the fake model server (each slow to start); an open-loop client
sends chat completions through the gateway, half of them streamed, while
the catalog's profile changes and is reloaded. With no spare GPU the
rollout drains one old replica at a time and places its replacement on the
GPU it freed.

Bounded: every wait polls the admin API with a deadline, and cleanup kills
the fleet and every shard it started, even when an assertion fails.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmgw.local import demo_catalog
from llmgw.testing.openloop import OpenLoopClient, tally
from tests.test_local_e2e import LocalFleetHarness

#: Seconds a fake engine takes before its /health answers 200.
START_DELAY = "1"
#: Words in a full reply before and after the change (how a replica shows
#: which version it runs).
OLD_TOKENS, NEW_TOKENS = 16, 12
ROLLOUT_DEADLINE = 90.0


def rollout_catalog(directory: Path, tokens: int) -> Path:
    """
    The demo catalog (two replicas of one simulated GPU each) with engines
    slow to start and replies of C{tokens} words, streamed at a pace that
    keeps requests in flight while a replica drains.
    """
    path = demo_catalog(directory)
    text = path.read_text()
    extra = (f'"--startup-delay", "{START_DELAY}", "--tokens-per-second", "40", '
             f'"--tokens", "{tokens}"]')
    marker = '"--metrics", "vllm"]'
    if marker not in text:
        raise AssertionError(f"the demo catalog's command no longer ends with {marker}")
    path.write_text(text.replace(marker, f'"--metrics", "vllm", {extra}', 1))
    return path


class RolloutUnderLoadTests(LocalFleetHarness, SynchronousTestCase):
    def admin(self, path: str, method: str = "GET") -> Any:
        request = urllib.request.Request(f"http://127.0.0.1:{self.admin_port}{path}", method=method,
                                         data=b"{}" if method == "POST" else None,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.loads(response.read())

    def ready(self) -> dict[str, str]:
        """
        Ready replicas of the demo model that are not draining: id -> address.
        """
        return {r["id"]: r["shards"][0]["address"] for r in self.admin("/api/v1/replicas")["replicas"]
                if r["model"] == "demo" and r["state"] == "ready" and not r["draining"]}

    def deployment(self) -> dict[str, Any]:
        [dep] = [d for d in self.admin("/api/v1/deployments")["deployments"] if d["model"] == "demo"]
        return dep  # type: ignore[no-any-return]

    def reply_words(self, address: str) -> int:
        """
        Tokens (the fake's words) in a full reply from the engine at
        C{address}, asked directly.
        """
        body = json.dumps({"model": "demo", "messages": [{"role": "user", "content": "which"}]})
        request = urllib.request.Request(f"http://{address}/v1/chat/completions", data=body.encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(json.loads(response.read())["usage"]["completion_tokens"])

    def test_profile_change_under_load(self) -> None:
        """
        A profile change of two replicas on two full one-GPU nodes under an
        open-loop client (10 requests a second, half streamed) replaces
        both replicas, one at a time, with the new version: the rollout is
        done 2/2, both ready replicas are new and run the new command, and
        no request got a non-2xx answer or a broken stream.
        """
        home = Path(self.mktemp()).resolve()
        home.mkdir(parents=True)
        catalog = rollout_catalog(home, OLD_TOKENS)
        self.start_fleet("--agents", "2", "--gpus", "sim:1x24GiB", "--catalog", str(catalog))
        before = self.wait("two ready replicas", lambda: (r := self.ready()) and len(r) == 2 and r)
        self.assertEqual({self.reply_words(a) for a in before.values()}, {OLD_TOKENS})

        client = OpenLoopClient("127.0.0.1", self.gateway_port, "demo", rate=10, timeout=30)
        client.start()
        try:
            # Traffic flows before the change, so requests are in flight when
            # the first replica drains.
            self.wait("answers before the change", lambda: len(client.answers) >= 10)
            catalog.write_text(catalog.read_text().replace(
                f'"--tokens", "{OLD_TOKENS}"', f'"--tokens", "{NEW_TOKENS}"'))
            changed = self.admin("/api/v1/catalog/reload", "POST")
            self.assertIn("demo", json.dumps(changed))
            done = self.wait("the rollout done", lambda: (
                (ro := self.deployment()["rollout"]) is not None and ro["state"] != "progressing" and ro),
                timeout=ROLLOUT_DEADLINE)
            sent_by_end = len(client.answers)
            # A little more traffic on the new replicas, awaited by count.
            self.wait("answers after the rollout", lambda: len(client.answers) >= sent_by_end + 10)
        finally:
            answers = client.stop()

        self.assertEqual((done["state"], done["updated"], done["total"]), ("done", 2, 2), done)
        after = self.wait("two ready replicas", lambda: (r := self.ready()) and len(r) == 2 and r)
        self.assertFalse(set(after) & set(before), (before, after))
        self.assertEqual({self.reply_words(a) for a in after.values()}, {NEW_TOKENS})
        counts = tally(answers)
        self.assertGreater(counts["sent"], 20, counts)
        self.assertEqual((counts["non_2xx"], counts["broken_streams"], counts["broken_plain"]),
                         (0, 0, 0), counts)
        kinds = [e["kind"] for e in self.admin("/api/v1/events")["events"]]
        self.assertEqual(kinds.count("rollout_step"), 2, kinds)
