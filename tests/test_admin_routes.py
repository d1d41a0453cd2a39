"""
Tests for C{GET /api/v1/routes} on the admin API: the published routing
table, and its long-poll (C{?since=REVISION}), against a fake fleet whose
C{routing_table} is a real L{RoutingTable} on a Clock.
"""

from __future__ import annotations

import json
from typing import Any

from treq.testing import StubTreq
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.admin.api import AdminResource
from llmgw.control.admin.site import admin_site
from llmgw.control.shell.metrics import make_registry
from llmgw.routing import LONG_POLL_MAX_S, EngineSignals, Route, RoutingTable
from llmgw.testing.fleet import sample_fleet

BASE = "http://127.0.0.1:7480"


class RoutesTestCase(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1000)
        self.table = RoutingTable(self.clock)
        self.table.publish(
            [
                Route("r1", "alpha", "10.0.0.1:9000"),
                Route("r2", "alpha", "10.0.0.2:9000", draining=True,
                      signals=EngineSignals(sampled_at=998.0, waiting=3.0)),
            ],
            ["alpha", "beta"],
        )
        self.fleet: Any = sample_fleet()
        self.fleet.routing_table = self.table
        self.logged: list[dict[str, Any]] = []
        self.resource = AdminResource(self.fleet, make_registry())
        self.resource.log = Logger(observer=self.logged.append)  # type: ignore[arg-type]
        self.treq = StubTreq(self.resource)

    def get(self, path: str) -> Any:
        """
        Start a GET; returns its Deferred (the response), not yet flushed.
        """
        d = self.treq.get(BASE + path)
        self.treq.flush()
        return d

    def body(self, d: Any) -> tuple[int, Any]:
        self.treq.flush()
        response = self.successResultOf(d)
        content = self.successResultOf(self.treq.content(response))
        return response.code, json.loads(content)


class RoutesTests(RoutesTestCase):
    def test_whole_table(self) -> None:
        """
        Without C{since} the answer is the whole table at once: revision,
        declared models, every route (draining ones marked), engine signals
        with their age.
        """
        code, body = self.body(self.get("/api/v1/routes"))
        self.assertEqual(code, 200)
        self.assertEqual(body["revision"], self.table.revision)
        self.assertEqual(body["known"], ["alpha", "beta"])
        self.assertEqual(
            body["routes"],
            [
                {"replica": "r1", "model": "alpha", "address": "10.0.0.1:9000", "draining": False},
                {"replica": "r2", "model": "alpha", "address": "10.0.0.2:9000", "draining": True,
                 "signals": {"age_s": 2.0, "waiting": 3.0}},
            ],
        )

    def test_since_older_answers_at_once(self) -> None:
        """
        A client holding an older revision gets the table at once.
        """
        code, body = self.body(self.get(f"/api/v1/routes?since={self.table.revision - 1}"))
        self.assertEqual((code, body["revision"]), (200, self.table.revision))

    def test_since_from_another_process_answers_at_once(self) -> None:
        """
        A revision higher than the table's (held from a control plane process
        before a restart, which counts from zero again) is answered at once,
        not held until this process counts that far.
        """
        code, body = self.body(self.get("/api/v1/routes?since=500"))
        self.assertEqual((code, body["revision"]), (200, self.table.revision))

    def test_current_revision_held_until_change(self) -> None:
        """
        A client holding the current revision is held until the table
        changes, then answered with the new one.
        """
        rev = self.table.revision
        d = self.get(f"/api/v1/routes?since={rev}")
        self.assertNoResult(d)
        self.assertEqual(self.table.waiting(), 1)
        self.clock.advance(10)
        self.assertNoResult(d)
        self.table.publish_model("alpha", [Route("r3", "alpha", "10.0.0.3:9000")])
        code, body = self.body(d)
        self.assertEqual((code, body["revision"]), (200, rev + 1))
        self.assertEqual([r["replica"] for r in body["routes"]], ["r3"])
        self.assertEqual(self.table.waiting(), 0)

    def test_held_at_most_the_long_poll(self) -> None:
        """
        With no change the held request is answered after the long-poll's
        30 s with the same revision, and nothing is left waiting.
        """
        rev = self.table.revision
        d = self.get(f"/api/v1/routes?since={rev}")
        self.clock.advance(LONG_POLL_MAX_S - 0.1)
        self.assertNoResult(d)
        self.clock.advance(0.1)
        code, body = self.body(d)
        self.assertEqual((code, body["revision"]), (200, rev))
        self.assertEqual(self.table.waiting(), 0)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_bad_since(self) -> None:
        """
        A C{since} that is not a whole number of 0 or more, or given twice,
        is refused with 400 and a reason naming it; nothing waits.
        """
        for query, word in [
            ("since=abc", "'abc' is not a revision"),
            ("since=-1", "'-1' is not a revision"),
            ("since=1.5", "'1.5' is not a revision"),
            ("since=", "'' is not a revision"),
            ("since=1&since=2", "give 'since' once"),
        ]:
            code, body = self.body(self.get(f"/api/v1/routes?{query}"))
            self.assertEqual((code, body["status"]), (400, 400), query)
            self.assertIn(word, body["error"])
        self.assertEqual(self.table.waiting(), 0)
        refusals = [e for e in self.logged if "refused" in e.get("log_format", "")]
        self.assertEqual(len(refusals), 5)

    def test_post_refused(self) -> None:
        """
        The routes are read-only: POST gets 405 naming GET.
        """
        d = self.treq.post(BASE + "/api/v1/routes", headers={"Content-Type": ["application/json"]})
        code, body = self.body(d)
        self.assertEqual(code, 405)
        self.assertIn("takes GET", body["error"])

    def test_no_routing_table(self) -> None:
        """
        A fleet that publishes no routing table answers 404 with a reason.
        """
        self.fleet.routing_table = None
        code, body = self.body(self.get("/api/v1/routes"))
        self.assertEqual(code, 404)
        self.assertIn("no routing table", body["error"])


class DisconnectTests(SynchronousTestCase):
    def test_client_gone_cancels_wait(self) -> None:
        """
        A client that disconnects while its long-poll is held cancels the
        wait: the table holds no waiter and no timer for it, nothing is
        written to the closed connection and no error is logged.
        """
        clock = Clock()
        table = RoutingTable(clock)
        table.publish([Route("r1", "alpha", "10.0.0.1:9000")], ["alpha"])
        fleet: Any = sample_fleet()
        fleet.routing_table = table
        site = admin_site(fleet, make_registry(), reactor=clock)
        logged: list[dict[str, Any]] = []
        site.resource.log = Logger(observer=logged.append)  # type: ignore[attr-defined]
        site.startFactory()
        self.addCleanup(site.stopFactory)
        protocols = []
        for _ in range(3):
            proto = site.buildProtocol(None)
            transport = StringTransport()
            proto.makeConnection(transport)
            proto.dataReceived(
                f"GET /api/v1/routes?since={table.revision} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
            )
            protocols.append((proto, transport))
        self.assertEqual(table.waiting(), 3)
        for proto, transport in protocols[:2]:
            proto.connectionLost(Failure(ConnectionError("client went away")))
            self.assertEqual(transport.value(), b"")
        self.assertEqual(table.waiting(), 1)
        self.assertEqual(len(expiries(clock)), 1)
        # The one still connected is answered on the next change.
        table.publish([], ["alpha"])
        proto, transport = protocols[2]
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 200 "), transport.value()[:100])
        self.assertEqual(table.waiting(), 0)
        proto.connectionLost(Failure(ConnectionError("done")))
        self.assertEqual(expiries(clock), [])
        self.assertEqual([e for e in logged if e.get("log_level") in (LogLevel.error, LogLevel.critical)], [])


def expiries(clock: Clock) -> list[Any]:
    """
    The long-poll timers still set on C{clock}.
    """
    return [c for c in clock.getDelayedCalls() if c.active() and "expire" in repr(c)]
