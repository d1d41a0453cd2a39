"""
Tests for C{llmgw ctl} against an HA control plane: it
follows a member's redirect to the leader, bounded, and never out of TLS.
"""

from __future__ import annotations

import io
import json
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.admin.api import AdminResource
from llmgw.control.shell.metrics import make_registry
from llmgw.ctl import fleet as ctl
from llmgw.ctl.main import build_parser
from llmgw.testing.fleet import sample_fleet
from tests.test_ctl import NOW, stub_http


def redirecting(to: str, then: ctl.HTTPFunction, calls: list[str], times: int = 1) -> ctl.HTTPFunction:
    """
    An HTTP function that answers the first C{times} requests with a 307 to
    C{to} plus the path, then asks C{then}; every URL asked is in C{calls}.
    """
    left = [times]

    def http(method: str, url: str, body: bytes | None, timeout: float) -> tuple[int, bytes]:
        calls.append(url)
        if left[0] > 0:
            left[0] -= 1
            path = url.split("/", 3)[3]
            raise ctl.Redirected(307, f"{to}/{path}")
        return then(method, url, body, timeout)

    return http


class RedirectTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.fleet = sample_fleet()
        self.stub_calls: list[tuple[str, str, Any]] = []
        self.leader = stub_http(AdminResource(self.fleet, make_registry()), self.stub_calls)
        self.calls: list[str] = []

    def ctl(self, http: ctl.HTTPFunction, *argv: str) -> tuple[int, str, str]:
        args = build_parser().parse_args(["ctl", *argv])
        out, err = io.StringIO(), io.StringIO()
        code = args.func(args, out=out, err=err, http=http, now=NOW)
        return code, out.getvalue(), err.getvalue()

    def test_write_follows_to_leader(self) -> None:
        """
        A cordon sent to a member that does not lead is sent again, same
        method and body, to the leader the redirect names, and done there.
        """
        http = redirecting("http://localhost:7481", self.leader, self.calls)
        code, out, err = self.ctl(http, "scale", "demo", "3", "--admin-url", "http://127.0.0.1:7480")
        self.assertEqual((code, err), (0, ""), out)
        self.assertEqual(self.calls, ["http://127.0.0.1:7480/api/v1/deployments/demo/scale",
                                      "http://localhost:7481/api/v1/deployments/demo/scale"])
        self.assertEqual(self.stub_calls[-1][0], "POST")
        self.assertEqual(self.stub_calls[-1][2], {"replicas": 3})
        self.assertIn(("scale", "demo", 3), self.fleet.calls)

    def test_bounded(self) -> None:
        """
        Members that keep redirecting are followed L{ctl.MAX_REDIRECTS} times,
        then the ctl stops with exit 4 and says why.
        """
        http = redirecting("http://localhost:7481", self.leader, self.calls, times=100)
        code, _, err = self.ctl(http, "nodes", "--admin-url", "http://127.0.0.1:7480")
        self.assertEqual(code, ctl.EXIT_SERVER)
        self.assertIn("redirected more than", err)
        self.assertEqual(len(self.calls), ctl.MAX_REDIRECTS + 1)
        self.assertEqual(self.stub_calls, [])

    def test_never_out_of_tls(self) -> None:
        """
        A redirect from https to http is refused: nothing is sent in clear.
        """
        http = redirecting("http://localhost:7481", self.leader, self.calls)
        code, _, err = self.ctl(http, "nodes", "--admin-url", "https://127.0.0.1:7480")
        self.assertEqual(code, ctl.EXIT_SERVER)
        self.assertIn("would leave TLS", err)
        self.assertEqual(self.stub_calls, [])

    def test_json_of_the_leader(self) -> None:
        """
        --json prints the leader's answer.
        """
        http = redirecting("http://localhost:7481", self.leader, self.calls)
        code, out, _ = self.ctl(http, "nodes", "--json", "--admin-url", "http://127.0.0.1:7480")
        self.assertEqual(code, 0)
        self.assertIn("gpu-1", [n["id"] for n in json.loads(out)["nodes"]])
