"""
C{GET /api/v1/series?since=T}: the curves of the last hour the control
plane keeps (L{llmgw.control.shell.series.SeriesKeeper}), for the
console's curves view. Any role that reads the fleet may read them.

C{since} (seconds since 1970) leaves out older points, so that a page that
polls gets only what is new; C{top=N} (0 to
L{llmgw.control.shell.series.MAX_ANSWER_NODES}, default
L{llmgw.control.shell.series.DEFAULT_TOP_NODES}) asks for the N nodes
using the most GPU memory now, and C{node=ID} (repeated) for nodes by
name.
"""

from __future__ import annotations

from typing import Any

from llmgw.control.admin.base import AdminNode, Refused, since_seconds
from llmgw.control.shell.series import DEFAULT_TOP_NODES, MAX_ANSWER_NODES
from llmgw.untrusted import clip


def _top(request: Any) -> int:
    values = request.args.get(b"top")
    if not values:
        return DEFAULT_TOP_NODES
    raw = values[-1].decode("utf-8", "replace")
    if len(values) > 1 or not raw.isdigit() or int(raw) > MAX_ANSWER_NODES:
        raise Refused(400, f"top={clip(raw)} must be given once, a whole number from 0 to {MAX_ANSWER_NODES}")
    return int(raw)


def _nodes(request: Any) -> list[str]:
    names = [v.decode("utf-8", "replace") for v in request.args.get(b"node", [])]
    if len(names) > MAX_ANSWER_NODES:
        raise Refused(400, f"{len(names)} nodes named; at most {MAX_ANSWER_NODES} per request")
    return names


class Series(AdminNode):
    """
    C{GET /api/v1/series}: L{llmgw.control.shell.series.SeriesKeeper.view};
    a 404 when this control plane keeps no curves.
    """

    def render_GET(self, request: Any) -> dict[str, Any]:  # noqa: N802
        since = since_seconds(request)
        top, nodes = _top(request), _nodes(request)
        keeper = getattr(self.root, "series", None)
        if keeper is None:
            raise Refused(404, "this control plane keeps no curves")
        view: dict[str, Any] = keeper.view(since, top, nodes)
        return view
