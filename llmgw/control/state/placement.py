"""
Placement (DESIGN §6.2) as pure decisions over plain data.

The reconciler hands a L{Placer} the nodes that may take work (connected,
not suspect, not lost, not cordoned) with the GPUs each can give: no health
problems, not given to another shard, and free memory (total, less used,
less what placed-but-silent shards will take) already worked out. The placer
then answers one replica at a time:

  - all shards of a replica or none;
  - a multi-shard replica on distinct nodes that share the profile's fabric;
  - only GPUs of the profile's C{gpu_types} where it names some
    (L{llmgw.gputypes});
  - replicas of one deployment spread across nodes (fewest of its shards
    first);
  - then the profile's C{prefer_gpu_types}: a node whose fitting GPUs
    are of an earlier preferred type first, and on it those GPUs;
  - then the weights: a node whose cache holds the deployment's model
    complete, then one fetching it, then the others; never a node whose
    cache is too small for a model of known size (L{ModelIndex});
  - otherwise best fit: the node with the fewest free GPUs that still fit
    (large holes stay for large models), and on it the GPUs with the least
    free memory that still covers the profile;
  - ties broken by node id, so the same inputs give the same answer;
  - ports from a per-host range (L{PortBook}), never one in use there.

A deployment's candidates are heaps by how many of its shards a node holds,
each ordered by (preferred type, weights, free GPUs, free memory, id), built once and kept; placing R
replicas of D deployments over N nodes costs about D times N plus R log N,
not R times N.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from llmgw.control.state.modelindex import ModelIndex
from llmgw.gputypes import matches, preference


class NoPortFree(Exception):
    """
    Every port of the range is in use on a host.
    """


@dataclass
class NodeCapacity:
    """
    A node that may take work, and what it can give.

    C{free} lists C{(free_mb, gpu_index)} for each eligible GPU;
    C{names} the model name of each GPU by index, for GPU types.
    """

    id: str
    host: str = "127.0.0.1"
    fabrics: Mapping[str, str] = field(default_factory=dict)
    free: list[tuple[int, int]] = field(default_factory=list)
    names: Mapping[int, str] = field(default_factory=dict)

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
    #: The cache key of the deployment's weights ("" for none): nodes that
    #: hold them are preferred.
    weights: str = ""
    #: GPU types the GPUs must be of (any, when empty), and those preferred
    #: among the GPUs that fit, most preferred first.
    gpu_types: tuple[str, ...] = ()
    prefer_gpu_types: tuple[str, ...] = ()


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


def _key(node: NodeCapacity) -> tuple[int, int, int, int, str]:
    # The heap entry of a group with no weights and no preferred types.
    return (0, 0, len(node.free), sum(f for f, _ in node.free), node.id)


#: A group's key: the group, the fabric (multi-shard only), GPUs per shard,
#: memory per GPU, the weights' cache key, the GPU types required and
#: those preferred.
GroupKey = tuple[str, str, int, int, str, tuple[str, ...], tuple[str, ...]]
#: A heap entry: the node's preferred-type rank, its weights rank, then
#: its best-fit key.
Entry = tuple[int, int, int, int, str]


#: What L{Placer.place} answers while a group's candidates are still being
#: gathered and the caller's time is up: ask again in the next pass.
BUSY: list[Slot] = []

#: Candidates gathered between looks at the caller's clock.
_CHUNK = 256


class Placer:
    """
    Placement state, kept from pass to pass and told of each node that
    changed (L{update}).

    Candidates for a group (a deployment) are kept in heaps by tier (how
    many of the group's shards a node holds), each entry ordered by the
    node's weights rank (L{ModelIndex.rank}) then its best-fit key; the
    entry each node has live there is recorded, and any other entry of it
    that comes up is a stale duplicate, dropped. An entry whose key or
    tier is no longer the node's is put back with the current ones when it
    comes up, but a node that now sorts earlier by tier or rank (its shards
    of the group went away, or it now holds the weights) gets a new entry
    at once, since its old one would come up after nodes it should precede;
    a node that turns up (or can take work again) gets an entry in each
    group that has none for it. So a placement costs a few heap
    operations and a changed node at most one per group, never a scan of
    the fleet. A group's heaps are gathered the first time it places, a
    chunk at a time within the caller's time (C{over}), and then kept.

    @param nodes: the nodes that may take work.
    @param spread: for each group, shards of that group already on each
        node. With C{live_spread}, the caller adds every placed shard there
        itself (the fleet state does) before the next placement; otherwise
        the placer counts its own placements on top.
    @param ports: the port book; a successful placement takes its ports.
    """

    def __init__(
        self,
        nodes: Iterable[NodeCapacity],
        spread: Mapping[str, Mapping[str, int]],
        ports: PortBook,
        live_spread: bool = False,
        weights: ModelIndex | None = None,
    ):
        self._nodes: dict[str, NodeCapacity] = {}
        self._keys: dict[str, Entry] = {}
        self._by_fabric: dict[str, dict[str, None]] = {}
        self._spread = spread
        self._live = live_spread
        self._extra: dict[str, dict[str, int]] = {}
        self._owned: set[str] = set()
        #: Each group's heaps by tier (keyed by group and request shape),
        #: the nodes with an entry there, and the ids still to gather for
        #: groups being gathered.
        self._groups: dict[GroupKey, dict[int, list[Entry]]] = {}
        self._members: dict[GroupKey, dict[str, Entry]] = {}
        #: The tier of each live entry (two maps, not one of pairs: a pair
        #: per node and group would be as many objects more to collect).
        self._member_tiers: dict[GroupKey, dict[str, int]] = {}
        self._gathering: dict[GroupKey, list[str]] = {}
        self._weights = weights
        self.ports = ports
        #: Candidates looked at, for the benchmark and tests of its cost.
        self.scanned = 0
        #: The nodes that may take work, free GPUs or not (where GPUs are
        #: lent: L{llmgw.control.state.lendable}).
        self.eligible: set[str] = set()
        for node in nodes:
            self._set(node.id, node)
            self.eligible.add(node.id)

    def __len__(self) -> int:
        return len(self._nodes)

    def _set(self, node_id: str, node: NodeCapacity | None) -> None:
        old = self._nodes.pop(node_id, None)
        self._keys.pop(node_id, None)
        self._owned.discard(node_id)
        if old is not None:
            for fabric in old.fabrics:
                members = self._by_fabric.get(fabric)
                if members is not None:
                    members.pop(node_id, None)
        if node is None or not node.free:
            return
        self._nodes[node_id] = node
        self._keys[node_id] = _key(node)
        for fabric in node.fabrics:
            self._by_fabric.setdefault(fabric, {})[node_id] = None

    def update(self, node_id: str, node: NodeCapacity | None, fewer: bool = True) -> None:
        """
        C{node_id} changed: it can now give C{node}, or takes no work
        (C{None}). C{fewer=False}: it holds no fewer shards of any group
        than when it was last updated (the caller keeps count), so its
        live entries sort no later than they should.
        """
        # One the placer did not have may hold fewer than its old entries say.
        fewer = fewer or node_id not in self._nodes
        self._set(node_id, node)
        if node is None:
            self.eligible.discard(node_id)
        else:
            self.eligible.add(node_id)
        node = self._nodes.get(node_id)
        if node is None:
            return
        spread, extras = self._spread, self._extra
        for gkey, members in self._members.items():
            if not fewer and node_id in members and not gkey[4] and not gkey[6]:
                continue  # as below, without looking further (most groups, most updates)
            group, fabric, gpus, mem, weights, types, prefer = gkey
            live_tier = self._member_tiers[gkey].get(node_id)
            plain = not weights and not prefer
            # A live entry that sorts too early is put right when it comes
            # up; one that sorts too late (the node now holds fewer of the
            # group's shards) would let nodes that hold more be taken first.
            # One in tier 0 never does: the node's shards are not looked up.
            if plain and live_tier == 0:
                continue
            # self._count(group, node_id), inline: once per group per node changed
            base, extra = spread.get(group), extras.get(group)
            tier = ((base.get(node_id, 0) if base is not None else 0)
                    + (extra.get(node_id, 0) if extra is not None else 0))
            if plain and live_tier is not None and tier >= live_tier:
                continue
            if fabric and fabric not in node.fabrics:
                continue
            if (self._fit(node, Request(group, 1, gpus, mem, gpu_types=types, prefer_gpu_types=prefer))
                    is None or (not plain and self._refused(gkey, node_id))):
                continue
            entry = self._keys[node_id] if plain else self._entry(gkey, node_id)
            if live_tier is not None and (
                    tier > live_tier or (tier == live_tier and entry[:2] >= members[node_id][:2])):
                # Its live entry comes up no later than the node now sorts
                # (tier, preferred types and weights no better): put right
                # lazily then.
                continue
            members[node_id], self._member_tiers[gkey][node_id] = entry, tier
            heapq.heappush(self._groups[gkey].setdefault(tier, []), entry)

    def _entry(self, gkey: GroupKey, node_id: str) -> Entry:
        weights, prefer = gkey[4], gkey[6]
        if not weights and not prefer:
            return self._keys[node_id]
        rank = self._weights.rank(weights, node_id) if weights and self._weights is not None else 0
        liked = 0
        if prefer:
            # The least preferred GPU a placement here would take.
            node = self._nodes[node_id]
            fit = self._fit(node, Request(gkey[0], 1, gkey[2], gkey[3], gpu_types=gkey[5],
                                          prefer_gpu_types=prefer))
            liked = max((preference(node.names.get(i, ""), prefer) for _, i in fit or ()),
                        default=len(prefer))
        return (liked, rank, *self._keys[node_id][2:])

    def _refused(self, gkey: GroupKey, node_id: str) -> bool:
        weights = gkey[4]
        return bool(weights) and self._weights is not None and self._weights.too_small(weights, node_id)

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
        if not req.gpu_types and not req.prefer_gpu_types:
            return node.free[i : i + req.gpus_per_shard]
        names = node.names
        fits = node.free[i:]
        if req.gpu_types:
            fits = [f for f in fits if matches(names.get(f[1], ""), req.gpu_types)]
            if len(fits) < req.gpus_per_shard:
                return None
        if req.prefer_gpu_types:
            # Preferred types first; best fit (least free) within each.
            fits = sorted(fits, key=lambda f: preference(names.get(f[1], ""), req.prefer_gpu_types))
        return fits[: req.gpus_per_shard]

    @staticmethod
    def _gkey(req: Request) -> GroupKey:
        return (req.group, req.fabric if req.shards > 1 else "", req.gpus_per_shard, req.gpu_memory_mb,
                req.weights, req.gpu_types, req.prefer_gpu_types)

    def _tiers(self, req: Request, over: Callable[[], bool] | None) -> dict[int, list[Entry]] | None:
        gkey = self._gkey(req)
        tiers = self._groups.get(gkey)
        if tiers is None:
            tiers = self._groups[gkey] = {}
            self._members[gkey], self._member_tiers[gkey] = {}, {}
            fabric = gkey[1]
            ids = self._by_fabric.get(fabric, {}) if fabric else self._nodes
            self._gathering[gkey] = list(ids)
        left = self._gathering.get(gkey)
        if left is None:
            return tiers
        # Gathered from the end, a chunk between looks at the clock (at
        # least one chunk a call, so every call makes progress); a node
        # that update() gave an entry meanwhile is not given another.
        members, member_tiers = self._members[gkey], self._member_tiers[gkey]
        # No weights and no preferred types (most groups): a node's entry is its key.
        plain = not gkey[4] and not gkey[6]
        keys = self._keys
        while left:
            chunk = left[-_CHUNK:]
            del left[-_CHUNK:]
            for node_id in chunk:
                node = self._nodes.get(node_id)
                if (node is None or node_id in members or self._fit(node, req) is None
                        or (not plain and self._refused(gkey, node_id))):
                    continue
                entry = keys[node_id] if plain else self._entry(gkey, node_id)
                tier = self._count(req.group, node_id)
                members[node_id], member_tiers[node_id] = entry, tier
                tiers.setdefault(tier, []).append(entry)
            if left and over is not None and over():
                return None
        del self._gathering[gkey]
        for heap in tiers.values():
            heapq.heapify(heap)
        return tiers

    def place(self, req: Request, over: Callable[[], bool] | None = None) -> list[Slot] | None:
        """
        Place one replica: its slots by rank, or C{None} when it does not
        fit (then nothing is taken). With C{over} (the caller's time is up),
        the answer may be L{BUSY}: nothing taken, ask again later.
        """
        if req.shards > 1 and not req.fabric:
            return None
        tiers = self._tiers(req, over)
        if tiers is None:
            return BUSY
        gkey = self._gkey(req)
        members, member_tiers = self._members[gkey], self._member_tiers[gkey]
        plain = not gkey[4] and not gkey[6]  # as in _tiers
        chosen: list[tuple[str, list[tuple[int, int]], int]] = []
        while len(chosen) < req.shards:
            # The lowest tier with candidates, looked for afresh each time:
            # an entry put back may land in a lower tier than the last.
            tier = min((t for t, h in tiers.items() if h), default=None)
            if tier is None:
                break
            heap = tiers[tier]
            key = heapq.heappop(heap)
            self.scanned += 1
            node_id = key[-1]
            if member_tiers.get(node_id) != tier or members[node_id] != key:
                # A stale duplicate: the node's live entry is another.
                continue
            if any(c[0] == node_id for c in chosen):
                # A second copy of an entry already taken: shards go on
                # distinct nodes, and the entry is pushed again once placed.
                continue
            if node_id not in self._keys:
                del members[node_id], member_tiers[node_id]
                continue
            current = self._keys[node_id] if plain else self._entry(gkey, node_id)
            count = self._count(req.group, node_id)
            if current != key or count != tier:
                # Changed since it was pushed: back with what it is now.
                members[node_id], member_tiers[node_id] = current, count
                heapq.heappush(tiers.setdefault(count, []), current)
                continue
            gpus = self._fit(self._nodes[node_id], req)
            if gpus is None or (not plain and self._refused(gkey, node_id)):
                # Until it changes again (update() pushes it then).
                del members[node_id], member_tiers[node_id]
                continue
            chosen.append((node_id, gpus, tier))
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
                heapq.heappush(tiers[tier], members[node_id])
            return None
        extra = self._extra.setdefault(req.group, {})
        for node_id, gpus, tier in chosen:
            if not self._live:
                extra[node_id] = extra.get(node_id, 0) + 1
            self._take(node_id, gpus)
            if node_id in self._keys:
                entry = self._keys[node_id] if plain else self._entry(gkey, node_id)
                members[node_id], member_tiers[node_id] = entry, tier + 1
                heapq.heappush(tiers.setdefault(tier + 1, []), entry)
            else:
                del members[node_id], member_tiers[node_id]
        return slots

    def _take(self, node_id: str, gpus: list[tuple[int, int]]) -> None:
        node = self._nodes[node_id]
        if node_id not in self._owned:
            # Copy on first write: callers may keep their capacities cached.
            node = NodeCapacity(node.id, node.host, node.fabrics, list(node.free), node.names)
            self._nodes[node_id] = node
            self._owned.add(node_id)
        for g in gpus:
            node.free.remove(g)
        if not node.free:
            self._set(node_id, None)
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
