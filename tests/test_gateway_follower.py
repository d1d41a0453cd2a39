"""
The standalone gateway's routing table, read from the control plane's
C{GET /api/v1/routes} (the real admin resource over a real L{RoutingTable},
in memory with StubTreq; time with a Clock).
"""

from __future__ import annotations

import json
import random
from typing import Any

from prometheus_client import CollectorRegistry
from treq.testing import StubTreq
from twisted.internet.defer import Deferred, fail
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import Clock
from twisted.logger import globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource

from llmgw.control.admin.api import AdminResource
from llmgw.control.shell.metrics import make_registry
from llmgw.gateway.follower import FollowerTable, RoutesFetchError, read_body
from llmgw.gateway.follower_service import FollowerService
from llmgw.gateway.router import Router
from llmgw.hostcheck import HostCheck
from llmgw.routing import IRoutingTable, Route, RoutingTable
from llmgw.testing.fleet import sample_fleet


class Switchable:
    """
    A treq-like client over StubTreq that can be made unreachable, or can
    answer from another resource.
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


class Raw(Resource):
    """
    An admin API that answers C{body} with C{status} to everything.
    """

    isLeaf = True

    def __init__(self, body: bytes, status: int = 200):
        super().__init__()
        self.body, self.status = body, status

    def render_GET(self, request: Any) -> bytes:
        request.setResponseCode(self.status)
        return self.body


class FollowerTestCase(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.published = RoutingTable(self.clock)
        self.published.publish([Route("r1", "alpha", "10.0.0.1:9000")], ["alpha"])
        fleet: Any = sample_fleet()
        fleet.routing_table = self.published
        # The admin API answers to the name the follower dials (llmgw.hostcheck).
        self.admin = AdminResource(fleet, make_registry(), hosts=HostCheck(["cp:7480"]))
        self.stub = StubTreq(self.admin)
        self.http = Switchable(self.stub)
        self.registry = CollectorRegistry()
        self.table = FollowerTable(self.clock, "http://cp:7480/", http=self.http, registry=self.registry)
        self.events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(self.events.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    def poll(self) -> bool:
        d = self.table.poll()
        self.stub.flush()
        return self.successResultOf(d)

    def metric(self, name: str) -> float | None:
        return self.registry.get_sample_value(name)

    def ids(self, model: str = "alpha") -> list[str]:
        return [r.replica_id for r in self.table.routes(model)]


class FollowerTests(FollowerTestCase):
    def test_before_first_poll(self) -> None:
        """
        Before the first successful read nothing is routed but every model
        counts as known, so clients get 503 (retry), not 404.
        """
        self.assertTrue(IRoutingTable.providedBy(self.table))
        self.assertEqual(self.table.routes("alpha"), ())
        self.assertTrue(self.table.knows_model("anything"))
        self.assertEqual(self.metric("llmgw_gateway_routing_table_age_seconds"), -1)

    def test_follows_with_long_poll(self) -> None:
        """
        The first read asks for the whole table; the next asks for what
        comes after the revision it holds, is held by the control plane
        until the table changes, and then swaps in the new table.
        """
        self.assertTrue(self.poll())
        rev = self.published.revision
        self.assertEqual(self.http.urls, ["http://cp:7480/api/v1/routes"])
        self.assertEqual(self.ids(), ["r1"])
        self.assertFalse(self.table.knows_model("anything"))
        self.assertEqual(self.metric("llmgw_gateway_routing_table_revision"), rev)
        d = self.table.poll()
        self.stub.flush()
        self.assertEqual(self.http.urls[-1], f"http://cp:7480/api/v1/routes?since={rev}")
        self.assertNoResult(d)
        self.published.publish(
            [Route("r2", "alpha", "10.0.0.2:9000"), Route("b1", "beta", "10.0.0.3:9000")], ["alpha", "beta"]
        )
        self.stub.flush()
        self.assertTrue(self.successResultOf(d))
        self.assertEqual(self.ids(), ["r2"])
        self.assertEqual(self.table.models(), ["alpha", "beta"])
        self.assertEqual(self.metric("llmgw_gateway_control_plane_reachable"), 1)
        self.assertEqual(self.metric("llmgw_gateway_routes"), 2)
        self.assertEqual(self.metric("llmgw_gateway_routing_table_revision"), rev + 1)

    def test_same_rules_as_published(self) -> None:
        """
        The follower routes exactly what was published: the same routes, the
        same draining marks, the same known models, so a router in front of
        either gives a draining replica nothing new.
        """
        self.published.publish(
            [Route("r1", "alpha", "10.0.0.1:9000", draining=True), Route("r2", "alpha", "10.0.0.2:9000")],
            ["alpha", "gamma"],
        )
        self.poll()
        for table in (self.published, self.table):
            self.assertEqual(list(table.routes("alpha")), list(self.published.routes("alpha")))
            self.assertEqual(table.models(), ["alpha"])
            self.assertTrue(table.knows_model("gamma"))
            router = Router(self.clock)
            picked = {router.pick(table.routes("alpha")).replica_id for _ in range(10)}  # type: ignore[union-attr]
            self.assertEqual(picked, {"r2"})

    def test_fails_static(self) -> None:
        """
        While the control plane is unreachable (or answers nonsense) the
        last table stays, the failure is logged and counted, and the table's
        age grows; the next read after a failure asks for the whole table
        (a restarted control plane counts revisions from zero), and a good
        answer replaces the table.
        """
        self.poll()
        self.http.down = True
        self.clock.advance(30)
        for _ in range(3):
            self.assertFalse(self.poll())
        self.assertEqual(self.ids(), ["r1"])
        self.assertEqual(self.metric("llmgw_gateway_control_plane_reachable"), 0)
        self.assertEqual(self.metric("llmgw_gateway_control_poll_failures_total"), 3)
        self.assertEqual(self.metric("llmgw_gateway_routing_table_age_seconds"), 30)
        self.http.down = False
        for bad in (Raw(b"not json"), Raw(b'{"revision": -1, "known": [], "routes": []}'),
                    Raw(b'{"error": "boom"}', 500)):
            self.http.stub = StubTreq(bad)
            self.assertFalse(self.poll())
        self.assertEqual(self.metric("llmgw_gateway_control_poll_failures_total"), 6)
        self.assertEqual(self.ids(), ["r1"])
        self.http.stub = self.stub
        self.published.publish([], ["alpha"])
        self.assertTrue(self.poll())
        self.assertEqual(self.http.urls[-1], "http://cp:7480/api/v1/routes")
        self.assertEqual(self.table.routes("alpha"), ())
        self.assertEqual(self.metric("llmgw_gateway_control_plane_reachable"), 1)

    def test_restarted_control_plane(self) -> None:
        """
        A control plane that restarted (its revision is lower than the one
        held) is followed at once.
        """
        for _ in range(5):
            self.published.publish_model("alpha", [Route(f"r{self.published.revision}", "alpha", "h:1")])
        self.poll()
        restarted = RoutingTable(self.clock)
        restarted.publish([Route("new", "alpha", "h:2")], ["alpha"])
        fleet: Any = sample_fleet()
        fleet.routing_table = restarted
        self.http.stub = StubTreq(AdminResource(fleet, make_registry(), hosts=HostCheck(["cp:7480"])))
        self.assertTrue(self.poll())
        self.assertEqual(self.ids(), ["new"])
        self.assertEqual(self.table.snapshot.revision, restarted.revision)

    def test_bad_entries_skipped_and_logged(self) -> None:
        """
        A route that makes no sense is skipped with a warning naming it; the
        rest of the table is used.
        """
        doc = {"revision": 3, "known": ["alpha"], "routes": [
            {"replica": "r1", "model": "alpha", "address": "10.0.0.1:9000", "draining": False},
            {"replica": "r2", "model": "alpha", "address": "no port"},
        ]}
        self.http.stub = StubTreq(Raw(json.dumps(doc).encode()))
        self.assertTrue(self.poll())
        self.assertEqual(self.ids(), ["r1"])
        warned = [e for e in self.events if "entry skipped" in e.get("log_format", "")]
        self.assertEqual(len(warned), 1)
        self.assertIn("routes[1]", warned[0]["problem"])

    def test_logs_failing_static(self) -> None:
        """
        The first failed read says, in the log, that the gateway keeps its
        last table; repeats are not logged at every read.
        """
        self.poll()
        self.http.down = True
        for _ in range(5):
            self.poll()
            self.clock.advance(2)
        warnings = [e for e in self.events if "unreachable" in e.get("log_format", "")]
        self.assertEqual(len(warnings), 1)
        self.assertIn("failing static", warnings[0]["log_format"])

    def test_listeners_on_change_only(self) -> None:
        """
        Listeners hear of each new revision, not of answers that change
        nothing (a long-poll that timed out).
        """
        heard: list[int] = []
        self.table.listeners.append(lambda snap: heard.append(snap.revision))
        self.poll()
        d = self.table.poll()
        self.stub.flush()
        self.clock.advance(30)
        self.stub.flush()
        self.assertTrue(self.successResultOf(d))
        self.assertEqual(heard, [self.published.revision])


    def test_watch_revision_not_sent_to_a_poll(self) -> None:
        """
        After a watch stream (the leader's, whose count differs from what
        the member polled counts) the next read asks for the whole table,
        not C{?since=} the stream's revision; an answer from another source
        with the same revision number still reaches the listeners.
        """
        heard: list[int] = []
        self.table.listeners.append(lambda snap: heard.append(snap.revision))
        self.poll()
        rev = self.published.revision
        self.table.apply_watch({"type": "snapshot", "epoch": "e1", "revision": 50, "routes": {
            "revision": rev, "known": ["alpha"], "routes": [
                {"replica": "w1", "model": "alpha", "address": "10.0.0.9:9000"}]}})
        self.assertEqual(self.ids(), ["w1"])
        self.assertEqual(heard, [rev, rev])
        self.assertEqual(self.table.url(), "http://cp:7480/api/v1/routes")
        self.assertTrue(self.poll())
        self.assertEqual(self.ids(), ["r1"])
        self.assertEqual(heard, [rev, rev, rev])
        self.assertEqual(self.table.url(), f"http://cp:7480/api/v1/routes?since={rev}")


class ServiceTests(FollowerTestCase):
    def test_keeps_one_read_outstanding(self) -> None:
        """
        Running, the service reads at once, and after each answer starts
        the next read (held by the control plane), so each change arrives
        as it is published.
        """
        svc = FollowerService(self.table, retry=2, jitter=0)
        svc.startService()
        self.addCleanup(svc.stopService)
        self.stub.flush()
        self.assertTrue(self.table.loaded)
        self.clock.advance(svc.min_gap)
        self.stub.flush()
        self.assertEqual(self.published.waiting(), 1)
        for n in range(3):
            self.published.publish_model("alpha", [Route(f"x{n}", "alpha", "h:1")])
            self.stub.flush()
            self.clock.advance(svc.min_gap)
            self.stub.flush()
            self.assertEqual(self.ids(), [f"x{n}"])
        self.assertEqual(len(self.http.urls), 4 + 1)

    def test_backs_off_on_failures(self) -> None:
        """
        After failures the service waits C{retry} seconds, doubling up to
        C{max_retry}; one success resets the wait.
        """
        svc = FollowerService(self.table, retry=2, max_retry=10, jitter=0)
        self.http.down = True
        svc.startService()
        self.addCleanup(svc.stopService)
        times = [self.clock.seconds()]
        for _ in range(5):
            n = len(self.http.urls)
            while len(self.http.urls) == n:
                self.clock.advance(0.5)
            times.append(self.clock.seconds())
        self.assertEqual([b - a for a, b in zip(times, times[1:], strict=False)], [2, 4, 8, 10, 10])
        self.assertEqual(self.metric("llmgw_gateway_control_poll_failures_total"), 6)
        self.http.down = False
        self.clock.advance(10)
        self.stub.flush()
        self.assertTrue(self.table.reachable)
        self.assertEqual(svc.retry_delay(1), 2)

    def test_jitter_bounded(self) -> None:
        """
        Jitter adds at most its share of the wait.
        """
        svc = FollowerService(self.table, retry=2, max_retry=30, jitter=0.2, rng=random.Random(7))
        for failures in range(1, 10):
            base = min(30, 2 * 2 ** (failures - 1))
            self.assertTrue(base <= svc.retry_delay(failures) <= base * 1.2)

    def test_stop_cancels_read_in_flight(self) -> None:
        """
        Stopping the service cancels the read in flight (the HTTP request
        itself) and the retry timer: nothing is left on the clock, no
        failure is counted or logged, and no read starts afterwards.
        """
        requests: list[Deferred[Any]] = []
        cancelled: list[Deferred[Any]] = []

        class Hanging:
            def get(self, url: str, **kw: Any) -> Deferred[Any]:
                d: Deferred[Any] = Deferred(cancelled.append)
                requests.append(d)
                return d

        table = FollowerTable(self.clock, "http://cp:7480", http=Hanging(), registry=CollectorRegistry())
        svc = FollowerService(table, retry=2)
        svc.startService()
        self.assertEqual(len(requests), 1)
        self.assertNotEqual(self.clock.getDelayedCalls(), [])  # the read's timeout
        self.assertIsNone(svc.stopService())
        self.assertEqual(cancelled, requests)
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.assertEqual(table.failures_in_a_row, 0)
        self.assertEqual([e for e in self.events if "unreachable" in e.get("log_format", "")], [])
        self.clock.advance(100)
        self.assertEqual(len(requests), 1)

    def test_stop_cancels_retry_timer(self) -> None:
        """
        Stopped while waiting to retry, the service leaves no timer behind.
        """
        svc = FollowerService(self.table, retry=2)
        self.http.down = True
        svc.startService()
        self.assertEqual(len(self.clock.getDelayedCalls()), 1)
        svc.stopService()
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_stop_ends_held_long_poll(self) -> None:
        """
        Stopped while its long-poll is held by the control plane, the
        service's read is cancelled and the control plane holds no waiter
        for it.
        """
        svc = FollowerService(self.table, retry=2, jitter=0)
        svc.startService()
        self.stub.flush()
        self.clock.advance(svc.min_gap)
        self.stub.flush()
        self.assertEqual(self.published.waiting(), 1)
        svc.stopService()
        self.stub.flush()
        self.assertEqual(self.published.waiting(), 0)
        self.assertEqual(self.table.failures_in_a_row, 0)


class BodyTests(SynchronousTestCase):
    def test_body_bounded(self) -> None:
        """
        A routes document over the limit is refused (the read fails, the
        connection is dropped) rather than buffered whole.
        """
        stub = StubTreq(Raw(b"x" * 1000))
        response = self.successResultOf(stub.get("http://cp/api/v1/routes"))
        d = read_body(response, limit=100)
        stub.flush()
        self.assertIn("over 100 bytes", str(self.failureResultOf(d, RoutesFetchError).value))
        response = self.successResultOf(stub.get("http://cp/api/v1/routes"))
        d = read_body(response, limit=1000)
        stub.flush()
        self.assertEqual(self.successResultOf(d), b"x" * 1000)
