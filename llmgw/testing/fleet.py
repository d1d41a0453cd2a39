"""
A fake reconciler for tests of what sits on L{IFleetAdmin}: the admin API,
C{llmgw ctl}, the metrics.

It keeps plain dicts that tests fill and read; its actions change them the
way the reconciler's would be seen from outside (cordon marks the node,
scale sets C{desired}) and refuse what the reconciler would refuse.
"""

from __future__ import annotations

import collections
from typing import Any

from twisted.internet.task import Clock
from zope.interface import implementer

from llmgw.control.state.interfaces import AdminError, IFleetAdmin, UnknownDeployment, UnknownNode
from llmgw.control.state.inventory import Inventory
from llmgw.routing import Route, RoutingTable


@implementer(IFleetAdmin)
class FakeFleet:
    def __init__(self) -> None:
        self.node_views: dict[str, dict[str, Any]] = {}
        self.deployment_views: dict[str, dict[str, Any]] = {}
        self.replica_views: list[dict[str, Any]] = []
        self.event_log: list[dict[str, Any]] = []
        #: What L{reload_catalog} returns; an exception instance is raised.
        self.reload_result: Any = {"added": [], "removed": [], "changed": []}
        self.frozen = False
        self.calls: list[tuple[Any, ...]] = []
        self.last_pass_seconds: float | None = None
        #: The routes a real reconciler would publish for these views (ready
        #: replicas at their rank 0 address, declared models), re-published
        #: by L{publish_routes} and whenever a view is added.
        self.routing_table = RoutingTable(Clock())
        #: What L{models_view} answers (C{GET /api/v1/models}).
        self.models: dict[str, Any] = {"models": [], "nodes": {}}

    # -- filling ------------------------------------------------------------------

    def add_node(self, node_id: str, state: str = "ready", connected: bool = True,
                 gpus: int = 2, memory_mb: int = 80_000, last_seen: float = 1_700_000_000.0,
                 shards: list[str] | None = None) -> dict[str, Any]:
        view = {
            "id": node_id,
            "state": state,
            "connected": connected,
            "cordoned": False,
            "draining": False,
            "last_seen": last_seen,
            "gpus": [
                {"index": i, "name": "Fake GPU", "memory_total_mb": memory_mb,
                 "memory_used_mb": 0, "problems": []}
                for i in range(gpus)
            ],
            "fabrics": {},
            "shards": list(shards or []),
        }
        self.node_views[node_id] = view
        return view

    def add_deployment(self, model: str, profile: str = "fake-1gpu", desired: int = 1,
                       ready: int = 0, held: dict[str, Any] | None = None,
                       last_failure: dict[str, Any] | None = None) -> dict[str, Any]:
        """
        C{held} is C{None} or C{{"reason", "crash_class", "since"}}, as the
        reconciler shows a deployment held after a configuration failure;
        C{last_failure} as a L{llmgw.control.core.failures.ShardFailure}'s dict.
        """
        view = {"model": model, "profile": profile, "desired": desired, "ready": ready,
                "backoff_until": None, "failures": 0, "last_failure": last_failure,
                "held": dict(held) if held is not None else None}
        self.deployment_views[model] = view
        self.publish_routes()
        return view

    def add_replica(self, replica_id: str, model: str, shards: list[tuple[str, str]],
                    state: str = "ready", profile: str = "fake-1gpu") -> dict[str, Any]:
        """
        C{shards} is C{(node, address)} per rank.
        """
        view = {
            "id": replica_id,
            "model": model,
            "profile": profile,
            "state": state,
            "draining": False,
            "shards": [
                {"id": f"{replica_id}-s{rank}", "node": node, "rank": rank, "state": state,
                 "address": address}
                for rank, (node, address) in enumerate(shards)
            ],
        }
        self.replica_views.append(view)
        self.publish_routes()
        return view

    def publish_routes(self) -> None:
        """
        Publish the routing table the views describe (call it again after
        changing a view in place).
        """
        routes = [
            Route(r["id"], r["model"], r["shards"][0]["address"], bool(r["draining"]))
            for r in self.replica_views
            if r["state"] == "ready" and r["shards"]
        ]
        self.routing_table.publish(routes, self.deployment_views)

    def add_event(self, time: float, kind: str, reason: str, node: str = "", replica: str = "",
                  shard: str = "", **extra: Any) -> dict[str, Any]:
        event = {"time": time, "kind": kind, "node": node, "replica": replica, "shard": shard,
                 "reason": reason, **extra}
        self.event_log.append(event)
        return event

    # -- IFleetAdmin ------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {
            "nodes": dict(collections.Counter(n["state"] for n in self.node_views.values())),
            "replicas": dict(collections.Counter(r["state"] for r in self.replica_views)),
            "deployments": len(self.deployment_views),
            "replacements_frozen": self.frozen,
            "frozen_reason": "more than half the nodes are suspect" if self.frozen else None,
            "epoch": 1_700_000_000_000,
            "catalog": "catalog.toml",
        }

    def nodes(self) -> list[dict[str, Any]]:
        return [self.node_views[k] for k in sorted(self.node_views)]

    def deployments(self) -> list[dict[str, Any]]:
        return [self.deployment_views[k] for k in sorted(self.deployment_views)]

    def replicas(self) -> list[dict[str, Any]]:
        return list(self.replica_views)

    def events(self, since: float = 0.0) -> list[dict[str, Any]]:
        return [e for e in self.event_log if e["time"] > since]

    def _node(self, node_id: str) -> dict[str, Any]:
        try:
            return self.node_views[node_id]
        except KeyError:
            raise UnknownNode(f"no node named {node_id!r}") from None

    def cordon(self, node_id: str) -> None:
        self.calls.append(("cordon", node_id))
        self._node(node_id)["cordoned"] = True

    def uncordon(self, node_id: str) -> None:
        self.calls.append(("uncordon", node_id))
        node = self._node(node_id)
        node["cordoned"] = False
        node["draining"] = False

    def drain_node(self, node_id: str) -> None:
        self.calls.append(("drain", node_id))
        node = self._node(node_id)
        node["cordoned"] = True
        node["draining"] = True

    def scale(self, model: str, replicas: int) -> None:
        self.calls.append(("scale", model, replicas))
        if model not in self.deployment_views:
            raise UnknownDeployment(f"no deployment serves model {model!r}")
        if replicas < 0:
            raise AdminError(f"replicas must not be negative (got {replicas})")
        if self.deployment_views[model].get("autoscale"):
            raise AdminError(f"deployment {model} autoscales; a fixed count does not apply")
        self.deployment_views[model]["desired"] = replicas

    def scale_bounds(self, model: str, min_replicas: int, max_replicas: int) -> None:
        """
        As the reconciler's: an autoscaled deployment's view takes the new
        bounds; one with a fixed count refuses.
        """
        self.calls.append(("scale_bounds", model, min_replicas, max_replicas))
        if model not in self.deployment_views:
            raise UnknownDeployment(f"no deployment serves model {model!r}")
        view = self.deployment_views[model].get("autoscale")
        if not view:
            raise AdminError(f"deployment {model} has a fixed count of replicas and does not autoscale")
        if max_replicas < 1 or max_replicas < min_replicas:
            raise AdminError(f"max ({max_replicas}) must be at least 1 and at least min ({min_replicas})")
        view["min_replicas"], view["max_replicas"] = min_replicas, max_replicas

    def report_demand(self, gateway_id: str, models: dict[str, Any]) -> None:
        self.calls.append(("report_demand", gateway_id, dict(models)))

    def models_view(self) -> dict[str, Any]:
        return self.models

    def pull_model(self, model: str, nodes: list[str]) -> list[str]:
        """
        As the reconciler's, roughly: a known deployment, known nodes; with
        none named, the first node.
        """
        self.calls.append(("pull", model, list(nodes)))
        if model not in self.deployment_views:
            raise UnknownDeployment(f"no deployment serves model {model!r}")
        for node_id in nodes:
            if node_id not in self.node_views:
                raise UnknownNode(f"no node {node_id!r}")
        return list(nodes) or sorted(self.node_views)[:1]

    def retry(self, model: str) -> None:
        """
        As the reconciler's: the deployment is no longer held and its
        backoff is cleared, so the next pass places it again.
        """
        self.calls.append(("retry", model))
        if model not in self.deployment_views:
            raise UnknownDeployment(f"no deployment serves model {model!r}")
        view = self.deployment_views[model]
        view["held"] = None
        view["backoff_until"] = None
        view["failures"] = 0

    def reload_catalog(self) -> dict[str, Any]:
        self.calls.append(("reload",))
        if isinstance(self.reload_result, BaseException):
            raise self.reload_result
        return dict(self.reload_result)

    # -- what the metrics read ---------------------------------------------------------

    def metrics_snapshot(self) -> dict[str, Any]:
        shards: collections.Counter[str] = collections.Counter()
        for r in self.replica_views:
            for s in r["shards"]:
                shards[s["state"]] += 1
        return {
            "nodes": dict(collections.Counter(n["state"] for n in self.node_views.values())),
            "shards": dict(shards),
            "replicas": dict(collections.Counter(r["state"] for r in self.replica_views)),
            "events": dict(collections.Counter(e["kind"] for e in self.event_log)),
            "last_pass_seconds": self.last_pass_seconds,
            "replacements_frozen": self.frozen,
        }


class FakeAgents:
    """
    The parts of the agent service (L{llmgw.control.shell.agentsvc.AgentService})
    that the admin API and the metrics read; its C{inventory} is a real,
    empty L{Inventory} that tests fill.
    """

    def __init__(self, nodes: list[str] | None = None) -> None:
        self.nodes = nodes or []
        self.inventory = Inventory()
        self.registrations: collections.Counter[str] = collections.Counter()
        self.dispatch_refusals: collections.Counter[str] = collections.Counter()

    def connected_nodes(self) -> list[str]:
        return sorted(self.nodes)

    def open_connections(self) -> int:
        return len(self.nodes)


def sample_fleet() -> FakeFleet:
    """
    A small fleet: two nodes (one suspect), two deployments (one with a
    slash in its model name), one replica, two events.
    """
    fleet = FakeFleet()
    fleet.add_node("gpu-1", shards=["r1-s0"])
    fleet.add_node("gpu-2", state="suspect", connected=False)
    fleet.add_deployment("demo", desired=2, ready=1)
    fleet.add_deployment("org/big", profile="fake-2node", desired=1)
    fleet.add_replica("r1", "demo", [("gpu-1", "10.0.0.1:8000")])
    fleet.add_event(100.0, "placed", "demo needs 2 replicas, has 0", node="gpu-1", replica="r1")
    fleet.add_event(200.0, "shard_failed", "exited with 1", node="gpu-2", replica="r2",
                    shard="r2-s0", exit_code=1, signal=0, last_output="boom")
    return fleet
