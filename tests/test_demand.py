"""
Tests for L{llmgw.control.state.demand}: gateways' demand reports, parsed,
summed and expired.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.state.demand import DemandBoard, DemandReportError, parse_report
from llmgw.routing import Demand


class ParseTests(SynchronousTestCase):
    def test_good_report(self) -> None:
        """
        A report gives its gateway id and each model's figures; models with
        nothing in flight or waiting are left out.
        """
        gw, models = parse_report({"gateway_id": "gw-1", "models": {
            "a": {"in_flight": 3, "waiting": 1}, "b": {"in_flight": 0, "waiting": 0}, "c": {"waiting": 2}}})
        self.assertEqual(gw, "gw-1")
        self.assertEqual(models, {"a": Demand(3, 1), "c": Demand(0, 2)})

    def test_bad_reports(self) -> None:
        """
        Every malformed report is refused with a message saying what is
        wrong with it.
        """
        for body, words in [
            ([], "JSON object"),
            ({"models": {}}, "gateway_id"),
            ({"gateway_id": "", "models": {}}, "gateway_id"),
            ({"gateway_id": "x" * 200, "models": {}}, "1 to 128"),
            ({"gateway_id": "gw", "models": []}, '"models" must be an object'),
            ({"gateway_id": "gw", "models": {}, "extra": 1}, "unknown field(s) 'extra'"),
            ({"gateway_id": "gw", "models": {"a": {"in_flight": -1}}}, "'in_flight' must be a whole number"),
            ({"gateway_id": "gw", "models": {"a": {"waiting": 1.5}}}, "'waiting' must be a whole number"),
            ({"gateway_id": "gw", "models": {"a": {"waiting": True}}}, "'waiting' must be a whole number"),
            ({"gateway_id": "gw", "models": {"a": {"queued": 1}}}, "model 'a'"),
            ({"gateway_id": "gw", "models": {"a": 3}}, "model 'a'"),
            ({"gateway_id": "gw", "models": {"a": {"waiting": 10**9}}}, "from 0 to 1000000"),
        ]:
            e = self.assertRaises(DemandReportError, parse_report, body)
            self.assertIn(words, str(e))


class BoardTests(SynchronousTestCase):
    def test_sum_replace_expire(self) -> None:
        """
        Reports from several gateways add up per model; a new report
        replaces its gateway's last; a report older than the expiry counts
        for nothing.
        """
        b = DemandBoard(expire_after=5)
        b.report("gw-1", {"a": Demand(1, 2)}, 100)
        b.report("gw-2", {"a": Demand(3, 0), "b": Demand(0, 1)}, 102)
        self.assertEqual(b.totals(103), {"a": Demand(4, 2), "b": Demand(0, 1)})
        b.report("gw-1", {}, 104)
        self.assertEqual(b.totals(104), {"a": Demand(3, 0), "b": Demand(0, 1)})
        self.assertEqual(b.totals(108), {})
        self.assertEqual(b.gateways(108), ["gw-1"])
        self.assertEqual(b.gateways(110), [])

    def test_bounded(self) -> None:
        """
        Past its bound of gateways the stalest report goes.
        """
        b = DemandBoard(max_gateways=3)
        for i in range(5):
            b.report(f"gw-{i}", {"a": Demand(1, 0)}, 100 + i)
        self.assertEqual(b.gateways(104), ["gw-2", "gw-3", "gw-4"])
        self.assertEqual(b.totals(104), {"a": Demand(3, 0)})


class InFlightDemandTests(SynchronousTestCase):
    def test_sums_busy_replicas_by_model(self) -> None:
        """
        A router's in-flight snapshot becomes in-flight demand per model;
        replicas no longer known are left out.
        """
        from llmgw.control.state.demand import InFlightDemand

        models = {"r1": "a", "r2": "a", "r3": "b"}
        source = InFlightDemand(lambda: {"r1": 2, "r2": 3, "r3": 1, "gone": 7}, models.get)
        self.assertEqual(source.demand(), {"a": Demand(5, 0), "b": Demand(1, 0)})
