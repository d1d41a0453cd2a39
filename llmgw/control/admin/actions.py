"""
The admin API's writes, each a C{POST} with a JSON body: a node's cordon,
uncordon and drain, a deployment's scale and retry, a gateway's demand
report, and the catalog and TLS reloads.

A write checks what it was sent before it asks the fleet (L{Refused}: 400
for a malformed body, 404 for no such endpoint), answers once the fleet
says it is done (an HA fleet answers once etcd kept the change: a
C{Deferred}), and logs who asked. What the fleet refuses is an
L{AdminError}, answered with its status.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.web.resource import Resource

from llmgw.control.admin.auth import known_admin
from llmgw.control.admin.base import AdminNode, Refused, at_end, json_body, segment
from llmgw.control.admin.deploy import DeploymentEdits
from llmgw.control.admin.rollouts import ROLLOUT_ACTIONS, Rollout
from llmgw.control.state.demand import DemandReportError, parse_report
from llmgw.control.state.interfaces import AdminError
from llmgw.untrusted import clip
from llmgw.wire import InvalidNodeId, validate_node_id

NODE_ACTIONS = ("cordon", "uncordon", "drain")
DEPLOYMENT_ACTIONS = ("scale", "retry", "pull")
#: Nodes one pull may name at most.
MAX_PULL_NODES = 256


def model_path(model: str) -> str:
    """
    The URL path segment for C{model} (slashes and all escaped).
    """
    return quote(model, safe="")


def _body(node: AdminNode, request: Any) -> dict[str, Any]:
    return json_body(request, node.root.max_body)


# -- nodes ---------------------------------------------------------------------------------


class Node(AdminNode):
    """
    C{/api/v1/nodes/ID}: no endpoint itself; its actions hang below it.
    """

    def __init__(self, root: Any, node_id: str):
        super().__init__(root)
        #: As the client wrote it; checked when an action is asked.
        self.node_id = node_id

    def getChild(self, path: bytes, request: Any) -> Resource:  # noqa: N802
        action = segment(path)
        if action in NODE_ACTIONS and at_end(request):
            return NodeAction(self.root, self.node_id, action)
        return super().getChild(path, request)


class NodeAction(AdminNode):
    """
    C{POST /api/v1/nodes/ID/cordon}, C{/uncordon} or C{/drain}; the body is
    C{{}} or nothing.
    """

    def __init__(self, root: Any, node_id: str, action: str):
        super().__init__(root)
        self.node_id = node_id
        self.action = action

    def render_POST(self, request: Any) -> Deferred[dict[str, Any]]:  # noqa: N802
        _body(self, request)
        try:
            node_id = validate_node_id(self.node_id)
        except InvalidNodeId as e:
            raise Refused(400, str(e)) from None
        fleet, action = self.root.fleet, self.action
        do = {"cordon": fleet.cordon, "uncordon": fleet.uncordon, "drain": fleet.drain_node}[action]

        def done(_: Any = None) -> dict[str, Any]:
            self.root.log.info("admin API: {action} {node} (asked by {client})",
                               action=action, node=node_id, client=self.root.who(request))
            return {"node": node_id, "action": action, "ok": True}

        return maybeDeferred(do, node_id).addCallback(done)


# -- deployments ---------------------------------------------------------------------------


class Deployment(DeploymentEdits):
    """
    C{/api/v1/deployments/MODEL}: C{PUT} and C{DELETE} change the catalog
    (L{DeploymentEdits}). A model name may hold slashes (C{org/model}),
    escaped or not: every segment up to the last, an action's name, is
    part of it.
    """

    def __init__(self, root: Any, model: str):
        super().__init__(root)
        self.model = model

    def getChild(self, path: bytes, request: Any) -> Resource:  # noqa: N802
        name = segment(path)
        if at_end(request) and name in DEPLOYMENT_ACTIONS:
            return {"scale": Scale, "retry": Retry, "pull": Pull}[name](self.root, self.model)
        if name == "rollout" and (at_end(request) or _rollout_action(request)):
            return Rollout(self.root, self.model)
        if path == b"" and not request.postpath:
            return self
        return Deployment(self.root, f"{self.model}/{name}")


def _rollout_action(request: Any) -> bool:
    # .../rollout/ACTION: the last segment names a rollout action.
    return len(request.postpath) == 1 and segment(request.postpath[0]) in ROLLOUT_ACTIONS


class _DeploymentAction(AdminNode):
    def __init__(self, root: Any, model: str):
        super().__init__(root)
        self.model = model

    def _model(self) -> str:
        if not self.model:
            raise Refused(400, "the model name is empty")
        return self.model


class Scale(_DeploymentAction):
    """
    C{POST /api/v1/deployments/MODEL/scale} with C{{"replicas": N}}, or
    C{{"min": N, "max": M}} for an autoscaled deployment's bounds.
    """

    def render_POST(self, request: Any) -> Deferred[dict[str, Any]]:  # noqa: N802
        model = self._model()
        body = _body(self, request)
        if "min" in body or "max" in body:
            low, high = _bounds(body)

            def bounded(_: Any = None) -> dict[str, Any]:
                self.root.log.info(
                    "admin API: autoscale {model} between {low} and {high} replicas (asked by {client})",
                    model=model, low=low, high=high, client=self.root.who(request),
                )
                return {"model": model, "min": low, "max": high, "ok": True}

            return maybeDeferred(self.root.fleet.scale_bounds, model, low, high).addCallback(bounded)
        replicas = _replicas(body)

        def done(_: Any = None) -> dict[str, Any]:
            self.root.log.info("admin API: scale {model} to {replicas} replicas (asked by {client})",
                               model=model, replicas=replicas, client=self.root.who(request))
            return {"model": model, "replicas": replicas, "ok": True}

        return maybeDeferred(self.root.fleet.scale, model, replicas).addCallback(done)


class Retry(_DeploymentAction):
    """
    C{POST /api/v1/deployments/MODEL/retry}: clear the deployment's hold
    and backoff; the body is C{{}} or nothing.
    """

    def render_POST(self, request: Any) -> Deferred[dict[str, Any]]:  # noqa: N802
        model = self._model()
        if _body(self, request):
            raise Refused(400, "retry takes no fields; send {} or nothing")

        def done(_: Any = None) -> dict[str, Any]:
            self.root.log.info("admin API: retry {model}: hold and backoff cleared (asked by {client})",
                               model=model, client=self.root.who(request))
            return {"model": model, "action": "retry", "ok": True}

        return maybeDeferred(self.root.fleet.retry, model).addCallback(done)


class Pull(_DeploymentAction):
    """
    C{POST /api/v1/deployments/MODEL/pull} with C{{"nodes": [ID, ...]}}
    (or C{{}}: where prefetch would choose): stage the deployment's weights
    in those nodes' caches. Answers with the nodes told.
    """

    def render_POST(self, request: Any) -> Deferred[dict[str, Any]]:  # noqa: N802
        model = self._model()
        nodes = _pull_nodes(_body(self, request))

        def done(told: list[str]) -> dict[str, Any]:
            self.root.log.info("admin API: pull {model} onto {nodes} (asked by {client})",
                               model=model, nodes=", ".join(told), client=self.root.who(request))
            return {"model": model, "nodes": told, "ok": True}

        return maybeDeferred(self.root.fleet.pull_model, model, nodes).addCallback(done)


def _pull_nodes(body: dict[str, Any]) -> list[str]:
    extra = set(body) - {"nodes"}
    if extra:
        raise Refused(400, f"pull takes only 'nodes', not {', '.join(sorted(map(clip, extra)))}")
    nodes = body.get("nodes", [])
    if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
        raise Refused(400, "'nodes' must be a list of node ids")
    if len(nodes) > MAX_PULL_NODES:
        raise Refused(400, f"at most {MAX_PULL_NODES} nodes may be named at once, not {len(nodes)}")
    try:
        return [validate_node_id(n) for n in nodes]
    except InvalidNodeId as e:
        raise Refused(400, str(e)) from None


def _replicas(body: dict[str, Any]) -> int:
    unknown = sorted(set(body) - {"replicas"})
    if unknown:
        raise Refused(
            400, f"unknown field(s) {', '.join(map(clip, unknown[:5]))}; the body is {{\"replicas\": N}}"
        )
    if "replicas" not in body:
        raise Refused(400, 'missing field "replicas"; the body is {"replicas": N}')
    n = body["replicas"]
    if isinstance(n, bool) or not isinstance(n, int):
        raise Refused(400, f'"replicas" must be a whole number, not {clip(json.dumps(n))}')
    if n < 0:
        raise Refused(400, f'"replicas" must not be negative (got {n})')
    return n


def _bounds(body: dict[str, Any]) -> tuple[int, int]:
    unknown = sorted(set(body) - {"min", "max"})
    if unknown:
        raise Refused(
            400, f"unknown field(s) {', '.join(map(clip, unknown[:5]))}; the body is "
                 f'{{"min": N, "max": M}} (an autoscaled deployment\'s bounds) or {{"replicas": N}}'
        )
    if "min" not in body or "max" not in body:
        raise Refused(400, 'give both "min" and "max": the body is {"min": N, "max": M}')
    out = []
    for key in ("min", "max"):
        n = body[key]
        if isinstance(n, bool) or not isinstance(n, int):
            raise Refused(400, f'"{key}" must be a whole number, not {clip(json.dumps(n))}')
        if n < 0:
            raise Refused(400, f'"{key}" must not be negative (got {n})')
        out.append(n)
    return out[0], out[1]


# -- the rest ------------------------------------------------------------------------------


class Demand(AdminNode):
    """
    C{POST /api/v1/demand}: a gateway's report of its requests in flight
    and waiting per model, for the autoscaler. Not logged (a report a
    second per gateway); its effect is, in the events.
    """

    def render_POST(self, request: Any) -> dict[str, Any]:  # noqa: N802
        try:
            gateway_id, demand = parse_report(_body(self, request))
        except DemandReportError as e:
            raise Refused(400, str(e)) from None
        # With mutual TLS a report is the certificate's: one gateway
        # certificate cannot overwrite or crowd out another's reports.
        admin = known_admin(request)
        if self.root.require_certificate and admin is not None and admin.name != gateway_id:
            gateway_id = f"{admin.name}/{gateway_id}"
        self.root.fleet.report_demand(gateway_id, demand)
        return {"ok": True}


class CatalogReload(AdminNode):
    """
    C{POST /api/v1/catalog/reload}: read the catalog file again; the answer
    lists what changed.
    """

    def render_POST(self, request: Any) -> Deferred[dict[str, Any]]:  # noqa: N802
        _body(self, request)

        def done(changes: Any) -> dict[str, Any]:
            self.root.log.info("admin API: catalog reloaded (asked by {client}): {changes}",
                               client=self.root.who(request), changes=changes)
            return {"ok": True, "changes": changes}

        return maybeDeferred(self.root.fleet.reload_catalog).addCallback(done)


class TLSReload(AdminNode):
    """
    C{POST /api/v1/tls/reload}: the control plane reads its certificates
    and CRLs again; a 409 says why it kept the old ones. No endpoint on an
    API built without a control plane to reload.
    """

    def methods(self) -> tuple[str, ...]:
        return super().methods() if self.root.control is not None else ()

    def render_POST(self, request: Any) -> dict[str, Any]:  # noqa: N802
        _body(self, request)
        result = self.root.control.reload_tls()
        self.root.log.info("admin API: TLS reload asked by {client}: {result}",
                           client=self.root.who(request), result=result)
        if not result.get("ok"):
            refused = AdminError(str(result.get("error") or "TLS reload refused"))
            refused.status = 409
            raise refused
        return dict(result)

