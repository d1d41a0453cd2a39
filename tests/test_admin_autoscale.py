"""
The admin API's autoscaling surface: bounds through
C{POST /api/v1/deployments/{model}/scale}, gateways' demand through
C{POST /api/v1/demand}, and the C{gateway} role's right to post it.
"""

from __future__ import annotations

from llmgw.control.admin.auth import role_allows
from llmgw.routing import Demand
from tests.test_admin import AdminTestCase


class AutoscaleAdminTests(AdminTestCase):
    def setUp(self) -> None:
        super().setUp()
        view = self.fleet.add_deployment("auto", desired=1)
        view["autoscale"] = {"min_replicas": 1, "max_replicas": 4}

    def test_bounds(self) -> None:
        """
        C{{"min": N, "max": M}} sets an autoscaled deployment's bounds and is
        logged with who asked.
        """
        code, body, _ = self.call("POST", "/api/v1/deployments/auto/scale", {"min": 0, "max": 6})
        self.assertEqual((code, body), (200, {"model": "auto", "min": 0, "max": 6, "ok": True}))
        self.assertEqual(self.fleet.calls, [("scale_bounds", "auto", 0, 6)])
        logged = [e for e in self.logged if e.get("low") == 0]
        self.assertEqual(logged[0]["client"], "127.0.0.1:31337")

    def test_bad_bounds(self) -> None:
        """
        Bounds that are incomplete, not whole numbers, mixed with a count,
        or refused by the fleet are a 400 that says why.
        """
        self.assertRefused(self.call("POST", "/api/v1/deployments/auto/scale", {"min": 1}), 400, '"min" and "max"')
        self.assertRefused(self.call("POST", "/api/v1/deployments/auto/scale", {"min": 1, "max": "x"}), 400,
                           '"max" must be a whole number')
        self.assertRefused(self.call("POST", "/api/v1/deployments/auto/scale", {"min": -1, "max": 2}), 400,
                           "negative")
        self.assertRefused(self.call("POST", "/api/v1/deployments/auto/scale", {"min": 1, "max": 2, "replicas": 2}),
                           400, "unknown field(s) 'replicas'")
        self.assertRefused(self.call("POST", "/api/v1/deployments/auto/scale", {"min": 3, "max": 2}), 400,
                           "at least min")
        self.assertRefused(self.call("POST", "/api/v1/deployments/demo/scale", {"min": 1, "max": 2}), 400,
                           "fixed count")

    def test_count_on_autoscaled(self) -> None:
        """
        A fixed count on an autoscaled deployment is refused by the fleet.
        """
        self.assertRefused(self.call("POST", "/api/v1/deployments/auto/scale", {"replicas": 2}), 400, "autoscales")

    def test_demand(self) -> None:
        """
        A gateway's report reaches the fleet as L{Demand} figures.
        """
        code, body, _ = self.call("POST", "/api/v1/demand", {
            "gateway_id": "gw-1", "models": {"auto": {"in_flight": 2, "waiting": 5}}})
        self.assertEqual((code, body), (200, {"ok": True}))
        self.assertEqual(self.fleet.calls, [("report_demand", "gw-1", {"auto": Demand(2, 5)})])

    def test_bad_demand(self) -> None:
        """
        A malformed report is a 400 saying what is wrong, logged with who
        sent it; the fleet hears nothing.
        """
        self.assertRefused(self.call("POST", "/api/v1/demand", {"gateway_id": "gw-1", "models": {"a": {"waiting": -2}}}),
                           400, "'waiting' must be a whole number")
        self.assertRefused(self.call("GET", "/api/v1/demand"), 405)
        self.assertEqual(self.fleet.calls, [])
        refused = [e for e in self.logged if e.get("status") == 400]
        self.assertEqual(refused[0]["client"], "127.0.0.1:31337")

    def test_gateway_role_posts_demand_only(self) -> None:
        """
        The gateway role may post its demand and nothing else; a viewer may
        not post it.
        """
        self.assertTrue(role_allows("gateway", "POST", ["api", "v1", "demand"]))
        self.assertFalse(role_allows("gateway", "POST", ["api", "v1", "deployments", "auto", "scale"]))
        self.assertFalse(role_allows("gateway", "GET", ["api", "v1", "demand"]))
        self.assertFalse(role_allows("viewer", "POST", ["api", "v1", "demand"]))
        self.assertTrue(role_allows("operator", "POST", ["api", "v1", "demand"]))
