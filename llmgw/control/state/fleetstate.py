"""
The fleet as the control plane knows it (DESIGN §6.7): one owner of every
node, replica and shard record and of the indexes over them.

Nothing outside this module adds or removes a record or touches an index;
the reconciler changes the fleet through the methods here, and everything
else (the views, the routing projection, the metrics snapshot) reads it.
The indexes exist so that a pass looks only at what can need work:

  - replicas by model, split into active, evacuating and ready;
  - shards by node, and the GPUs given on each node;
  - shards unsettled (pending or starting), stopping, and replicas
    draining or incomplete after adoption;
  - shard counts by state, for the metrics;
  - each node's capacity for placement, recomputed only when it changed;
  - ports in use per host (L{PortBook}), including the ports of shards
    that were forgotten without a confirmed stop (L{reserved}).

Methods take C{now} where they record a time; none reads a clock.
"""

from __future__ import annotations

import collections
import heapq
import math
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from enum import StrEnum

from llmgw.control.state.fetches import FetchProgress
from llmgw.control.state.inventory import GPUInfo, Inventory
from llmgw.control.state.placement import NodeCapacity, Placer, PortBook
from llmgw.routing import EngineSignals, Route
from llmgw.states import SERVING, SEVERITY, ReplicaState, ShardState

#: Replica ids retired (torn down or replaced) remembered, so their shards
#: on a node that comes back are not claimed again.
RETIRED_LIMIT = 100_000
#: Shards that went missing while their node was away, kept so that their
#: late final status (exit code, output) is still taken.
MISSING_KEPT = 10_000
#: Distinct GPU name maps kept for nodes to share: beyond it (a fleet of
#: ever new GPUs, or agents naming them at will) they are made afresh.
MAX_NAME_MAPS = 1024


class Phase(StrEnum):
    """
    Where a replica is in its life, as the control plane decided it.
    """

    ACTIVE = "active"
    DRAINING = "draining"
    STOPPING = "stopping"


def format_address(host: str, port: int) -> str:
    # Cheaper than parsing the address: only IPv6 literals hold a colon.
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(slots=True, eq=False)
class ShardRec:
    id: str
    replica_id: str
    node_id: str
    rank: int
    gpus: tuple[int, ...]
    port: int
    host: str
    state: ShardState
    since: float
    sent_at: float = 0.0
    sends: int = 0
    stopping: bool = False
    stop_sent_at: float = 0.0
    #: The engine's own load figures, when heartbeats carry them; the
    #: routing projection copies the leader's into its route.
    signals: EngineSignals | None = None
    #: While it is fetching its weights: how far its node has come.
    fetch: FetchProgress | None = None

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    @property
    def shown_state(self) -> ShardState:
        return ShardState.STOPPING if self.stopping and self.state not in (
            ShardState.STOPPED, ShardState.FAILED) else self.state


@dataclass(slots=True, eq=False)
class ReplicaRec:
    id: str
    model: str
    profile: str
    world_size: int
    created_at: float
    shards: dict[int, ShardRec] = field(default_factory=dict)
    phase: Phase = Phase.ACTIVE
    #: Why it is being moved make-before-break ("node drain", "profile
    #: changed"), or "" when it is not.
    evacuating: str = ""
    ready_since: float | None = None
    #: How long it was ready before it last stopped being ready (0: never).
    was_ready_for: float = 0.0
    drain_started: float = 0.0
    adopted: bool = False
    #: Its route as last projected; cleared whenever what is routed of it
    #: changes.
    route: Route | None = None
    #: The LoRA adapters it holds (L{set_adapters}), and whether a request
    #: selects one by its position there (llama.cpp's "lora" field) rather
    #: than by name.
    adapters: tuple[str, ...] = ()
    lora_ids: bool = False
    #: The replicas that borrowed GPUs it holds while it sleeps: while any
    #: do, it is displaced (out of the routes, never woken).
    displaced_by: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Reserved:
    """
    A port held for a shard that may still run: forgotten without a
    confirmed stop, or reported by an agent and not claimed.
    """

    node_id: str
    host: str
    port: int


class FleetState:
    """
    @param ports: the port range's book.
    """

    def __init__(self, ports: PortBook):
        self.replicas: dict[str, ReplicaRec] = {}
        self.shards: dict[str, ShardRec] = {}
        self.ports = ports
        self.by_model: dict[str, set[str]] = collections.defaultdict(set)
        self.active: dict[str, set[str]] = collections.defaultdict(set)
        self.evacuating: dict[str, set[str]] = collections.defaultdict(set)
        self.ready: dict[str, set[str]] = collections.defaultdict(set)
        self.node_shards: dict[str, set[str]] = collections.defaultdict(set)
        self.spread: dict[str, dict[str, int]] = collections.defaultdict(dict)
        self.gpus_given: dict[str, set[int]] = collections.defaultdict(set)
        self.unsettled: set[str] = set()
        self.stopping: set[str] = set()
        #: When an unsettled or stopping shard is next looked at, in whole
        #: seconds: shard ids by second, each shard's second, and a heap of
        #: the seconds that hold any. A shard that settles leaves its
        #: second at once, so nothing stale piles up for a later pass.
        self._checks: dict[int, set[str]] = {}
        self._check_of: dict[str, int] = {}
        self._check_seconds: list[int] = []
        self.draining: set[str] = set()
        self.incomplete: set[str] = set()
        #: Replicas displaced by borrowers of their GPUs (L{set_displaced}).
        self.displaced: set[str] = set()
        #: Borrowers whose start waits out their lend's grace, with when it
        #: ends (L{llmgw.control.core.lending}).
        self.lend_starts: dict[str, float] = {}
        #: Lenders whose borrowers were taken for their own waiting
        #: requests, with until when they lend nothing (to be woken first).
        self.called_back: dict[str, float] = {}
        self.retired: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.missing: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()
        self.shard_counts: collections.Counter[str] = collections.Counter()
        #: Ports held for shards not confirmed stopped, by shard id, and
        #: those shard ids by node.
        self.reserved: dict[str, Reserved] = {}
        self.reserved_by_node: dict[str, set[str]] = collections.defaultdict(set)
        #: Models whose routes may have changed since the last projection.
        self.routes_dirty: set[str] = set()

        # Nodes.
        self.known_since: dict[str, float] = {}
        self.heap: list[tuple[float, str]] = []
        self.suspect: set[str] = set()
        self.lost: set[str] = set()
        #: When each suspect node's lost clock starts, if later than its
        #: last message (a freeze covered some of its silence).
        self.lost_clock: dict[str, float] = {}
        self.cordoned: set[str] = set()
        self.draining_nodes: set[str] = set()
        #: Nodes that registered with this process: only such a node can be
        #: seen to have no shards left (a drain finished).
        self.registered: set[str] = set()
        #: Shards each registering node listed and that were claimed.
        self.reported: dict[str, set[str]] = {}
        self.capacity: dict[str, NodeCapacity] = {}
        #: Each node's GPU names by index, and the GPU list they came from;
        #: nodes with the same GPUs share one map (L{_name_map}).
        self._gpu_names: dict[str, dict[int, str]] = {}
        self._gpu_lists: dict[str, list[GPUInfo]] = {}
        self._name_maps: dict[tuple[tuple[int, str], ...], dict[int, str]] = {}
        #: Nodes whose capacity or eligibility may have changed since
        #: placement last saw them (L{sync_placer}).
        self.cap_dirty: set[str] = set()
        #: Of those, the ones that now hold fewer shards of some deployment.
        self.cap_fewer: set[str] = set()

    # -- nodes -----------------------------------------------------------------------

    def note_node(self, node_id: str, now: float, suspect_after: float) -> None:
        if node_id not in self.known_since:
            self.known_since[node_id] = now
            heapq.heappush(self.heap, (now + suspect_after, node_id))
        self.cap_dirty.add(node_id)

    def eligibility_changed(self, node_ids: Iterable[str]) -> None:
        """
        These nodes turned suspect, lost, cordoned, or back: placement must
        look at them again.
        """
        self.cap_dirty.update(node_ids)

    def watch(self, node_id: str, deadline: float) -> None:
        heapq.heappush(self.heap, (deadline, node_id))

    def take_due(self, now: float, limit: int | None = None) -> list[str]:
        """
        The nodes whose check deadline has come, off the heap, earliest
        first and at most C{limit} of them (the rest stay for the next
        call, L{due_left}); those already suspect or lost are checked
        otherwise and dropped.
        """
        heap = self.heap
        due: list[str] = []
        while heap and heap[0][0] <= now and (limit is None or len(due) < limit):
            _, node_id = heapq.heappop(heap)
            if node_id not in self.suspect and node_id not in self.lost:
                due.append(node_id)
        return due

    def due_left(self, now: float) -> bool:
        """
        Whether some node's check deadline has come and it is not taken yet.
        """
        return bool(self.heap) and self.heap[0][0] <= now

    def forget_node(self, node_id: str) -> None:
        self.cap_dirty.add(node_id)
        for s in (self.suspect, self.lost, self.cordoned, self.draining_nodes, self.registered):
            s.discard(node_id)
        self.lost_clock.pop(node_id, None)
        self.known_since.pop(node_id, None)
        self.capacity.pop(node_id, None)
        self._gpu_names.pop(node_id, None)
        self._gpu_lists.pop(node_id, None)
        self.reported.pop(node_id, None)
        for sid in list(self.reserved_by_node.get(node_id, ())):
            self.release_reserved(sid)

    def node_state(self, node_id: str) -> str:
        if node_id in self.lost:
            return "lost"
        if node_id in self.suspect:
            return "suspect"
        return "ready"

    # -- ports held for shards that may still run ------------------------------------

    def reserve(self, shard_id: str, node_id: str, host: str, port: int) -> None:
        """
        Hold C{port} on C{host} for a shard that may still run there, until
        L{release_reserved}. Never offered to placement meanwhile.
        """
        if shard_id in self.reserved or port <= 0:
            return
        self.reserved[shard_id] = Reserved(node_id, host, port)
        self.reserved_by_node[node_id].add(shard_id)
        self.ports.take(host, port)

    def release_reserved(self, shard_id: str) -> None:
        held = self._unreserve(shard_id)
        if held is not None:
            self.ports.release(held.host, held.port)

    def _unreserve(self, shard_id: str) -> Reserved | None:
        held = self.reserved.pop(shard_id, None)
        if held is not None:
            ids = self.reserved_by_node.get(held.node_id)
            if ids is not None:
                ids.discard(shard_id)
                if not ids:
                    del self.reserved_by_node[held.node_id]
        return held

    def reserved_on(self, node_id: str) -> set[str]:
        return set(self.reserved_by_node.get(node_id, ()))

    # -- shards ----------------------------------------------------------------------

    def set_shard_state(self, shard: ShardRec, state: ShardState, now: float) -> None:
        if shard.state == state:
            return
        self.shard_counts[shard.state] -= 1
        self.shard_counts[state] += 1
        shard.state = state
        shard.since = now
        if shard.fetch is not None and state != ShardState.FETCHING:
            shard.fetch = None
        if state in (ShardState.PENDING, ShardState.STARTING) and not shard.stopping:
            self.unsettled.add(shard.id)
        else:
            self.unsettled.discard(shard.id)
            if shard.id not in self.stopping:
                self.uncheck(shard.id)

    def check_at(self, shard_id: str, when: float) -> None:
        """
        Look at C{shard_id} again once C{when} has come (it may be moved
        later, or earlier).
        """
        second = math.ceil(when)
        old = self._check_of.get(shard_id)
        if old == second:
            return
        if old is not None:
            self._checks[old].discard(shard_id)
        bucket = self._checks.get(second)
        if bucket is None:
            bucket = self._checks[second] = set()
            heapq.heappush(self._check_seconds, second)
        bucket.add(shard_id)
        self._check_of[shard_id] = second

    def uncheck(self, shard_id: str) -> None:
        old = self._check_of.pop(shard_id, None)
        if old is not None:
            self._checks[old].discard(shard_id)

    def take_checks(self, now: float) -> list[str]:
        """
        The unsettled or stopping shards due for a look, in id order; each
        is taken off the schedule (the caller puts it back if need be).
        """
        due: list[str] = []
        seconds = self._check_seconds
        while seconds and seconds[0] <= now:
            second = heapq.heappop(seconds)
            bucket = self._checks.pop(second, set())
            for sid in bucket:
                self._check_of.pop(sid, None)
            due.extend(bucket)
        return sorted(due)

    def add_shard(self, rep: ReplicaRec, shard: ShardRec, port_taken: bool = False) -> None:
        """
        Record C{shard} of C{rep}. C{port_taken}: placement already took its
        port from the book.
        """
        rep.shards[shard.rank] = shard
        self.shards[shard.id] = shard
        self.node_shards[shard.node_id].add(shard.id)
        spread = self.spread[rep.model]
        spread[shard.node_id] = spread.get(shard.node_id, 0) + 1
        self.gpus_given[shard.node_id].update(shard.gpus)
        if not port_taken:
            self.ports.take(shard.host, shard.port)
        # A shard taken over from a reservation holds the port itself now.
        self.release_reserved(shard.id)
        self.shard_counts[shard.state] += 1
        if shard.state in (ShardState.PENDING, ShardState.STARTING):
            self.unsettled.add(shard.id)
        self.cap_dirty.add(shard.node_id)

    def mark_stopping(self, shard: ShardRec, now: float) -> None:
        shard.stopping = True
        shard.stop_sent_at = now
        self.unsettled.discard(shard.id)
        self.stopping.add(shard.id)

    def drop_shard(self, shard: ShardRec, now: float, confirmed: bool = True) -> None:
        """
        Forget a shard. C{confirmed}: its process is known to have ended;
        otherwise (its node is lost or cannot be told) its port stays
        reserved until it is (L{release_reserved}).
        """
        if self.shards.pop(shard.id, None) is None:
            return
        rep = self.replicas.get(shard.replica_id)
        self.node_shards[shard.node_id].discard(shard.id)
        if not self.node_shards[shard.node_id]:
            del self.node_shards[shard.node_id]
        given = self.gpus_given.get(shard.node_id)
        if given is not None:
            given.difference_update(shard.gpus)
            # A GPU lent to a borrower stays given while its sleeping
            # lender (or the borrower) still holds it.
            for other in self.node_shards.get(shard.node_id, ()):
                given.update(g for g in self.shards[other].gpus if g in shard.gpus)
        if confirmed or shard.state in (ShardState.STOPPED, ShardState.FAILED):
            self.ports.release(shard.host, shard.port)
        elif shard.id not in self.reserved:
            # The port passes from the shard to its reservation.
            self.reserved[shard.id] = Reserved(shard.node_id, shard.host, shard.port)
            self.reserved_by_node[shard.node_id].add(shard.id)
        else:
            self.ports.release(shard.host, shard.port)
        self.shard_counts[shard.state] -= 1
        self.unsettled.discard(shard.id)
        self.stopping.discard(shard.id)
        self.uncheck(shard.id)
        self.cap_dirty.add(shard.node_id)
        if rep is not None:
            if rep.shards.get(shard.rank) is shard:
                del rep.shards[shard.rank]
            spread = self.spread.get(rep.model)
            if spread is not None:
                self.cap_fewer.add(shard.node_id)
                n = spread.get(shard.node_id, 0) - 1
                if n > 0:
                    spread[shard.node_id] = n
                else:
                    spread.pop(shard.node_id, None)
            self.update_ready(rep, now)
            if not rep.shards and rep.phase == Phase.STOPPING:
                self.remove_replica(rep, now)

    def remember_missing(self, shard_id: str, node_id: str, model: str) -> None:
        self.missing[shard_id] = (node_id, model)
        while len(self.missing) > MISSING_KEPT:
            self.missing.popitem(last=False)

    # -- replicas --------------------------------------------------------------------

    def add_replica(self, rep: ReplicaRec, incomplete: bool = False) -> None:
        self.replicas[rep.id] = rep
        self.by_model[rep.model].add(rep.id)
        self.active[rep.model].add(rep.id)
        if incomplete:
            self.incomplete.add(rep.id)

    def remove_replica(self, rep: ReplicaRec, now: float) -> None:
        for shard in list(rep.shards.values()):
            self.drop_shard(shard, now)
        self.replicas.pop(rep.id, None)
        for index in (self.by_model, self.active, self.evacuating, self.ready):
            s = index.get(rep.model)
            if s is not None:
                s.discard(rep.id)
        self.draining.discard(rep.id)
        self.incomplete.discard(rep.id)
        self.displaced.discard(rep.id)
        self.lend_starts.pop(rep.id, None)
        self.called_back.pop(rep.id, None)
        self.routes_dirty.add(rep.model)
        self.retired[rep.id] = None
        if len(self.retired) > RETIRED_LIMIT:
            self.retired.popitem(last=False)

    def serving(self, rep: ReplicaRec) -> bool:
        return (
            rep.phase != Phase.STOPPING
            and len(rep.shards) == rep.world_size
            and all(s.state in SERVING and not s.stopping for s in rep.shards.values())
        )

    def update_ready(self, rep: ReplicaRec, now: float) -> bool:
        """
        Bring the ready index in step with C{rep}; returns whether an
        active replica just became ready.
        """
        ready = self.ready[rep.model]
        serving = self.serving(rep)
        if serving and rep.id not in ready:
            ready.add(rep.id)
            rep.route = None
            rep.ready_since = now
            self.incomplete.discard(rep.id)
            self.routes_dirty.add(rep.model)
            return rep.phase == Phase.ACTIVE
        if not serving and rep.id in ready:
            ready.discard(rep.id)
            if rep.ready_since is not None:
                rep.was_ready_for = now - rep.ready_since
            rep.ready_since = None
            self.routes_dirty.add(rep.model)
        return False

    def set_phase(self, rep: ReplicaRec, phase: Phase, now: float) -> None:
        """
        Move C{rep} to C{phase} (draining or stopping: never back).
        """
        rep.phase = phase
        rep.route = None
        for index in (self.active, self.evacuating):
            s = index.get(rep.model)
            if s is not None:
                s.discard(rep.id)
        if phase == Phase.DRAINING:
            rep.drain_started = now
            self.draining.add(rep.id)
        else:
            self.draining.discard(rep.id)
            self.incomplete.discard(rep.id)
        self.routes_dirty.add(rep.model)
        self.update_ready(rep, now)

    def set_evacuating(self, rep: ReplicaRec, reason: str) -> None:
        """
        Mark C{rep} as being moved (C{reason}), or no longer (C{""}).
        """
        rep.evacuating = reason
        if reason:
            self.active[rep.model].discard(rep.id)
            self.evacuating[rep.model].add(rep.id)
        else:
            self.evacuating[rep.model].discard(rep.id)
            self.active[rep.model].add(rep.id)

    def set_displaced(self, rep: ReplicaRec, borrowers: tuple[str, ...]) -> None:
        """
        C{rep} is displaced by C{borrowers} (out of the routes), or no
        longer (C{()}).
        """
        if borrowers == rep.displaced_by:
            return
        rep.displaced_by = borrowers
        rep.route = None
        if borrowers:
            self.displaced.add(rep.id)
        else:
            self.displaced.discard(rep.id)
        self.routes_dirty.add(rep.model)

    def replica_state(self, rep: ReplicaRec) -> ReplicaState:
        if rep.phase == Phase.STOPPING:
            return ReplicaState.STOPPING
        worst: str = ShardState.READY
        for s in rep.shards.values():
            if SEVERITY[s.state] > SEVERITY[worst]:
                worst = s.state
        if len(rep.shards) < rep.world_size and SEVERITY[worst] < SEVERITY[ShardState.PENDING]:
            worst = ShardState.PENDING
        return ReplicaState(worst)

    # -- placement's view --------------------------------------------------------------

    def node_capacity(self, inventory: Inventory, node_id: str) -> NodeCapacity | None:
        node = inventory.peek(node_id)
        if node is None:
            return None
        given = self.gpus_given.get(node_id, ())
        # A GPU is given whole to one shard, so a placed shard that has not
        # reported yet reserves all of its GPU: memory it will take is never
        # counted as free.
        free = [
            (g.memory_total_mb - g.memory_used_mb, g.index)
            for g in node.gpus
            if not g.problems and g.index not in given
        ]
        # GPU names change only with a new Register (a new list of GPUs):
        # the map is looked up once per Register, not per change of memory used.
        if self._gpu_lists.get(node_id) is not node.gpus:
            self._gpu_lists[node_id] = node.gpus
            self._gpu_names[node_id] = self._name_map(node.gpus)
        return NodeCapacity(
            id=node_id, host=node.address or "127.0.0.1", fabrics=dict(node.fabrics), free=free,
            names=self._gpu_names[node_id],
        )

    def _name_map(self, gpus: list[GPUInfo]) -> dict[int, str]:
        # One map per set of GPU names and indices seen (a fleet has few),
        # shared by the nodes that have it and never changed.
        layout = tuple((g.index, g.name) for g in gpus)
        names = self._name_maps.get(layout)
        if names is None:
            if len(self._name_maps) >= MAX_NAME_MAPS:
                self._name_maps.clear()
            names = self._name_maps[layout] = dict(layout)
        return names

    def eligible(self, node_id: str, connected: AbstractSet[str]) -> bool:
        """
        Whether C{node_id} may take work: connected, and neither suspect,
        lost nor cordoned.
        """
        return (node_id in connected and node_id not in self.suspect
                and node_id not in self.lost and node_id not in self.cordoned)

    def sync_placer(
        self,
        placer: Placer,
        inventory: Inventory,
        connected: AbstractSet[str],
        over: Callable[[], bool] | None = None,
    ) -> bool:
        """
        Tell C{placer} of every node that changed since it last heard (its
        capacity worked out afresh, or C{None} where it may take no work),
        a chunk at a time until C{over} (at least one chunk: every call makes
        progress). True when none is left.
        """
        dirty = self.cap_dirty
        while dirty:
            for _ in range(min(len(dirty), 128)):
                node_id = dirty.pop()
                cap = self.node_capacity(inventory, node_id) if self.eligible(node_id, connected) else None
                fewer = node_id in self.cap_fewer
                self.cap_fewer.discard(node_id)
                placer.update(node_id, cap, fewer)
            if dirty and over is not None and over():
                return False
        return True

    # -- the routing projection ---------------------------------------------------------

    def routes(self, model: str) -> list[Route]:
        """
        The routes of C{model}: its ready replicas' leaders, draining ones
        flagged; displaced ones are left out (their memory is lent).
        """
        out = []
        for rid in sorted(self.ready.get(model, ())):
            rep = self.replicas[rid]
            if rep.displaced_by:
                continue
            route = rep.route
            if route is None:
                leader = rep.shards.get(0)
                if leader is None:
                    continue
                route = rep.route = Route(rid, model, leader.address,
                                          draining=rep.phase != Phase.ACTIVE,
                                          signals=leader.signals, adapters=rep.adapters,
                                          lora_ids=rep.lora_ids)
            out.append(route)
        return out

    def models(self) -> list[str]:
        """
        Models with a ready replica that takes new requests.
        """
        return sorted(
            m for m, ready in self.ready.items()
            if any(self.replicas[r].phase == Phase.ACTIVE and not self.replicas[r].displaced_by for r in ready)
        )

    def set_signals(self, shard: ShardRec, signals: EngineSignals | None) -> None:
        """
        Take the engine's load figures for C{shard} (from a heartbeat); a
        leader's go into its replica's route.
        """
        shard.signals = signals
        rep = self.replicas.get(shard.replica_id)
        if rep is not None and shard.rank == 0:
            rep.route = None
            if rep.id in self.ready.get(rep.model, ()):
                self.routes_dirty.add(rep.model)

    def set_adapters(self, rep: ReplicaRec, adapters: tuple[str, ...]) -> None:
        """
        C{rep} holds C{adapters} now (its leader's heartbeat said so).
        """
        if adapters != rep.adapters:
            rep.adapters = adapters
            rep.route = None
            if rep.id in self.ready.get(rep.model, ()):
                self.routes_dirty.add(rep.model)

    def take_routes_dirty(self) -> set[str]:
        dirty, self.routes_dirty = self.routes_dirty, set()
        return dirty

    # -- counts ----------------------------------------------------------------------

    def counts(self) -> Mapping[str, int]:
        return {s: n for s, n in self.shard_counts.items() if n}
