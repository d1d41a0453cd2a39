"""
Tests for the admin API's resource tree (L{llmgw.control.admin.api}): what
the walk down the segments adds to the routes that tests/test_admin.py
pins: unknown segments at every depth, methods a resource does not take,
model names whose slashes span segments, and the root rendered whole.
"""

from __future__ import annotations

from typing import Any

from twisted.web.resource import getChildForRequest
from twisted.web.server import NOT_DONE_YET
from twisted.web.test.requesthelper import DummyRequest

from llmgw.control.admin.actions import NodeAction, Scale
from llmgw.control.admin.api import AdminResource
from llmgw.control.admin.base import NotFound
from llmgw.control.admin.fleet import Nodes
from tests.test_admin import AdminTestCase


class UnknownTests(AdminTestCase):
    def test_unknown_segments_at_every_depth(self) -> None:
        """
        A path below no endpoint is a 404 with the JSON error shape and the
        whole path named, whatever the method and however deep it goes.
        """
        for path in ("/nope", "/api", "/api/v1", "/api/v2/status", "/api/v1/nope", "/api/v1/status/x",
                     "/api/v1/nodes/gpu-1", "/api/v1/nodes/gpu-1/nope", "/api/v1/nodes/gpu-1/cordon/x",
                     "/api/v1/catalog/nope", "/api/v1/tls", "/metrics/x", "/api/v1//nodes"):
            for method in ("GET", "POST"):
                self.assertRefused(self.call(method, path, {}), 404, f"no such endpoint: {path!r}")

    def test_wrong_method(self) -> None:
        """
        A method the resource does not take is a 405 that names the path and
        the method (quoted, as client strings in errors are), with C{Allow};
        the fleet is not asked.
        """
        for method, path, allowed in (("POST", "/api/v1/nodes", "GET"), ("GET", "/api/v1/nodes/gpu-1/drain", "POST"),
                                      ("PUT", "/api/v1/status", "GET"), ("DELETE", "/api/v1/catalog/reload", "POST"),
                                      ("POST", "/", "GET"), ("POST", "/page/page.js", "GET")):
            code, body, headers = self.call(method, path, {})
            self.assertEqual((code, body["status"]), (405, 405), path)
            self.assertEqual(body["error"], f"{path!r} takes {allowed}, not {method!r}")
            self.assertEqual(headers.getRawHeaders(b"allow"), [allowed.encode()])
        self.assertEqual(self.fleet.calls, [])

    def test_tls_reload_needs_a_control_plane(self) -> None:
        """
        Without a control plane to reload, C{/api/v1/tls/reload} is no
        endpoint: a 404 for any method.
        """
        self.assertRefused(self.call("POST", "/api/v1/tls/reload", {}), 404, "no such endpoint")
        self.assertRefused(self.call("GET", "/api/v1/tls/reload"), 404, "no such endpoint")


class WalkTests(AdminTestCase):
    def walk(self, path: bytes) -> Any:
        request = DummyRequest(path.split(b"/")[1:])
        return getChildForRequest(self.resource, request)

    def test_one_resource_a_segment(self) -> None:
        """
        The walk finds one resource a segment: a node's action below the
        node below C{nodes}; a segment past an endpoint finds nothing.
        """
        self.assertIsInstance(self.walk(b"/api/v1/nodes"), Nodes)
        self.assertIsInstance(self.walk(b"/api/v1/nodes/"), Nodes)
        action = self.walk(b"/api/v1/nodes/gpu-1/drain")
        self.assertIsInstance(action, NodeAction)
        self.assertEqual((action.node_id, action.action), ("gpu-1", "drain"))
        self.assertIsInstance(self.walk(b"/api/v1/nodes/gpu-1/drain/more"), NotFound)
        self.assertIs(self.walk(b"/"), self.resource)

    def test_model_spans_segments(self) -> None:
        """
        Every segment between C{deployments/} and the last, an action, is
        part of the model's name, so a name may hold slashes unescaped; an
        action's name earlier in the path is part of the model too.
        """
        for path, model in ((b"/api/v1/deployments/org/model/scale", "org/model"),
                            (b"/api/v1/deployments/scale/scale", "scale"),
                            (b"/api/v1/deployments/a/retry/b/scale/", "a/retry/b")):
            found = self.walk(path)
            self.assertIsInstance(found, Scale, path)
            self.assertEqual(found.model, model)

    def test_root_rendered_whole(self) -> None:
        """
        The root rendered with its path not walked (as a resource that
        embeds the API, or the watch socket, does) finds the resource
        itself, and answers as through a Site.
        """
        request = DummyRequest([b"api", b"v1", b"nope"])
        request.requestHeaders.setRawHeaders(b"host", [b"127.0.0.1"])
        self.assertEqual(self.resource.render(request), b'{"error": "no such endpoint: \'/api/v1/nope\'", '
                                                        b'"status": 404}\n')
        self.assertEqual(request.responseCode, 404)
        request = DummyRequest([b"api", b"v1", b"replicas"])
        request.requestHeaders.setRawHeaders(b"host", [b"127.0.0.1"])
        self.assertIs(AdminResource.render(self.resource, request), NOT_DONE_YET)
        self.assertEqual(request.responseCode, 200)
        self.assertIn(b'"replicas"', b"".join(request.written))
