"""
Test tools for the reconciler: a fake dispatcher that records commands, and
builders for fleets of simulated nodes. The benchmark uses them too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from zope.interface import implementer

from llmgw.control.state.interfaces import IDispatcher, NotConnected, ShardCommand
from llmgw.control.state.inventory import GPUInfo, Inventory, Node
from llmgw.sourcespec import ModelSource


@implementer(IDispatcher)
@dataclass
class FakeDispatcher:
    """
    Records every command. Nodes in C{connected} accept commands; others
    raise L{NotConnected}. C{refuse} maps a node to an exception to raise.
    """

    connected: set[str] = field(default_factory=set)
    refuse: dict[str, Exception] = field(default_factory=dict)
    starts: list[ShardCommand] = field(default_factory=list)
    stops: list[tuple[str, str]] = field(default_factory=list)
    drains: list[tuple[str, str]] = field(default_factory=list)
    #: (node, shard) of each SleepShard.
    sleeps: list[tuple[str, str]] = field(default_factory=list)
    #: (node, source, peers, pin) of each PrefetchModel.
    prefetches: list[tuple[str, ModelSource, tuple[str, ...], str]] = field(default_factory=list)
    #: (node, key, pin) of each DropModel.
    model_drops: list[tuple[str, str, str]] = field(default_factory=list)
    #: (node, shard, adapter) of each LoadAdapter.
    adapter_loads: list[tuple[str, str, str]] = field(default_factory=list)

    def _check(self, node_id: str) -> None:
        if node_id in self.refuse:
            raise self.refuse[node_id]
        if node_id not in self.connected:
            raise NotConnected(f"no agent stream is open for node {node_id}")

    def start_shard(self, command: ShardCommand) -> None:
        self._check(command.node_id)
        self.starts.append(command)

    def stop_shard(self, node_id: str, shard_id: str) -> None:
        self._check(node_id)
        self.stops.append((node_id, shard_id))

    def drain_shard(self, node_id: str, shard_id: str) -> None:
        self._check(node_id)
        self.drains.append((node_id, shard_id))

    def sleep_shard(self, node_id: str, shard_id: str) -> None:
        self._check(node_id)
        self.sleeps.append((node_id, shard_id))

    def prefetch_model(self, node_id: str, source: ModelSource, peers: Sequence[str], pin: str) -> None:
        self._check(node_id)
        self.prefetches.append((node_id, source, tuple(peers), pin))

    def drop_model(self, node_id: str, key: str, pin: str) -> None:
        self._check(node_id)
        self.model_drops.append((node_id, key, pin))

    def load_adapter(self, node_id: str, shard_id: str, name: str, source: ModelSource) -> None:
        self._check(node_id)
        self.adapter_loads.append((node_id, shard_id, name))

    def connected_nodes(self) -> list[str]:
        return sorted(self.connected)

    def clear(self) -> None:
        self.starts.clear()
        self.stops.clear()
        self.drains.clear()


def sim_node(
    node_id: str,
    gpus: int = 8,
    memory_mb: int = 80_000,
    fabrics: dict[str, str] | None = None,
    address: str = "",
    now: float = 0.0,
) -> Node:
    """
    A node with C{gpus} identical simulated GPUs.
    """
    return Node(
        id=node_id,
        gpus=[
            GPUInfo(index=i, uuid=f"GPU-{node_id}-{i}", name="SimGPU", memory_total_mb=memory_mb)
            for i in range(gpus)
        ],
        fabrics=dict(fabrics or {}),
        address=address or f"10.{hash(node_id) % 250}.0.1",
        last_seen=now,
        registered_at=now,
    )


def sim_fleet(
    inventory: Inventory,
    count: int,
    gpus: int = 8,
    memory_mb: int = 80_000,
    fabric: str = "",
    now: float = 0.0,
    prefix: str = "node",
) -> list[str]:
    """
    Add C{count} nodes named C{prefix-00000}... and return their ids. With
    C{fabric}, every node is on it.
    """
    ids = []
    for i in range(count):
        node_id = f"{prefix}-{i:05d}"
        fabrics = {fabric: f"192.168.{i // 250}.{i % 250}"} if fabric else None
        inventory.upsert(
            sim_node(node_id, gpus, memory_mb, fabrics, address=f"10.0.{i // 250}.{i % 250}", now=now)
        )
        ids.append(node_id)
    return ids
