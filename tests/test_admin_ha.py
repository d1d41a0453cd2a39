"""
Tests for the admin API of an HA control plane's members:
a member that does not lead sends clients to the leader's admin URL, and
answers its own status, metrics and TLS reload itself.
"""

from __future__ import annotations

import json
from typing import Any

from treq.testing import StubTreq
from twisted.logger import Logger
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.admin.api import AdminResource
from llmgw.control.admin.leader import leader_location, local_path
from llmgw.control.ha.published_fleet import FleetDocument, pack_fleet
from llmgw.routing import Route
from tests.test_admin import AdminTestCase

LEADER_URL = "https://cp-2.example:7480"


class FakeHA:
    """
    What the admin API reads of an HA member: its C{status()}, with the
    leader as the tests say.
    """

    def __init__(self, role: str = "follower", leader_id: str | None = "cp-2",
                 leader_admin_url: str | None = LEADER_URL, member_id: str = "cp-1",
                 routes: bool = False, fleet: FleetDocument | None = None):
        self.routes = routes
        #: The fleet views this member follows, if any.
        self.fleet = fleet
        self.st = {"role": role, "member_id": member_id, "leader_id": leader_id,
                   "leader_agent_address": "cp-2.example:7443", "leader_admin_url": leader_admin_url,
                   "epoch": 7, "revision": 3}

    def status(self) -> dict[str, Any]:
        return dict(self.st)

    def serves_routes(self) -> bool:
        return self.routes

    def followed_fleet(self) -> FleetDocument | None:
        return self.fleet


class FakeControl:
    def __init__(self, ha: FakeHA):
        self.ha = ha
        self.reloaded = 0

    def reload_tls(self) -> dict[str, Any]:
        self.reloaded += 1
        return {"ok": True, "closed": []}


class LeaderLocationTests(SynchronousTestCase):
    def test_leader_answers_itself(self) -> None:
        """
        The leader answers everything itself: no location.
        """
        self.assertIsNone(leader_location(FakeHA(role="leader", leader_id="cp-1").status(), b"/api/v1/nodes"))

    def test_path_and_query_kept(self) -> None:
        """
        The location is the leader's admin URL with the request's path and
        query; a trailing slash in the published URL is not doubled.
        """
        ha = FakeHA(leader_admin_url=LEADER_URL + "/")
        location, _ = leader_location(ha.status(), b"/api/v1/routes?since=12")  # type: ignore[misc]
        self.assertEqual(location, LEADER_URL + "/api/v1/routes?since=12")

    def test_absolute_form_and_odd_bytes(self) -> None:
        """
        A request target in absolute form keeps only its path and query (the
        host is the leader's), and bytes past ASCII are percent-encoded.
        """
        location, _ = leader_location(FakeHA().status(), b"http://evil.example/api/v1/events?since=1")  # type: ignore[misc]
        self.assertEqual(location, LEADER_URL + "/api/v1/events?since=1")
        location, _ = leader_location(FakeHA().status(), "/api/v1/deployments/m\u00e9/scale".encode("latin-1"))  # type: ignore[misc]
        self.assertEqual(location, LEADER_URL + "/api/v1/deployments/m%E9/scale")

    def test_no_leader_or_no_url(self) -> None:
        """
        No leader known, a leader without an admin URL, or this member named
        as leader while it does not lead (it has just lost): no location to
        send the client to.
        """
        for ha in (FakeHA(leader_id=None, leader_admin_url=None), FakeHA(leader_admin_url=""),
                   FakeHA(leader_id="cp-1")):
            where = leader_location(ha.status(), b"/api/v1/nodes")
            assert where is not None
            self.assertIsNone(where[0])

    def test_local_paths(self) -> None:
        """
        Status, whoami, metrics, usage, TLS reload, the index and the page's
        files are each member's own; fleet reads and writes are not.
        """
        for path in ([], ["metrics"], ["api", "v1", "status"], ["api", "v1", "whoami"],
                     ["api", "v1", "usage"], ["api", "v1", "tls", "reload"], ["page", "page.js"]):
            self.assertTrue(local_path(path), path)
        for path in (["api", "v1", "nodes"], ["api", "v1", "routes"], ["api", "v1", "watch"],
                     ["api", "v1", "nodes", "gpu-1", "cordon"], ["api", "v1", "demand"]):
            self.assertFalse(local_path(path), path)


class _NoFollow:
    """A StubTreq whose requests do not follow redirects."""

    def __init__(self, stub: StubTreq):
        self.stub = stub

    def request(self, *args: Any, **kwargs: Any) -> Any:
        return self.stub.request(*args, allow_redirects=False, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stub, name)


class FollowerAdminTests(AdminTestCase):
    def use(self, ha: FakeHA) -> FakeControl:
        control = FakeControl(ha)
        self.resource = AdminResource(self.fleet, self.registry, self.agents, control=control)
        self.resource.log = Logger(observer=self.logged.append)  # type: ignore[arg-type]
        self.treq = _NoFollow(StubTreq(self.resource))
        return control

    def test_reads_redirected(self) -> None:
        """
        A follower answers a fleet read with 307 and the leader's URL for the
        same request in Location and in the body.
        """
        self.use(FakeHA())
        for path in ("/api/v1/nodes", "/api/v1/events?since=5", "/api/v1/routes?since=3"):
            code, body, headers = self.call("GET", path)
            self.assertEqual(code, 307, body)
            self.assertEqual(headers.getRawHeaders(b"location"), [(LEADER_URL + path).encode()])
            self.assertEqual(body["location"], LEADER_URL + path)
            self.assertEqual(body["leader_id"], "cp-2")
            self.assertIn("does not lead", body["error"])

    def test_routes_answered_from_the_followed_table(self) -> None:
        """
        A follower that holds the table the leader published answers
        GET /api/v1/routes itself, from its own routing table; other reads
        are still redirected.
        """
        self.use(FakeHA(routes=True))
        self.fleet.routing_table.publish([Route("r1", "demo", "10.0.0.1:9000")], ["demo"])
        code, body, _ = self.call("GET", "/api/v1/routes")
        self.assertEqual(code, 200, body)
        self.assertEqual([r["replica"] for r in body["routes"]], ["r1"])
        code, body, _ = self.call("GET", "/api/v1/nodes")
        self.assertEqual(code, 307, body)

    def test_fleet_reads_answered_from_the_published_views(self) -> None:
        """
        A follower that holds the fleet views the leader published
        answers nodes, replicas and events itself (the leader's answer, with
        published_at, published_by and the leader's URL in x-llmgw-leader;
        events filtered by ?since=), its status carries the leader's fleet
        parts; writes are still redirected.
        """
        views = {"leader": "cp-2", "leader_admin_url": LEADER_URL,
                 "nodes": [{"id": "gpu-1", "state": "ready"}], "replicas": [{"id": "r1", "model": "demo"}],
                 "events": [{"time": 3.0, "kind": "a"}, {"time": 9.0, "kind": "b"}],
                 "status": {"nodes": {"ready": 1, "suspect": 0, "lost": 0}, "connected": 1}}
        self.use(FakeHA(fleet=FleetDocument(pack_fleet(views, 1234.5) or b"")))
        code, body, headers = self.call("GET", "/api/v1/nodes")
        self.assertEqual(code, 200, body)
        self.assertEqual(body, {"nodes": [{"id": "gpu-1", "state": "ready"}], "published_at": 1234.5,
                                "published_by": "cp-2"})
        self.assertEqual(headers.getRawHeaders(b"x-llmgw-leader"), [LEADER_URL.encode()])
        code, body, _ = self.call("GET", "/api/v1/replicas")
        self.assertEqual((code, body["replicas"]), (200, [{"id": "r1", "model": "demo"}]))
        code, body, _ = self.call("GET", "/api/v1/events?since=5")
        self.assertEqual((code, [e["kind"] for e in body["events"]]), (200, ["b"]))
        code, body, _ = self.call("GET", "/api/v1/events?since=x")
        self.assertEqual(code, 400, body)
        code, body, _ = self.call("GET", "/api/v1/status")
        self.assertEqual((code, body["connected"], body["published_at"], body["role"]), (200, 1, 1234.5, "follower"))
        code, body, _ = self.call("POST", "/api/v1/nodes/gpu-1/cordon", {})
        self.assertEqual(code, 307, body)
        self.assertEqual(self.fleet.calls, [])

    def test_unreadable_part_redirected(self) -> None:
        """
        A part of the published views that cannot be inflated (the
        header was fine) is logged and the read sent to the leader; the
        other parts are still answered here.
        """
        views = {"leader": "cp-2", "leader_admin_url": LEADER_URL, "nodes": [{"id": "gpu-1"}],
                 "replicas": [], "events": [], "status": {}}
        value = pack_fleet(views, 1234.5)
        assert value is not None
        head, _, body = value.partition(b"\n")
        at, size = json.loads(head)["parts"]["nodes"]
        self.use(FakeHA(fleet=FleetDocument(head + b"\n" + body[:at] + b"x" * size + body[at + size:])))
        code, body_, headers = self.call("GET", "/api/v1/nodes")
        self.assertEqual(code, 307, body_)
        self.assertEqual(headers.getRawHeaders(b"location"), [f"{LEADER_URL}/api/v1/nodes".encode()])
        code, body_, _ = self.call("GET", "/api/v1/replicas")
        self.assertEqual((code, body_["replicas"]), (200, []))
        self.flushLoggedErrors()

    def test_writes_redirected_not_done(self) -> None:
        """
        A write sent to a follower is redirected, and the follower's fleet is
        not changed.
        """
        self.use(FakeHA())
        code, body, headers = self.call("POST", "/api/v1/nodes/gpu-1/cordon", {})
        self.assertEqual(code, 307, body)
        self.assertEqual(headers.getRawHeaders(b"location"), [f"{LEADER_URL}/api/v1/nodes/gpu-1/cordon".encode()])
        self.assertEqual(self.fleet.calls, [])

    def test_status_metrics_and_tls_reload_local(self) -> None:
        """
        Status, metrics and a TLS reload are answered by the follower itself.
        """
        control = self.use(FakeHA())
        code, _, _ = self.call("GET", "/api/v1/status")
        self.assertEqual(code, 200)
        code, _, _ = self.call("GET", "/metrics")
        self.assertEqual(code, 200)
        code, body, _ = self.call("POST", "/api/v1/tls/reload", {})
        self.assertEqual(code, 200, body)
        self.assertEqual(control.reloaded, 1)

    def test_no_leader_is_503(self) -> None:
        """
        With no leader known the follower answers 503 with Retry-After and
        says why; with a leader that published no admin URL it names it.
        """
        self.use(FakeHA(leader_id=None, leader_admin_url=None))
        code, body, headers = self.call("GET", "/api/v1/nodes")
        self.assertEqual(code, 503, body)
        self.assertIn("no leader is known", body["error"])
        self.assertEqual(headers.getRawHeaders(b"retry-after"), [b"1"])
        self.use(FakeHA(leader_admin_url=""))
        code, body, _ = self.call("POST", "/api/v1/nodes/gpu-1/drain", {})
        self.assertEqual(code, 503, body)
        self.assertIn("cp-2 published no admin URL", body["error"])
        self.assertEqual(self.fleet.calls, [])

    def test_leader_serves(self) -> None:
        """
        The leader answers reads and writes itself.
        """
        self.use(FakeHA(role="leader", leader_id="cp-1", leader_admin_url="http://127.0.0.1:7480"))
        code, body, _ = self.call("GET", "/api/v1/nodes")
        self.assertEqual(code, 200, body)
        code, body, _ = self.call("POST", "/api/v1/nodes/gpu-1/cordon", {})
        self.assertEqual(code, 200, body)

    def test_refused_before_redirect(self) -> None:
        """
        A request the follower refuses (unknown host here) is refused, not
        redirected: the follower checks before it sends anyone on.
        """
        self.use(FakeHA())
        code, body, _ = self.call("GET", "/api/v1/nodes", headers={"Host": ["evil.example"]})
        self.assertEqual(code, 421, body)


