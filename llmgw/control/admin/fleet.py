"""
The admin API's reads: the fleet's status, nodes, deployments, replicas,
events and routing table, who the API takes the client for, the embedded
gateway's usage and C{/metrics}. Each is a resource of the tree with a
C{render_GET}; what the fleet does to them (cordon, scale) hangs below
C{nodes} and C{deployments} (L{llmgw.control.admin.actions}).
"""

from __future__ import annotations

from typing import Any

from prometheus_client.exposition import choose_encoder
from twisted.internet.defer import CancelledError
from twisted.python.failure import Failure
from twisted.web.resource import Resource

from llmgw.control.admin.actions import Deployment, Node
from llmgw.control.admin.auth import has_certificate, known_admin
from llmgw.control.admin.base import AdminNode, Refused, at_end, segment, since_seconds
from llmgw.routing import LONG_POLL_MAX_S, RoutesDataError, RoutingTable, snapshot_to_json


def nodes_view(fleet: Any, agents: Any) -> dict[str, Any]:
    """
    C{GET /api/v1/nodes}: the fleet's nodes view, each node with the
    C{stray_processes} its agent listed in its latest Register (from the
    inventory, where the fleet's view does not carry them).
    """
    nodes = fleet.nodes()
    inventory = getattr(agents, "inventory", None)
    out = []
    for view in nodes:
        if "stray_processes" not in view:
            strays = inventory.strays(view.get("id", "")) if inventory is not None else []
            view = {**view, "stray_processes": [s.as_dict() for s in strays]}
        out.append(view)
    return {"nodes": out}


def fleet_status(fleet: Any, agents: Any) -> dict[str, Any]:
    """C{GET /api/v1/status}'s fleet parts (without the HA member's own)."""
    status = dict(fleet.status())
    if agents is not None and "agents_connected" not in status:
        status["agents_connected"] = len(agents.connected_nodes())
    return status


class Status(AdminNode):
    """
    C{GET /api/v1/status}: the fleet's status; on a member of an HA control
    plane also its role, the leader and the epoch, and on one that does not
    lead the leader's fleet as it published it.
    """

    def render_GET(self, request: Any) -> dict[str, Any]:  # noqa: N802
        root = self.root
        status = fleet_status(root.fleet, root.agents)
        ha = getattr(root.control, "ha", None)
        if ha is not None:
            # A member that does not lead runs no reconciler of its own.
            followed = ha.followed_fleet()
            if followed is not None:
                try:
                    status = {**followed.status(), "published_at": followed.published_at,
                              "published_by": followed.leader}
                except RoutesDataError as e:
                    # This member's own view of the fleet stays.
                    root.log.error("admin API: the status the leader published is unreadable ({error})",
                                   error=str(e))
            ha_status = ha.status()
            status["ha"] = ha_status
            for key in ("role", "member_id", "leader_id", "leader_agent_address", "epoch"):
                status[key] = ha_status[key]
        return status


class Whoami(AdminNode):
    """
    C{GET /api/v1/whoami}: who the API takes the requester for: with mutual
    TLS the admin's name and role, or a logged-in user's with the session's
    CSRF token; with logins and neither, no one (C{"role": null,
    "login": true}: the page shows its login form); without TLS (loopback
    only) an operator.
    """

    def render_GET(self, request: Any) -> dict[str, Any]:  # noqa: N802
        session = getattr(request, "llmgw_session", None)
        if session is not None:
            # A logged-in person: the page repeats the token on every write.
            return {"name": session.user, "role": session.role, "tls": True, "session": True,
                    "csrf": session.csrf}
        admin = known_admin(request)
        if self.root.require_certificate and admin is not None:
            return {"name": admin.name, "role": admin.role, "tls": True}
        if self.root.logins is not None and not has_certificate(request):
            # No certificate and no live session: nobody yet, the page logs in.
            return {"name": None, "role": None, "tls": True, "session": False, "login": True}
        return {"name": None, "role": "operator", "tls": False}


class Nodes(AdminNode):
    """
    C{GET /api/v1/nodes} (L{nodes_view}); C{/api/v1/nodes/ID} below it.
    """

    def render_GET(self, request: Any) -> dict[str, Any]:  # noqa: N802
        return nodes_view(self.root.fleet, self.root.agents)

    def getChild(self, path: bytes, request: Any) -> Resource:  # noqa: N802
        if path == b"" and at_end(request):
            return self
        return Node(self.root, segment(path))


class Deployments(AdminNode):
    """
    C{GET /api/v1/deployments}; C{/api/v1/deployments/MODEL} below it.
    """

    def render_GET(self, request: Any) -> dict[str, Any]:  # noqa: N802
        return {"deployments": self.root.fleet.deployments()}

    def getChild(self, path: bytes, request: Any) -> Resource:  # noqa: N802
        if path == b"" and at_end(request):
            return self
        return Deployment(self.root, segment(path))


class Models(AdminNode):
    """
    C{GET /api/v1/models}: the weight caches, by model
    (L{llmgw.control.shell.modelviews.models}).
    """

    def render_GET(self, request: Any) -> dict[str, Any]:  # noqa: N802
        result: dict[str, Any] = self.root.fleet.models_view()
        return result


class Replicas(AdminNode):
    """
    C{GET /api/v1/replicas}.
    """

    def render_GET(self, request: Any) -> dict[str, Any]:  # noqa: N802
        return {"replicas": self.root.fleet.replicas()}


class Events(AdminNode):
    """
    C{GET /api/v1/events?since=SECONDS}: the reconciler's events after
    C{since} (all it keeps without).
    """

    def render_GET(self, request: Any) -> dict[str, Any]:  # noqa: N802
        return {"events": self.root.fleet.events(since_seconds(request))}


class Routes(AdminNode):
    """
    C{GET /api/v1/routes?since=REVISION}: the fleet's published
    L{RoutingTable} (its C{routing_table}) as C{snapshot_to_json} writes
    it: at once without C{since} or when the table's revision differs from
    it (newer, or a client of an earlier control plane process whose count
    was higher); else when the table next changes or after
    L{LONG_POLL_MAX_S} seconds, whichever comes first. A client that goes
    away cancels its wait.
    """

    def render_GET(self, request: Any) -> Any:  # noqa: N802
        table = getattr(self.root.fleet, "routing_table", None)
        if not isinstance(table, RoutingTable):
            raise Refused(404, "this control plane publishes no routing table")
        values = request.args.get(b"since")
        since: int | None = None
        if values:
            if len(values) > 1:
                raise Refused(400, "give 'since' once")
            raw = values[0].decode("utf-8", "replace")
            if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
                raise Refused(400, f"since={raw!r} is not a revision (a whole number, 0 or more)")
            since = int(raw)
        if since is None or since != table.revision:
            return snapshot_to_json(table, table.clock.seconds())
        waiting = table.wait_newer(since, LONG_POLL_MAX_S)
        request.notifyFinish().addErrback(lambda _: waiting.cancel())

        def answer(_: int) -> dict[str, Any]:
            return snapshot_to_json(table, table.clock.seconds())

        def gone(f: Failure) -> bytes:
            f.trap(CancelledError)
            return b""  # nobody is there to read it

        return waiting.addCallbacks(answer, gone)


class Usage(AdminNode):
    """
    C{GET /api/v1/usage}: the embedded gateway's usage per API key and
    model (L{llmgw.gateway.usage.Usage.snapshot}); a 404 when this control
    plane runs no gateway.
    """

    def render_GET(self, request: Any) -> Any:  # noqa: N802
        service = getattr(self.root.control, "gateway", None)
        usage = getattr(getattr(service, "gateway", None), "usage", None)
        if usage is None:
            raise Refused(404, "this control plane runs no gateway (--gateway off); a standalone "
                               "gateway serves its own /api/v1/usage on its --metrics address")
        return usage.snapshot()


class Metrics(AdminNode):
    """
    C{GET /metrics}: the registry, in the format the client's C{Accept}
    picks (Prometheus text or OpenMetrics).
    """

    def render_GET(self, request: Any) -> bytes:  # noqa: N802
        accept = (request.getHeader(b"accept") or b"").decode("latin-1")
        encoder, content_type = choose_encoder(accept)
        body: bytes = encoder(self.root.registry)
        request.setHeader(b"content-type", content_type.encode("ascii"))
        return body
