"""
The admin API's view of the weight caches (C{GET /api/v1/models}) and the
figures C{/metrics} takes from them: read only, built from the inventory's
L{ModelIndex} and the catalog on request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmgw.control.core import prefetching
from llmgw.control.core.commands import weights_key
from llmgw.control.core.context import Context


def models(ctx: Context) -> dict[str, Any]:
    """
    C{{"models": [...], "nodes": {...}}}: each model some node holds or
    some deployment names, by key: C{key}, C{source}, C{size} (C{None}:
    unknown), C{deployments} (the models served from it), C{prefetch} (the
    nodes told to keep it), and C{nodes}, each C{node}, C{size}, C{state}
    (C{complete} or C{partial}), C{last_used}; and for each node that
    reported a cache, its C{capacity}, C{free} and C{peer_address}.
    """
    index = ctx.inventory.models
    deployments: dict[str, list[str]] = {}
    sources: dict[str, str] = {}
    for model, dep in sorted(ctx.catalog.deployments.items()):
        key = weights_key(dep.source)
        if key and dep.source is not None:
            deployments.setdefault(key, []).append(model)
            sources.setdefault(key, dep.source.uri)
    rows: dict[str, dict[str, Any]] = {}
    cache_nodes: dict[str, Any] = {}
    for node_id in index.nodes():
        room = index.room(node_id)
        cache_nodes[node_id] = {"capacity": room.capacity, "free": room.free,
                                "peer_address": index.peer_address(node_id)}
        for c in index.copies(node_id):
            row = rows.setdefault(c.key, {"key": c.key, "source": c.source, "nodes": []})
            row["source"] = row["source"] or c.source
            row["nodes"].append({"node": node_id, "size": c.size, "state": c.state,
                                 "last_used": c.last_used, "revision": c.revision})
    for key in deployments:
        rows.setdefault(key, {"key": key, "source": sources[key], "nodes": []})
    out = []
    for key in sorted(rows):
        row = rows[key]
        row["size"] = index.size(key)
        row["deployments"] = deployments.get(key, [])
        row["prefetch"] = sorted({n for m in row["deployments"] for n in ctx.prefetch.nodes(m)})
        out.append(row)
    return {"models": out, "nodes": cache_nodes}


class ModelControl:
    """
    Mixed into the reconciler, whose C{ctx}, C{_decide} and C{connected}
    it uses: the weights' view and an operator's pull.
    """

    ctx: Context
    _decide: Callable[..., Any]
    connected: Callable[[], set[str]]

    def pull_model(self, model: str, nodes: list[str]) -> list[str]:
        """
        Stage C{model}'s weights on C{nodes} (or where prefetch would);
        the nodes told (L{prefetching.pull}).
        """
        result: list[str] = self._decide(prefetching.pull, self.ctx.prefetch, model, nodes, self.connected())
        return result

    def models_view(self) -> dict[str, Any]:
        return models(self.ctx)
