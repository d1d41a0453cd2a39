"""
End to end: a deployment with C{min_replicas = 0} in a real
C{llmgw local} fleet (a process, real agents and fake model servers) has no
replica; a gateway's demand report brings one up, a request through the
gateway is answered, and once idle for C{scale_to_zero_after_s} the fleet
is back to zero replicas.

Scale from zero is asked for once by a demand report (what a standalone
gateway posts) and once by the request itself: held in the embedded
gateway's admission queue, counted as waiting, answered once the replica
it brought up is ready.

Bounded: every wait has a deadline, and cleanup kills whatever is left even
when an assertion fails.
"""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmgw.local import demo_catalog
from tests.test_local_e2e import LocalFleetHarness, processes_mentioning

DEADLINE = 60.0
AUTOSCALED = """min_replicas = 0
max_replicas = 2
target_in_flight = 4
scale_to_zero_after_s = 3
stabilization_s = 5
"""


class ScaleFromAndToZeroTests(LocalFleetHarness, SynchronousTestCase):
    def setUp(self) -> None:
        where = Path(self.mktemp()).resolve()
        where.mkdir(parents=True)
        catalog = demo_catalog(where)
        text = catalog.read_text()
        self.assertIn("replicas = 2\n", text)
        catalog.write_text(text.replace("replicas = 2\n", AUTOSCALED))
        self.start_fleet("--catalog", str(catalog))

    def admin(self, path: str, body: Any = None) -> Any:
        url = f"http://127.0.0.1:{self.admin_port}{path}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.loads(response.read())

    def replicas(self) -> list[dict[str, Any]]:
        return self.admin("/api/v1/replicas")["replicas"]  # type: ignore[no-any-return]

    def test_from_zero_and_back(self) -> None:
        """
        No replica while nothing is asked; a report of one waiting request
        places one, which answers a chat completion through the gateway;
        with no demand for the idle time the replica is drained and
        stopped, and the deployment holds zero replicas again. Each step is
        an event with its reason.
        """
        from openai import OpenAI

        deployment = self.wait("the admin API", lambda: self.admin("/api/v1/deployments")["deployments"])[0]
        self.assertEqual((deployment["desired"], deployment["autoscale"]["min_replicas"]), (0, 0))
        # Past the adoption grace, with agents registered: still nothing placed.
        self.wait("the adoption grace over", lambda: self.admin("/api/v1/status").get("placing_after") is None
                  and len(self.admin("/api/v1/nodes")["nodes"]) == 2)
        self.assertEqual(self.replicas(), [])

        def report_and_look() -> list[dict[str, Any]]:
            # As a standalone gateway does: a report every poll, each
            # counting for a few seconds.
            self.admin("/api/v1/demand", {"gateway_id": "e2e", "models": {"demo": {"in_flight": 0, "waiting": 1}}})
            return [r for r in self.replicas() if r["state"] == "ready"]

        ready = self.wait("a ready replica", report_and_look)
        self.assertEqual(len(ready), 1)
        client = OpenAI(base_url=f"http://127.0.0.1:{self.gateway_port}/v1", api_key="none",
                        timeout=10, max_retries=0)
        reply = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hello"}])
        self.assertTrue(reply.choices[0].message.content)
        self.admin("/api/v1/demand", {"gateway_id": "e2e", "models": {}})

        self.wait("zero replicas again", lambda: self.replicas() == [] and
                  self.admin("/api/v1/deployments")["deployments"][0]["desired"] == 0)
        events = self.admin("/api/v1/events")["events"]
        kinds = [e["kind"] for e in events if e["kind"].startswith("autoscale")]
        self.assertEqual(kinds, ["autoscale_up", "autoscale_to_zero"], events)
        self.assertTrue(any(e["kind"] == "replica_draining" and e["replica"] == ready[0]["id"] for e in events))

        self.stop_fleet()

    def test_first_request_held_until_ready(self) -> None:
        """
        With zero replicas, the first request is held (not refused): it
        counts as waiting, the autoscaler places a replica for it, and it
        is answered through the gateway once that replica is ready; with
        no request for the idle time the deployment goes back to zero.
        """
        from concurrent.futures import ThreadPoolExecutor

        from openai import OpenAI

        self.wait("the adoption grace over", lambda: self.admin("/api/v1/status").get("placing_after") is None
                  and len(self.admin("/api/v1/nodes")["nodes"]) == 2)
        self.assertEqual(self.replicas(), [])
        client = OpenAI(base_url=f"http://127.0.0.1:{self.gateway_port}/v1", api_key="none",
                        timeout=DEADLINE, max_retries=0)
        pool = ThreadPoolExecutor(1)
        self.addCleanup(pool.shutdown, wait=False)
        held = pool.submit(client.chat.completions.create, model="demo",
                           messages=[{"role": "user", "content": "hello"}])
        reply = held.result(timeout=DEADLINE)
        self.assertTrue(reply.choices[0].message.content)
        events = self.admin("/api/v1/events")["events"]
        up = [e for e in events if e["kind"] == "autoscale_up"]
        self.assertEqual(len(up), 1, events)
        # It was held while the replica started, not answered from one
        # already there: the only replica was placed for it, queued.
        self.assertIn("1 queued", up[0]["reason"])
        self.wait("zero replicas again", lambda: self.replicas() == [] and
                  self.admin("/api/v1/deployments")["deployments"][0]["desired"] == 0)
        self.stop_fleet()

    def stop_fleet(self) -> None:
        self.fleet.send_signal(signal.SIGTERM)
        try:
            self.fleet.wait(30)
        except subprocess.TimeoutExpired:
            self.fail(f"the fleet did not stop on SIGTERM:\n{self.output()[-4000:]}")
        self.assertEqual(processes_mentioning(str(self.dir)), [])
