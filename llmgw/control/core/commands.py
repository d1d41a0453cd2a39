"""
What the reconciler decides to tell agents, as data.

Decisions return these; the reconciler's shell queues them and sends them
through the dispatcher (the agent service) only after the handler that
caused them has returned, so nothing dispatches into the agent service
from inside its own message handling.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from llmgw.control.core.catalog import Deployment, Profile, fill
from llmgw.control.state.fleetstate import ReplicaRec, ShardRec, format_address
from llmgw.control.state.interfaces import IDispatcher, NotConnected, NotKeepingUp, ShardCommand
from llmgw.models.source import spec_key
from llmgw.shards import ShardSpec
from llmgw.sourcespec import ModelSource

#: A deployment's weights' cache key ("" for none), worked out once per source.
weights_key: Callable[[ModelSource | None], str] = functools.lru_cache(maxsize=4096)(spec_key)


@dataclass(frozen=True, slots=True)
class Start:
    command: ShardCommand
    #: The first send of a new shard: a refusal tears its replica down. A
    #: re-send that is refused waits for the next try instead.
    first: bool = True

    @property
    def node_id(self) -> str:
        return self.command.node_id

    @property
    def shard_id(self) -> str:
        return self.command.shard_id


@dataclass(frozen=True, slots=True)
class Stop:
    node_id: str
    shard_id: str


@dataclass(frozen=True, slots=True)
class Drain:
    node_id: str
    shard_id: str


@dataclass(frozen=True, slots=True)
class Sleep:
    """
    Have C{node_id} put leader shard C{shard_id}'s engine to sleep now.
    """

    node_id: str
    shard_id: str


@dataclass(frozen=True, slots=True)
class Prefetch:
    """
    Have C{node_id} fetch C{source} into its cache and keep it under C{pin}
    ("" for a one-off pull that LRU may evict).
    """

    node_id: str
    source: ModelSource
    pin: str
    peers: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class DropModel:
    """
    Tell C{node_id} it no longer keeps the model C{key} under C{pin}.
    """

    node_id: str
    key: str
    pin: str


@dataclass(frozen=True, slots=True)
class LoadAdapter:
    """
    Have C{node_id} load adapter C{name} (from C{source}) into shard
    C{shard_id}'s engine (one that loads adapters while it runs).
    """

    node_id: str
    shard_id: str
    name: str
    source: ModelSource


Command = Start | Stop | Drain | Sleep | Prefetch | DropModel | LoadAdapter


def send(dispatcher: IDispatcher | None, cmd: Command) -> str | None:
    """
    Send C{cmd}; returns why the dispatcher refused it, or C{None}.
    """
    if dispatcher is None:
        return "no dispatcher attached"
    try:
        if isinstance(cmd, Start):
            dispatcher.start_shard(cmd.command)
        elif isinstance(cmd, Stop):
            dispatcher.stop_shard(cmd.node_id, cmd.shard_id)
        elif isinstance(cmd, Drain):
            dispatcher.drain_shard(cmd.node_id, cmd.shard_id)
        elif isinstance(cmd, Sleep):
            dispatcher.sleep_shard(cmd.node_id, cmd.shard_id)
        elif isinstance(cmd, Prefetch):
            dispatcher.prefetch_model(cmd.node_id, cmd.source, cmd.peers, cmd.pin)
        elif isinstance(cmd, LoadAdapter):
            dispatcher.load_adapter(cmd.node_id, cmd.shard_id, cmd.name, cmd.source)
        else:
            dispatcher.drop_model(cmd.node_id, cmd.key, cmd.pin)
    except (NotConnected, NotKeepingUp) as e:
        return str(e) or type(e).__name__
    return None


def start_command(
    rep: ReplicaRec, shard: ShardRec, profile: Profile, leader_fabrics: Mapping[str, str],
    deployment: Deployment | None = None,
) -> ShardCommand:
    """
    The start command for C{shard} of C{rep}: the profile's command (or
    the one llmgw writes for C{deployment}'s source, L{Profile.launch}) and
    environment with their placeholders filled. A multi-shard replica's
    leader is reached on the profile's fabric where its node has one
    (C{leader_fabrics}: the leader node's fabric addresses).
    """
    leader = rep.shards.get(0)
    leader_address = ""
    if leader is not None:
        host = leader.host
        if profile.fabric and leader_fabrics.get(profile.fabric):
            host = leader_fabrics[profile.fabric]
        leader_address = format_address(host, leader.port)
    values = {
        "port": str(shard.port),
        "model": rep.model,
        "rank": str(shard.rank),
        "world_size": str(rep.world_size),
        "leader": leader_address,
        "gpus": ",".join(str(g) for g in shard.gpus),
        # The node's advertised address, and the leader's.
        "host": shard.host,
        "leader_host": leader.host if leader is not None else "",
    }
    launch, kept = _launch(profile, shard.rank, deployment)
    # One command built, not the launch spec copied twice: each copy
    # costs every field of the spec.
    return ShardCommand(
        node_id=shard.node_id,
        shard_id=shard.id,
        replica_id=rep.id,
        model=rep.model,
        profile=rep.profile,
        argv=[fill(a, values) for a in launch.argv],
        env={k: fill(v, values) for k, v in launch.env.items()},
        gpu_indices=shard.gpus,
        port=shard.port,
        world_size=rep.world_size,
        leader_address=leader_address,
        **kept,
    )


#: The fields of a launch spec that L{start_command} fills in per shard.
_FILLED = frozenset({"shard_id", "replica_id", "model", "profile", "argv", "env", "gpu_indices", "port",
                     "world_size", "leader_address"})
#: Launches worked out, by the identity of their profile, rank and
#: deployment (catalog records never change once made): the spec and its
#: fields that a start keeps as they are.
_LAUNCHES: dict[tuple[int, int, int], tuple[Profile, Deployment | None, ShardSpec, dict[str, Any]]] = {}
#: Enough for every profile, rank and deployment of a few catalogs.
_LAUNCHES_KEPT = 256


def _launch(profile: Profile, rank: int, deployment: Deployment | None) -> tuple[ShardSpec, dict[str, Any]]:
    """
    C{profile.launch(rank, deployment)}, and its fields other than those
    a start fills in; worked out once per profile, rank and deployment.
    """
    key = (id(profile), rank, id(deployment))
    hit = _LAUNCHES.get(key)
    # The records themselves are kept with it, so neither id can be reused meanwhile.
    if hit is not None and hit[0] is profile and hit[1] is deployment:
        return hit[2], hit[3]
    launch = profile.launch(rank, deployment)
    kept = {f.name: getattr(launch, f.name) for f in fields(ShardSpec) if f.name not in _FILLED}
    if len(_LAUNCHES) >= _LAUNCHES_KEPT:
        _LAUNCHES.clear()
    _LAUNCHES[key] = (profile, deployment, launch, kept)
    return launch, kept
