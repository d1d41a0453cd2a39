"""
The curves of the last hour: the bounded rings (L{llmgw.control.state.series}),
the keeper that samples the control plane's sources on a clock
(L{llmgw.control.shell.series}), C{GET /api/v1/series}, and the charting
library the page draws them with, served from the package.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import treq
from treq.testing import StubTreq
from twisted.internet import reactor as global_reactor
from twisted.internet.defer import inlineCallbacks
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import Agent, HTTPConnectionPool

from llmgw.control.admin.api import ENDPOINTS, AdminResource
from llmgw.control.admin.site import admin_service
from llmgw.control.shell.metrics import make_registry
from llmgw.control.shell.series import ControlSources, NodeMemoryCollector, SeriesKeeper
from llmgw.control.state.inventory import GPUInfo, Inventory, Node
from llmgw.control.state.series import (
    OTHER,
    SeriesFamily,
    bucket_deltas,
    histogram_quantile,
    points_for,
    rates,
)
from llmgw.gateway.keys import KeyRing
from llmgw.gateway.service import GatewayService
from llmgw.routing import Demand, Route, RoutingSnapshot
from llmgw.testing.fleet import sample_fleet
from llmgw.testing.pki import make_pki
from llmgw.tlsconf.options import ClientTLSPolicy, ServerTLS, TLSFiles, server_files

BASE = "http://127.0.0.1:7480"


class FamilyTests(SynchronousTestCase):
    def test_points_bounded(self) -> None:
        """
        A ring holds C{points} samples whatever is added: after a thousand
        samples a name has the newest C{points}, oldest first, and the
        rings' bytes are what they were after the first.
        """
        fam = SeriesFamily(("v",), points=5, max_names=4)
        fam.add(0.0, {"a": [0.0]})
        size = fam.nbytes()
        for i in range(1, 1000):
            fam.add(float(i), {"a": [float(i)]})
        self.assertEqual(fam.nbytes(), size)
        self.assertEqual(fam.read(0.0 - 1)["a"]["v"], [[995, 995.0], [996, 996.0], [997, 997.0],
                                                         [998, 998.0], [999, 999.0]])
        self.assertEqual(fam.read(997.5)["a"]["v"], [[998, 998.0], [999, 999.0]])
        self.assertEqual(points_for(3600, 10), 361)
        self.assertRaises(ValueError, points_for, 5, 10)

    def test_names_capped_with_other(self) -> None:
        """
        Past C{max_names}, new names are summed into C{_other} for the
        metrics that add up and give no value for the others; a name named
        C{_other} by a source is folded in too, never its own.
        """
        fam = SeriesFamily(("rate", "p50"), points=3, max_names=2, additive=("rate",))
        fam.add(1.0, {"a": [1.0, 0.1], "b": [2.0, 0.2], "c": [3.0, 0.3], "d": [4.0, None], OTHER: [5.0, 9.0]})
        self.assertEqual(fam.names(), [OTHER, "a", "b"])
        view = fam.read(0.0)
        self.assertEqual(view[OTHER], {"rate": [[1, 12.0]], "p50": []})
        self.assertEqual(view["a"], {"rate": [[1, 1.0]], "p50": [[1, 0.1]]})
        self.assertEqual(fam.refused, 3)
        left_out = SeriesFamily(("v",), points=3, max_names=1, other=None)
        left_out.add(1.0, {"a": [1.0], "b": [2.0]})
        self.assertEqual(left_out.names(), ["a"])

    def test_silent_names_dropped(self) -> None:
        """
        A name not given a value has a gap at that sample, and is dropped
        once it had none for a whole window, freeing room under the cap for
        the next sample.
        """
        fam = SeriesFamily(("v",), points=3, max_names=1, other=None)
        fam.add(1.0, {"a": [1.0]})
        fam.add(2.0, {})
        self.assertEqual(fam.read(0.0)["a"]["v"], [[1, 1.0]])
        fam.add(3.0, {"b": [5.0]})
        self.assertEqual(fam.names(), ["a"])
        fam.add(4.0, {"b": [5.0]})
        self.assertEqual(fam.names(), [])
        fam.add(5.0, {"b": [6.0]})
        self.assertEqual(fam.names(), ["b"])
        self.assertEqual(fam.read(0.0)["b"]["v"], [[5, 6.0]])

    def test_scaled_integers(self) -> None:
        """
        An unsigned family keeps C{round(v * scale)}, clamped to its range,
        and reads it back divided; NaN and C{None} are no value.
        """
        fam = SeriesFamily(("pct",), points=4, max_names=5, typecode="H", scale=100.0, other=None)
        fam.add(10.5, {"a": [57.314], "b": [1e9], "c": [-3.0], "d": [math.nan], "e": [None]})
        view = fam.read(0.0)
        self.assertEqual(view["a"]["pct"], [[10.5, 57.31]])
        self.assertEqual(view["b"]["pct"], [[10.5, 655.34]])
        self.assertEqual(view["c"]["pct"], [[10.5, 0.0]])
        self.assertEqual((view["d"]["pct"], view["e"]["pct"]), ([], []))
        self.assertEqual(fam.latest("a"), 57.31)
        self.assertIsNone(fam.latest("nope"))

    def test_rates(self) -> None:
        """
        A rate needs the total one step ago; a counter that went down (its
        source restarted) counts its new total for the step.
        """
        prev: dict[str, float] = {}
        self.assertEqual(rates(prev, {"a": 10.0}, 0.0), {})
        self.assertEqual(rates(prev, {"a": 30.0, "b": 5.0}, 10.0), {"a": 2.0})
        self.assertEqual(rates(prev, {"a": 4.0, "b": 5.0}, 2.0), {"a": 2.0, "b": 0.0})
        self.assertEqual(prev, {"a": 4.0, "b": 5.0})
        self.assertEqual(rates(prev, {"a": 4.0, "c": 6.0}, 2.0, new_from_zero=True), {"a": 0.0, "c": 3.0})
        self.assertEqual(rates({}, {"a": 4.0}, 0.0, new_from_zero=True), {})

    def test_quantiles(self) -> None:
        """
        Quantiles of bucket counts interpolate within the bucket as
        Prometheus does; the C{+Inf} bucket gives the top bound; none
        without observations. Bucket deltas need a previous look with
        counts that did not go down.
        """
        bounds = (0.1, 0.5, 1.0)
        self.assertAlmostEqual(histogram_quantile(0.5, bounds, [0, 10, 0, 0]) or 0, 0.3)
        self.assertAlmostEqual(histogram_quantile(0.99, bounds, [50, 0, 0, 50]) or 0, 1.0)
        self.assertAlmostEqual(histogram_quantile(0.25, bounds, [10, 10, 0, 0]) or 0, 0.05)
        self.assertIsNone(histogram_quantile(0.5, bounds, [0, 0, 0, 0]))
        prev: dict[str, list[float]] = {}
        self.assertEqual(bucket_deltas(prev, {"m": [1, 2]}), {})
        self.assertEqual(bucket_deltas(prev, {"m": [3, 2]}), {"m": [2, 0]})
        self.assertEqual(bucket_deltas(prev, {"m": [0, 2]}), {})
        self.assertEqual(bucket_deltas(prev, {"m": [0, 2], "n": [1, 1]}, new_from_zero=True),
                         {"m": [0, 0], "n": [1, 1]})


class FakeFleetSource:
    """The reconciler's side the keeper reads: the gateways' demand."""

    def __init__(self) -> None:
        self.demands: dict[str, Demand] = {}

    def demand(self) -> dict[str, Demand]:
        return dict(self.demands)


def node(node_id: str, used: list[int], total: int = 1000) -> Node:
    return Node(node_id, gpus=[GPUInfo(i, memory_total_mb=total, memory_used_mb=u) for i, u in enumerate(used)])


class KeeperTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1000)
        keys = KeyRing({"team-a": "sk-team-a-0001", "batch": "sk-batch-00002", "c": "sk-ccccc-00003"})
        self.gateway = GatewayService(self.clock, RoutingSnapshot([Route("r1", "demo", "10.0.0.9:8000")]),
                                      port=0, keys=keys).gateway
        self.fleet = FakeFleetSource()
        self.inventory = Inventory()
        self.inventory.upsert(node("n1", [250, 750]))
        self.inventory.upsert(node("n2", [1000]))
        self.inventory.upsert(Node("cpu-only"))
        self.keeper = SeriesKeeper(self.clock, ControlSources(self.fleet, self.inventory, lambda: self.gateway),
                                   max_keys=2)

    def traffic(self, n: int, key: str = "team-a", ttfb: float = 0.2) -> None:
        for _ in range(n):
            self.gateway.metrics.count("demo", "/v1/chat/completions", 200)
            self.gateway.metrics.first_byte("demo", ttfb)
            meter = self.gateway.usage.admit(key, "demo")
            meter.feed(b'{"usage": {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}}')
            meter.finish(200)

    def test_samples_on_the_clock(self) -> None:
        """
        Running, the keeper samples at once and every step on its clock,
        and stops sampling when stopped; the first sample gives levels
        only (GPU memory, queues), later ones rates over the step.
        """
        self.fleet.demands["demo"] = Demand(3, 2)
        self.keeper.startService()
        self.assertEqual(self.keeper.samples, 1)
        view = self.keeper.view(0.0)
        self.assertEqual(view["nodes"]["n1"], {"gpu_memory_used_pct": [[1000, 50.0]]})
        self.assertEqual(view["models"]["demo"]["queue"], [[1000, 2.0]])
        self.assertEqual(view["models"]["demo"]["requests_per_s"], [])
        self.assertEqual(view["fleet"]["gpu_memory_total_gib"], [[1000, round(3000 / 1024, 4)]])
        self.traffic(20)
        self.clock.advance(10)
        self.assertEqual(self.keeper.samples, 2)
        self.keeper.stopService()
        self.clock.advance(100)
        self.assertEqual(self.keeper.samples, 2)
        view = self.keeper.view(1005.0)
        self.assertEqual(view["models"]["demo"]["requests_per_s"], [[1010, 2.0]])
        self.assertEqual(view["fleet"]["requests_per_s"], [[1010, 2.0]])
        self.assertEqual(view["keys"]["team-a"], {"requests_per_s": [[1010, 2.0]], "tokens_per_s": [[1010, 20.0]]})
        self.assertEqual((view["step_s"], view["keep_s"], view["newest"]), (10.0, 3600.0, 1010))

    def test_first_byte_quantiles(self) -> None:
        """
        p50 and p99 of the time to first byte are over the requests of the
        last step only; a step without requests has no point.
        """
        self.keeper.sample()
        self.traffic(97, ttfb=0.02)
        self.traffic(3, ttfb=40.0)
        self.clock.advance(10)
        self.keeper.sample()
        self.clock.advance(10)
        self.keeper.sample()
        demo = self.keeper.view(0.0)["models"]["demo"]
        self.assertEqual([t for t, _ in demo["ttfb_p50_s"]], [1010])
        self.assertTrue(0.01 < demo["ttfb_p50_s"][0][1] <= 0.025, demo)
        self.assertTrue(30 < demo["ttfb_p99_s"][0][1] <= 60, demo)
        self.assertEqual(demo["requests_per_s"], [[1010, 10.0], [1020, 0.0]])

    def test_output_tokens_per_model(self) -> None:
        """
        Output tokens per second per model are the completion tokens the
        embedded gateway counted over the step, whatever the key.
        """
        self.keeper.sample()
        self.traffic(10, "team-a")
        self.traffic(20, "batch")
        self.clock.advance(10)
        self.keeper.sample()
        view = self.keeper.view(0.0)
        self.assertEqual(view["models"]["demo"]["output_tokens_per_s"], [[1010, 21.0]])
        self.assertEqual(view["fleet"]["output_tokens_per_s"], [[1010, 21.0]])

    def test_keys_capped(self) -> None:
        """
        Past C{max_keys}, keys' rates add up in C{_other}.
        """
        self.keeper.sample()
        self.traffic(10, "team-a")
        self.traffic(20, "batch")
        self.traffic(30, "c")
        self.clock.advance(10)
        self.keeper.sample()
        keys = self.keeper.view(0.0)["keys"]
        self.assertEqual(sorted(keys), [OTHER, "batch", "c"])
        self.assertEqual(keys[OTHER]["requests_per_s"], [[1010, 1.0]])

    def test_nodes_answered(self) -> None:
        """
        An answer carries the busiest nodes (C{top}) and those named, with
        the number of nodes that have a curve; a node that left has no
        point after it left.
        """
        self.keeper.sample()
        view = self.keeper.view(0.0, top=1)
        self.assertEqual((list(view["nodes"]), view["nodes_total"]), (["n2"], 2))
        view = self.keeper.view(0.0, top=1, nodes=["n1", "nope"])
        self.assertEqual(sorted(view["nodes"]), ["n1", "n2"])
        self.assertEqual(self.keeper.view(0.0, top=0)["nodes"], {})
        self.inventory.remove("n1")
        self.clock.advance(10)
        self.keeper.sample()
        self.assertEqual(self.keeper.view(0.0, top=5)["nodes"]["n1"]["gpu_memory_used_pct"], [[1000, 50.0]])

    def test_failing_source(self) -> None:
        """
        A source that raises is logged once while it keeps failing; the
        other curves go on, and it is sampled again once it works.
        """
        self.inventory.ids = lambda: 1 / 0  # type: ignore[method-assign]
        self.fleet.demands["demo"] = Demand(1, 4)
        self.keeper.sample()
        self.clock.advance(10)
        self.keeper.sample()
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)
        view = self.keeper.view(0.0)
        self.assertEqual(view["nodes"], {})
        self.assertEqual(view["models"]["demo"]["queue"], [[1000, 4.0], [1010, 4.0]])
        del self.inventory.ids
        self.clock.advance(10)
        self.keeper.sample()
        self.assertEqual(self.keeper.view(0.0)["nodes_total"], 2)

    def test_no_gateway_no_fleet(self) -> None:
        """
        Without an embedded gateway, a fleet or an inventory (a fake, a
        member that does not lead) a sample has nothing to keep and fails
        nothing.
        """
        keeper = SeriesKeeper(self.clock, ControlSources(object(), None, lambda: None))
        keeper.sample()
        self.clock.advance(10)
        keeper.sample()
        view = keeper.view(0.0)
        self.assertEqual((view["models"], view["nodes"], view["keys"]), ({}, {}, {}))


class EndpointTests(SynchronousTestCase):
    def get(self, resource: AdminResource, path: str) -> tuple[int, Any, Any]:
        stub: Any = StubTreq(resource)
        d = stub.get(BASE + path)
        stub.flush()
        response = self.successResultOf(d)
        return response.code, response.headers, json.loads(self.successResultOf(stub.content(response)))

    def resource(self) -> AdminResource:
        clock = Clock()
        clock.advance(500)
        inventory = Inventory()
        for i in range(12):
            inventory.upsert(node(f"n{i:02}", [i * 50]))
        self.keeper = SeriesKeeper(clock, ControlSources(None, inventory, lambda: None))
        self.keeper.sample()
        clock.advance(10)
        self.keeper.sample()
        return AdminResource(sample_fleet(), make_registry(), series=self.keeper)

    def test_shape(self) -> None:
        """
        C{GET /api/v1/series} answers each family's curves as C{[t, v]}
        arrays, the 8 busiest nodes unless asked otherwise, only points
        after C{since}; it is listed at C{/}.
        """
        resource = self.resource()
        code, headers, body = self.get(resource, "/api/v1/series")
        self.assertEqual(code, 200)
        self.assertIn(b"application/json", headers.getRawHeaders(b"content-type")[0])
        self.assertEqual(sorted(body), ["fleet", "keep_s", "keys", "models", "newest", "nodes", "nodes_total",
                                        "now", "step_s"])
        self.assertEqual(sorted(body["nodes"]), [f"n{i:02}" for i in range(4, 12)])
        self.assertEqual(body["nodes"]["n11"]["gpu_memory_used_pct"], [[500, 55.0], [510, 55.0]])
        self.assertEqual(body["nodes_total"], 12)
        _, _, body = self.get(resource, "/api/v1/series?since=505&top=1&node=n00")
        self.assertEqual(body["nodes"], {"n11": {"gpu_memory_used_pct": [[510, 55.0]]},
                                         "n00": {"gpu_memory_used_pct": [[510, 0.0]]}})
        self.assertIn("GET /api/v1/series?since=SECONDS&top=N&node=ID (curves of the last hour)", ENDPOINTS)

    def test_refusals(self) -> None:
        """
        A bad C{since} or C{top} is a 400 that names it; a control plane
        without a keeper answers 404; a write is a 405.
        """
        resource = self.resource()
        for query, word in (("since=soon", "since"), ("top=-1", "top"), ("top=201", "top"), ("top=1&top=2", "top")):
            code, _, body = self.get(resource, "/api/v1/series?" + query)
            self.assertEqual(code, 400, query)
            self.assertIn(word, body["error"])
        code, _, body = self.get(AdminResource(sample_fleet(), make_registry()), "/api/v1/series")
        self.assertEqual((code, body["error"]), (404, "this control plane keeps no curves"))
        stub: Any = StubTreq(resource)
        d = stub.post(BASE + "/api/v1/series", headers={"Content-Type": ["application/json"]})
        stub.flush()
        self.assertEqual(self.successResultOf(d).code, 405)


class RoleTests(TestCase):
    """
    Over mutual TLS on 127.0.0.1: who may read the curves, from the
    keeper the admin listener runs.
    """

    @inlineCallbacks
    def test_roles(self) -> Any:
        """
        A viewer and an operator read the curves the listener's own keeper
        samples; a gateway's certificate is refused.
        """
        d = Path(self.mktemp())
        ca = make_pki(d, ["node-a"])
        ca.issue_admin("alice", "viewer")
        ca.issue_admin("gw-1", "gateway")
        control = SimpleNamespace(gateway=None)
        svc: Any = admin_service(global_reactor, "127.0.0.1", 0, sample_fleet(), make_registry(),
                                 control=control, tls=ServerTLS(server_files(d)))
        svc.startService()
        self.addCleanup(svc.stopService)
        self.assertTrue(svc.series.running)
        self.assertEqual(svc.series.samples, 1)
        url = f"https://127.0.0.1:{svc.address()[1]}/api/v1/series"
        for stem, expected in (("admin-alice", 200), ("admin-gw-1", 403)):
            files = TLSFiles.load(d / "ca.pem", d / f"{stem}.pem", d / f"{stem}.key")
            pool = HTTPConnectionPool(global_reactor, persistent=False)
            client = treq.client.HTTPClient(Agent(global_reactor, contextFactory=ClientTLSPolicy(files), pool=pool))
            response = yield client.get(url)
            body = json.loads((yield treq.content(response)))
            self.assertEqual(response.code, expected, body)
            if expected == 200:
                self.assertEqual(body["step_s"], 10.0)
        yield svc.stopService()
        self.assertFalse(svc.series.running)


class VendorFileTests(SynchronousTestCase):
    def get(self, path: str) -> tuple[int, Any, bytes]:
        stub: Any = StubTreq(AdminResource(sample_fleet(), make_registry()))
        d = stub.get(BASE + path)
        stub.flush()
        response = self.successResultOf(d)
        return response.code, response.headers, self.successResultOf(stub.content(response))

    def test_charting_library_served(self) -> None:
        """
        The page loads uPlot and its style sheet from the package, with
        their types and the page's own CSP, and the curves script; the
        page links them; the library's licence ships beside it; other
        names under vendor/ are 404s.
        """
        code, headers, body = self.get("/page/vendor/uPlot.iife.min.js")
        self.assertEqual(code, 200)
        self.assertEqual(headers.getRawHeaders(b"content-type"), [b"text/javascript; charset=utf-8"])
        self.assertIn(b"script-src 'self'", headers.getRawHeaders(b"content-security-policy")[0])
        self.assertIn(b"uPlot", body)
        code, headers, _ = self.get("/page/vendor/uPlot.min.css")
        self.assertEqual((code, headers.getRawHeaders(b"content-type")), (200, [b"text/css; charset=utf-8"]))
        code, headers, body = self.get("/page/curves.js")
        self.assertEqual((code, headers.getRawHeaders(b"content-type")), (200, [b"text/javascript; charset=utf-8"]))
        self.assertIn(b"/api/v1/series", body)
        _, _, html = self.get("/page/index.html")
        for ref in (b"/page/vendor/uPlot.iife.min.js", b"/page/vendor/uPlot.min.css", b"/page/curves.js"):
            self.assertIn(ref, html)
        for bad in ("/page/vendor/uPlot.LICENSE", "/page/vendor/nope.js", "/page/vendor"):
            self.assertEqual(self.get(bad)[0], 404, bad)
        from importlib.resources import files

        licence = files("llmgw.control.admin").joinpath("page", "vendor", "uPlot.LICENSE").read_text()
        self.assertIn("MIT License", licence)


class NodeMemoryMetricsTests(SynchronousTestCase):
    def test_metrics(self) -> None:
        """
        C{/metrics} has each node's GPU memory in use and in all, in bytes,
        from the inventory; nodes without GPUs have no sample (the control
        plane's metrics include it: L{tests.test_metrics}).
        """
        inventory = Inventory()
        inventory.upsert(node("n1", [250, 750]))
        inventory.upsert(Node("cpu-only"))
        registry = make_registry()
        registry.register(NodeMemoryCollector(lambda: inventory))
        self.assertEqual(registry.get_sample_value("llmgw_node_gpu_memory_used_bytes", {"node": "n1"}),
                         1000 * 2**20)
        self.assertEqual(registry.get_sample_value("llmgw_node_gpu_memory_total_bytes", {"node": "n1"}),
                         2000 * 2**20)
        self.assertIsNone(registry.get_sample_value("llmgw_node_gpu_memory_total_bytes", {"node": "cpu-only"}))
