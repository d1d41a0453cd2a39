"""
The seams between the agent service, the reconciler and the gateway.

Each side is tested against a fake of the other through these interfaces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from zope.interface import Interface

from llmgw.routing import IInFlight, IRoutingTable, Route
from llmgw.shards import ReportedShard, ShardReport, ShardSpec
from llmgw.sourcespec import ModelSource

# Re-exported: they live in llmgw.routing, and in llmgw.shards, which the
# agent shares.
__all__ = ["IInFlight", "IRoutingTable", "ReportedShard", "Route", "ShardReport", "ShardSpec"]


class NotConnected(Exception):
    """
    No agent stream is open for the node.
    """


class NotKeepingUp(Exception):
    """
    The node's stream has too many commands waiting behind a transport that
    is not being read; more would only hide a broken node.
    """


@dataclass(frozen=True, kw_only=True)
class ShardCommand(ShardSpec):
    """
    A shard's spec addressed to the node that is to run it.
    """

    node_id: str
    #: Peer addresses of nodes holding the shard's weights complete
    #: (StartShard.model_peers); filled by the control plane as it sends.
    model_peers: tuple[str, ...] = ()

    @classmethod
    def to_node(cls, node_id: str, spec: ShardSpec) -> ShardCommand:
        """
        C{spec}, addressed to C{node_id}.
        """
        return cls(node_id=node_id, **{f.name: getattr(spec, f.name) for f in fields(ShardSpec)})


class IDispatcher(Interface):
    """
    Delivers commands to agents. The agent service implements it.
    """

    def start_shard(command: ShardCommand) -> None:
        """
        Send a C{StartShard} to C{command.node_id}.

        @raise NotConnected: no stream is open for the node.
        @raise NotKeepingUp: the node is too far behind.
        """

    def stop_shard(node_id: str, shard_id: str) -> None:
        """
        Send a C{StopShard}. Raises like L{start_shard}.
        """

    def drain_shard(node_id: str, shard_id: str) -> None:
        """
        Send a C{DrainShard}. Raises like L{start_shard}.
        """

    def sleep_shard(node_id: str, shard_id: str) -> None:
        """
        Send a C{SleepShard}. Raises like L{start_shard}.
        """

    def prefetch_model(node_id: str, source: ModelSource, peers: Sequence[str], pin: str) -> None:
        """
        Send a C{PrefetchModel}: C{node_id} fetches C{source} into its cache
        (from C{peers} first) and keeps it under C{pin} ("" for none).
        Raises like L{start_shard}.
        """

    def drop_model(node_id: str, key: str, pin: str) -> None:
        """
        Send a C{DropModel}: C{node_id} no longer keeps C{key} under C{pin}.
        Raises like L{start_shard}.
        """

    def load_adapter(node_id: str, shard_id: str, name: str, source: ModelSource) -> None:
        """
        Send a C{LoadAdapter}: C{node_id} loads adapter C{name} from
        C{source} into shard C{shard_id}'s engine. Raises like L{start_shard}.
        """

    def connected_nodes() -> list[str]:
        """
        The ids of the nodes with an open, registered stream, sorted.
        """


class IStatusSink(Interface):
    """
    Receives what agents report. The reconciler implements it.
    """

    def adopt(node_id: str, shards: list[ReportedShard]) -> list[ReportedShard]:
        """
        Claim the shards a node reports running; return those nothing claims
        (the caller stops them).
        """

    def on_shard_status(report: ShardReport) -> None:
        """
        A shard changed state.
        """

    def shard_node(shard_id: str) -> str | None:
        """
        The node the control plane placed or adopted C{shard_id} on, or
        C{None} if it knows no such shard.
        """

    def node_registered(node_id: str) -> None:
        """
        A node registered (or registered again) and is in the inventory.
        """


class AdminError(Exception):
    """
    An admin request was refused. C{status} is the HTTP status the admin API
    answers with (400 malformed, 404 unknown, 409 conflict).
    """

    status = 400


class UnknownNode(AdminError):
    status = 404


class UnknownDeployment(AdminError):
    status = 404


class IFleetAdmin(Interface):
    """
    What the admin API and C{llmgw ctl} see and do. The reconciler
    implements it. Every view is plain JSON-able data, and times are seconds
    since 1970 (wall clock) so an operator can read them.
    """

    def status() -> dict:  # type: ignore[type-arg]
        """
        Summary: counts of nodes, deployments and replicas by state, whether
        replacements are frozen and why, the epoch, the catalog's path.
        """

    def nodes() -> list[dict]:  # type: ignore[type-arg]
        """
        Each node: C{id}, C{state} (C{ready}, C{suspect}, C{lost}),
        C{connected}, C{cordoned}, C{draining}, C{last_seen}, C{gpus} (index,
        name, memory_total_mb, memory_used_mb, problems), C{fabrics} (name to
        address), C{shards} (shard ids).
        """

    def deployments() -> list[dict]:  # type: ignore[type-arg]
        """
        Each deployment: C{model}, C{profile}, C{desired}, C{ready},
        C{backoff_until} (or C{None}: it can place now; with variants, set
        only while every variant is in backoff), C{failures} (with variants,
        summed over them), C{variants_backoff} (C{None} without variants,
        else each variant's profile to its C{failures} and
        C{backoff_until}), C{last_failure} (C{None} or a dict with node,
        replica, shard, exit_code, signal, error, last_output, time).
        """

    def replicas() -> list[dict]:  # type: ignore[type-arg]
        """
        Each replica: C{id}, C{model}, C{profile}, C{state}, C{draining},
        C{shards} (each C{id}, C{node}, C{rank}, C{state}, C{address} as
        C{host:port}).
        """

    def events(since: float = 0.0) -> list[dict]:  # type: ignore[type-arg]
        """
        Events newer than C{since}, oldest first: C{time}, C{kind}, C{node},
        C{replica}, C{shard}, C{reason}, and for failures C{exit_code},
        C{signal}, C{last_output}.
        """

    def cordon(node_id: str) -> None:
        """
        @raise UnknownNode: no such node.
        """

    def uncordon(node_id: str) -> None:
        """
        @raise UnknownNode: no such node.
        """

    def drain_node(node_id: str) -> None:
        """
        Cordon the node and move its replicas off it, make-before-break.

        @raise UnknownNode: no such node.
        """

    def scale(model: str, replicas: int) -> None:
        """
        Set the desired replica count of C{model}'s deployment; kept across
        restarts.

        @raise UnknownDeployment: no deployment serves C{model}.
        @raise AdminError: C{replicas} is negative.
        """

    def scale_bounds(model: str, min_replicas: int, max_replicas: int) -> None:
        """
        Set the bounds an autoscaled deployment scales between; kept across
        restarts until the catalog's own bounds change.

        @raise UnknownDeployment: no deployment serves C{model}.
        @raise AdminError: the deployment does not autoscale, or the bounds
            are out of order.
        """

    def report_demand(gateway_id: str, models: dict) -> None:  # type: ignore[type-arg]
        """
        A standalone gateway's demand per model (L{llmgw.routing.Demand}),
        replacing its previous report; it counts for a few seconds.
        """

    def models_view() -> dict:  # type: ignore[type-arg]
        """
        The weight caches: which model each node holds, its size, state and
        last use, and which deployments use it
        (L{llmgw.control.shell.modelviews.models}).
        """

    def pull_model(model: str, nodes: list[str]) -> list[str]:
        """
        Stage C{model}'s weights on C{nodes}, or where prefetch would choose
        with none; returns the nodes told.

        @raise UnknownDeployment: no deployment serves C{model}.
        @raise UnknownNode: a named node is not known.
        @raise AdminError: nothing to fetch, a node not connected, or no node
            may take them.
        """

    def retry(model: str) -> None:
        """
        Lift C{model}'s hold (a configuration failure holds its deployment:
        nothing is placed for it) and its crash backoff, so the next pass
        places again. Nothing to lift is no error.

        @raise UnknownDeployment: no deployment serves C{model}.
        """

    def reload_catalog() -> dict:  # type: ignore[type-arg]
        """
        Re-read the catalog file; returns a summary of what changed.

        @raise AdminError: the new catalog is refused (the message names the
            entry and field); the running one stays.
        """
