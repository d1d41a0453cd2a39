"""
C{GET /api/v1/usage}: on the control plane's admin API for its embedded
gateway (with the admin roles over mutual TLS), on a standalone gateway's
metrics listener, and C{llmgw ctl usage} reading it.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import treq
from treq.testing import StubTreq
from twisted.internet import reactor as global_reactor
from twisted.internet.defer import inlineCallbacks
from twisted.internet.task import Clock
from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import Agent, HTTPConnectionPool

from llmgw.control.admin.api import AdminResource
from llmgw.control.admin.site import admin_service
from llmgw.control.shell.metrics import make_registry
from llmgw.ctl.main import build_parser
from llmgw.ctl.usage import cmd_usage
from llmgw.gateway.keys import KeyRing
from llmgw.gateway.service import GatewayService, Options, makeService
from llmgw.gateway.usage import KeyLimits
from llmgw.routing import Route, RoutingSnapshot
from llmgw.testing.fleet import sample_fleet
from llmgw.testing.pki import make_pki
from llmgw.tlsconf.options import ClientTLSPolicy, ServerTLS, TLSFiles, server_files

BASE = "http://127.0.0.1:7480"


def embedded(clock: Clock) -> Any:
    """
    A control plane stand-in holding an embedded gateway (not listening)
    with one limited key, and some usage counted.
    """
    keys = KeyRing({"team-a": "sk-team-a-0001", "batch": "sk-batch-00002"},
                   {"team-a": KeyLimits(requests_per_minute=60, tokens_per_minute=1000)})
    gateway = GatewayService(clock, RoutingSnapshot([Route("r1", "demo", "10.0.0.9:8000")]), port=0, keys=keys)
    usage = gateway.gateway.usage
    meter = usage.admit("team-a", "demo")
    meter.feed(b'{"usage": {"prompt_tokens": 11, "completion_tokens": 22, "total_tokens": 33}}')
    meter.finish(200)
    usage.admit("batch", "demo")
    return SimpleNamespace(gateway=gateway)


class AdminUsageTests(SynchronousTestCase):
    def get(self, resource: AdminResource, path: str = "/api/v1/usage", method: str = "GET") -> tuple[int, Any]:
        stub: Any = StubTreq(resource)
        d = stub.request(method, BASE + path, headers={"Content-Type": ["application/json"]})
        stub.flush()
        response = self.successResultOf(d)
        return response.code, json.loads(self.successResultOf(stub.content(response)))

    def test_embedded_gateway(self) -> None:
        """
        The admin API answers the embedded gateway's counts per key and
        model and the limited keys' limits; it is listed at C{/}.
        """
        clock = Clock()
        clock.advance(1000)
        resource = AdminResource(sample_fleet(), make_registry(), control=embedded(clock))
        code, body = self.get(resource)
        self.assertEqual(code, 200)
        self.assertEqual(body["since"], 1000)
        self.assertEqual(body["usage"], [
            {"key": "batch", "model": "demo", "requests": 1, "prompt_tokens": 0, "completion_tokens": 0,
             "total_tokens": 0, "unreported": 0, "estimated": 0, "limited_requests": 0, "limited_tokens": 0},
            {"key": "team-a", "model": "demo", "requests": 1, "prompt_tokens": 11, "completion_tokens": 22,
             "total_tokens": 33, "unreported": 0, "estimated": 0, "limited_requests": 0, "limited_tokens": 0},
        ])
        self.assertEqual([(lim["key"], lim["requests_available"], lim["tokens_available"]) for lim in body["limits"]],
                         [("team-a", 59, 967)])
        self.assertNotIn("sk-", json.dumps(body))
        _, listing = self.get(resource, "/")
        self.assertIn("GET /api/v1/usage", listing["endpoints"])

    def test_no_gateway(self) -> None:
        """
        A control plane without a gateway answers 404 saying so and where
        a standalone gateway's usage is; a POST is a 405.
        """
        resource = AdminResource(sample_fleet(), make_registry(), control=SimpleNamespace(gateway=None))
        code, body = self.get(resource)
        self.assertEqual(code, 404)
        self.assertIn("runs no gateway", body["error"])
        self.assertIn("--metrics", body["error"])
        code, _ = self.get(AdminResource(sample_fleet(), make_registry(), control=embedded(Clock())),
                           method="POST")
        self.assertEqual(code, 405)

    def test_standalone_gateway(self) -> None:
        """
        A standalone gateway serves its own C{/api/v1/usage} beside
        C{/metrics} on its C{--metrics} address, with its C{--limit-share}.
        """
        d = Path(self.mktemp())
        d.mkdir()
        keys = d / "keys.toml"
        keys.write_text('[keys.team-a]\nkey = "sk-team-a-0001"\nrequests_per_minute = 10\n')
        os.chmod(keys, 0o600)
        o = Options()
        o.parseOptions(["--metrics", "127.0.0.1:0", "--api-keys", str(keys), "--limit-share", "0.5"])
        svc = makeService(o, reactor=Clock())
        svc.front.gateway.usage.admit("team-a", "demo")
        assert svc.metrics_listener is not None
        stub: Any = StubTreq(svc.metrics_listener.factory.resource)
        d2 = stub.get("http://127.0.0.1:7481/api/v1/usage")
        stub.flush()
        body = json.loads(self.successResultOf(stub.content(self.successResultOf(d2))))
        self.assertEqual(body["share"], 0.5)
        self.assertEqual([(u["key"], u["requests"]) for u in body["usage"]], [("team-a", 1)])
        self.assertEqual(body["limits"][0]["requests_per_minute_here"], 5)
        # A name this gateway does not serve (a rebound page's) reads nothing.
        d3 = stub.get("http://rebind.example:7481/api/v1/usage")
        stub.flush()
        refused = self.successResultOf(d3)
        self.assertEqual(refused.code, 421)
        text = self.successResultOf(stub.content(refused))
        self.assertIn(b"rebind.example", text)
        self.assertNotIn(b"team-a", text)
        e = self.assertRaises(usage.UsageError, Options().parseOptions, ["--limit-share", "2"])
        self.assertIn("--limit-share", str(e))


class RoleTests(TestCase):
    """
    The admin API over mutual TLS on 127.0.0.1: who may read the usage.
    """

    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        self.ca = make_pki(self.dir, ["node-a"])
        self.ca.issue_admin("alice", "viewer")
        self.ca.issue_admin("olga", "operator")
        self.ca.issue_admin("gw-1", "gateway")
        self.svc = admin_service(
            global_reactor, "127.0.0.1", 0, sample_fleet(), make_registry(),
            control=embedded(Clock()), tls=ServerTLS(server_files(self.dir)),
        )
        self.svc.startService()
        self.addCleanup(self.svc.stopService)
        self.url = f"https://127.0.0.1:{self.svc.address()[1]}"

    @inlineCallbacks
    def call(self, stem: str) -> Any:
        d = self.dir
        files = TLSFiles.load(d / "ca.pem", d / f"{stem}.pem", d / f"{stem}.key")
        pool = HTTPConnectionPool(global_reactor, persistent=False)
        client = treq.client.HTTPClient(Agent(global_reactor, contextFactory=ClientTLSPolicy(files), pool=pool))
        response = yield client.get(self.url + "/api/v1/usage")
        body = yield treq.content(response)
        return response.code, json.loads(body)

    @inlineCallbacks
    def test_roles(self) -> Any:
        """
        A viewer and an operator read the usage; a gateway's certificate is
        refused (it reads only the routing data it follows).
        """
        for stem in ("admin-alice", "admin-olga"):
            code, body = yield self.call(stem)
            self.assertEqual(code, 200, stem)
            self.assertEqual(len(body["usage"]), 2)
        code, body = yield self.call("admin-gw-1")
        self.assertEqual(code, 403)
        self.assertIn("role gateway", body["error"])


ANSWER = {
    "since": 0,
    "share": 0.5,
    "usage": [
        {"key": "team-a", "model": "demo", "requests": 12, "prompt_tokens": 300, "completion_tokens": 700,
         "total_tokens": 1000, "unreported": 2, "estimated": 4, "limited_requests": 3, "limited_tokens": 1},
        {"key": "batch", "model": "other/\x1b[31mmodel", "requests": 1, "prompt_tokens": 5,
         "completion_tokens": 6, "total_tokens": 11, "unreported": 0, "limited_requests": 0,
         "limited_tokens": 0},
    ],
    "limits": [
        {"key": "team-a", "requests_per_minute": 60, "tokens_per_minute": 100000,
         "requests_per_minute_here": 30, "requests_available": 17,
         "tokens_per_minute_here": 50000, "tokens_available": 49000},
    ],
}


class CtlUsageTests(SynchronousTestCase):
    def run_ctl(self, *argv: str) -> tuple[int, str, str, list[str]]:
        urls: list[str] = []

        def http(method: str, url: str, body: bytes | None, timeout: float) -> tuple[int, bytes]:
            urls.append(f"{method} {url}")
            return 200, json.dumps(ANSWER).encode()

        args = build_parser().parse_args(["ctl", "usage", *argv])
        out, err = io.StringIO(), io.StringIO()
        code = cmd_usage(args, out, err, http)
        return code, out.getvalue(), err.getvalue(), urls

    def test_table(self) -> None:
        """
        C{llmgw ctl usage} prints a row per key and model (requests,
        tokens, answers without usage, streams counted from their chunks,
        429s) and the limits with this
        gateway's share and what is available; control characters from
        names are escaped.
        """
        code, out, _, urls = self.run_ctl("--admin-url", "http://127.0.0.1:7481")
        self.assertEqual(code, 0)
        self.assertEqual(urls, ["GET http://127.0.0.1:7481/api/v1/usage"])
        lines = out.splitlines()
        self.assertIn("this gateway enforces 0.5 of each limit", lines[0])
        self.assertEqual(lines[1].split(), ["KEY", "MODEL", "REQUESTS", "PROMPT", "COMPLETION", "TOTAL",
                                            "UNREPORTED", "ESTIMATED", "429", "(REQ/TOK)"])
        self.assertEqual(lines[2].split(), ["team-a", "demo", "12", "300", "700", "1000", "2", "4", "3/1"])
        self.assertNotIn("\x1b", out)
        self.assertIn("\\x1b[31mmodel", lines[3])
        limits = [line for line in lines if line.startswith("team-a") and "here" in line]
        self.assertEqual(limits[0].split(), ["team-a", "60", "(30", "here)", "17", "100000", "(50000", "here)",
                                             "49000"])

    def test_json_and_filters(self) -> None:
        """
        C{--json} prints the API's answer; C{--key} and C{--model} keep
        only the matching rows.
        """
        code, out, _, _ = self.run_ctl("--json")
        self.assertEqual((code, json.loads(out)), (0, ANSWER))
        code, out, _, _ = self.run_ctl("--json", "--key", "batch")
        body = json.loads(out)
        self.assertEqual([u["key"] for u in body["usage"]], ["batch"])
        self.assertEqual(body["limits"], [])
        code, out, _, _ = self.run_ctl("--model", "demo")
        self.assertIn("team-a", out)
        self.assertNotIn("batch", out)


class ControlPlaneTests(SynchronousTestCase):
    def test_embedded_wiring(self) -> None:
        """
        A control plane made from its options serves its embedded
        gateway's usage on its admin API, with the keys file's limits and
        C{--limit-share}.
        """
        from twisted.internet.testing import MemoryReactorClock

        from llmgw.control.service import Options as ControlOptions
        from llmgw.control.service import makeService as control_service

        d = Path(self.mktemp())
        d.mkdir()
        keys = d / "keys.toml"
        keys.write_text('[keys.team-a]\nkey = "sk-team-a-0001"\ntokens_per_minute = 1000\n')
        os.chmod(keys, 0o600)
        o = ControlOptions()
        o.parseOptions(["--insecure", "--agent-listen", "127.0.0.1:0", "--api-keys", str(keys),
                        "--limit-share", "0.25"])
        cp = control_service(o, reactor=MemoryReactorClock())
        assert cp.admin_listener is not None and cp.gateway is not None
        cp.gateway.gateway.usage.admit("team-a", "demo")
        stub: Any = StubTreq(cp.admin_listener.factory.resource)
        d2 = stub.get(BASE + "/api/v1/usage")
        stub.flush()
        body = json.loads(self.successResultOf(stub.content(self.successResultOf(d2))))
        self.assertEqual([(u["key"], u["requests"]) for u in body["usage"]], [("team-a", 1)])
        self.assertEqual((body["share"], body["limits"][0]["tokens_per_minute_here"]), (0.25, 250))
