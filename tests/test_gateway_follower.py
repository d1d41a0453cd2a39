"""
The standalone gateway's routing table, read from the control plane's admin
API (in memory with StubTreq, time with a Clock).
"""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import CollectorRegistry
from treq.testing import StubTreq
from twisted.internet.defer import fail
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource

from llmgw.control.interfaces import IRoutingTable, Route
from llmgw.gateway.follower import (
    AdminDataError,
    FollowerService,
    FollowerTable,
    table_from_admin,
)


def replica(rid: str, model: str, state: str = "ready", draining: bool = False, port: int = 9000) -> dict[str, Any]:
    return {
        "id": rid,
        "model": model,
        "profile": "p",
        "state": state,
        "draining": draining,
        "shards": [
            {"id": rid + "-1", "node": "n2", "rank": 1, "state": state, "address": f"10.0.0.2:{port + 1}"},
            {"id": rid + "-0", "node": "n1", "rank": 0, "state": state, "address": f"10.0.0.1:{port}"},
        ],
    }


class TableTests(SynchronousTestCase):
    def test_ready_replicas_routed_to_leader(self) -> None:
        """
        Ready replicas are routed to their rank 0 shard's address; others are
        not; draining is carried; deployments are the known models.
        """
        table, problems = table_from_admin(
            [
                replica("r1", "alpha"),
                replica("r2", "alpha", state="starting"),
                replica("r3", "alpha", draining=True, port=9100),
                replica("r4", "beta", state="failed"),
            ],
            [{"model": "alpha"}, {"model": "beta"}],
        )
        self.assertEqual(problems, [])
        self.assertTrue(IRoutingTable.providedBy(table))
        self.assertEqual(
            table.routes("alpha"),
            [Route("r1", "alpha", "10.0.0.1:9000"), Route("r3", "alpha", "10.0.0.1:9100", True)],
        )
        self.assertEqual(table.routes("beta"), [])
        self.assertEqual(table.models(), ["alpha"])
        self.assertTrue(table.knows_model("beta"))
        self.assertFalse(table.knows_model("gamma"))

    def test_wrapped_lists(self) -> None:
        """
        Lists wrapped in an object under their name are accepted too.
        """
        table, _ = table_from_admin({"replicas": [replica("r1", "alpha")]}, {"deployments": []})
        self.assertEqual(table.models(), ["alpha"])

    def test_bad_entries_skipped(self) -> None:
        """
        Entries that make no sense are skipped, each with a problem saying
        which; the rest are used.
        """
        no_address = replica("r2", "alpha")
        no_address["shards"][1]["address"] = None
        table, problems = table_from_admin(
            [replica("r1", "alpha"), "junk", {"id": 5}, no_address], [{"model": 3}]
        )
        self.assertEqual(len(table), 1)
        self.assertEqual(len(problems), 4)
        self.assertIn("r2", problems[2])

    def test_bad_shape_refused(self) -> None:
        """
        An answer that is not a list at all is refused whole.
        """
        self.assertRaises(AdminDataError, table_from_admin, {"nodes": []}, [])
        self.assertRaises(AdminDataError, table_from_admin, [], "x")


class FakeAdmin(Resource):
    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.replicas: Any = [replica("r1", "alpha")]
        self.deployments: Any = [{"model": "alpha"}]
        self.status = 200

    def render_GET(self, request: Any) -> bytes:
        request.setResponseCode(self.status)
        if request.path == b"/api/v1/replicas":
            return json.dumps(self.replicas).encode()
        if request.path == b"/api/v1/deployments":
            return json.dumps(self.deployments).encode()
        request.setResponseCode(404)
        return b"{}"


class Switchable:
    """
    StubTreq that can be made unreachable.
    """

    def __init__(self, stub: StubTreq):
        self.stub = stub
        self.down = False
        self.urls: list[str] = []

    def get(self, url: str, **kw: Any) -> Any:
        self.urls.append(url)
        if self.down:
            return fail(ConnectionRefusedError("refused"))
        return self.stub.get(url, **kw)


class FollowerTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.admin = FakeAdmin()
        self.stub = StubTreq(self.admin)
        self.http = Switchable(self.stub)
        self.registry = CollectorRegistry()
        self.table = FollowerTable(self.clock, "http://cp:7480/", http=self.http, registry=self.registry)

    def poll(self) -> None:
        d = self.table.poll()
        self.stub.flush()
        self.successResultOf(d)

    def metric(self, name: str) -> float | None:
        return self.registry.get_sample_value(name)

    def test_before_first_poll(self) -> None:
        """
        Before the first successful poll nothing is routed but every model
        counts as known, so clients get 503 (retry), not 404.
        """
        self.assertEqual(self.table.routes("alpha"), [])
        self.assertTrue(self.table.knows_model("anything"))
        self.assertEqual(self.metric("llmgw_gateway_routing_table_age_seconds"), -1)

    def test_follows(self) -> None:
        """
        Each poll reads replicas and deployments and replaces the table.
        """
        self.poll()
        self.assertEqual(self.http.urls, ["http://cp:7480/api/v1/replicas", "http://cp:7480/api/v1/deployments"])
        self.assertEqual([r.replica_id for r in self.table.routes("alpha")], ["r1"])
        self.assertFalse(self.table.knows_model("anything"))
        self.admin.replicas = [replica("r2", "alpha"), replica("b1", "beta")]
        self.admin.deployments = [{"model": "alpha"}, {"model": "beta"}]
        self.poll()
        self.assertEqual([r.replica_id for r in self.table.routes("alpha")], ["r2"])
        self.assertEqual(self.table.models(), ["alpha", "beta"])
        self.assertEqual(self.metric("llmgw_gateway_control_plane_reachable"), 1)
        self.assertEqual(self.metric("llmgw_gateway_routes"), 2)

    def test_fails_static(self) -> None:
        """
        While the control plane is unreachable (or answers nonsense) the
        last table stays, the failure is logged and counted, and the table's
        age grows; the next good poll replaces it.
        """
        self.poll()
        self.http.down = True
        self.clock.advance(30)
        for _ in range(3):
            self.poll()
        self.assertEqual([r.replica_id for r in self.table.routes("alpha")], ["r1"])
        self.assertEqual(self.metric("llmgw_gateway_control_plane_reachable"), 0)
        self.assertEqual(self.metric("llmgw_gateway_control_poll_failures_total"), 3)
        self.assertEqual(self.metric("llmgw_gateway_routing_table_age_seconds"), 30)
        self.http.down = False
        self.admin.replicas = "not a list"
        self.poll()
        self.assertEqual(self.metric("llmgw_gateway_control_poll_failures_total"), 4)
        self.admin.status = 500
        self.poll()
        self.assertEqual(self.metric("llmgw_gateway_control_poll_failures_total"), 5)
        self.assertEqual([r.replica_id for r in self.table.routes("alpha")], ["r1"])
        self.admin.status = 200
        self.admin.replicas = []
        self.poll()
        self.assertEqual(self.table.routes("alpha"), [])
        self.assertEqual(self.metric("llmgw_gateway_control_plane_reachable"), 1)

    def test_logs_failing_static(self) -> None:
        """
        The first failed poll says, in the log, that the gateway keeps its
        last table; repeats are not logged at every poll.
        """
        events: list[dict[str, Any]] = []
        from twisted.logger import globalLogPublisher

        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        self.poll()
        self.http.down = True
        for _ in range(5):
            self.poll()
            self.clock.advance(2)
        warnings = [e for e in events if "unreachable" in e.get("log_format", "")]
        self.assertEqual(len(warnings), 1)
        self.assertIn("failing static", warnings[0]["log_format"])

    def test_service_polls_and_survives(self) -> None:
        """
        The service polls at once and then every interval, through failures.
        """
        svc = FollowerService(self.table, interval=2)
        self.http.down = True
        svc.startService()
        self.clock.advance(2)
        self.clock.advance(2)
        self.assertEqual(self.metric("llmgw_gateway_control_poll_failures_total"), 3)
        self.http.down = False
        self.clock.advance(2)
        self.stub.flush()
        self.assertTrue(self.table.loaded)
        svc.stopService()
        n = len(self.http.urls)
        self.clock.advance(10)
        self.assertEqual(len(self.http.urls), n)
