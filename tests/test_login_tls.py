"""
Login on a real control plane started with C{--admin-tls}, on loopback
sockets with certificates made by llmgw's CA at test time: a client with
no certificate logs in and reads, a viewer's forged write is refused, a
wrong password is rate-limited, and mutual-TLS tools work as before.
"""

from __future__ import annotations

import json
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

import treq
from twisted.internet import reactor as global_reactor
from twisted.internet import ssl
from twisted.internet.defer import inlineCallbacks
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.iweb import IPolicyForHTTPS
from zope.interface import implementer

from llmgw.control import service as control_service
from llmgw.control.core.users import MIN_LOG_N, USERS_FILE, UserFile, hash_password
from llmgw.testing.pki import make_pki
from llmgw.tlsconf.options import ClientTLSPolicy, TLSFiles

reactor: Any = global_reactor


@implementer(IPolicyForHTTPS)
class BrowserPolicy:
    """
    A browser's TLS: it trusts llmgw's CA (as an operator would have told
    it to) and holds no client certificate.
    """

    def __init__(self, ca_pem: bytes):
        self.root = ssl.Certificate.loadPEM(ca_pem)

    def creatorForNetloc(self, hostname: bytes, port: int) -> Any:  # noqa: N802
        return ssl.optionsForClientTLS(hostname.decode("ascii"), trustRoot=self.root)


class LoginOverTLSTests(TestCase):
    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        self.ca = make_pki(self.dir)
        self.ca.issue_admin("olga", "operator")
        users = UserFile(self.dir / USERS_FILE)
        users.book.add(hash_password("vera", "viewer", "viewer-password", log_n=MIN_LOG_N))
        users.save()
        options = control_service.Options()
        options.parseOptions(["--certs", str(self.dir), "--agent-listen", "127.0.0.1:0",
                              "--admin", "127.0.0.1:0", "--admin-tls",
                              "--gateway", "off"])
        self.control = control_service.makeService(options, reactor)
        self.control.startService()
        self.addCleanup(self.control.stopService)
        self.url = f"https://127.0.0.1:{self.control.admin_listener.address()[1]}"

    def client(self, policy: Any) -> Any:
        pool = HTTPConnectionPool(reactor, persistent=False)
        return treq.client.HTTPClient(Agent(reactor, contextFactory=policy, pool=pool))

    def browser(self) -> Any:
        return self.client(BrowserPolicy((self.dir / "ca.pem").read_bytes()))

    @inlineCallbacks
    def request(self, client: Any, method: str, path: str, body: Any = None,
                headers: dict[str, list[str]] | None = None) -> Any:
        headers = dict(headers or {})
        if method == "POST":
            headers["Content-Type"] = ["application/json"]
        data = json.dumps(body if body is not None else {}).encode() if method == "POST" else None
        d = client.request(method, self.url + path, headers=headers, data=data)
        d.addTimeout(10, reactor)
        response = yield d
        content = yield treq.content(response)
        return response, (json.loads(content) if content.startswith(b"{") else content)

    @inlineCallbacks
    def test_browser_logs_in_reads_and_is_refused_writes(self) -> None:
        """
        A client without a certificate completes the handshake, gets a 401
        from the API and the page, logs in, reads with its cookie, and its
        write as a viewer, CSRF token and all, is a 403.
        """
        browser = self.browser()
        response, body = yield self.request(browser, "GET", "/api/v1/nodes")
        self.assertEqual(response.code, 401)
        response, page = yield self.request(browser, "GET", "/", headers={"Accept": ["text/html"]})
        self.assertEqual(response.code, 200)
        self.assertIn(b"login", page)
        response, body = yield self.request(browser, "POST", "/api/v1/login",
                                            {"user": "vera", "password": "viewer-password"})
        self.assertEqual(response.code, 200, body)
        cookie: SimpleCookie = SimpleCookie()
        cookie.load(response.headers.getRawHeaders(b"set-cookie")[0].decode())
        session = {"Cookie": [f"llmgw_session={cookie['llmgw_session'].value}"]}
        response, nodes = yield self.request(browser, "GET", "/api/v1/nodes", headers=session)
        self.assertEqual(response.code, 200)
        self.assertIn("nodes", nodes)
        response, refused = yield self.request(
            browser, "POST", "/api/v1/nodes/gpu-1/cordon",
            headers={**session, "X-CSRF-Token": [body["csrf"]]})
        self.assertEqual(response.code, 403)
        self.assertIn("role viewer", refused["error"])

    @inlineCallbacks
    def test_wrong_password_rate_limited(self) -> None:
        """
        Five wrong passwords, then the sixth try is a 429 with
        C{Retry-After}, over the real listener.
        """
        browser = self.browser()
        for i in range(5):
            response, _ = yield self.request(browser, "POST", "/api/v1/login",
                                             {"user": "vera", "password": f"wrong-{i}-password"})
            self.assertEqual(response.code, 401)
        response, body = yield self.request(browser, "POST", "/api/v1/login",
                                            {"user": "vera", "password": "viewer-password"})
        self.assertEqual(response.code, 429)
        self.assertTrue(response.headers.getRawHeaders(b"retry-after"))

    @inlineCallbacks
    def test_mutual_tls_tools_unchanged(self) -> None:
        """
        An operator's certificate still works with no session and no CSRF
        token, as every tool has it.
        """
        d = self.dir
        tool = self.client(ClientTLSPolicy(TLSFiles.load(d / "ca.pem", d / "admin-olga.pem", d / "admin-olga.key")))
        response, who = yield self.request(tool, "GET", "/api/v1/whoami")
        self.assertEqual((response.code, who["name"], who["role"]), (200, "olga", "operator"))
        response, body = yield self.request(tool, "POST", "/api/v1/catalog/reload")
        self.assertNotIn(response.code, (401, 403), body)

    @inlineCallbacks
    def test_foreign_certificate_still_fails_the_handshake(self) -> None:
        """
        Asking for a certificate instead of requiring one checks one that
        is offered as before: an admin certificate from another CA fails
        the handshake, and gets no chance to log in.
        """
        other = Path(self.mktemp())
        make_pki(other).issue_admin("mallory", "operator")
        # The client trusts both CAs, so that only the server's verdict counts.
        both = other / "both.pem"
        both.write_bytes((other / "ca.pem").read_bytes() + (self.dir / "ca.pem").read_bytes())
        files = TLSFiles.load(both, other / "admin-mallory.pem", other / "admin-mallory.key")
        with self.assertRaises(Exception):  # noqa: B017 (the handshake is refused)
            yield self.request(self.client(ClientTLSPolicy(files)), "GET", "/api/v1/whoami")
