"""
The admin API over mutual TLS with roles, on real
loopback sockets with certificates made by llmgw's CA at test time: who may
read, who may change state, what is refused and how it is logged; and the
two clients, C{llmgw ctl} (blocking, in a thread) and the standalone
gateway's follower.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

import treq
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from twisted.internet import reactor as global_reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.threads import deferToThread
from twisted.logger import Logger, formatEvent
from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import Agent, HTTPConnectionPool

from llmgw.control import service as control_service
from llmgw.control.admin.api import AdminResource
from llmgw.control.admin.auth import role_allows
from llmgw.control.admin.site import AdminChannel, AdminTLSRequired, admin_service
from llmgw.control.shell.metrics import make_registry
from llmgw.ctl import fleet as ctl_fleet
from llmgw.ctl.main import build_parser
from llmgw.gateway import service as gateway_service
from llmgw.gateway.follower import FollowerTable
from llmgw.testing.fleet import sample_fleet
from llmgw.testing.pki import issue_raw, make_pki
from llmgw.tlsconf.options import ClientTLSPolicy, ServerTLS, TLSFiles, admin_files, server_files
from llmgw.tlsconf.roles import ADMIN_ROLE_OIDS

reactor: Any = global_reactor

KEY_AGREEMENT_ONLY = x509.KeyUsage(
    digital_signature=False, content_commitment=False, key_encipherment=False,
    data_encipherment=False, key_agreement=True, key_cert_sign=False,
    crl_sign=False, encipher_only=False, decipher_only=False,
)


class RoleTableTests(SynchronousTestCase):
    def test_roles(self) -> None:
        """
        Viewers read everything and change nothing; operators do both;
        the gateway role reads only the routing data a gateway follows.
        """
        nodes = ["api", "v1", "nodes"]
        cordon = ["api", "v1", "nodes", "gpu-1", "cordon"]
        self.assertTrue(role_allows("viewer", "GET", nodes))
        self.assertFalse(role_allows("viewer", "POST", cordon))
        self.assertTrue(role_allows("operator", "POST", cordon))
        self.assertTrue(role_allows("operator", "GET", ["metrics"]))
        self.assertTrue(role_allows("gateway", "GET", ["api", "v1", "routes"]))
        self.assertFalse(role_allows("gateway", "GET", ["api", "v1", "replicas"]))
        self.assertFalse(role_allows("gateway", "GET", nodes))
        self.assertFalse(role_allows("gateway", "GET", ["api", "v1", "events"]))
        self.assertFalse(role_allows("gateway", "POST", ["api", "v1", "catalog", "reload"]))
        self.assertFalse(role_allows("nobody", "GET", nodes))


class ListenRefusalTests(SynchronousTestCase):
    def test_beyond_loopback_without_tls_refused(self) -> None:
        """
        The admin API refuses to listen beyond loopback without mutual TLS,
        in one line; on loopback it may.
        """
        with self.assertRaises(AdminTLSRequired) as caught:
            admin_service(reactor, "0.0.0.0", 0, sample_fleet(), make_registry())
        self.assertIn("--admin-tls", str(caught.exception))
        self.assertNotIn("\n", str(caught.exception))
        admin_service(reactor, "127.0.0.1", 0, sample_fleet(), make_registry())

    def test_control_options(self) -> None:
        """
        C{--admin} beyond loopback turns admin TLS on; with C{--insecure}
        (no certificates) it is refused at start; C{--admin-tls} asks for it
        on loopback too.
        """
        d = Path(self.mktemp())
        make_pki(d)
        o = control_service.Options()
        o.parseOptions(["--certs", str(d), "--agent-listen", "127.0.0.1:0", "--admin", "0.0.0.0:0"])
        self.assertTrue(o["admin_tls"])
        o = control_service.Options()
        o.parseOptions(["--certs", str(d), "--agent-listen", "127.0.0.1:0"])
        self.assertFalse(o["admin_tls"])
        o = control_service.Options()
        o.parseOptions(["--certs", str(d), "--agent-listen", "127.0.0.1:0", "--admin-tls"])
        self.assertTrue(o["admin_tls"])
        o = control_service.Options()
        with self.assertRaises(usage.UsageError) as caught:
            o.parseOptions(["--insecure", "--agent-listen", "127.0.0.1:0", "--admin", "0.0.0.0:7480"])
        self.assertIn("beyond loopback", str(caught.exception))

    def test_gateway_options(self) -> None:
        """
        A standalone gateway told to follow an https:// admin API needs its
        own certificate, and loads it at start.
        """
        d = Path(self.mktemp())
        ca = make_pki(d)
        ca.issue_admin("gw-1", "gateway")
        o = gateway_service.Options()
        with self.assertRaises(usage.UsageError) as caught:
            o.parseOptions(["--admin-url", "https://127.0.0.1:7480"])
        self.assertIn("--certs DIR and --as NAME", str(caught.exception))
        o = gateway_service.Options()
        o.parseOptions(["--admin-url", "https://127.0.0.1:7480", "--certs", str(d), "--as", "gw-1"])
        self.assertIsInstance(o["admin_tls"], ClientTLSPolicy)
        o = gateway_service.Options()
        with self.assertRaises(usage.UsageError) as caught:
            o.parseOptions(["--admin-url", "https://127.0.0.1:7480", "--certs", str(d), "--as", "nobody"])
        self.assertIn("admin-nobody", str(caught.exception))


class MutualTLSTests(TestCase):
    """
    A real admin listener on 127.0.0.1 with the control plane's
    certificates, and clients with various certificates.
    """

    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        self.ca = make_pki(self.dir, ["node-a"])
        self.ca.issue_admin("alice", "viewer")
        self.ca.issue_admin("olga", "operator")
        self.ca.issue_admin("gw-1", "gateway")
        self.fleet = sample_fleet()
        self.logged: list[dict[str, Any]] = []
        self.patch(AdminResource, "log", Logger(observer=self.logged.append))  # type: ignore[arg-type]
        self.tls = ServerTLS(server_files(self.dir))
        self.svc = admin_service(
            reactor, "127.0.0.1", 0, self.fleet, make_registry(), tls=self.tls
        )
        self.svc.startService()
        self.addCleanup(self.svc.stopService)
        self.url = f"https://127.0.0.1:{self.svc.address()[1]}"

    def files(self, stem: str) -> TLSFiles:
        d = self.dir
        return TLSFiles.load(d / "ca.pem", d / f"{stem}.pem", d / f"{stem}.key")

    @inlineCallbacks
    def call(self, stem: str, method: str, path: str) -> Any:
        pool = HTTPConnectionPool(reactor, persistent=False)
        agent = Agent(reactor, contextFactory=ClientTLSPolicy(self.files(stem)), pool=pool)
        client = treq.client.HTTPClient(agent)
        headers = {"Content-Type": ["application/json"]} if method == "POST" else {}
        response = yield client.request(method, self.url + path, headers=headers,
                                        data=b"{}" if method == "POST" else None)
        body = yield treq.content(response)
        return response.code, json.loads(body) if body.startswith(b"{") else body

    def messages(self) -> list[str]:
        return [formatEvent(e) for e in self.logged]

    @inlineCallbacks
    def test_viewer_reads_but_cannot_change(self) -> None:
        """
        A viewer certificate reads nodes; its cordon is a 403 that names the
        role, reaches nothing, and is logged with the certificate's name.
        """
        code, body = yield self.call("admin-alice", "GET", "/api/v1/nodes")
        self.assertEqual(code, 200)
        self.assertEqual([n["id"] for n in body["nodes"]], ["gpu-1", "gpu-2"])
        code, body = yield self.call("admin-alice", "POST", "/api/v1/nodes/gpu-1/cordon")
        self.assertEqual(code, 403)
        self.assertIn("role viewer", body["error"])
        self.assertEqual(self.fleet.calls, [])
        self.assertTrue(any("admin alice (viewer)" in m and "403" in m for m in self.messages()))

    @inlineCallbacks
    def test_operator_changes_state_logged_with_name(self) -> None:
        """
        An operator certificate cordons and scales; each change is logged
        with the certificate's name and role.
        """
        code, body = yield self.call("admin-olga", "POST", "/api/v1/nodes/gpu-1/cordon")
        self.assertEqual((code, body["ok"]), (200, True))
        self.assertIn(("cordon", "gpu-1"), self.fleet.calls)
        changes = [m for m in self.messages() if "cordon gpu-1" in m]
        self.assertEqual(len(changes), 1)
        self.assertIn("admin olga (operator) at 127.0.0.1:", changes[0])

    @inlineCallbacks
    def test_pull_needs_operator(self) -> None:
        """
        Staging a model's weights is a change: a viewer's pull is a 403 and
        reaches nothing; an operator's is done.
        """
        code, body = yield self.call("admin-alice", "POST", "/api/v1/deployments/demo/pull")
        self.assertEqual(code, 403)
        self.assertIn("role viewer", body["error"])
        self.assertEqual(self.fleet.calls, [])
        code, body = yield self.call("admin-olga", "POST", "/api/v1/deployments/demo/pull")
        self.assertEqual((code, body["ok"]), (200, True))

    @inlineCallbacks
    def test_retry_needs_operator(self) -> None:
        """
        Retrying a held deployment is a change: a viewer is refused (403,
        nothing reaches the fleet), an operator's retry is done and logged
        with the certificate's name and role.
        """
        self.fleet.deployment_views["demo"]["held"] = {"reason": "bad flag", "crash_class": "config",
                                                       "since": 1.0}
        code, body = yield self.call("admin-alice", "POST", "/api/v1/deployments/demo/retry")
        self.assertEqual(code, 403)
        self.assertIn("role viewer", body["error"])
        self.assertEqual(self.fleet.calls, [])
        code, body = yield self.call("admin-olga", "POST", "/api/v1/deployments/demo/retry")
        self.assertEqual((code, body["ok"]), (200, True))
        self.assertIsNone(self.fleet.deployment_views["demo"]["held"])
        changes = [m for m in self.messages() if "retry demo" in m]
        self.assertEqual(len(changes), 1)
        self.assertIn("admin olga (operator) at 127.0.0.1:", changes[0])

    @inlineCallbacks
    def test_gateway_role_reads_routes_only(self) -> None:
        """
        The gateway role reads the routing table a gateway follows and is
        refused the fleet's other views and every change.
        """
        code, body = yield self.call("admin-gw-1", "GET", "/api/v1/routes")
        self.assertEqual(code, 200)
        self.assertEqual([r["replica"] for r in body["routes"]], ["r1"])
        code, _ = yield self.call("admin-gw-1", "GET", "/api/v1/replicas")
        self.assertEqual(code, 403)
        code, body = yield self.call("admin-gw-1", "GET", "/api/v1/nodes")
        self.assertEqual(code, 403)
        self.assertIn("role gateway", body["error"])
        code, _ = yield self.call("admin-gw-1", "POST", "/api/v1/catalog/reload")
        self.assertEqual(code, 403)

    @inlineCallbacks
    def test_node_and_server_certificates_refused(self) -> None:
        """
        A node's certificate is from the same CA and passes the handshake,
        but is no admin certificate: 403 saying so, logged with the
        certificate's name. The control plane's own certificate (serverAuth
        only) does not even pass the handshake as a client.
        """
        code, body = yield self.call("agent-node-a", "GET", "/api/v1/nodes")
        self.assertEqual(code, 403)
        self.assertIn("node certificate", body["error"])
        self.assertTrue(any("certificate node-a" in m and "403" in m for m in self.messages()))
        logged: Deferred[str] = Deferred()

        def observe(event: dict[str, Any]) -> None:
            if not logged.called:
                logged.callback(formatEvent(event))

        self.patch(AdminChannel, "log", Logger(observer=observe))  # type: ignore[arg-type]
        with self.assertRaises(Exception):  # noqa: B017 (the handshake is refused)
            yield self.call("server", "GET", "/api/v1/nodes")
        self.assertEqual(self.fleet.calls, [])
        logged.addTimeout(10, reactor)
        line = yield logged
        self.assertIn("TLS handshake from 127.0.0.1:", line)

    @inlineCallbacks
    def test_key_agreement_only_admin_certificate_refused(self) -> None:
        """
        A certificate with the operator role whose key usage is keyAgreement
        alone is refused as an identity: its key may not sign.
        """
        issue_raw(self.ca, "admin-ka", "ka", usage=ExtendedKeyUsageOID.CLIENT_AUTH,
                  key_usage=KEY_AGREEMENT_ONLY, extra_usages=[ADMIN_ROLE_OIDS["operator"]])
        code, body = yield self.call("admin-ka", "POST", "/api/v1/nodes/gpu-1/cordon")
        self.assertEqual(code, 403)
        self.assertIn("digitalSignature", body["error"])
        self.assertEqual(self.fleet.calls, [])

    @inlineCallbacks
    def test_no_client_certificate_fails_handshake(self) -> None:
        """
        A client without a certificate gets no answer at all: the handshake
        requires one.
        """
        pool = HTTPConnectionPool(reactor, persistent=False)
        agent = Agent(reactor, pool=pool)
        client = treq.client.HTTPClient(agent)
        d = client.get(self.url + "/api/v1/nodes")
        d.addTimeout(10, reactor)
        with self.assertRaises(Exception):  # noqa: B017 (a TLS or connection error)
            yield d
        self.assertEqual(self.fleet.calls, [])

    def ctl(self, *argv: str) -> Any:
        """
        Run C{llmgw ctl ARGV} in a thread (it blocks); fires with
        (exit code, stdout, stderr).
        """
        args = build_parser().parse_args(["ctl", *argv])
        out, err = io.StringIO(), io.StringIO()

        def run() -> tuple[int, str, str]:
            return int(args.func(args, out=out, err=err)), out.getvalue(), err.getvalue()

        return deferToThread(run)

    @inlineCallbacks
    def test_ctl_over_mutual_tls(self) -> None:
        """
        C{llmgw ctl --admin https://... --certs DIR --as NAME} reads as a
        viewer, is refused a cordon (exit 1, the reason printed), and
        cordons as an operator.
        """
        base = ["--admin", self.url, "--certs", str(self.dir)]
        code, out, err = yield self.ctl("nodes", *base, "--as", "alice")
        self.assertEqual(code, 0, err)
        self.assertIn("gpu-1", out)
        code, out, err = yield self.ctl("cordon", "gpu-1", *base, "--as", "alice")
        self.assertEqual(code, 1)
        self.assertIn("role viewer", err)
        code, out, err = yield self.ctl("cordon", "gpu-1", *base, "--as", "olga")
        self.assertEqual(code, 0, err)
        self.assertIn(("cordon", "gpu-1"), self.fleet.calls)

    @inlineCallbacks
    def test_ctl_reload_tls_as_operator(self) -> None:
        """
        C{llmgw ctl reload --tls} asks the control plane to re-read its TLS
        files; a viewer is refused, an operator gets the result.
        """
        calls: list[str] = []

        class Control:
            def reload_tls(self) -> dict[str, Any]:
                calls.append("reload")
                return {"ok": True, "error": None, "closed": [], "server_serial": "ab",
                        "crl_number": None}

        svc = admin_service(reactor, "127.0.0.1", 0, self.fleet, make_registry(),
                            control=Control(), tls=self.tls)
        svc.startService()
        self.addCleanup(svc.stopService)
        base = ["--admin", f"https://127.0.0.1:{svc.address()[1]}", "--certs", str(self.dir)]
        code, _, err = yield self.ctl("reload", "--tls", *base, "--as", "alice")
        self.assertEqual(code, 1)
        self.assertEqual(calls, [])
        code, out, err = yield self.ctl("reload", "--tls", *base, "--as", "olga")
        self.assertEqual(code, 0, err)
        self.assertIn("server certificate serial ab", out)
        self.assertEqual(calls, ["reload"])

    @inlineCallbacks
    def test_revoked_admin_refused(self) -> None:
        """
        C{llmgw ctl cert revoke --admin NAME} and a TLS reload shut that
        admin out: a connection it kept alive gets 403, a new one fails the
        handshake; other admins carry on.
        """
        # A kept-alive connection opened before the revocation.
        pool = HTTPConnectionPool(reactor, persistent=True)
        self.addCleanup(pool.closeCachedConnections)
        agent = Agent(reactor, contextFactory=ClientTLSPolicy(self.files("admin-olga")), pool=pool)
        kept = treq.client.HTTPClient(agent)
        response = yield kept.get(self.url + "/api/v1/nodes")
        yield treq.content(response)
        self.assertEqual(response.code, 200)
        code, out, err = yield self.ctl("cert", "revoke", "--admin", "olga", "--certs", str(self.dir))
        self.assertEqual(code, 0, err)
        self.assertIn("CN=olga", out)
        self.tls.reload(server_files(self.dir))
        response = yield kept.post(self.url + "/api/v1/nodes/gpu-1/cordon",
                                   headers={"Content-Type": ["application/json"]}, data=b"{}")
        body = yield treq.json_content(response)
        self.assertEqual(response.code, 403)
        self.assertIn("revoked", body["error"])
        with self.assertRaises(Exception):  # noqa: B017 (certificate revoked)
            yield self.call("admin-olga", "POST", "/api/v1/nodes/gpu-1/cordon")
        self.assertEqual(self.fleet.calls, [])
        code, _ = yield self.call("admin-alice", "GET", "/api/v1/nodes")
        self.assertEqual(code, 200)

    @inlineCallbacks
    def test_ctl_https_needs_a_certificate(self) -> None:
        """
        An https:// admin URL without --certs/--as, or naming a certificate
        that is not there, is a usage error (exit 2) before anything is sent.
        """
        code, _, err = yield self.ctl("nodes", "--admin-url", self.url)
        self.assertEqual(code, ctl_fleet.EXIT_USAGE)
        self.assertIn("--certs DIR and --as NAME", err)
        code, _, err = yield self.ctl("nodes", "--admin", self.url, "--certs", str(self.dir),
                                      "--as", "nobody")
        self.assertEqual(code, ctl_fleet.EXIT_USAGE)
        self.assertIn("admin-nobody.pem", err)

    @inlineCallbacks
    def test_ctl_refuses_server_without_the_dialled_name(self) -> None:
        """
        A control plane whose certificate does not name the host in the URL
        is refused by ctl (exit 3), saying how to add the name.
        """
        port = self.svc.address()[1]
        self.ca.issue_server(["cp.example"])
        self.tls.reload(server_files(self.dir))
        code, _, err = yield self.ctl("nodes", "--admin-url", f"https://127.0.0.1:{port}",
                                      "--certs", str(self.dir), "--as", "alice")
        self.assertEqual(code, ctl_fleet.EXIT_UNREACHABLE)
        self.assertIn("--host HOST --renew", err)

    @inlineCallbacks
    def test_gateway_follows_with_its_certificate(self) -> None:
        """
        A standalone gateway's routing table polls the mTLS admin API with
        its gateway certificate and loads the routes; with a node's
        certificate instead it keeps failing (403) and loads nothing.
        """
        table = FollowerTable(reactor, self.url, tls=ClientTLSPolicy(admin_files(self.dir, "gw-1")))
        self.addCleanup(table.close)
        yield table.poll()
        self.assertTrue(table.loaded)
        self.assertEqual([r.replica_id for r in table.routes("demo")], ["r1"])
        refused = FollowerTable(reactor, self.url, tls=ClientTLSPolicy(self.files("agent-node-a")))
        self.addCleanup(refused.close)
        yield refused.poll()
        self.assertFalse(refused.loaded)
        self.assertEqual(refused.failures_in_a_row, 1)


class CtlEnvironmentTests(SynchronousTestCase):
    def test_environment_variables(self) -> None:
        """
        C{LLMGW_ADMIN_URL}, C{LLMGW_ADMIN_CERTS} and C{LLMGW_ADMIN_AS} are
        the defaults of C{--admin}, C{--certs} and C{--as}.
        """
        self.patch(ctl_fleet.os, "environ", {
            "LLMGW_ADMIN_URL": "https://cp.example:7480",
            "LLMGW_ADMIN_CERTS": "/etc/llmgw/admin",
            "LLMGW_ADMIN_AS": "olga",
        })
        args = build_parser().parse_args(["ctl", "nodes"])
        self.assertIsInstance(args, argparse.Namespace)
        self.assertEqual(
            (args.admin, args.certs, args.as_name),
            ("https://cp.example:7480", "/etc/llmgw/admin", "olga"),
        )
