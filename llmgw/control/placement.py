"""
Placement (DESIGN §6.2) as pure decisions over plain data.

The reconciler hands a L{Placer} the nodes that may take work (connected,
not suspect, not lost, not cordoned) with the GPUs each can give: no health
problems, not given to another shard, and free memory (total, less used,
less what placed-but-silent shards will take) already worked out. The placer
then answers one replica at a time:

  - all shards of a replica or none;
  - a multi-shard replica on distinct nodes that share the profile's fabric;
  - replicas of one deployment spread across nodes (fewest of its shards
    first);
  - otherwise best fit: the node with the fewest free GPUs that still fit
    (large holes stay for large models), and on it the GPUs with the least
    free memory that still covers the profile;
  - ties broken by node id, so the same inputs give the same answer;
  - ports from a per-host range (L{PortBook}), never one in use there.

A deployment's candidates are heaps by how many of its shards a node holds,
each ordered by (free GPUs, free memory, id), built once per pass; placing R
replicas of D deployments over N nodes costs about D times N plus R log N,
not R times N.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


class NoPortFree(Exception):
    """
    Every port of the range is in use on a host.
    """


@dataclass
class NodeCapacity:
    """
    A node that may take work, and what it can give.

    C{free} lists C{(free_mb, gpu_index)} for each eligible GPU.
    """

    id: str
    host: str = "127.0.0.1"
    fabrics: Mapping[str, str] = field(default_factory=dict)
    free: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free = sorted(self.free)


@dataclass(frozen=True)
class Request:
    """
    One replica to place: C{shards} nodes, each with C{gpus_per_shard}
    GPUs that have C{gpu_memory_mb} free. C{group} is what spreading is
    counted by (the deployment's model).
    """

    group: str
    shards: int = 1
    gpus_per_shard: int = 1
    gpu_memory_mb: int = 0
    fabric: str = ""


@dataclass(frozen=True)
class Slot:
    """
    Where one shard goes.
    """

    node_id: str
    rank: int
    gpu_indices: tuple[int, ...]
    port: int
    host: str


class PortBook:
    """
    Ports in use per host, and where each host's next search starts.

    Nodes that connect from the same address share its ports, so agents of
    a local fleet on one machine never get the same port. The search starts
    after the last port handed out rather than at the bottom of the range,
    so a port a crashed shard just held is not reused at once.
    """

    def __init__(self, first: int = 20000, last: int = 29999):
        self.first, self.last = first, last
        self.used: dict[str, set[int]] = {}
        #: How many records hold each port, where more than one does (a
        #: shard and a reservation for the same process, say).
        self._holders: dict[tuple[str, int], int] = {}
        self._cursor: dict[str, int] = {}

    def set_range(self, first: int, last: int) -> None:
        self.first, self.last = first, last

    def take(self, host: str, port: int) -> None:
        """
        Record that C{port} is in use on C{host} (a shard adopted with it,
        or one that may still run). Each take is undone by one release.
        """
        used = self.used.setdefault(host, set())
        if port in used:
            key = (host, port)
            self._holders[key] = self._holders.get(key, 1) + 1
        else:
            used.add(port)

    def release(self, host: str, port: int) -> None:
        key = (host, port)
        held = self._holders.get(key)
        if held is not None:
            if held > 2:
                self._holders[key] = held - 1
            else:
                del self._holders[key]
            return
        used = self.used.get(host)
        if used is not None:
            used.discard(port)
            if not used:
                del self.used[host]

    def in_use(self, host: str, port: int) -> bool:
        return port in self.used.get(host, ())

    def allocate(self, host: str) -> int:
        """
        A free port on C{host}, now taken.

        @raise NoPortFree: the whole range is in use there.
        """
        used = self.used.setdefault(host, set())
        span = self.last - self.first + 1
        start = self._cursor.get(host, self.first)
        if not self.first <= start <= self.last:
            start = self.first
        for i in range(span):
            port = self.first + (start - self.first + i) % span
            if port not in used:
                used.add(port)
                self._cursor[host] = port + 1 if port < self.last else self.first
                return port
        raise NoPortFree(f"every port in {self.first}..{self.last} is in use on {host}")


def _key(node: NodeCapacity) -> tuple[int, int, str]:
    return (len(node.free), sum(f for f, _ in node.free), node.id)


class Placer:
    """
    One reconcile pass's placement state.

    Candidates for a group (a deployment) are kept in heaps by tier (how
    many of the group's shards a node holds), each ordered by the node's
    best-fit key, built the first time the group places in the pass. A node
    whose key changed since it was pushed is re-pushed when it comes up, so
    a placement costs a few heap operations, not a scan of the fleet.

    @param nodes: the nodes that may take work.
    @param spread: for each group, shards of that group already on each node.
    @param ports: the port book; a successful placement takes its ports.
    """

    def __init__(
        self,
        nodes: Iterable[NodeCapacity],
        spread: Mapping[str, Mapping[str, int]],
        ports: PortBook,
    ):
        self._nodes: dict[str, NodeCapacity] = {}
        self._keys: dict[str, tuple[int, int, str]] = {}
        self._by_fabric: dict[str, list[str]] = {}
        for node in nodes:
            if not node.free:
                continue
            self._nodes[node.id] = node
            self._keys[node.id] = _key(node)
            for fabric in node.fabrics:
                self._by_fabric.setdefault(fabric, []).append(node.id)
        self._spread = spread
        self._extra: dict[str, dict[str, int]] = {}
        self._owned: set[str] = set()
        self._groups: dict[tuple[str, str, int, int], dict[int, list[tuple[int, int, str]]]] = {}
        self.ports = ports
        #: Candidates looked at, for the benchmark and tests of its cost.
        self.scanned = 0

    def __len__(self) -> int:
        return len(self._nodes)

    def _count(self, group: str, node_id: str) -> int:
        base = self._spread.get(group)
        n = base.get(node_id, 0) if base is not None else 0
        extra = self._extra.get(group)
        return n + (extra.get(node_id, 0) if extra is not None else 0)

    @staticmethod
    def _fit(node: NodeCapacity, req: Request) -> list[tuple[int, int]] | None:
        i = bisect.bisect_left(node.free, (req.gpu_memory_mb, -1))
        if len(node.free) - i < req.gpus_per_shard:
            return None
        return node.free[i : i + req.gpus_per_shard]

    def _tiers(self, req: Request) -> dict[int, list[tuple[int, int, str]]]:
        fabric = req.fabric if req.shards > 1 else ""
        gkey = (req.group, fabric, req.gpus_per_shard, req.gpu_memory_mb)
        tiers = self._groups.get(gkey)
        if tiers is None:
            tiers = {}
            ids = self._by_fabric.get(fabric, ()) if fabric else self._nodes
            for node_id in ids:
                node = self._nodes.get(node_id)
                # Nodes only lose GPUs during a pass: no fit now, none later.
                if node is None or self._fit(node, req) is None:
                    continue
                tiers.setdefault(self._count(req.group, node_id), []).append(self._keys[node_id])
            for heap in tiers.values():
                heapq.heapify(heap)
            self._groups[gkey] = tiers
        return tiers

    def place(self, req: Request) -> list[Slot] | None:
        """
        Place one replica: its slots by rank, or C{None} when it does not
        fit (then nothing is taken).
        """
        if req.shards > 1 and not req.fabric:
            return None
        tiers = self._tiers(req)
        chosen: list[tuple[str, list[tuple[int, int]], int]] = []
        for tier in sorted(tiers):
            heap = tiers[tier]
            while heap and len(chosen) < req.shards:
                key = heapq.heappop(heap)
                self.scanned += 1
                node_id = key[2]
                current = self._keys.get(node_id)
                if current is None:
                    continue
                if current != key:
                    heapq.heappush(heap, current)
                    continue
                gpus = self._fit(self._nodes[node_id], req)
                if gpus is not None:
                    chosen.append((node_id, gpus, tier))
            if len(chosen) == req.shards:
                break
        slots: list[Slot] = []
        if len(chosen) == req.shards:
            try:
                for rank, (node_id, gpus, _) in enumerate(chosen):
                    host = self._nodes[node_id].host
                    port = self.ports.allocate(host)
                    slots.append(Slot(node_id, rank, tuple(sorted(i for _, i in gpus)), port, host))
            except NoPortFree:
                for s in slots:
                    self.ports.release(s.host, s.port)
                slots = []
        if not slots:
            for node_id, _, tier in chosen:
                heapq.heappush(tiers[tier], self._keys[node_id])
            return None
        extra = self._extra.setdefault(req.group, {})
        for node_id, gpus, tier in chosen:
            self._take(node_id, gpus)
            extra[node_id] = extra.get(node_id, 0) + 1
            if node_id in self._keys:
                heapq.heappush(tiers.setdefault(tier + 1, []), self._keys[node_id])
        return slots

    def _take(self, node_id: str, gpus: list[tuple[int, int]]) -> None:
        node = self._nodes[node_id]
        if node_id not in self._owned:
            # Copy on first write: callers may keep their capacities cached.
            node = NodeCapacity(node.id, node.host, node.fabrics, list(node.free))
            self._nodes[node_id] = node
            self._owned.add(node_id)
        for g in gpus:
            node.free.remove(g)
        if not node.free:
            del self._nodes[node_id], self._keys[node_id]
        else:
            self._keys[node_id] = _key(node)


def place_all(
    nodes: Iterable[NodeCapacity],
    requests: Iterable[Request],
    spread: Mapping[str, Mapping[str, int]] | None = None,
    ports: PortBook | None = None,
) -> list[list[Slot] | None]:
    """
    Place C{requests} in order over C{nodes}: each answer is the slots of
    one replica, or C{None} where it did not fit.
    """
    placer = Placer(nodes, spread or {}, ports or PortBook())
    return [placer.place(r) for r in requests]
