"""
The rollout's admin API (C{/api/v1/deployments/MODEL/rollout}), its
C{/metrics} gauge and C{llmgw ctl rollout}, on a reconciler over simulated
nodes.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from prometheus_client import generate_latest
from treq.testing import StubTreq
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.admin.api import AdminResource
from llmgw.control.shell.metrics import make_registry, register_control_metrics
from llmgw.ctl.rollout import render
from llmgw.testing.fleet import FakeAgents
from tests.test_rollout import full_fleet, version

BASE = "http://127.0.0.1:7480"
JSON = {"Content-Type": ["application/json"]}


class RolloutAPITests(SynchronousTestCase):
    def setUp(self) -> None:
        self.f = full_fleet(nodes=3)
        self.registry = make_registry()
        register_control_metrics(self.registry, FakeAgents(["node-00000"]), lambda: self.f.rec)
        self.treq: Any = StubTreq(AdminResource(self.f.rec, self.registry, FakeAgents(["node-00000"])))

    def call(self, method: str, path: str) -> tuple[int, Any]:
        d = self.treq.request(method, BASE + path, headers=JSON if method == "POST" else {},
                              data=b"{}" if method == "POST" else None)
        self.treq.flush()
        response = self.successResultOf(d)
        return response.code, json.loads(self.successResultOf(self.treq.content(response)))

    def test_status_pause_resume_undo(self) -> None:
        """
        GET .../rollout answers the deployment's rollout; POST
        .../rollout/pause, /resume and /undo control it and answer the
        status after; control with no rollout is a 409; the deployments
        view carries the rollout.
        """
        code, body = self.call("POST", "/api/v1/deployments/demo/rollout/pause")
        self.assertEqual(code, 409, body)
        self.f.rec.apply_catalog(version(61))
        code, body = self.call("GET", "/api/v1/deployments/demo/rollout")
        self.assertEqual((code, body["rollout"]["state"], body["rollout"]["total"]), (200, "progressing", 2))
        code, body = self.call("POST", "/api/v1/deployments/demo/rollout/pause")
        self.assertEqual((code, body["rollout"]["state"], body["action"]), (200, "paused", "pause"))
        code, body = self.call("GET", "/api/v1/deployments")
        [demo] = body["deployments"]
        self.assertEqual(demo["rollout"]["state"], "paused")
        code, body = self.call("POST", "/api/v1/deployments/demo/rollout/resume")
        self.assertEqual((code, body["rollout"]["state"]), (200, "progressing"))
        code, body = self.call("POST", "/api/v1/deployments/demo/rollout/undo")
        self.assertEqual(code, 200, body)
        code, body = self.call("GET", "/api/v1/deployments/nope/rollout")
        self.assertEqual(code, 404, body)

    def test_metrics_gauge(self) -> None:
        """llmgw_rollout_state{model,state} is 1 for the rollout's state and 0 for the others."""
        self.f.rec.apply_catalog(version(61))
        text = generate_latest(self.registry).decode()
        self.assertIn('llmgw_rollout_state{model="demo",state="progressing"} 1.0', text)
        self.assertIn('llmgw_rollout_state{model="demo",state="done"} 0.0', text)

    def test_ctl_renders_status(self) -> None:
        """C{llmgw ctl rollout status} prints the rollout's line and the spec placed from."""
        self.f.rec.apply_catalog(version(61))
        line = render(self.f.rec.rollout_status("demo"))
        self.assertIn("demo: rollout progressing 0/2: one@", line)
        self.assertIn("placing one@", line)

    def test_ctl_parser(self) -> None:
        """C{llmgw ctl rollout ACTION MODEL} is registered."""
        from llmgw.ctl.main import build_parser

        parser = build_parser()
        args = parser.parse_args(["ctl", "rollout", "undo", "demo"])
        self.assertIsInstance(args, argparse.Namespace)
        self.assertEqual((args.action, args.model), ("undo", "demo"))
