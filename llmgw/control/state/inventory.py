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

from llmgw.control.state.modelindex import CachedCopy, CacheRoom, ModelIndex

#: Stray processes kept per node: enough to see what is wrong, bounded
#: whatever an agent sends.
MAX_STRAYS_PER_NODE = 64
#: Characters kept of a stray's command line and reason.
MAX_STRAY_TEXT = 256

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


@dataclass(frozen=True)
class StrayProcess:
    """
    A process on a node that carries the agent's shard marker but that no
    shard accounts for (as the agent's Register listed it).
    """

    pid: int
    pgid: int = 0
    shard_id: str = ""
    reason: str = ""
    command: str = ""

    def as_dict(self) -> dict[str, object]:
        return {"pid": self.pid, "pgid": self.pgid, "shard_id": self.shard_id,
                "reason": self.reason, "command": self.command}


def bounded_strays(strays: Iterable[StrayProcess]) -> list[StrayProcess]:
    """
    The first L{MAX_STRAYS_PER_NODE} of C{strays}, their texts cut at
    L{MAX_STRAY_TEXT} characters.
    """
    out: list[StrayProcess] = []
    for s in strays:
        if len(out) >= MAX_STRAYS_PER_NODE:
            break
        out.append(replace(s, shard_id=s.shard_id[:MAX_STRAY_TEXT], reason=s.reason[:MAX_STRAY_TEXT],
                           command=s.command[:MAX_STRAY_TEXT]))
    return out


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
    #: From the latest Register, at most L{MAX_STRAYS_PER_NODE}; the
    #: elements are immutable, so copies share them.
    stray_processes: list[StrayProcess] = field(default_factory=list)

    def fabric_names(self) -> list[str]:
        return sorted(self.fabrics)


def _copy_node(node: Node) -> Node:
    """
    A copy that shares nothing mutable with C{node}.

    C{copy.deepcopy} costs about 8 times as much and allocates enough to set
    off the cyclic collector during a registration storm; a L{Node}'s only
    mutable parts are its GPU list (with each GPU's problems), its fabrics
    and its list of (immutable) strays. A mutable field added to L{Node} or L{GPUInfo} must be copied
    here too.
    """
    return replace(
        node,
        gpus=[replace(g, problems=list(g.problems)) for g in node.gpus],
        fabrics=dict(node.fabrics),
        stray_processes=list(node.stray_processes),
    )


class Inventory:
    """
    Nodes by id.
    """

    def __init__(self) -> None:
        self._nodes: dict[str, Node] = {}
        self._changed: set[str] = set()
        self._generation = 0
        #: Nodes whose latest Register listed strays: the gauge reads these
        #: without walking every node.
        self._with_strays: set[str] = set()
        #: What each node's weight cache holds (L{apply_cache}).
        self.models = ModelIndex()

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
        mine.stray_processes = bounded_strays(mine.stray_processes)
        self._nodes[node.id] = mine
        if mine.stray_processes:
            self._with_strays.add(node.id)
        else:
            self._with_strays.discard(node.id)
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

    def apply_cache(self, node_id: str, copies: Iterable[CachedCopy] | None,
                    room: CacheRoom | None = None, peer_address: str | None = None) -> bool:
        """
        Fold in a node's cache report (L{ModelIndex.report}); a change
        placement looks at counts as a change of the node. Returns whether
        the node is known.
        """
        node = self._nodes.get(node_id)
        if node is None:
            return False
        if self.models.report(node_id, copies, room, peer_address):
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

    def strays(self, node_id: str) -> builtins.list[StrayProcess]:
        """
        The stray processes C{node_id}'s latest Register listed (empty for
        an unknown node).
        """
        node = self._nodes.get(node_id)
        return list(node.stray_processes) if node is not None else []

    def stray_counts(self) -> dict[str, int]:
        """
        C{{node: number of strays}} for the nodes that have any.
        """
        return {k: len(self._nodes[k].stray_processes) for k in sorted(self._with_strays)}

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
        self._with_strays.discard(node_id)
        self.models.drop(node_id)
        if self._nodes.pop(node_id, None) is not None:
            self._changed.add(node_id)

    def take_changed(self) -> set[str]:
        """
        The ids of nodes added, replaced, changed or removed since the last
        call, for incremental indexes.
        """
        changed, self._changed = self._changed, set()
        return changed
