"""
The inventory: what the control plane knows about each node's hardware and
when it last heard from it.

It is plain data with no I/O. Readers get copies, so nothing outside can
change a node behind the inventory's back; writers go through methods that
bump the node's generation, which lets the reconciler keep indexes up to date
by looking only at what changed.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

#: Problems kept per GPU: one is enough to keep it out of placement, and a
#: buggy agent sending ever-new texts must not grow the inventory forever.
MAX_PROBLEMS_PER_GPU = 32


@dataclass
class GPUInfo:
    index: int
    uuid: str = ""
    name: str = ""
    memory_total_mb: int = 0
    memory_used_mb: int = 0
    problems: list[str] = field(default_factory=list)


@dataclass
class Node:
    """
    One node as last reported. C{last_seen} and C{registered_at} are on the
    control plane's clock (seconds).
    """

    id: str
    gpus: list[GPUInfo] = field(default_factory=list)
    fabrics: dict[str, str] = field(default_factory=dict)
    agent_version: str = ""
    address: str = ""  # the host the node connected from
    last_seen: float = 0.0
    registered_at: float = 0.0
    certificate_not_after: float = 0.0
    generation: int = 0

    def fabric_names(self) -> list[str]:
        return sorted(self.fabrics)


def _copy_node(node: Node) -> Node:
    """
    A copy that shares nothing mutable with C{node}.

    C{copy.deepcopy} costs about 8 times as much and allocates enough to set
    off the cyclic collector during a registration storm; a L{Node}'s only
    mutable parts are its GPU list (with each GPU's problems) and its
    fabrics. A mutable field added to L{Node} or L{GPUInfo} must be copied
    here too.
    """
    return replace(
        node,
        gpus=[replace(g, problems=list(g.problems)) for g in node.gpus],
        fabrics=dict(node.fabrics),
    )


class Inventory:
    """
    Nodes by id.
    """

    def __init__(self) -> None:
        self._nodes: dict[str, Node] = {}
        self._changed: set[str] = set()
        self._generation = 0

    def _bump(self, node: Node) -> None:
        self._generation += 1
        node.generation = self._generation
        self._changed.add(node.id)

    def upsert(self, node: Node) -> None:
        """
        Add C{node} or replace what was known about it. The inventory keeps
        its own copy.
        """
        mine = _copy_node(node)
        self._nodes[node.id] = mine
        self._bump(mine)

    def touch(self, node_id: str, now: float) -> bool:
        """
        Record that C{node_id} was heard from at C{now}. Returns whether the
        node is known. Touching does not count as a change for indexes.
        """
        node = self._nodes.get(node_id)
        if node is None:
            return False
        node.last_seen = now
        return True

    def apply_heartbeat(
        self,
        node_id: str,
        memory_used_mb: Iterable[int],
        problems: Iterable[tuple[int, str]],
    ) -> bool:
        """
        Fold in a heartbeat: memory used per GPU (by position), and new
        problems as C{(gpu_index, text)}. A problem for a GPU the node does
        not have is attached to its first GPU, keeping at least that one out
        of placement. Returns whether the node is known.
        """
        node = self._nodes.get(node_id)
        if node is None:
            return False
        changed = False
        for gpu, used in zip(node.gpus, memory_used_mb, strict=False):
            if gpu.memory_used_mb != used:
                gpu.memory_used_mb = used
                changed = True
        by_index = {g.index: g for g in node.gpus}
        for index, text in problems:
            target = by_index.get(index) or (node.gpus[0] if node.gpus else None)
            if (
                target is not None
                and text not in target.problems
                and len(target.problems) < MAX_PROBLEMS_PER_GPU
            ):
                target.problems.append(text)
                changed = True
        if changed:
            self._bump(node)
        return True

    def get(self, node_id: str) -> Node | None:
        """
        A copy of the node, or C{None}.
        """
        node = self._nodes.get(node_id)
        return _copy_node(node) if node is not None else None

    def peek(self, node_id: str) -> Node | None:
        """
        The inventory's own record, for hot paths that only read it. Callers
        must not change it.
        """
        return self._nodes.get(node_id)

    def list(self) -> list[Node]:
        """
        Copies of every node, by id.
        """
        return [_copy_node(self._nodes[k]) for k in sorted(self._nodes)]

    def ids(self) -> builtins.list[str]:
        return sorted(self._nodes)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def remove(self, node_id: str) -> None:
        if self._nodes.pop(node_id, None) is not None:
            self._changed.add(node_id)

    def take_changed(self) -> set[str]:
        """
        The ids of nodes added, replaced, changed or removed since the last
        call, for incremental indexes.
        """
        changed, self._changed = self._changed, set()
        return changed
