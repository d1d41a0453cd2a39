"""
The fleet page's files (C{llmgw/control/admin/page/}): C{GET /} with
C{Accept: text/html} is its C{index.html}, C{GET /page/NAME} its scripts
and styles, among them the charting library it draws curves with (uPlot,
MIT, in C{page/vendor/} with its licence: the page loads nothing from
outside the control plane, so it works on a fleet with no internet). Every member of an HA control plane serves them itself; the
page's own API calls are sent on like any other.
"""

from __future__ import annotations

from typing import Any

from twisted.web.resource import Resource

from llmgw.control.admin.base import AdminNode, Refused, segment

#: The fleet page's files and their types.
PAGE_FILES = {
    "index.html": b"text/html; charset=utf-8",
    "page.js": b"text/javascript; charset=utf-8",
    "page.css": b"text/css; charset=utf-8",
    "curves.js": b"text/javascript; charset=utf-8",
    "console.js": b"text/javascript; charset=utf-8",
    "console.css": b"text/css; charset=utf-8",
    "deploy.js": b"text/javascript; charset=utf-8",
    "playground.js": b"text/javascript; charset=utf-8",
    "watch.js": b"text/javascript; charset=utf-8",
    "icon.svg": b"image/svg+xml",
    "vendor/uPlot.iife.min.js": b"text/javascript; charset=utf-8",
    "vendor/uPlot.min.css": b"text/css; charset=utf-8",
}
#: The page loads only its own files and talks only to this API.
PAGE_CSP = (b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
            b"img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_page_cache: dict[str, tuple[bytes, bytes]] = {}


def page_file(name: str) -> tuple[bytes, bytes] | None:
    """
    The bytes and content type of the page file C{name}, read from the
    package once; C{None} for a name that is not one.
    """
    if name not in PAGE_FILES:
        return None
    if name not in _page_cache:
        from importlib.resources import files

        body = files("llmgw.control.admin").joinpath("page", *name.split("/")).read_bytes()
        _page_cache[name] = (body, PAGE_FILES[name])
    return _page_cache[name]


def serve_page(request: Any, name: str) -> bytes:
    """
    The page file C{name} as the answer to C{request}, with the headers
    that keep it to its own files and out of frames.

    @raise Refused: 404, C{name} is no page file.
    """
    found = page_file(name)
    if found is None:
        raise Refused(404, f"no such page file: {name}")
    body, ctype = found
    request.setResponseCode(200)
    request.setHeader(b"content-type", ctype)
    request.setHeader(b"content-security-policy", PAGE_CSP)
    request.setHeader(b"x-frame-options", b"DENY")
    return body


class PageFiles(AdminNode):
    """
    C{/page}: its children are the page's files; anything else under it,
    itself included, is a 404 that names the file asked for.
    """

    def render_GET(self, request: Any) -> bytes:  # noqa: N802
        return serve_page(request, "")

    def getChild(self, path: bytes, request: Any) -> Resource:  # noqa: N802
        return PageFile(self.root, segment(path))


class PageFile(AdminNode):
    """
    C{/page/NAME}: one file of the page. It takes what follows its name as
    part of it, so that C{/page/a/b} is refused as the file C{a/b}.
    """

    isLeaf = True

    def __init__(self, root: Any, name: str):
        super().__init__(root)
        self.name = name

    def render_GET(self, request: Any) -> bytes:  # noqa: N802
        rest = [segment(s) for s in request.postpath]
        if rest and rest[-1] == "":
            rest.pop()
        return serve_page(request, "/".join([self.name, *rest]))
