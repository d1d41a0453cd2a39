"""
docs/grafana-dashboard.json: the console's curves for Grafana, queried from
the metric names llmgw serves.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

import llmgw

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "docs" / "grafana-dashboard.json"


class DashboardTests(SynchronousTestCase):
    def test_queries_name_served_metrics(self) -> None:
        """
        Every metric a panel or variable queries is one llmgw's code
        defines (a counter read with its C{_total}, a histogram with its
        C{_bucket}), so that renaming a metric breaks this test rather
        than the dashboard.
        """
        if not DASHBOARD.exists():
            self.skipTest("docs/ is not in this tree")
        dashboard = json.loads(DASHBOARD.read_text())
        source = "\n".join(p.read_text() for p in Path(llmgw.__file__).parent.rglob("*.py"))
        queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
        queries += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
        names = {n for q in queries for n in re.findall(r"\bllmgw_[a-z0-9_]+", q)}
        self.assertGreater(len(names), 8)
        for name in names:
            base = re.sub(r"_(total|bucket)$", "", name)
            self.assertIn(f'"{base}"', source, name)
        titles = [p["title"] for p in dashboard["panels"]]
        for word in ("Requests per second, by model", "Time to first byte", "Output tokens per second",
                     "Requests waiting", "GPU memory used, by node", "by API key"):
            self.assertTrue(any(word in t for t in titles), word)
