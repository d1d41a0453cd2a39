"""
The fleet page's files on the admin API, and C{/api/v1/whoami}, in memory
(the page in a real browser: L{tests.test_page_browser}).
"""

from __future__ import annotations

import json
from typing import Any

from treq.testing import StubTreq
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.admin.api import AdminResource
from llmgw.control.shell.metrics import make_registry
from llmgw.testing.fleet import sample_fleet

BASE = "http://127.0.0.1:7480"


class PageTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.treq: Any = StubTreq(AdminResource(sample_fleet(), make_registry()))

    def get(self, path: str, accept: str | None = None) -> tuple[int, Any, bytes]:
        d = self.treq.get(BASE + path, headers={"Accept": [accept]} if accept else {})
        self.treq.flush()
        response = self.successResultOf(d)
        return response.code, response.headers, self.successResultOf(self.treq.content(response))

    def test_browser_gets_the_page(self) -> None:
        """
        GET / from a browser (Accept: text/html) is the page, with a
        Content-Security-Policy that lets it load only its own files and
        talk only to this API; any other client still gets the endpoint
        list.
        """
        code, headers, body = self.get("/", "text/html,application/xhtml+xml")
        self.assertEqual(code, 200)
        self.assertIn(b"<title>llmgw fleet</title>", body)
        self.assertIn(b"text/html", headers.getRawHeaders(b"content-type")[0])
        csp = headers.getRawHeaders(b"content-security-policy")[0]
        self.assertIn(b"script-src 'self'", csp)
        self.assertIn(b"connect-src 'self'", csp)
        code, _, body = self.get("/")
        self.assertIn("GET /api/v1/watch?since=REVISION&epoch=EPOCH&only=routes (WebSocket)",
                      json.loads(body)["endpoints"])

    def test_files(self) -> None:
        """
        The script and the style sheet come from the package with their
        types; any other name is a 404.
        """
        code, headers, body = self.get("/page/page.js")
        self.assertEqual(code, 200)
        self.assertIn(b"javascript", headers.getRawHeaders(b"content-type")[0])
        self.assertIn(b"/api/v1/watch", body)
        code, headers, _ = self.get("/page/page.css")
        self.assertIn(b"text/css", headers.getRawHeaders(b"content-type")[0])
        code, _, body = self.get("/page/../admin.py")
        self.assertEqual(code, 404)
        code, _, _ = self.get("/page/nope.js")
        self.assertEqual(code, 404)

    def test_whoami_on_loopback(self) -> None:
        """
        Without TLS (loopback only) the requester counts as an operator.
        """
        code, _, body = self.get("/api/v1/whoami")
        self.assertEqual(json.loads(body), {"name": None, "role": "operator", "tls": False})
