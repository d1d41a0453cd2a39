"""
Mutual TLS on a member that does not lead: it checks the
client's certificate and role itself, with the same rules as the leader,
before it sends the client on, so a redirect never widens access.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import treq
from twisted.internet import reactor as global_reactor
from twisted.internet.defer import inlineCallbacks
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, HTTPConnectionPool

from llmgw.control.admin.site import admin_service
from llmgw.control.shell.metrics import make_registry
from llmgw.testing.fleet import sample_fleet
from llmgw.testing.pki import make_pki
from llmgw.tlsconf.options import ClientTLSPolicy, ServerTLS, TLSFiles, server_files
from tests.test_admin_ha import FakeControl, FakeHA

reactor: Any = global_reactor
LEADER = "https://cp-2.example:7480"


class FollowerMutualTLSTests(TestCase):
    timeout = 30

    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        self.ca = make_pki(self.dir, ["node-a"])
        self.ca.issue_admin("alice", "viewer")
        self.ca.issue_admin("olga", "operator")
        self.ca.issue_admin("gw-1", "gateway")
        self.fleet = sample_fleet()
        self.svc = admin_service(reactor, "127.0.0.1", 0, self.fleet, make_registry(),
                                 control=FakeControl(FakeHA(leader_admin_url=LEADER)),
                                 tls=ServerTLS(server_files(self.dir)))
        self.svc.startService()
        self.addCleanup(self.svc.stopService)
        self.url = f"https://127.0.0.1:{self.svc.address()[1]}"

    @inlineCallbacks
    def call(self, stem: str, method: str, path: str) -> Any:
        d = self.dir
        files = TLSFiles.load(d / "ca.pem", d / f"{stem}.pem", d / f"{stem}.key")
        pool = HTTPConnectionPool(reactor, persistent=False)
        client = treq.client.HTTPClient(Agent(reactor, contextFactory=ClientTLSPolicy(files), pool=pool))
        headers = {"Content-Type": ["application/json"]} if method == "POST" else {}
        response = yield client.request(method, self.url + path, headers=headers,
                                        data=b"{}" if method == "POST" else None, allow_redirects=False)
        body = yield treq.content(response)
        return response.code, json.loads(body), response.headers.getRawHeaders(b"location")

    @inlineCallbacks
    def test_roles_checked_before_redirect(self) -> None:
        """
        A viewer's cordon and a gateway's read of nodes are refused (403) by
        the follower itself; an operator's cordon and a gateway's read of
        the routes are redirected to the leader; the follower changes
        nothing.
        """
        code, body, location = yield self.call("admin-alice", "POST", "/api/v1/nodes/gpu-1/cordon")
        self.assertEqual((code, location), (403, None))
        self.assertIn("role viewer", body["error"])
        code, body, location = yield self.call("admin-gw-1", "GET", "/api/v1/nodes")
        self.assertEqual((code, location), (403, None))
        code, body, location = yield self.call("admin-olga", "POST", "/api/v1/nodes/gpu-1/cordon")
        self.assertEqual((code, location), (307, [f"{LEADER}/api/v1/nodes/gpu-1/cordon".encode()]))
        code, body, location = yield self.call("admin-gw-1", "GET", "/api/v1/routes?since=4")
        self.assertEqual((code, location), (307, [f"{LEADER}/api/v1/routes?since=4".encode()]))
        code, body, location = yield self.call("admin-alice", "GET", "/api/v1/status")
        self.assertEqual((code, body["role"]), (200, "follower"))
        self.assertEqual(self.fleet.calls, [])
