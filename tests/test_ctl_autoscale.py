"""
C{llmgw ctl scale} on autoscaled deployments: bounds with
C{--min}/C{--max}, a fixed count refused, usage errors.
"""

from __future__ import annotations

from llmgw.ctl import fleet as ctl
from tests.test_ctl import CtlTestCase


class ScaleBoundsTests(CtlTestCase):
    def setUp(self) -> None:
        super().setUp()
        view = self.fleet.add_deployment("auto", desired=2)
        view["autoscale"] = {"min_replicas": 1, "max_replicas": 4}

    def test_min_and_max(self) -> None:
        """
        C{ctl scale MODEL --min N --max M} posts the bounds.
        """
        self.assertEqual(self.ctl("scale", "auto", "--min", "0", "--max", "6"),
                         (0, "auto: autoscales between 0 and 6 replicas\n", ""))
        self.assertEqual(self.calls[-1], ("POST", "http://127.0.0.1:7480/api/v1/deployments/auto/scale",
                                          {"min": 0, "max": 6}))

    def test_one_bound_keeps_the_other(self) -> None:
        """
        Given one bound, the other stays as the deployment has it.
        """
        self.assertEqual(self.ctl("scale", "auto", "--max", "8")[0], 0)
        self.assertEqual(self.calls[-1][2], {"min": 1, "max": 8})
        self.assertEqual(self.ctl("scale", "auto", "--min", "3")[0], 0)
        self.assertEqual(self.calls[-1][2], {"min": 3, "max": 8})

    def test_count_refused_on_autoscaled(self) -> None:
        """
        A fixed count on an autoscaled deployment is the control plane's
        refusal, exit code "refused".
        """
        code, _, err = self.ctl("scale", "auto", "3")
        self.assertEqual(code, ctl.EXIT_REFUSED)
        self.assertIn("autoscales", err)

    def test_bounds_refused_on_fixed(self) -> None:
        """
        Bounds on a fixed deployment are refused, saying it has a fixed
        count.
        """
        code, _, err = self.ctl("scale", "demo", "--min", "1", "--max", "2")
        self.assertEqual(code, ctl.EXIT_REFUSED)
        self.assertIn("fixed count", err)

    def test_usage(self) -> None:
        """
        A count and bounds together, or neither, is a usage error before
        anything is sent; the deployments table shows an autoscaled one's
        bounds.
        """
        self.assertUsageError("scale", "auto", "3", "--max", "4")
        self.assertUsageError("scale", "auto")
        self.assertUsageError("scale", "auto", "--min", "-1")
        self.assertEqual(self.calls, [])
        code, out, _ = self.ctl("deployments")
        self.assertEqual(code, 0)
        self.assertIn("2 (auto 1-4)", out)
