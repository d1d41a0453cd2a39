"""
What every resource of the admin API's tree shares: the refusal a request
gets (L{Refused}), JSON out and in, and L{AdminNode}, the base resource.

An L{AdminNode} is one path segment. Its children are found as
C{twisted.web} finds any resource's (C{putChild}, C{getChild}); the methods
it takes are its C{render_GET}, C{render_POST}. Its C{render} does not call
them itself: it hands the request to the tree's root
(L{llmgw.control.admin.api.AdminResource.serve}), which runs the checks
every request passes (Host, certificate and role, a follower's forwarding)
and then the method, and writes the answer or the refusal as JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from twisted.web.resource import Resource

from llmgw.addresses import format_address
from llmgw.untrusted import CLIP, JSONInputError, clip, load_json

JSON_TYPE = b"application/json; charset=utf-8"
#: Largest request body accepted, in bytes.
MAX_BODY = 64 * 1024
#: The methods a resource of the tree may take, each as its C{render_METHOD}.
METHODS = ("GET", "POST", "PUT", "DELETE")


class Refused(Exception):
    """
    A request the API refuses before asking the fleet; C{status} is the
    HTTP status it is answered with.
    """

    def __init__(self, status: int, reason: str, allow: tuple[str, ...] = (),
                 headers: dict[bytes, bytes] | None = None, extra: dict[str, Any] | None = None):
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.allow = allow
        #: More response headers (C{Location}, C{Retry-After}).
        self.headers = headers or {}
        #: More fields of the JSON body.
        self.extra = extra or {}


def client_address(request: Any) -> str:
    """
    The requester's address as C{host:port}, for log lines.
    """
    addr = request.getClientAddress()
    host = getattr(addr, "host", None)
    if host is None:
        return str(addr)
    return format_address(host, addr.port)


def printable(raw: bytes) -> str:
    """
    C{raw} (a method or URI a client sent) safe for a log line: control
    characters escaped, and past 4 * L{CLIP} bytes cut, with its length.
    """
    limit = 4 * CLIP
    text = raw[:limit].decode("latin-1")
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(raw) <= limit else f"{text}\u2026 ({len(raw)} bytes)"


def bounded(reason: str) -> str:
    """
    A refusal's reason, cut past 16 * L{CLIP} characters: the fleet's own
    messages may quote what a client sent in full.
    """
    limit = 16 * CLIP
    return reason if len(reason) <= limit else f"{reason[:limit]}\u2026 ({len(reason)} characters)"


def _json_default(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def encode_json(value: Any) -> bytes:
    """
    C{value} as JSON bytes with a final newline.

    @raise ValueError: a float is not finite (NaN would not be valid JSON).
    @raise TypeError: something in C{value} has no JSON form.
    """
    return (json.dumps(value, allow_nan=False, default=_json_default) + "\n").encode("utf-8")


# -- reading a request --------------------------------------------------------------------


def request_method(request: Any) -> str:
    """
    The request's method as text, C{HEAD} read as C{GET}.
    """
    method: str = request.method.decode("ascii", "replace")
    return "GET" if method == "HEAD" else method


def request_path(request: Any) -> list[str]:
    """
    The request's path segments (what the walk down the tree consumed and
    what it left), without a trailing empty one: C{/api/v1/nodes/} is
    C{/api/v1/nodes}.

    @raise Refused: 400, the path is not UTF-8.
    """
    try:
        path = [seg.decode("utf-8") for seg in [*request.prepath, *request.postpath]]
    except UnicodeDecodeError:
        raise Refused(400, "the path is not UTF-8") from None
    if path and path[-1] == "":
        path.pop()
    return path


def at_end(request: Any) -> bool:
    """
    Whether the segment a C{getChild} is finding is the path's last (at
    most a trailing slash follows).
    """
    return request.postpath in ([], [b""])


def segment(name: bytes) -> str:
    """
    A path segment as text, for a resource's name. A segment that is not
    UTF-8 never reaches a C{render} (the root refuses the path first), so
    the replacement characters are never seen.
    """
    return name.decode("utf-8", "replace")


def since_seconds(request: Any) -> float:
    """
    C{?since=SECONDS} (seconds since 1970), C{0.0} when not given.

    @raise Refused: 400, given twice, or not a finite number.
    """
    values = request.args.get(b"since")
    if not values:
        return 0.0
    if len(values) > 1:
        raise Refused(400, "give 'since' once")
    raw = values[0].decode("utf-8", "replace")
    try:
        since = float(raw)
    except ValueError:
        raise Refused(400, f"since={clip(raw)} is not a number of seconds since 1970") from None
    if not math.isfinite(since):
        raise Refused(400, f"since={clip(raw)} is not a finite number")
    return since


def json_body(request: Any, max_body: int) -> dict[str, Any]:
    """
    The JSON object a C{POST} carries (C{{}} when it carries nothing).

    @raise Refused: 415, not C{Content-Type: application/json}; 413, over
        C{max_body} bytes; 400, not a JSON object.
    """
    ctype = (request.getHeader(b"content-type") or b"").split(b";")[0].strip().lower()
    if ctype != b"application/json":
        raise Refused(
            415,
            "POST requests must have Content-Type: application/json"
            + (f" (got {clip(ctype)})" if ctype else ""),
        )
    if getattr(request, "body_too_large", False):
        raise Refused(413, f"the request body is over {max_body} bytes")
    request.content.seek(0)
    raw = request.content.read(max_body + 1)
    if len(raw) > max_body:
        raise Refused(413, f"the request body is over {max_body} bytes")
    if not raw.strip():
        return {}
    try:
        body = load_json(raw, unique=None)
    except JSONInputError as e:
        raise Refused(400, str(e)) from None
    if not isinstance(body, dict):
        raise Refused(400, f"the body must be a JSON object, not {type(body).__name__}")
    return body


# -- the base resource --------------------------------------------------------------------


class AdminNode(Resource):
    """
    One segment of the admin API's tree. A subclass takes a method by
    defining C{render_GET(request)} or C{render_POST(request)}, which
    returns the answer: a JSON value (encoded with L{encode_json}), bytes
    already encoded, a C{Deferred} of either, or C{NOT_DONE_YET} when it
    answers the request itself. It raises L{Refused} to refuse, and an
    L{llmgw.control.state.interfaces.AdminError} from the fleet is answered
    with that error's status. A resource that takes no method is no
    endpoint (a 404); one that takes others is a 405 with C{Allow}.

    @ivar root: the tree's root, which holds what the tree serves (the
        fleet, the registry, the control plane) and does the checks.
    """

    def __init__(self, root: Any):
        super().__init__()
        self.root = root

    def render(self, request: Any) -> Any:
        return self.root.serve(request, self)

    def getChild(self, path: bytes, request: Any) -> Resource:  # noqa: N802
        # A trailing slash names the same resource; anything else below an
        # endpoint is none.
        if path == b"" and not request.postpath:
            return self
        return NotFound(self.root)

    def methods(self) -> tuple[str, ...]:
        """
        The methods this resource takes (those it has a C{render_} for).
        """
        return tuple(m for m in METHODS if callable(getattr(self, f"render_{m}", None)))

    def handler(self, method: str, path: list[str]) -> Callable[[Any], Any]:
        """
        What answers C{method} on this resource, whose C{path} it is.

        @raise Refused: 404, this resource takes no method; 405, not this one.
        """
        methods = self.methods()
        if not methods:
            raise Refused(404, f"no such endpoint: {clip('/' + '/'.join(path))}")
        if method not in methods:
            raise Refused(
                405,
                f"{clip('/' + '/'.join(path))} takes {' or '.join(methods)}, not {clip(method)}",
                allow=methods,
            )
        render: Callable[[Any], Any] = getattr(self, f"render_{method}")
        return render


class NotFound(AdminNode):
    """
    No endpoint: not this path, nor any below it.
    """

    def getChild(self, path: bytes, request: Any) -> Resource:  # noqa: N802
        return self
