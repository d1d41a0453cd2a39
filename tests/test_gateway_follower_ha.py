"""
A standalone gateway following an HA control plane:
several admin URLs tried in turn, a member's redirect to the leader
followed, and the leader's URL used for the watch stream and demand.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry
from treq.testing import StubTreq
from twisted.internet.defer import fail
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import Clock
from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource

from llmgw.control.admin.api import AdminResource
from llmgw.control.shell.metrics import make_registry
from llmgw.gateway.demand import DemandReporter
from llmgw.gateway.follower import FollowerTable
from llmgw.gateway.follower_service import FollowerService
from llmgw.gateway.service import Options
from llmgw.hostcheck import HostCheck
from llmgw.routing import Demand, Route, RoutingTable
from llmgw.testing.fleet import sample_fleet
from tests.test_admin_ha import FakeControl, FakeHA


class ByHost(Resource):
    """
    Admin APIs in memory by the host they are dialled at.
    """

    isLeaf = True

    def __init__(self, sites: dict[bytes, Resource]):
        super().__init__()
        self.sites = sites

    def render(self, request: Any) -> Any:
        host = (request.getHeader(b"host") or b"").split(b":")[0]
        return self.sites[host].render(request)


class DeadHosts:
    """
    A treq-like client over C{stub} to which the hosts in C{dead} refuse
    connections; every URL asked is kept.
    """

    def __init__(self, stub: StubTreq, dead: set[str]):
        self.stub = stub
        self.dead = dead
        self.urls: list[str] = []

    def _down(self, url: str) -> bool:
        return url.split("/")[2].split(":")[0] in self.dead

    def get(self, url: str, **kw: Any) -> Any:
        self.urls.append(url)
        if self._down(url):
            return fail(ConnectionRefusedError("refused"))
        return self.stub.get(url, **kw)

    def post(self, url: str, **kw: Any) -> Any:
        self.urls.append(url)
        if self._down(url):
            return fail(ConnectionRefusedError("refused"))
        return self.stub.post(url, **kw)


class SeveralMembersTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.published = RoutingTable(self.clock)
        self.published.publish([Route("r1", "alpha", "10.0.0.1:9000")], ["alpha"])
        fleet: Any = sample_fleet()
        fleet.routing_table = self.published
        hosts = HostCheck(["leader:7480", "cp-1:7480"])
        self.leader = AdminResource(fleet, make_registry(), hosts=hosts)
        # cp-1 does not lead; the leader published http://leader:7480.
        self.follower = AdminResource(sample_fleet(), make_registry(), hosts=hosts,
                                      control=FakeControl(FakeHA(leader_admin_url="http://leader:7480")))
        self.stub = StubTreq(ByHost({b"leader": self.leader, b"cp-1": self.follower}))
        self.http = DeadHosts(self.stub, {"dead"})

    def table(self, *urls: str) -> FollowerTable:
        return FollowerTable(self.clock, list(urls), http=self.http, registry=CollectorRegistry())

    def test_dead_first_member_then_next_at_once(self) -> None:
        """
        With the first admin URL dead, the follower's next read goes to the
        second one without the failure backoff, and the table loads.
        """
        table = self.table("http://dead:7480", "http://leader:7480")
        service = FollowerService(table, retry=2.0, min_gap=0.1, jitter=0.0)
        service.startService()
        self.addCleanup(service.stopService)
        self.stub.flush()
        self.assertEqual(self.http.urls, ["http://dead:7480/api/v1/routes"])
        self.assertFalse(table.loaded)
        self.clock.advance(0.1)
        self.stub.flush()
        self.assertEqual(self.http.urls[1], "http://leader:7480/api/v1/routes")
        self.assertEqual([r.replica_id for r in table.routes("alpha")], ["r1"])
        self.assertTrue(table.reachable)

    def test_all_dead_backs_off_and_fails_static(self) -> None:
        """
        Once every member failed in a row the follower backs off, and the
        routes it held stay in force; it comes back on the member that
        answers.
        """
        table = self.table("http://leader:7480", "http://dead:7480")
        service = FollowerService(table, retry=2.0, min_gap=0.1, jitter=0.0)
        service.startService()
        self.addCleanup(service.stopService)
        self.stub.flush()
        self.assertTrue(table.loaded)
        self.http.dead.add("leader")
        # The held long-poll to the leader is cut: fail it as a lost connection.
        self.published.publish([Route("r1", "alpha", "10.0.0.1:9000")], ["alpha"])
        self.stub.flush()
        self.clock.advance(0.1)  # the next read: the leader refuses
        self.stub.flush()
        self.assertEqual(self.http.urls[-1].split("?")[0], "http://leader:7480/api/v1/routes")
        self.clock.advance(0.1)  # the other member, at once: dead too
        self.assertEqual(self.http.urls[-1], "http://dead:7480/api/v1/routes")
        asked = len(self.http.urls)
        self.clock.advance(1.9)  # a full round failed: 2 s before the next
        self.assertEqual(len(self.http.urls), asked)
        self.assertEqual([r.replica_id for r in table.routes("alpha")], ["r1"])
        self.assertFalse(table.reachable)
        self.http.dead.discard("leader")
        self.clock.advance(0.2)
        self.stub.flush()
        self.assertEqual(self.http.urls[-1], "http://leader:7480/api/v1/routes")
        self.assertTrue(table.reachable)

    def test_follower_redirects_to_leader(self) -> None:
        """
        A read sent to a member that does not lead is redirected to the
        leader and answered there; the table then dials the watch stream
        and posts demand at the leader's URL.
        """
        table = self.table("http://cp-1:7480")
        d = table.poll()
        self.stub.flush()
        self.assertTrue(self.successResultOf(d))
        self.assertEqual([r.replica_id for r in table.routes("alpha")], ["r1"])
        self.assertEqual(table.answered_by, "http://leader:7480")
        self.assertTrue(table.watch_url().startswith("ws://leader:7480/api/v1/watch"))

        class Source:
            def demand(self) -> dict[str, Demand]:
                return {"alpha": Demand(in_flight=2, waiting=0)}

        reporter = DemandReporter(table, Source(), "gw-1")
        self.assertEqual(reporter.url, "http://leader:7480/api/v1/demand")

    def test_follower_answering_names_the_leader(self) -> None:
        """
        A member that does not lead but holds the published table
        answers the routes itself; the header it sends names the leader,
        whose URL the table then uses for the watch stream and demand.
        """
        followed: Any = sample_fleet()
        followed.routing_table = RoutingTable(self.clock)
        followed.routing_table.publish([Route("r2", "alpha", "10.0.0.2:9000")], ["alpha"])
        hosts = HostCheck(["leader:7480", "cp-1:7480"])
        self.stub = StubTreq(ByHost({b"leader": self.leader, b"cp-1": AdminResource(
            followed, make_registry(), hosts=hosts,
            control=FakeControl(FakeHA(leader_admin_url="http://leader:7480", routes=True)))}))
        self.http = DeadHosts(self.stub, set())
        table = self.table("http://cp-1:7480")
        d = table.poll()
        self.stub.flush()
        self.assertTrue(self.successResultOf(d))
        self.assertEqual([r.replica_id for r in table.routes("alpha")], ["r2"])
        self.assertEqual(self.http.urls, ["http://cp-1:7480/api/v1/routes"])
        self.assertEqual(table.answered_by, "http://leader:7480")
        self.assertTrue(table.watch_url().startswith("ws://leader:7480/api/v1/watch"))
        self.assertFalse(FollowerTable._named_leader(
            "https://cp-1:7480/api/v1/routes", type("R", (), {"headers": _headers("http://leader:7480")})()))

    def test_forgets_leader_on_failure(self) -> None:
        """
        After a failed read the leader the table learned is forgotten: the
        watch stream goes to the member asked next.
        """
        table = self.table("http://cp-1:7480", "http://dead:7480")
        d = table.poll()
        self.stub.flush()
        self.assertTrue(self.successResultOf(d))
        self.http.dead.add("cp-1")
        table._resync = True  # ask for the whole table: answered at once
        d = table.poll()
        self.stub.flush()
        self.assertFalse(self.successResultOf(d))
        self.assertIsNone(table.answered_by)
        self.assertTrue(table.watch_url().startswith("ws://dead:7480/"))


class OptionsTests(SynchronousTestCase):
    def test_repeatable(self) -> None:
        """
        --admin-url may be given once per member; the first is still
        C{admin-url}, and a URL given twice or not http(s) is refused.
        """
        o = Options()
        o.parseOptions(["--admin-url", "http://127.0.0.1:7480", "--admin-url", "http://127.0.0.1:7481"])
        self.assertEqual(o["admin-urls"], ["http://127.0.0.1:7480", "http://127.0.0.1:7481"])
        self.assertEqual(o["admin-url"], "http://127.0.0.1:7480")
        default = Options()
        default.parseOptions([])
        self.assertEqual(default["admin-urls"], ["http://127.0.0.1:7480"])
        for argv in (["--admin-url", "http://a:1", "--admin-url", "http://a:1"],
                     ["--admin-url", "http://a:1", "--admin-url", "a:2"]):
            with self.assertRaises(usage.UsageError):
                Options().parseOptions(argv)


class DowngradeTests(SynchronousTestCase):
    def test_redirect_out_of_tls_refused(self) -> None:
        """
        A read of an https admin URL that a redirect took to http is a
        failed read: the routes are not taken from outside TLS.
        """
        clock = Clock()
        published = RoutingTable(clock)
        published.publish([Route("r1", "alpha", "10.0.0.1:9000")], ["alpha"])
        fleet: Any = sample_fleet()
        fleet.routing_table = published
        hosts = HostCheck(["leader:7480", "cp-1:7480"])
        leader = AdminResource(fleet, make_registry(), hosts=hosts)
        follower = AdminResource(sample_fleet(), make_registry(), hosts=hosts,
                                 control=FakeControl(FakeHA(leader_admin_url="http://leader:7480")))
        stub = StubTreq(ByHost({b"leader": leader, b"cp-1": follower}))
        table = FollowerTable(clock, ["https://cp-1:7480"], http=stub, registry=CollectorRegistry())
        d = table.poll()
        stub.flush()
        self.assertFalse(self.successResultOf(d))
        self.assertFalse(table.loaded)
        self.assertEqual(table.routes("alpha"), ())


def _headers(leader: str) -> Any:
    from twisted.web.http_headers import Headers

    return Headers({b"x-llmgw-leader": [leader.encode()]})
