"""
Adoption (DESIGN §6.5) as a pure decision: what to make of one shard a
registering agent reports running, given the catalog and the fleet state.

L{verdict} changes nothing; the reconciler applies what it returns, one
reported shard at a time (so a replica adopted from one shard is there for
the next shard of the same replica).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.control.core.catalog import Catalog
from llmgw.control.state.fleetstate import FleetState, Phase
from llmgw.control.state.interfaces import ReportedShard
from llmgw.states import UNDER_WAY


@dataclass(frozen=True)
class Refuse:
    """Nothing claims it: stop it."""

    reason: str


@dataclass(frozen=True)
class Known:
    """The control plane placed it there: take its reported state."""


@dataclass(frozen=True)
class Join:
    """It belongs to a replica the control plane holds, at a free rank."""


@dataclass(frozen=True)
class NewReplica:
    """The first shard seen of a replica: adopt the replica."""

    world_size: int


Verdict = Refuse | Known | Join | NewReplica


def verdict(s: ReportedShard, node_id: str, catalog: Catalog, state: FleetState) -> Verdict:
    dep = catalog.deployments.get(s.model)
    if dep is None:
        return Refuse(f"model {s.model!r} is not in the catalog")
    if s.profile not in dep.profile_names:
        return Refuse(f"profile {s.profile!r} is not the deployment's ({', '.join(repr(p) for p in dep.profile_names)})")
    if s.state not in UNDER_WAY:
        return Refuse(f"reported {s.state}")
    if s.replica_id in state.retired:
        return Refuse("its replica was replaced")
    known = state.shards.get(s.shard_id)
    if known is not None:
        rep = state.replicas.get(known.replica_id)
        if (
            known.node_id != node_id
            or known.replica_id != s.replica_id
            or known.stopping
            or rep is None
            or rep.phase == Phase.STOPPING
        ):
            return Refuse("it clashes with what the control plane placed")
        return Known()
    rep = state.replicas.get(s.replica_id)
    if rep is None:
        # An agent that does not know the world size reports 1.
        world_size = s.world_size if s.world_size > 1 else catalog.profiles[s.profile].shards
        if s.rank >= world_size:
            return Refuse(f"rank {s.rank} is outside a world of {world_size}")
        return NewReplica(world_size)
    if rep.phase == Phase.STOPPING or rep.model != s.model or s.rank in rep.shards or s.rank >= rep.world_size:
        return Refuse("its replica is stopping or already has that rank")
    return Join()
