"""
Requests for LoRA adapters (DESIGN §22): a client names an adapter as its
"model"; the gateway sends it only to replicas of the adapter's base that
hold it, chosen by the base's routing policy among those.

A vLLM replica serves an adapter under its name, so the request goes as
the client wrote it. llama.cpp's server holds a fixed list of adapters and
applies each at the scale a request's C{"lora"} field gives it by
position (all at scale 1 when the field is absent), so the gateway adds
that field to every request for a base with adapters: scale 1 for the
adapter asked for and 0 for the others, or 0 for all of them for the base
itself. Since the ids are positions, one request's candidates share one
list (the most replicas' list: during a make-before-break replace the
others wait their turn).

The choice is worked out once per routing-table revision and model
(the table hands out the same routes until it changes), so that a request
for an adapter costs little more than one for its base.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Final

from llmgw.routing import Route

#: Models whose choice is kept per base (past it, the cache starts over).
_MAX_KEPT: Final = 4096
#: The adapter -> base map of a routing table that has none.
NO_ADAPTERS: Final[Mapping[str, str]] = {}


def lora_field(layout: Sequence[str], adapter: str | None) -> bytes:
    """
    The C{"lora"} member that selects C{adapter} (C{None}: none, the base)
    on a llama.cpp server started with C{layout}'s adapters in that order:
    every id listed, the adapter's at scale 1, the others at 0.
    """
    entries = b",".join(b'{"id":%d,"scale":%d}' % (i, name == adapter) for i, name in enumerate(layout))
    return b'"lora":[' + entries + b"]"


def with_member(body: bytes, member: bytes) -> bytes:
    """
    C{body} (a JSON object) with C{member} added as its last member: a
    reader that keeps the last of a repeated name takes ours.

    @raise ValueError: C{body} does not end with a closing brace.
    """
    if body[-1:] == b"}" and body[-2:-1] not in b"{ \t\r\n":
        # The usual body: a member's value, then the brace.
        return body[:-1] + b"," + member + b"}"
    end = body.rstrip()
    if not end.endswith(b"}"):
        raise ValueError("the body is not a JSON object")
    head = end[:-1].rstrip()
    return head + (b"," if not head.endswith(b"{") else b"") + member + b"}"


def choose_routes(routes: Sequence[Route], adapter: str | None) -> tuple[tuple[Route, ...], bytes]:
    """
    The routes a request for C{adapter} (C{None}: for the base itself) may
    go to among its base's C{routes}, and the C{"lora"} member its body
    gets (C{b""}: none).

    Replicas that select adapters by position count only with the list
    most of them (not draining) hold; ties go to the longer, then the
    first in order, so that every gateway agrees. Such replicas with no
    adapters get no member.
    """
    holders = [r for r in routes if adapter is None or adapter in r.adapters]
    by_id = [r for r in holders if r.lora_ids]
    if not by_id:
        return tuple(holders), b""
    counts: dict[tuple[str, ...], int] = {}
    for r in by_id:
        counts[r.adapters] = counts.get(r.adapters, 0) + (not r.draining)
    layout = max(sorted(counts), key=lambda lay: (counts[lay], len(lay)))
    return tuple(r for r in by_id if r.adapters == layout), lora_field(layout, adapter) if layout else b""


class AdapterRouting:
    """
    The gateway's choice of routes for adapters and for the bases whose
    replicas select adapters by position, kept while the base's routes
    are the same object (the routing table hands out the same sequence
    until it changes).
    """

    __slots__ = ("_kept",)

    def __init__(self) -> None:
        #: model -> (the base's routes it was chosen from, candidates, member)
        self._kept: dict[str, tuple[Sequence[Route], tuple[Route, ...], bytes]] = {}

    def resolve(
        self, adapters: Mapping[str, str], routes_of: Callable[[str], Sequence[Route]], model: str,
        routes: Sequence[Route],
    ) -> tuple[Sequence[Route], bytes] | None:
        """
        For a request naming C{model}, whose own routes are C{routes}:
        C{None} when it is neither an adapter (in C{adapters}, adapter ->
        base) nor a base whose replicas select adapters by position (it
        goes on with C{routes}); else its candidate routes and the member
        its body gets (L{choose_routes}). C{routes_of(base)} gives a base's
        routes.
        """
        if routes:
            if not routes[0].lora_ids:
                return None
            adapter, base_routes = None, routes
        else:
            base = adapters.get(model)
            if base is None:
                return None
            adapter, base_routes = model, routes_of(base)
        kept = self._kept.get(model)
        if kept is None or kept[0] is not base_routes:
            if len(self._kept) >= _MAX_KEPT:
                self._kept.clear()
            kept = self._kept[model] = (base_routes, *choose_routes(base_routes, adapter))
        return kept[1], kept[2]
