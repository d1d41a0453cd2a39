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
from tests.test_admin_ha import FakeControl, FakeHA
from tests.test_ctl import NOW, stub_http

FOLLOWER = "http://127.0.0.1:7480"
LEADER = "http://127.0.0.1:7481"


def members(follower: Any, leader: ctl.HTTPFunction, calls: list[str]) -> ctl.HTTPFunction:
    """
    Two members of an HA control plane by URL: C{FOLLOWER} answers with
    the admin API C{follower} (a member that does not lead, in process),
    whose C{307} is raised as L{ctl.urllib_http} raises it (with its
    body); C{LEADER} is C{leader}.
    """
    from treq.testing import StubTreq

    stub: Any = StubTreq(follower)

    def http(method: str, url: str, body: bytes | None, timeout: float) -> tuple[int, bytes]:
        calls.append(url)
        if url.startswith(LEADER):
            return leader(method, url, body, timeout)
        got: list[Any] = []
        d = stub.request(method, url, data=body, allow_redirects=False,
                         headers={"Content-Type": ["application/json"]})
        d.addCallback(lambda r: stub.content(r).addCallback(lambda c: (r, c)))
        d.addBoth(got.append)
        stub.flush()
        response, content = got[0]
        location = response.headers.getRawHeaders(b"location")
        if response.code in (307, 308) and location:
            raise ctl.Redirected(response.code, location[0].decode(), content)
        return response.code, content

    return http


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
        self.assertEqual(code, 0, out)
        self.assertEqual(err, "llmgw ctl scale: http://127.0.0.1:7480 does not lead; POST sent to the leader "
                              "at http://localhost:7481\n")
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


class FollowerWritesTests(SynchronousTestCase):
    """
    Every write sent to a member that does not lead reaches the leader, and
    the ctl says so on stderr, against the follower's real admin API.
    """

    def setUp(self) -> None:
        self.fleet = sample_fleet()
        self.follower_fleet = sample_fleet()
        self.stub_calls: list[tuple[str, str, Any]] = []
        leader = stub_http(AdminResource(self.fleet, make_registry()), self.stub_calls)
        follower = AdminResource(self.follower_fleet, make_registry(),
                                 control=FakeControl(FakeHA(leader_id="cp-2", leader_admin_url=LEADER)))
        self.calls: list[str] = []
        self.http = members(follower, leader, self.calls)

    def ctl(self, *argv: str) -> tuple[int, str, str]:
        args = build_parser().parse_args(["ctl", *argv, "--admin-url", FOLLOWER])
        out, err = io.StringIO(), io.StringIO()
        code = args.func(args, out=out, err=err, http=self.http, now=NOW)
        return code, out.getvalue(), err.getvalue()

    def test_cordon_reaches_the_leader(self) -> None:
        """
        `ctl cordon` against a member that does not lead is answered 307 by
        it and done by the leader it names; stderr names that leader.
        """
        code, out, err = self.ctl("cordon", "gpu-1")
        self.assertEqual(code, 0, err)
        self.assertEqual(self.calls, [f"{FOLLOWER}/api/v1/nodes/gpu-1/cordon", f"{LEADER}/api/v1/nodes/gpu-1/cordon"])
        self.assertIn(("cordon", "gpu-1"), self.fleet.calls)
        self.assertEqual(self.follower_fleet.calls, [])
        self.assertEqual(err, f"llmgw ctl cordon: {FOLLOWER} does not lead; POST sent to the leader cp-2 at "
                              "http://127.0.0.1:7481\n")

    def test_every_write(self) -> None:
        """
        Uncordon, drain, scale, retry and the catalog reload go the same
        way: each is done by the leader, none by the member asked.
        """
        for argv, path in (
            (("uncordon", "gpu-1"), "/api/v1/nodes/gpu-1/uncordon"),
            (("drain", "gpu-1"), "/api/v1/nodes/gpu-1/drain"),
            (("scale", "demo", "2"), "/api/v1/deployments/demo/scale"),
            (("retry", "demo"), "/api/v1/deployments/demo/retry"),
            (("reload",), "/api/v1/catalog/reload"),
        ):
            del self.calls[:]
            code, _, err = self.ctl(*argv)
            self.assertEqual(self.calls, [FOLLOWER + path, LEADER + path], (argv, err))
            self.assertIn("POST sent to the leader cp-2", err, argv)
            self.assertEqual(self.stub_calls[-1][:2], ("POST", LEADER + path))
        self.assertEqual(self.follower_fleet.calls, [])

    def test_no_leader_url_is_said(self) -> None:
        """
        A member that cannot name the leader's admin URL answers 503 with
        the leader's reason; the ctl exits 4 with it, sending nothing on.
        """
        follower = AdminResource(self.follower_fleet, make_registry(), control=FakeControl(FakeHA(
            leader_admin_url="")))
        follower.control.ha.st["leader_admin_problem"] = "its admin API listens on every address: set --advertise-admin URL"
        self.http = members(follower, self.http, self.calls)
        code, _, err = self.ctl("cordon", "gpu-1")
        self.assertEqual(code, ctl.EXIT_SERVER)
        self.assertIn("set --advertise-admin", err)
        self.assertEqual(self.fleet.calls, [])


class CatalogWarningTests(SynchronousTestCase):
    def test_status_warns_of_a_different_catalog_file(self) -> None:
        """
        `ctl status` of a member whose catalog file differs from etcd's
        prints a warning line naming the file and the command that stores it.
        """
        from tests.test_ctl import canned

        status = {"role": "follower", "ha": {"catalog_file": {
            "path": "/etc/llmgw/catalog.toml", "differs_from_etcd": True, "etcd_revision": 12, "problem": ""}}}
        answers = {"/api/v1/status": status, "/api/v1/deployments": {"deployments": []}}

        def http(method: str, url: str, body: bytes | None, timeout: float) -> tuple[int, bytes]:
            return canned(200, json.dumps(answers[url.split("7480", 1)[1]]).encode())(method, url, body, timeout)

        args = build_parser().parse_args(["ctl", "status", "--admin-url", FOLLOWER])
        out = io.StringIO()
        self.assertEqual(args.func(args, out=out, err=io.StringIO(), http=http, now=NOW), 0)
        self.assertIn("WARNING        catalog file /etc/llmgw/catalog.toml differs from the catalog in etcd "
                      "(revision 12)", out.getvalue())
        status["ha"]["catalog_file"]["differs_from_etcd"] = False  # type: ignore[index]
        out = io.StringIO()
        args.func(args, out=out, err=io.StringIO(), http=http, now=NOW)
        self.assertNotIn("WARNING", out.getvalue())
