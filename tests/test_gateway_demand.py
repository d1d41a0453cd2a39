"""
L{llmgw.gateway.demand.DemandReporter}: a standalone gateway's demand
posted to the admin API every second, driven on a L{Clock} through the real
admin resource in process.
"""

from __future__ import annotations

from typing import Any

from treq.testing import StubTreq
from twisted.internet.task import Clock
from twisted.logger import Logger
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer

from llmgw.control.admin.api import AdminResource
from llmgw.control.shell.metrics import make_registry
from llmgw.gateway.demand import DemandReporter
from llmgw.gateway.follower import FollowerTable
from llmgw.routing import Demand, IDemand
from llmgw.testing.fleet import sample_fleet


@implementer(IDemand)
class Source:
    def __init__(self) -> None:
        self.now: dict[str, Demand] = {}

    def demand(self) -> dict[str, Demand]:
        return dict(self.now)


class DemandReporterTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.fleet = sample_fleet()
        self.resource = AdminResource(self.fleet, make_registry())
        self.stub: Any = StubTreq(self.resource)
        self.table = FollowerTable(self.clock, "http://127.0.0.1:7480", http=self.stub)
        self.source = Source()
        self.reporter = DemandReporter(self.table, self.source, "gw-1")
        self.logged: list[dict[str, Any]] = []
        self.reporter.log = Logger(observer=self.logged.append)  # type: ignore[arg-type]
        self.reporter.startService()
        self.addCleanup(self.reporter.stopService)

    def tick(self, seconds: int = 1) -> None:
        for _ in range(seconds):
            self.clock.advance(1)
            self.stub.flush()

    def reports(self) -> list[tuple[Any, ...]]:
        return [c for c in self.fleet.calls if c[0] == "report_demand"]

    def test_posts_every_second(self) -> None:
        """
        While the gateway has demand it is posted every second under its
        id; once it has none, one empty report says so, then nothing.
        """
        self.source.now = {"demo": Demand(2, 3), "idle": Demand(0, 0)}
        self.tick(3)
        self.assertEqual(self.reports(), [("report_demand", "gw-1", {"demo": Demand(2, 3)})] * 3)
        self.source.now = {}
        self.tick(5)
        self.assertEqual(self.reports()[3:], [("report_demand", "gw-1", {})])
        self.assertEqual(self.reporter.sent, 4)

    def test_nothing_to_say(self) -> None:
        """
        A gateway that never had demand posts nothing.
        """
        self.tick(10)
        self.assertEqual(self.reports(), [])

    def test_refusal_logged_rarely(self) -> None:
        """
        A control plane that refuses the reports is logged once (not once
        a second), and the reporter goes on trying.
        """
        self.resource.fleet = None  # type: ignore[assignment]  # every report now fails inside
        self.source.now = {"demo": Demand(1, 0)}
        self.tick(10)
        self.flushLoggedErrors()
        self.assertEqual(self.reporter.failures, 10)
        warnings = [e for e in self.logged if "demand report" in e.get("log_format", "")]
        self.assertEqual(len(warnings), 1)
        self.assertIn("HTTP 500", warnings[0]["why"])

    def test_stop_leaves_nothing(self) -> None:
        """
        A stopped reporter leaves no timer on its clock.
        """
        self.reporter.stopService()
        self.assertEqual(self.clock.getDelayedCalls(), [])
