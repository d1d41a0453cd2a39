"""
Tests for L{llmgw.control.admin.api}: the admin API against a fake fleet.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from treq.testing import StubTreq
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import Logger, formatEvent
from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control import service
from llmgw.control.admin.actions import model_path
from llmgw.control.admin.api import AdminResource
from llmgw.control.admin.base import MAX_BODY
from llmgw.control.admin.site import ABORT_BODY, admin_service, admin_site
from llmgw.control.shell.metrics import make_registry, register_control_metrics
from llmgw.control.state.interfaces import AdminError
from llmgw.control.state.inventory import Node, StrayProcess
from llmgw.hostcheck import HostCheck
from llmgw.testing.fleet import FakeAgents, FakeFleet, sample_fleet
from llmgw.testing.pki import make_pki
from llmgw.testing.sinks import RecordingSink
from llmgw.tlsconf.options import ServerTLS, server_files

BASE = "http://127.0.0.1:7480"
JSON = {"Content-Type": ["application/json"]}


class AdminTestCase(SynchronousTestCase):
    def setUp(self) -> None:
        self.fleet = sample_fleet()
        self.agents = FakeAgents(["gpu-1"])
        self.registry = make_registry()
        register_control_metrics(self.registry, self.agents, lambda: self.fleet)
        self.resource = AdminResource(self.fleet, self.registry, self.agents)
        self.logged: list[dict[str, Any]] = []
        self.resource.log = Logger(observer=self.logged.append)  # type: ignore[arg-type]
        self.treq: Any = StubTreq(self.resource)

    def call(self, method: str, path: str, body: Any = None, headers: Any = None,
             raw: bytes | None = None) -> tuple[int, Any, Any]:
        """
        One request; returns status, the decoded JSON body (or bytes when not
        JSON) and the response headers.
        """
        if headers is None:
            headers = JSON if method == "POST" else {}
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        d = self.treq.request(method, BASE + path, headers=headers, data=data)
        self.treq.flush()
        response = self.successResultOf(d)
        content = self.successResultOf(self.treq.content(response))
        ctype = response.headers.getRawHeaders(b"content-type", [b""])[0]
        if ctype.startswith(b"application/json") and method != "HEAD":
            return response.code, json.loads(content), response.headers
        return response.code, content, response.headers

    def assertRefused(self, result: tuple[int, Any, Any], status: int, *words: str) -> None:
        code, body, _ = result
        self.assertEqual(code, status, body)
        self.assertEqual(body["status"], status)
        for w in words:
            self.assertIn(w, body["error"])


class ReadTests(AdminTestCase):
    def test_nodes(self) -> None:
        """
        GET /api/v1/nodes answers the fleet's node views as JSON under
        C{nodes}, with every documented field.
        """
        code, body, headers = self.call("GET", "/api/v1/nodes")
        self.assertEqual(code, 200)
        self.assertEqual(headers.getRawHeaders(b"content-type"), [b"application/json; charset=utf-8"])
        self.assertEqual([n["id"] for n in body["nodes"]], ["gpu-1", "gpu-2"])
        for field in ("id", "state", "connected", "cordoned", "last_seen", "gpus", "fabrics", "shards"):
            self.assertIn(field, body["nodes"][0])
        self.assertEqual(body["nodes"][1]["state"], "suspect")

    def test_deployments_and_replicas(self) -> None:
        """
        GET /api/v1/deployments and /api/v1/replicas answer the fleet's
        views under C{deployments} and C{replicas}.
        """
        code, body, _ = self.call("GET", "/api/v1/deployments")
        self.assertEqual(code, 200)
        self.assertEqual([d["model"] for d in body["deployments"]], ["demo", "org/big"])
        self.assertEqual(body["deployments"][0]["desired"], 2)
        code, body, _ = self.call("GET", "/api/v1/replicas")
        self.assertEqual(code, 200)
        self.assertEqual(body["replicas"][0]["shards"][0]["address"], "10.0.0.1:8000")

    def test_status_adds_connected_agents(self) -> None:
        """
        GET /api/v1/status is the fleet's summary plus the count of
        connected agents from the agent service.
        """
        code, body, _ = self.call("GET", "/api/v1/status")
        self.assertEqual(code, 200)
        self.assertEqual(body["nodes"], {"ready": 1, "suspect": 1})
        self.assertEqual(body["agents_connected"], 1)

    def test_events_since(self) -> None:
        """
        GET /api/v1/events?since=T answers only the events after T; without
        C{since}, all of them.
        """
        _, body, _ = self.call("GET", "/api/v1/events")
        self.assertEqual([e["kind"] for e in body["events"]], ["placed", "shard_failed"])
        _, body, _ = self.call("GET", "/api/v1/events?since=150.5")
        self.assertEqual([e["kind"] for e in body["events"]], ["shard_failed"])
        self.assertEqual(body["events"][0]["last_output"], "boom")

    def test_events_bad_since(self) -> None:
        """
        A C{since} that is not a finite number, or given twice, is a 400
        naming the value.
        """
        self.assertRefused(self.call("GET", "/api/v1/events?since=yesterday"), 400, "yesterday")
        self.assertRefused(self.call("GET", "/api/v1/events?since=nan"), 400, "finite")
        self.assertRefused(self.call("GET", "/api/v1/events?since=1&since=2"), 400, "once")

    def test_index_and_trailing_slash(self) -> None:
        """
        GET / lists the endpoints, and a trailing slash is the same path.
        """
        code, body, _ = self.call("GET", "/")
        self.assertEqual(code, 200)
        self.assertIn("POST /api/v1/catalog/reload", body["endpoints"])
        code, body, _ = self.call("GET", "/api/v1/nodes/")
        self.assertEqual(code, 200)
        self.assertEqual(len(body["nodes"]), 2)

    def test_head(self) -> None:
        """
        HEAD is answered like GET, without a body.
        """
        code, body, headers = self.call("HEAD", "/api/v1/nodes")
        self.assertEqual(code, 200)
        self.assertEqual(body, b"")
        self.assertEqual(headers.getRawHeaders(b"content-type"), [b"application/json; charset=utf-8"])

    def test_unknown_path(self) -> None:
        """
        An unknown path is a JSON 404 naming the path.
        """
        self.assertRefused(self.call("GET", "/api/v1/widgets"), 404, "/api/v1/widgets")
        self.assertRefused(self.call("GET", "/api/v2/nodes"), 404, "/api/v2/nodes")
        self.assertRefused(self.call("POST", "/api/v1/nodes/gpu-1/reboot"), 404)

    def test_wrong_method(self) -> None:
        """
        A method the path does not take is a JSON 405 with an C{Allow}
        header.
        """
        result = self.call("POST", "/api/v1/nodes")
        self.assertRefused(result, 405, "GET")
        self.assertEqual(result[2].getRawHeaders(b"allow"), [b"GET"])
        result = self.call("GET", "/api/v1/nodes/gpu-1/cordon")
        self.assertRefused(result, 405, "POST")
        self.assertEqual(result[2].getRawHeaders(b"allow"), [b"POST"])
        self.assertRefused(self.call("DELETE", "/api/v1/nodes"), 405)
        self.assertEqual(self.fleet.calls, [])


class ActionTests(AdminTestCase):
    def test_cordon_uncordon_drain(self) -> None:
        """
        POST /api/v1/nodes/{id}/cordon|uncordon|drain call the fleet for
        that node and answer what was done; each is logged with the
        requester.
        """
        code, body, _ = self.call("POST", "/api/v1/nodes/gpu-1/cordon")
        self.assertEqual((code, body), (200, {"node": "gpu-1", "action": "cordon", "ok": True}))
        self.assertTrue(self.fleet.node_views["gpu-1"]["cordoned"])
        code, _, _ = self.call("POST", "/api/v1/nodes/gpu-1/uncordon")
        self.assertEqual(code, 200)
        self.assertFalse(self.fleet.node_views["gpu-1"]["cordoned"])
        code, _, _ = self.call("POST", "/api/v1/nodes/gpu-2/drain")
        self.assertEqual(code, 200)
        self.assertEqual(
            self.fleet.calls, [("cordon", "gpu-1"), ("uncordon", "gpu-1"), ("drain", "gpu-2")]
        )
        actions = [e for e in self.logged if e.get("action")]
        self.assertEqual([e["action"] for e in actions], ["cordon", "uncordon", "drain"])
        self.assertEqual(actions[0]["client"], "127.0.0.1:31337")

    def test_unknown_node(self) -> None:
        """
        An action on a node the fleet does not know is the fleet's 404 with
        its reason.
        """
        self.assertRefused(self.call("POST", "/api/v1/nodes/gpu-9/cordon"), 404, "gpu-9")

    def test_malformed_node_id(self) -> None:
        """
        A node id outside the grammar is a 400 before the fleet is asked.
        """
        self.assertRefused(self.call("POST", "/api/v1/nodes/GPU_1/drain"), 400, "GPU_1")
        self.assertEqual(self.fleet.calls, [])

    def test_post_must_be_json(self) -> None:
        """
        A POST without C{Content-Type: application/json} is a 415 and does
        nothing, so a cross-site form cannot drain a node.
        """
        self.assertRefused(self.call("POST", "/api/v1/nodes/gpu-1/drain", headers={}), 415, "application/json")
        self.assertRefused(
            self.call("POST", "/api/v1/nodes/gpu-1/drain",
                      headers={"Content-Type": ["application/x-www-form-urlencoded"]}, raw=b"a=b"),
            415, "x-www-form-urlencoded",
        )
        self.assertEqual(self.fleet.calls, [])
        self.assertFalse(self.fleet.node_views["gpu-1"]["draining"])

    def test_scale(self) -> None:
        """
        POST /api/v1/deployments/{model}/scale with C{{"replicas": N}} sets
        the deployment's desired count.
        """
        code, body, _ = self.call("POST", "/api/v1/deployments/demo/scale", {"replicas": 5})
        self.assertEqual((code, body), (200, {"model": "demo", "replicas": 5, "ok": True}))
        self.assertEqual(self.fleet.deployment_views["demo"]["desired"], 5)
        code, _, _ = self.call("POST", "/api/v1/deployments/demo/scale", {"replicas": 0})
        self.assertEqual(code, 200)
        self.assertEqual(self.fleet.deployment_views["demo"]["desired"], 0)

    def test_scale_model_with_slash(self) -> None:
        """
        A model name holding a slash reaches the fleet whole, escaped
        (C{org%2Fbig}) or not.
        """
        self.assertEqual(model_path("org/big"), "org%2Fbig")
        code, _, _ = self.call("POST", "/api/v1/deployments/org%2Fbig/scale", {"replicas": 3})
        self.assertEqual(code, 200)
        code, _, _ = self.call("POST", "/api/v1/deployments/org/big/scale", {"replicas": 4})
        self.assertEqual(code, 200)
        self.assertEqual(self.fleet.calls, [("scale", "org/big", 3), ("scale", "org/big", 4)])

    def test_retry(self) -> None:
        """
        POST /api/v1/deployments/{model}/retry asks the fleet to place a
        held deployment again (its hold and backoff gone from the view),
        for a model with a slash too, and is logged with who asked.
        """
        self.fleet.deployment_views["demo"].update(
            held={"reason": "unknown argument --bogus", "crash_class": "config", "since": 150.0},
            backoff_until=10_000.0,
        )
        code, body, _ = self.call("POST", "/api/v1/deployments/demo/retry")
        self.assertEqual((code, body), (200, {"model": "demo", "action": "retry", "ok": True}))
        code, body, _ = self.call("GET", "/api/v1/deployments")
        demo = [d for d in body["deployments"] if d["model"] == "demo"][0]
        self.assertIsNone(demo["held"])
        self.assertIsNone(demo["backoff_until"])
        code, _, _ = self.call("POST", "/api/v1/deployments/org%2Fbig/retry", {})
        self.assertEqual(code, 200)
        self.assertEqual(self.fleet.calls, [("retry", "demo"), ("retry", "org/big")])
        lines = [formatEvent(e) for e in self.logged if "retry" in formatEvent(e)]
        self.assertEqual(len(lines), 2)
        self.assertIn("retry demo", lines[0])
        self.assertIn("asked by 127.0.0.1", lines[0])

    def test_models_and_pull(self) -> None:
        """
        GET /api/v1/models answers the fleet's cache view; POST
        /api/v1/deployments/{model}/pull passes the named nodes to the
        fleet and answers with the nodes told; a malformed node list is
        refused before the fleet is asked.
        """
        self.fleet.models = {"models": [{"key": "k", "nodes": []}], "nodes": {}}
        self.assertEqual(self.call("GET", "/api/v1/models")[:2], (200, self.fleet.models))
        node = sorted(self.fleet.node_views)[0]
        code, body, _ = self.call("POST", "/api/v1/deployments/demo/pull", {"nodes": [node]})
        self.assertEqual((code, body), (200, {"model": "demo", "nodes": [node], "ok": True}))
        self.assertRefused(self.call("POST", "/api/v1/deployments/demo/pull", {"nodes": "x"}), 400, "list")
        self.assertRefused(self.call("POST", "/api/v1/deployments/demo/pull", {"force": 1}), 400, "only")
        self.assertEqual(self.fleet.calls, [("pull", "demo", [node])])

    def test_retry_refusals(self) -> None:
        """
        A retry of a model no deployment serves is the fleet's 404; one
        with fields in its body, an empty model or a GET is refused
        before the fleet is asked.
        """
        self.assertRefused(self.call("POST", "/api/v1/deployments/nope/retry"), 404, "nope")
        self.assertRefused(self.call("POST", "/api/v1/deployments/demo/retry", {"force": True}), 400,
                           "no fields")
        self.assertRefused(self.call("POST", "/api/v1/deployments//retry"), 400, "empty")
        self.assertRefused(self.call("GET", "/api/v1/deployments/demo/retry"), 405, "POST")
        self.assertEqual(self.fleet.calls, [("retry", "nope")])

    def test_nodes_show_strays(self) -> None:
        """
        The nodes view lists, per node, the stray processes its agent's
        latest Register reported (kept in the inventory); a node with none
        has an empty list.
        """
        self.agents.inventory.upsert(Node(id="gpu-1", stray_processes=[
            StrayProcess(pid=4242, pgid=4242, shard_id="r0-s0", reason="no record", command="vllm serve")
        ]))
        code, body, _ = self.call("GET", "/api/v1/nodes")
        self.assertEqual(code, 200)
        strays = {n["id"]: n["stray_processes"] for n in body["nodes"]}
        self.assertEqual(strays, {
            "gpu-1": [{"pid": 4242, "pgid": 4242, "shard_id": "r0-s0", "reason": "no record",
                       "command": "vllm serve"}],
            "gpu-2": [],
        })

    def test_scale_unknown_model(self) -> None:
        """
        Scaling a model no deployment serves is the fleet's 404.
        """
        self.assertRefused(
            self.call("POST", "/api/v1/deployments/nope/scale", {"replicas": 1}), 404, "nope"
        )

    def test_scale_bad_bodies(self) -> None:
        """
        A scale body that is not C{{"replicas": N}} with N a whole number
        of at least zero is a 400 saying what is wrong, and the fleet is not
        asked.
        """
        path = "/api/v1/deployments/demo/scale"
        self.assertRefused(self.call("POST", path, {"replicas": -1}), 400, "negative")
        self.assertRefused(self.call("POST", path, {"replicas": True}), 400, "whole number")
        self.assertRefused(self.call("POST", path, {"replicas": 1.5}), 400, "whole number")
        self.assertRefused(self.call("POST", path, {"replicas": "2"}), 400, "whole number")
        self.assertRefused(self.call("POST", path, {}), 400, "missing")
        self.assertRefused(self.call("POST", path, {"replica": 2}), 400, "'replica'")
        self.assertRefused(self.call("POST", path, [2]), 400, "object")
        self.assertRefused(self.call("POST", path, raw=b"{replicas: 2"), 400, "not valid JSON")
        self.assertRefused(self.call("POST", path, raw=b"\xff\xfe"), 400, "not valid JSON")
        self.assertRefused(self.call("POST", "/api/v1/deployments//scale", {"replicas": 1}), 400, "empty")
        self.assertEqual(self.fleet.calls, [])
        refusals = [e for e in self.logged if e.get("status") == 400]
        self.assertTrue(refusals)
        self.assertEqual(refusals[0]["client"], "127.0.0.1:31337")

    def test_body_over_limit(self) -> None:
        """
        A body over the limit is a 413 and does nothing.
        """
        raw = json.dumps({"replicas": 1, "pad": "x" * MAX_BODY}).encode()
        self.assertRefused(self.call("POST", "/api/v1/deployments/demo/scale", raw=raw), 413, str(MAX_BODY))
        self.assertEqual(self.fleet.calls, [])

    def test_reload(self) -> None:
        """
        POST /api/v1/catalog/reload answers the fleet's summary of changes.
        """
        self.fleet.reload_result = {"added": ["new"], "removed": [], "changed": ["demo"]}
        code, body, _ = self.call("POST", "/api/v1/catalog/reload")
        self.assertEqual(code, 200)
        self.assertEqual(body, {"ok": True, "changes": {"added": ["new"], "removed": [], "changed": ["demo"]}})

    def test_reload_refused(self) -> None:
        """
        A catalog the fleet refuses is a 400 carrying its message (which
        names the entry and field).
        """
        self.fleet.reload_result = AdminError("deployments[1].replicas: must be a whole number")
        self.assertRefused(self.call("POST", "/api/v1/catalog/reload"), 400, "deployments[1].replicas")

    def test_asynchronous_answer(self) -> None:
        """
        A fleet method that returns a Deferred is answered when it fires.
        """
        d: Deferred[dict[str, Any]] = Deferred()
        fleet: Any = self.fleet
        fleet.reload_catalog = lambda: d
        response = self.treq.request("POST", BASE + "/api/v1/catalog/reload", headers=JSON)
        self.treq.flush()
        self.assertNoResult(response)
        d.callback({"added": [], "removed": [], "changed": []})
        self.treq.flush()
        self.assertEqual(self.successResultOf(response).code, 200)


class FailureTests(AdminTestCase):
    def test_internal_error_hides_traceback(self) -> None:
        """
        An exception inside the fleet is a 500 whose body holds neither the
        exception nor a traceback; the failure is logged with the
        requester's address.
        """
        def broken() -> list[dict[str, Any]]:
            raise KeyError("secret-internal-detail")

        self.fleet.nodes = broken  # type: ignore[method-assign]
        code, body, _ = self.call("GET", "/api/v1/nodes")
        self.assertEqual(code, 500)
        self.assertEqual(body["status"], 500)
        self.assertNotIn("secret", json.dumps(body))
        self.assertNotIn("Traceback", json.dumps(body))
        failures = [e for e in self.logged if "log_failure" in e]
        self.assertEqual(len(failures), 1)
        self.assertEqual(failures[0]["client"], "127.0.0.1:31337")
        self.assertIsInstance(failures[0]["log_failure"].value, KeyError)

    def test_unencodable_view(self) -> None:
        """
        A view the fleet returns that has no valid JSON form (NaN) is a 500,
        never invalid JSON.
        """
        self.fleet.node_views["gpu-1"]["last_seen"] = float("nan")
        code, body, _ = self.call("GET", "/api/v1/nodes")
        self.assertEqual(code, 500)
        self.assertEqual(body["status"], 500)

    def test_admin_error_with_odd_status(self) -> None:
        """
        An L{AdminError} whose status is not a 4xx is answered as 400.
        """
        err = AdminError("refused")
        err.status = 200
        self.fleet.reload_result = err
        self.assertRefused(self.call("POST", "/api/v1/catalog/reload"), 400, "refused")


class MetricsEndpointTests(AdminTestCase):
    def test_metrics(self) -> None:
        """
        GET /metrics serves the control plane's registry in the Prometheus
        text format, read at the time of the scrape.
        """
        self.agents.registrations["ok"] += 3
        code, body, headers = self.call("GET", "/metrics")
        self.assertEqual(code, 200)
        self.assertTrue(headers.getRawHeaders(b"content-type")[0].startswith(b"text/plain"))
        families = {f.name: f for f in text_string_to_metric_families(body.decode())}
        self.assertEqual(families["llmgw_agents_connected"].samples[0].value, 1)
        regs = {s.labels["outcome"]: s.value for s in families["llmgw_agent_registrations"].samples
                if s.name.endswith("_total")}
        self.assertEqual(regs, {"ok": 3})
        nodes = {s.labels["state"]: s.value for s in families["llmgw_nodes"].samples}
        self.assertEqual(nodes, {"ready": 1, "suspect": 1, "lost": 0})

    def test_openmetrics(self) -> None:
        """
        A scraper that asks for OpenMetrics gets it.
        """
        code, body, headers = self.call(
            "GET", "/metrics", headers={"Accept": ["application/openmetrics-text; version=1.0.0"]}
        )
        self.assertEqual(code, 200)
        self.assertTrue(headers.getRawHeaders(b"content-type")[0].startswith(b"application/openmetrics-text"))
        self.assertTrue(body.endswith(b"# EOF\n"))


def raw_request(site: Any, data: bytes) -> StringTransport:
    """
    Feed C{data} to a fresh connection of C{site}; return its transport.
    """
    proto = site.buildProtocol(None)
    transport = StringTransport()
    proto.makeConnection(transport)
    proto.dataReceived(data)
    return transport


class SiteTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.fleet = sample_fleet()
        self.clock = Clock()
        self.site = admin_site(self.fleet, make_registry(), reactor=self.clock)
        self.site.startFactory()
        self.addCleanup(self.site.stopFactory)

    def test_declared_body_over_limit(self) -> None:
        """
        A request whose body is over the limit is answered 413 and its
        body is not kept.
        """
        body = b"{" + b" " * (MAX_BODY + 10) + b"}"
        head = (
            b"POST /api/v1/deployments/demo/scale HTTP/1.1\r\nHost: 127.0.0.1:7480\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        transport = raw_request(self.site, head + body)
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 413 "), transport.value()[:200])
        self.assertIn(b'"status": 413', transport.value())
        self.assertEqual(self.fleet.calls, [])

    def test_chunked_body_over_limit(self) -> None:
        """
        A chunked body (no declared length) over the limit is a 413 too.
        """
        chunk = b"x" * 8192
        chunks = b"".join(b"%x\r\n" % len(chunk) + chunk + b"\r\n" for _ in range(MAX_BODY // 8192 + 2))
        head = (
            b"POST /api/v1/catalog/reload HTTP/1.1\r\nHost: 127.0.0.1:7480\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        transport = raw_request(self.site, head + chunks + b"0\r\n\r\n")
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 413 "), transport.value()[:200])
        self.assertEqual(self.fleet.calls, [])

    def test_huge_body_aborts(self) -> None:
        """
        Past the abort limit the connection is cut instead of read to the
        end.
        """
        head = (
            b"POST /api/v1/catalog/reload HTTP/1.1\r\nHost: 127.0.0.1:7480\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n"
        )
        proto = self.site.buildProtocol(None)
        transport = StringTransport()
        proto.makeConnection(transport)
        proto.dataReceived(head)
        for _ in range(ABORT_BODY // 65536 + 2):
            proto.dataReceived(b"x" * 65536)
        self.assertTrue(transport.disconnecting)
        self.assertEqual(self.fleet.calls, [])

    def test_host_header_count(self) -> None:
        """
        Two C{Host} headers, or none in HTTP/1.1, are a 400; an HTTP/1.0
        request without one is answered.
        """
        for head in (
            b"GET /api/v1/nodes HTTP/1.1\r\nHost: localhost\r\nHost: evil.example\r\n\r\n",
            b"GET /api/v1/nodes HTTP/1.1\r\n\r\n",
        ):
            transport = raw_request(self.site, head)
            self.assertTrue(transport.value().startswith(b"HTTP/1.1 400 "), transport.value()[:200])
            self.assertIn(b"Host header", transport.value())
        transport = raw_request(self.site, b"GET /api/v1/nodes HTTP/1.0\r\n\r\n")
        self.assertTrue(transport.value().startswith(b"HTTP/1.0 200 "), transport.value()[:200])

    def test_small_request_works(self) -> None:
        """
        Through the site, a request within the limits is answered normally.
        """
        body = b'{"replicas": 3}'
        transport = raw_request(
            self.site,
            b"POST /api/v1/deployments/demo/scale HTTP/1.1\r\nHost: 127.0.0.1:7480\r\n"
            b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
            + b"\r\n\r\n" + body,
        )
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 200 "), transport.value()[:200])
        self.assertEqual(self.fleet.deployment_views["demo"]["desired"], 3)


class SurfaceTests(AdminTestCase):
    def test_foreign_host_is_421(self) -> None:
        """
        A request whose C{Host} is not a name the API serves (a page in the
        operator's browser whose name rebinds to 127.0.0.1) is refused with
        421 before anything is read or changed, naming the option that
        lists names; the refusal is logged with the requester.
        """
        evil = {"Host": ["rebind.evil.example:7480"]}
        self.assertRefused(self.call("GET", "/api/v1/nodes", headers=evil), 421, "--admin-hosts",
                           "'rebind.evil.example:7480'")
        headers = {**evil, **JSON}
        self.assertRefused(self.call("POST", "/api/v1/deployments/demo/scale", {"replicas": 9}, headers=headers),
                           421)
        self.assertRefused(self.call("POST", "/api/v1/nodes/gpu-1/drain", headers=headers), 421)
        self.assertEqual(self.fleet.calls, [])
        self.assertEqual([e["status"] for e in self.logged], [421, 421, 421])
        self.assertEqual(self.logged[0]["client"], "127.0.0.1:31337")

    def test_served_hosts(self) -> None:
        """
        Loopback names with or without a port, and listed names, are
        served.
        """
        for host in ("localhost", "localhost:7480", "127.0.0.1", "[::1]:7480"):
            code, _, _ = self.call("GET", "/api/v1/nodes", headers={"Host": [host]})
            self.assertEqual(code, 200, host)
        self.treq = StubTreq(AdminResource(self.fleet, self.registry, hosts=HostCheck(["admin.example"])))
        code, _, _ = self.call("GET", "/api/v1/nodes", headers={"Host": ["admin.example:7480"]})
        self.assertEqual(code, 200)

    def test_bound_address_served(self) -> None:
        """
        C{admin_service} serves the address it binds (and listed names); a
        wildcard bind serves only loopback, listed names and the names of
        the server certificate (beyond loopback the API needs mutual TLS).
        """
        directory = Path(self.mktemp())
        make_pki(directory, [], server_hosts=["127.0.0.1", "control.example", "*.cp.example", "fd00::5"])
        tls = ServerTLS(server_files(directory))

        def check(host: str, hosts: list[str] | None = None) -> HostCheck:
            svc = admin_service(MemoryReactorClock(), host, 7480, self.fleet, self.registry,
                                tls=tls, hosts=hosts)
            factory: Any = svc.factory
            while not hasattr(factory, "resource"):
                # Beyond loopback: the per-address cap, then TLS, then the site.
                factory = factory.wrappedFactory
            return factory.resource.hosts  # type: ignore[no-any-return]

        self.assertTrue(check("10.0.0.7").allows(b"10.0.0.7:7480"))
        self.assertFalse(check("0.0.0.0").allows(b"10.0.0.7:7480"))
        self.assertTrue(check("0.0.0.0", ["cp.example"]).allows(b"cp.example:7480"))
        # The names in the server certificate are the names clients can
        # verify the API under, so they are served too.
        wildcard = check("0.0.0.0")
        for name in (b"control.example:7480", b"a.cp.example", b"[fd00::5]:7480"):
            self.assertTrue(wildcard.allows(name), name)
        self.assertFalse(wildcard.allows(b"evil.example"))

    def test_deep_json_is_400(self) -> None:
        """
        A body nesting 100,000 levels is a 400 with the reason, not a 500
        and a RecursionError traceback; the fleet is not asked.
        """
        raw = b'{"replicas": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"
        self.assertRefused(self.call("POST", "/api/v1/deployments/demo/scale", raw=raw), 400, "64 levels deep")
        self.assertEqual(self.fleet.calls, [])
        self.assertFalse([e for e in self.logged if "log_failure" in e])

    def test_repeated_key_is_400(self) -> None:
        """
        A body naming a key twice is a 400 naming it: the API would act on
        one value while a proxy or log in front of it read the other.
        """
        raw = b'{"replicas": 1, "replicas": 50}'
        self.assertRefused(self.call("POST", "/api/v1/deployments/demo/scale", raw=raw), 400, "'replicas'",
                           "more than once")
        self.assertEqual(self.fleet.calls, [])

    def test_nan_infinity_and_bom_are_400(self) -> None:
        """
        C{NaN}, C{Infinity} and a leading byte order mark, which Python's
        C{json} would take and JSON has not, are a 400 saying which; the
        fleet is not asked.
        """
        path = "/api/v1/deployments/demo/scale"
        for raw, reason in (
            (b'{"replicas": NaN}', "NaN is not a JSON value"),
            (b'{"replicas": -Infinity}', "-Infinity is not a JSON value"),
            (b'\xef\xbb\xbf{"replicas": 1}', "byte order mark"),
        ):
            self.assertRefused(self.call("POST", path, raw=raw), 400, reason)
        self.assertEqual(self.fleet.calls, [])

    def test_long_client_strings_clipped(self) -> None:
        """
        A 10 KB path, model name, query value, field name or C{Host} comes
        back in an error of about a kilobyte at most (the fleet's own
        messages are cut there) and a log line of under two.
        """
        long = "x" * 10_000
        cases = [
            ("GET", f"/api/v1/{long}", None, None, 404),
            ("POST", f"/api/v1/deployments/{long}/scale", {"replicas": 1}, None, 404),
            ("GET", f"/api/v1/events?since={long}", None, None, 400),
            ("POST", "/api/v1/deployments/demo/scale", {long: 1}, None, 400),
            ("POST", "/api/v1/deployments/demo/scale", {"replicas": long}, None, 400),
            ("GET", "/api/v1/nodes", None, {"Host": [long]}, 421),
        ]
        for method, path, body, headers, status in cases:
            del self.logged[:]
            code, answer, _ = self.call(method, path, body, headers=headers)
            self.assertEqual(code, status, path[:40])
            self.assertLess(len(answer["error"]), 1100, path[:40])
            for event in self.logged:
                self.assertLess(len(formatEvent(event)), 2048)


class ServiceTests(SynchronousTestCase):
    def options(self, *argv: str) -> service.Options:
        opts = service.Options()
        opts.parseOptions(["--insecure", "--agent-listen", "127.0.0.1:0", *argv])
        return opts

    def test_admin_option(self) -> None:
        """
        C{--admin} defaults to 127.0.0.1:7480, takes C{[HOST:]PORT} or
        C{off}, and refuses a malformed address.
        """
        self.assertEqual(self.options()["admin_address"], ("127.0.0.1", 7480))
        self.assertEqual(self.options("--admin", "9000")["admin_address"], ("127.0.0.1", 9000))
        self.assertEqual(self.options("--admin", "[::1]:9000")["admin_address"], ("::1", 9000))
        self.assertIsNone(self.options("--admin", "off")["admin_address"])
        e = self.assertRaises(usage.UsageError, self.options, "--admin", "host:port")
        self.assertIn("--admin", str(e))

    def test_hosts_options(self) -> None:
        """
        C{--admin-hosts} and C{--gateway-hosts} take comma-separated names
        (none by default) and refuse a malformed one; the admin API and the
        embedded gateway serve them.
        """
        opts = self.options()
        self.assertEqual((opts["admin-hosts"], opts["gateway-hosts"]), ([], []))
        opts = self.options("--admin-hosts", "cp.example, .fleet.example", "--gateway-hosts", "gw.example:443")
        self.assertEqual(opts["admin-hosts"], ["cp.example", ".fleet.example"])
        self.assertEqual(opts["gateway-hosts"], ["gw.example:443"])
        e = self.assertRaises(usage.UsageError, self.options, "--gateway-hosts", "http://gw.example")
        self.assertIn("--gateway-hosts", str(e))
        cp = service.makeService(opts, MemoryReactorClock())
        assert cp.admin_listener is not None and cp.gateway is not None
        self.assertTrue(cp.admin_listener.factory.resource.hosts.allows(b"a.fleet.example:7480"))
        self.assertFalse(cp.admin_listener.factory.resource.hosts.allows(b"gw.example:443"))
        self.assertTrue(cp.gateway.gateway.hosts.allows(b"gw.example:443"))
        self.assertFalse(cp.gateway.gateway.hosts.allows(b"cp.example"))

    def plane(self, reactor: Any, fleet: Any = None) -> service.ControlPlane:
        return service.ControlPlane(
            reactor, sink=RecordingSink(), tls=None, agents_host="127.0.0.1", agents_port=0,
            fleet=fleet, admin_address=("127.0.0.1", 7480),
        )

    def test_no_fleet_no_listener(self) -> None:
        """
        Without a fleet the control plane does not serve the admin API, but
        still has its own metrics registry.
        """
        reactor = MemoryReactorClock()
        cp = self.plane(reactor)
        cp.startService()
        self.addCleanup(cp.stopService)
        self.assertIsNone(cp.admin_listener)
        self.assertEqual([p[0] for p in reactor.tcpServers], [0])
        self.assertIsNotNone(cp.registry.get_sample_value("llmgw_agents_connected"))

    def test_fleet_listener(self) -> None:
        """
        With a fleet (given or attached before start) the admin API listens
        on its address, and each control plane's registry is its own.
        """
        reactor = MemoryReactorClock()
        cp = self.plane(reactor, FakeFleet())
        cp.startService()
        self.addCleanup(cp.stopService)
        self.assertEqual(sorted(p[0] for p in reactor.tcpServers), [0, 7480])
        self.assertEqual(reactor.tcpServers[-1][3], "127.0.0.1")

        reactor2 = MemoryReactorClock()
        cp2 = self.plane(reactor2)
        cp2.fleet = FakeFleet()
        cp2.fleet.add_node("gpu-1")
        cp2.startService()
        self.addCleanup(cp2.stopService)
        self.assertIsNotNone(cp2.admin_listener)
        self.assertIsNot(cp.registry, cp2.registry)
        self.assertEqual(cp2.registry.get_sample_value("llmgw_nodes", {"state": "ready"}), 1)
        self.assertEqual(cp.registry.get_sample_value("llmgw_nodes", {"state": "ready"}), 0)

    def test_strays_wired_through(self) -> None:
        """
        In a control plane, the strays the agent service keeps in its
        inventory reach the admin API's nodes view and the
        C{llmgw_node_stray_processes} gauge.
        """
        reactor = MemoryReactorClock()
        fleet = FakeFleet()
        fleet.add_node("gpu-1")
        cp = self.plane(reactor, fleet)
        cp.startService()
        self.addCleanup(cp.stopService)
        cp.agents.inventory.upsert(Node(id="gpu-1", stray_processes=[StrayProcess(pid=77, pgid=70)]))
        self.assertEqual(cp.registry.get_sample_value("llmgw_node_stray_processes", {"node": "gpu-1"}), 1)
        assert cp.admin_listener is not None
        treq: Any = StubTreq(cp.admin_listener.factory.resource)
        d = treq.get(BASE + "/api/v1/nodes")
        treq.flush()
        body = json.loads(self.successResultOf(treq.content(self.successResultOf(d))))
        self.assertEqual([s["pid"] for s in body["nodes"][0]["stray_processes"]], [77])


class FakeControl:
    """
    Answers C{reload_tls()} with whatever the test sets.
    """

    def __init__(self, result: dict[str, Any]) -> None:
        self.result = result
        self.calls = 0

    def reload_tls(self) -> dict[str, Any]:
        self.calls += 1
        return self.result


class TLSReloadTests(AdminTestCase):
    def test_reload(self) -> None:
        """
        POST /api/v1/tls/reload re-reads the control plane's TLS files and
        answers what the reload did.
        """
        control = FakeControl({"ok": True, "closed": ["node-x"]})
        self.treq = StubTreq(AdminResource(self.fleet, self.registry, self.agents, control=control))
        code, body, _ = self.call("POST", "/api/v1/tls/reload")
        self.assertEqual((code, body["closed"]), (200, ["node-x"]))
        self.assertEqual(control.calls, 1)

    def test_reload_refused(self) -> None:
        """
        A refused reload (a bad file) is a 409 with the reason; the running
        files stay.
        """
        control = FakeControl({"ok": False, "error": "server.pem is not a PEM certificate"})
        self.treq = StubTreq(AdminResource(self.fleet, self.registry, self.agents, control=control))
        self.assertRefused(self.call("POST", "/api/v1/tls/reload"), 409, "server.pem")

    def test_get_not_allowed(self) -> None:
        """
        The reload is a POST only.
        """
        control = FakeControl({"ok": True})
        self.treq = StubTreq(AdminResource(self.fleet, self.registry, self.agents, control=control))
        code, _, _ = self.call("GET", "/api/v1/tls/reload")
        self.assertEqual(code, 405)
        self.assertEqual(control.calls, 0)
