"""
The states of a shard and of a replica (DESIGN §6.4), shared by the wire
(L{llmgw.wire}), the agent's supervisor, the control plane and its metrics.

Both are C{StrEnum}s whose values are the strings the admin API, the event
log and the metrics have always shown, so a member compares equal to its
string and renders as it in JSON.
"""

from __future__ import annotations

from enum import StrEnum


class ShardState(StrEnum):
    #: Placed and the start command sent; nothing heard yet (control plane only).
    PENDING = "pending"
    #: Its weights are being put on its node: no process yet, but its GPUs
    #: and port are held. It is starting once they are there.
    FETCHING = "fetching"
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    #: Told to stop, and its process group is not empty yet: not serving,
    #: and its GPUs and port are not free.
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


class ReplicaState(StrEnum):
    """
    A replica's state is its worst shard's (L{SEVERITY}), or C{STOPPING}
    once the control plane tore it down and waits for its shards to stop.
    """

    PENDING = "pending"
    FETCHING = "fetching"
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


#: States in which a shard's process runs (what an agent lists in Register).
LIVE = frozenset({ShardState.STARTING, ShardState.READY, ShardState.DRAINING})
#: States of a shard that an agent has taken on and not yet been told to
#: stop: fetching its weights, or its process runs. What a Register lists
#: as running, and what the control plane keeps.
UNDER_WAY = LIVE | {ShardState.FETCHING}
#: States in which a shard serves requests.
SERVING = frozenset({ShardState.READY, ShardState.DRAINING})
#: A shard's process has ended.
ENDED = frozenset({ShardState.STOPPED, ShardState.FAILED})

#: Worse is larger: a replica's state is its worst shard's.
SEVERITY: dict[str, int] = {
    ShardState.READY: 0,
    ShardState.DRAINING: 1,
    ShardState.STARTING: 2,
    ShardState.FETCHING: 3,
    ShardState.PENDING: 4,
    ShardState.STOPPING: 5,
    ShardState.STOPPED: 6,
    ShardState.FAILED: 7,
}
