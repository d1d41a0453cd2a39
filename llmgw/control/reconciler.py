"""
The reconciler (DESIGN §6): the control plane's brain.

It is the agent service's status sink (L{IStatusSink}), the gateway's routing
table (L{IRoutingTable}) and the admin API's fleet (L{IFleetAdmin}). A
C{LoopingCall} runs a pass every C{pass_interval} seconds; a pass never
overlaps another, and an exception in one is logged and the loop goes on.

A pass looks only at what can need work, through indexes kept as things
change: nodes due for an expiry check come off a heap by deadline; shards
that are pending, starting, draining or stopping are in sets of their own;
replicas are indexed by deployment and readiness; each node's capacity for
placement is cached and recomputed only when the node or its shards change.
A steady pass over a large, healthy fleet therefore does little more than
pop the nodes whose heartbeat deadline came up.

Times: every decision uses the injected clock. Views for the admin API
report that same clock, which under the reactor is wall-clock seconds.

Without a catalog file the reconciler runs with an empty catalog: it places
nothing, and every shard an agent reports is unclaimed and stopped (as
DESIGN §5 says of shards nothing in the catalog claims).
"""

from __future__ import annotations

import collections
import functools  # interim: replaced by the core branch
import heapq
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from twisted.application.service import Service
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from zope.interface import implementer

from llmgw.control.backoff import Backoff
from llmgw.control.catalog import (
    Catalog,
    CatalogError,
    Deployment,
    FleetState,
    Profile,
    diff,
    fill,
    load_catalog,
)
from llmgw.control.events import EventLog
from llmgw.control.interfaces import (
    AdminError,
    IDispatcher,
    IFleetAdmin,
    IInFlight,
    IRoutingTable,
    IStatusSink,
    NotConnected,
    NotKeepingUp,
    ReportedShard,
    Route,
    ShardCommand,
    ShardReport,
    UnknownDeployment,
    UnknownNode,
)
from llmgw.control.inventory import Inventory
from llmgw.control.placement import NodeCapacity, Placer, PortBook, Request
from llmgw.control.signals import SignalStore, signals_json  # engines (issue 11)
from llmgw.control.signals import from_message as signals_from_message
from llmgw.routing import RoutingTable  # interim: replaced by the core branch

DEFAULT_PASS_INTERVAL = 1.0
DEFAULT_SUSPECT_AFTER = 15.0
DEFAULT_LOST_AFTER = 300.0
DEFAULT_ADOPTION_GRACE = 30.0
#: A pending shard (command sent, nothing heard) is re-sent after this long,
#: at most C{MAX_SENDS} times in all, then its replica is replaced.
DEFAULT_PENDING_TIMEOUT = 30.0
MAX_SENDS = 3
#: How long past its stop grace a stopping shard may stay unconfirmed.
STOP_SLACK = 30.0
#: Share of nodes suspect at once beyond which replacements freeze.
DEFAULT_FREEZE_SHARE = 0.5
#: Replica ids retired (torn down or replaced) remembered, so their shards
#: on a node that comes back are not claimed again.
RETIRED_LIMIT = 100_000
#: Shards that went missing while their node was away, kept so that their
#: late final status (exit code, output) is still taken.
MISSING_KEPT = 10_000

PENDING, STARTING, READY, DRAINING, STOPPED, FAILED = (
    "pending",
    "starting",
    "ready",
    "draining",
    "stopped",
    "failed",
)
#: Worse is larger: a replica's state is its worst shard's.
SEVERITY = {READY: 0, DRAINING: 1, STARTING: 2, PENDING: 3, STOPPED: 4, FAILED: 5}
SERVING = frozenset({READY, DRAINING})

ACTIVE, DRAINING_PHASE, STOPPING = "active", "draining", "stopping"

_SLUG = re.compile(r"[^A-Za-z0-9.]+")


_F = TypeVar("_F", bound=Callable[..., Any])


def _republishes(method: _F) -> _F:
    """
    interim: replaced by the core branch. Publish the routing table after
    C{method}, however it returns.
    """

    @functools.wraps(method)
    def wrapper(self: Reconciler, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        finally:
            self.publish_routes()

    return wrapper  # type: ignore[return-value]


def format_address(host: str, port: int) -> str:
    # Cheaper than parsing the address: only IPv6 literals hold a colon.
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


@dataclass(slots=True, eq=False)
class ShardRec:
    id: str
    replica_id: str
    node_id: str
    rank: int
    gpus: tuple[int, ...]
    port: int
    host: str
    state: str
    since: float
    sent_at: float = 0.0
    sends: int = 0
    stopping: bool = False
    stop_sent_at: float = 0.0

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)


@dataclass(slots=True, eq=False)
class ReplicaRec:
    id: str
    model: str
    profile: str
    world_size: int
    created_at: float
    shards: dict[int, ShardRec] = field(default_factory=dict)
    phase: str = ACTIVE
    #: Why it is being moved make-before-break ("node drain", "profile
    #: changed"), or "" when it is not.
    evacuating: str = ""
    ready_since: float | None = None
    drain_started: float = 0.0
    adopted: bool = False


@dataclass
class DeploymentState:
    backoff: Backoff = field(default_factory=Backoff)
    last_failure: dict[str, Any] | None = None
    unplaceable: str = ""


def _reason(e: Exception) -> str:
    return str(e) or type(e).__name__


@implementer(IStatusSink, IRoutingTable, IFleetAdmin)
class Reconciler(Service):
    """
    @param catalog: the catalog to start with (L{EMPTY} for none).
    @param inventory: the nodes, shared with the agent service.
    @param clock: every time the reconciler uses comes from here.
    @param dispatcher: the agent service; may be attached later with
        L{attach}, and passes do nothing until it is.
    @param in_flight: the gateway's in-flight counts, optional; without it a
        draining replica is stopped at its drain timeout.
    @param timer: a monotonic timer used only to measure pass durations.
    @param fleet_state: scale overrides, cordoned and draining nodes kept
        across restarts; by default the file beside the catalog, and nothing
        is kept without a catalog file.
    """

    log = Logger()

    def __init__(
        self,
        catalog: Catalog,
        inventory: Inventory,
        clock: IReactorTime,
        dispatcher: IDispatcher | None = None,
        in_flight: IInFlight | None = None,
        epoch: int = 0,
        pass_interval: float = DEFAULT_PASS_INTERVAL,
        suspect_after: float = DEFAULT_SUSPECT_AFTER,
        lost_after: float = DEFAULT_LOST_AFTER,
        adoption_grace: float = DEFAULT_ADOPTION_GRACE,
        pending_timeout: float = DEFAULT_PENDING_TIMEOUT,
        freeze_share: float = DEFAULT_FREEZE_SHARE,
        fleet_state: FleetState | None = None,
        event_limit: int = 10000,
        timer: Callable[[], float] = time.perf_counter,
        backoff: Backoff | None = None,
    ):
        self.catalog = catalog
        self.inventory = inventory
        self.clock = clock
        self.dispatcher = dispatcher
        self.in_flight = in_flight
        self.pass_interval = pass_interval
        self.suspect_after = suspect_after
        self.lost_after = lost_after
        self.adoption_grace = adoption_grace
        self.pending_timeout = pending_timeout
        self.freeze_share = freeze_share
        self.fleet_state = fleet_state if fleet_state is not None else FleetState.beside(catalog.path)
        for warning in self.fleet_state.load():
            self.log.error("{warning}", warning=warning)
        self.event_log = EventLog(event_limit)
        self.engine_signals = SignalStore()  # engines (issue 11)
        self._timer = timer
        self.epoch = epoch
        self._id_prefix = _base36(epoch)
        self._ids = 0

        self.replica_recs: dict[str, ReplicaRec] = {}
        self.shard_recs: dict[str, ShardRec] = {}
        #: The backoff each deployment starts with (its timings are copied).
        self.backoff = backoff if backoff is not None else Backoff()
        self.deps: dict[str, DeploymentState] = collections.defaultdict(
            lambda: DeploymentState(
                Backoff(self.backoff.base, self.backoff.cap, self.backoff.reset_after)
            )
        )
        self.desired: dict[str, int] = {}
        # Indexes, kept as things change.
        self._by_model: dict[str, set[str]] = collections.defaultdict(set)
        self._active: dict[str, set[str]] = collections.defaultdict(set)
        self._evacuating: dict[str, set[str]] = collections.defaultdict(set)
        self._ready: dict[str, set[str]] = collections.defaultdict(set)
        self._node_shards: dict[str, set[str]] = collections.defaultdict(set)
        self._spread: dict[str, dict[str, int]] = collections.defaultdict(dict)
        self._gpus_given: dict[str, set[int]] = collections.defaultdict(set)
        self._unsettled: set[str] = set()
        self._stopping: set[str] = set()
        self._draining: set[str] = set()
        self._incomplete: set[str] = set()
        self._retired: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._missing: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()
        self._shard_states: collections.Counter[str] = collections.Counter()
        self.ports = PortBook(*catalog.port_range)
        self._capacity: dict[str, NodeCapacity] = {}
        self._cap_dirty: set[str] = set()

        # Nodes.
        self._known_since: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []
        self.suspect: set[str] = set()
        self.lost: set[str] = set()
        # Kept across restarts in the fleet state file: a cordoned node stays
        # cordoned, and a draining node's replicas are moved off it once it
        # registers again with them.
        self.cordoned: set[str] = set(self.fleet_state.cordoned)
        self.draining_nodes: set[str] = set(self.fleet_state.draining)
        #: Nodes that registered with this process: only such a node can be
        #: seen to have no shards left (a drain finished).
        self._registered: set[str] = set()
        self._reported: dict[str, set[str]] = {}

        self.frozen = False
        self.frozen_reason = ""
        self.started_at = clock.seconds()
        self.last_pass_duration = 0.0
        self.passes = 0
        self.pass_seconds_total = 0.0
        self.pass_errors = 0
        self._in_pass = False
        self._loop: LoopingCall | None = None
        self._apply_desired()
        # interim: replaced by the core branch. The published routing table
        # (what every gateway routes by), re-published after each change.
        self.routing_table = RoutingTable(clock)
        self._routes_dirty: set[str] = set()
        self.publish_routes()

    # -- wiring -----------------------------------------------------------------

    def attach(self, dispatcher: IDispatcher, epoch: int | None = None) -> None:
        """
        Give the reconciler its dispatcher (the agent service), which is
        built after it because it needs the reconciler as its sink.
        """
        self.dispatcher = dispatcher
        if epoch is not None:
            self.epoch = epoch
            self._id_prefix = _base36(epoch)

    def set_in_flight(self, source: IInFlight | None) -> None:
        self.in_flight = source

    @property
    def grace_end(self) -> float:
        return self.started_at + self.adoption_grace

    def startService(self) -> None:
        super().startService()
        self.started_at = self.clock.seconds()
        # Every node this process learns of gets a fresh clock (DESIGN §6.3).
        for node_id in list(self._known_since):
            self._known_since[node_id] = self.started_at
        loop = LoopingCall(self.run_pass)
        loop.clock = self.clock
        self._loop = loop
        loop.start(self.pass_interval, now=False)
        self.log.info(
            "reconciler started: {deployments} deployments, pass every {interval}s, "
            "placing nothing for {grace}s while agents report what they run",
            deployments=len(self.catalog.deployments),
            interval=self.pass_interval,
            grace=self.adoption_grace,
        )

    def stopService(self) -> Any:
        super().stopService()
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None
        return None

    # -- events -----------------------------------------------------------------

    def _event(self, kind: str, *, level: str = "info", **fields: Any) -> None:
        now = self.clock.seconds()
        ev = self.event_log.add(now, kind, **fields)
        parts = [f"{k}={{{k}}}" for k in ("node", "replica", "shard") if fields.get(k)]
        if ev.reason:
            parts.append("({reason})")
        text = " ".join([f"{kind}:", *parts])
        getattr(self.log, level)(
            text,
            kind=kind,
            node=ev.node,
            replica=ev.replica,
            shard=ev.shard,
            reason=ev.reason,
            exit_code=ev.exit_code,
            signal=ev.signal,
        )

    # -- indexes ----------------------------------------------------------------

    def _host(self, node_id: str) -> str:
        node = self.inventory.peek(node_id)
        return (node.address if node is not None else "") or "127.0.0.1"

    def _set_shard_state(self, shard: ShardRec, state: str, now: float) -> None:
        if shard.state == state:
            return
        self._shard_states[shard.state] -= 1
        self._shard_states[state] += 1
        shard.state = state
        shard.since = now
        if state in (PENDING, STARTING) and not shard.stopping:
            self._unsettled.add(shard.id)
        else:
            self._unsettled.discard(shard.id)

    def _add_shard(self, rep: ReplicaRec, shard: ShardRec) -> None:
        rep.shards[shard.rank] = shard
        self.shard_recs[shard.id] = shard
        self._node_shards[shard.node_id].add(shard.id)
        spread = self._spread[rep.model]
        spread[shard.node_id] = spread.get(shard.node_id, 0) + 1
        self._gpus_given[shard.node_id].update(shard.gpus)
        self.ports.take(shard.host, shard.port)
        self._shard_states[shard.state] += 1
        if shard.state in (PENDING, STARTING):
            self._unsettled.add(shard.id)
        self._cap_dirty.add(shard.node_id)

    def _drop_shard(self, shard: ShardRec) -> None:
        """
        Forget a shard: it ended, or it is on a node that cannot be told.
        """
        if self.shard_recs.pop(shard.id, None) is None:
            return
        rep = self.replica_recs.get(shard.replica_id)
        self._node_shards[shard.node_id].discard(shard.id)
        if not self._node_shards[shard.node_id]:
            del self._node_shards[shard.node_id]
        given = self._gpus_given.get(shard.node_id)
        if given is not None:
            given.difference_update(shard.gpus)
        self.ports.release(shard.host, shard.port)
        self._shard_states[shard.state] -= 1
        self._unsettled.discard(shard.id)
        self._stopping.discard(shard.id)
        self._cap_dirty.add(shard.node_id)
        if rep is not None:
            if rep.shards.get(shard.rank) is shard:
                del rep.shards[shard.rank]
            spread = self._spread.get(rep.model)
            if spread is not None:
                n = spread.get(shard.node_id, 0) - 1
                if n > 0:
                    spread[shard.node_id] = n
                else:
                    spread.pop(shard.node_id, None)
            self._update_ready(rep)
            if not rep.shards and rep.phase == STOPPING:
                self._remove_replica(rep)

    def _add_replica(self, rep: ReplicaRec) -> None:
        self.replica_recs[rep.id] = rep
        self._by_model[rep.model].add(rep.id)
        self._active[rep.model].add(rep.id)

    def _remove_replica(self, rep: ReplicaRec) -> None:
        for shard in list(rep.shards.values()):
            self._drop_shard(shard)
        self.replica_recs.pop(rep.id, None)
        for index in (self._by_model, self._active, self._evacuating, self._ready):
            s = index.get(rep.model)
            if s is not None:
                s.discard(rep.id)
        self._draining.discard(rep.id)
        self._incomplete.discard(rep.id)
        self._retired[rep.id] = None
        if len(self._retired) > RETIRED_LIMIT:
            self._retired.popitem(last=False)

    def _serving(self, rep: ReplicaRec) -> bool:
        return (
            rep.phase != STOPPING
            and len(rep.shards) == rep.world_size
            and all(s.state in SERVING and not s.stopping for s in rep.shards.values())
        )

    def _update_ready(self, rep: ReplicaRec) -> None:
        ready = self._ready[rep.model]
        serving = self._serving(rep)
        if serving and rep.id not in ready:
            self._routes_dirty.add(rep.model)  # interim: replaced by the core branch
            ready.add(rep.id)
            rep.ready_since = self.clock.seconds()
            self._incomplete.discard(rep.id)
            if rep.phase == ACTIVE:
                self._event("replica_ready", replica=rep.id, reason=f"model {rep.model}")
        elif not serving and rep.id in ready:
            self._routes_dirty.add(rep.model)  # interim: replaced by the core branch
            ready.discard(rep.id)
            rep.ready_since = None

    def replica_state(self, rep: ReplicaRec) -> str:
        if rep.phase == STOPPING:
            return "stopping"
        worst = READY
        for s in rep.shards.values():
            if SEVERITY[s.state] > SEVERITY[worst]:
                worst = s.state
        if len(rep.shards) < rep.world_size and SEVERITY[worst] < SEVERITY[PENDING]:
            worst = PENDING
        return worst

    # -- catalog ------------------------------------------------------------------

    def _apply_desired(self) -> None:
        self.desired = {
            m: self.fleet_state.desired(d) for m, d in self.catalog.deployments.items()
        }

    def _profile(self, name: str) -> Profile | None:
        return self.catalog.profiles.get(name)

    @_republishes  # interim: replaced by the core branch
    def apply_catalog(self, new: Catalog) -> dict[str, Any]:
        """
        Make C{new} the running catalog: deployments that went away are
        drained; replicas whose profile changed are replaced
        make-before-break. Returns what changed.
        """
        old = self.catalog
        changes = diff(old, new)
        self.catalog = new
        self.ports.set_range(*new.port_range)
        self._apply_desired()
        for model in changes["removed"]:
            for rid in sorted(self._active.get(model, set()) | self._evacuating.get(model, set())):
                self._retire(self.replica_recs[rid], "its deployment left the catalog")
        for model in changes["changed"]:
            dep = new.deployments[model]
            old_dep = old.deployments[model]
            if dep.profile != old_dep.profile or new.profiles[dep.profile] != old.profiles.get(
                old_dep.profile
            ):
                for rid in sorted(self._active.get(model, set())):
                    self._evacuate(self.replica_recs[rid], "profile changed")
        return changes

    def reload_catalog(self) -> dict[str, Any]:
        path = self.catalog.path
        if not path:
            raise AdminError("there is no catalog file to reload: the control plane was started without --catalog")
        try:
            new = load_catalog(path)
        except CatalogError as e:
            self._event("catalog_refused", level="error", reason=str(e))
            raise AdminError(f"{e}; the running catalog stays") from None
        changes = self.apply_catalog(new)
        summary = {"path": path, **changes}
        self._event(
            "catalog_reloaded",
            reason=", ".join(f"{k}: {','.join(v)}" for k, v in changes.items() if v) or "no changes",
        )
        return summary

    # -- IStatusSink --------------------------------------------------------------

    def _note_node(self, node_id: str, now: float) -> None:
        if node_id not in self._known_since:
            self._known_since[node_id] = now
            heapq.heappush(self._heap, (now + self.suspect_after, node_id))
        self._cap_dirty.add(node_id)

    @_republishes  # interim: replaced by the core branch
    def adopt(self, node_id: str, shards: list[ReportedShard]) -> list[ReportedShard]:
        now = self.clock.seconds()
        self._note_node(node_id, now)
        host = self._host(node_id)
        unclaimed: list[ReportedShard] = []
        reported: set[str] = set()

        def refuse(s: ReportedShard, why: str) -> None:
            unclaimed.append(s)
            self._event("shard_unclaimed", node=node_id, replica=s.replica_id, shard=s.shard_id, reason=why)

        for s in shards:
            dep = self.catalog.deployments.get(s.model)
            if dep is None:
                refuse(s, f"model {s.model!r} is not in the catalog")
                continue
            if dep.profile != s.profile:
                refuse(s, f"profile {s.profile!r} is not the deployment's ({dep.profile!r})")
                continue
            if s.state not in (STARTING, READY, DRAINING):
                refuse(s, f"reported {s.state}")
                continue
            if s.replica_id in self._retired:
                refuse(s, "its replica was replaced")
                continue
            known = self.shard_recs.get(s.shard_id)
            if known is not None:
                rep = self.replica_recs.get(known.replica_id)
                if (
                    known.node_id != node_id
                    or known.replica_id != s.replica_id
                    or known.stopping
                    or rep is None
                    or rep.phase == STOPPING
                ):
                    refuse(s, "it clashes with what the control plane placed")
                    continue
                self._set_shard_state(known, s.state, now)
                reported.add(s.shard_id)
                if rep is not None:
                    self._update_ready(rep)
                continue
            rep = self.replica_recs.get(s.replica_id)
            if rep is None:
                profile = self.catalog.profiles[dep.profile]
                # An agent that does not know the world size reports 1.
                world_size = s.world_size if s.world_size > 1 else profile.shards
                if s.rank >= world_size:
                    refuse(s, f"rank {s.rank} is outside a world of {world_size}")
                    continue
                rep = ReplicaRec(
                    id=s.replica_id,
                    model=s.model,
                    profile=s.profile,
                    world_size=world_size,
                    created_at=now,
                    adopted=True,
                )
                self._add_replica(rep)
                self._incomplete.add(rep.id)
                self._event("replica_adopted", node=node_id, replica=rep.id, reason=f"model {s.model}")
            elif rep.phase == STOPPING or rep.model != s.model or s.rank in rep.shards or s.rank >= rep.world_size:
                refuse(s, "its replica is stopping or already has that rank")
                continue
            shard = ShardRec(
                id=s.shard_id,
                replica_id=rep.id,
                node_id=node_id,
                rank=s.rank,
                gpus=tuple(s.gpu_indices),
                port=s.port,
                host=host,
                state=s.state,
                since=now,
            )
            self._add_shard(rep, shard)
            reported.add(s.shard_id)
            if s.state == DRAINING and rep.phase == ACTIVE:
                self._start_drain(rep, "it was draining when adopted", send=False)
            elif node_id in self.draining_nodes:
                # The node was being drained before a restart: go on moving
                # its replicas, make-before-break.
                self._evacuate(rep, "node drain")
            self._update_ready(rep)
        self._reported[node_id] = reported
        return unclaimed

    @_republishes  # interim: replaced by the core branch
    def node_registered(self, node_id: str) -> None:
        now = self.clock.seconds()
        self._note_node(node_id, now)
        self._registered.add(node_id)
        returned = node_id in self.lost
        was_suspect = node_id in self.suspect
        self.lost.discard(node_id)
        self.suspect.discard(node_id)
        if returned or was_suspect:
            heapq.heappush(self._heap, (now + self.suspect_after, node_id))
            self._event("node_returned" if returned else "node_ready", node=node_id, reason="registered")
        reported = self._reported.pop(node_id, None)
        if reported is None:
            return
        # What we hold on the node that it did not list has ended.
        for sid in sorted(self._node_shards.get(node_id, set()) - reported):
            shard = self.shard_recs[sid]
            rep = self.replica_recs.get(shard.replica_id)
            if shard.stopping or rep is None:
                self._drop_shard(shard)
            elif shard.state == PENDING:
                # Sent on an older stream and maybe lost with it: send again.
                self._send_start(rep, shard, now)
            else:
                self._event(
                    "shard_missing",
                    level="warn",
                    node=node_id,
                    replica=rep.id,
                    shard=sid,
                    reason="the node registered without it",
                )
                # It ended while the stream was down: a failure like any
                # other (crash loops must back off), whose exit code and
                # output may still arrive in a status the agent kept for us.
                self._failure(rep.model, {
                    "node": node_id, "replica": rep.id, "shard": sid, "exit_code": 0,
                    "signal": 0, "error": "the shard ended while its node was disconnected",
                    "last_output": "", "time": now,
                }, now)
                self._remember_missing(sid, node_id, rep.model)
                self._drop_shard(shard)
                self._teardown(rep, f"shard {sid} is gone from {node_id}")

    def _remember_missing(self, shard_id: str, node_id: str, model: str) -> None:
        self._missing[shard_id] = (node_id, model)
        while len(self._missing) > MISSING_KEPT:
            self._missing.popitem(last=False)

    # -- engines (issue 11): signals from heartbeats ---------------------------

    def record_engine_signals(self, node_id: str, msgs: Iterable[Any]) -> None:
        """
        Keep a heartbeat's engine signals; those for shards not on
        C{node_id} are dropped (a node speaks only for its own shards).
        """
        now = self.clock.seconds()
        self.engine_signals.record(node_id, [
            (m.shard_id, signals_from_message(m, now)) for m in msgs
            if self.shard_node(m.shard_id) == node_id
        ])

    def engine_signal_rows(self) -> list[tuple[str, str, str, Any]]:
        rows = []
        for rep_ in self.replica_recs.values():
            for shard in rep_.shards.values():
                entry = self.engine_signals.get(shard.id)
                if entry is not None:
                    rows.append((rep_.model, rep_.id, shard.id, entry))
        return rows

    def shard_node(self, shard_id: str) -> str | None:
        shard = self.shard_recs.get(shard_id)
        if shard is not None:
            return shard.node_id
        missing = self._missing.get(shard_id)
        return missing[0] if missing is not None else None

    def _late_final_status(self, report: ShardReport, model: str, now: float) -> None:
        """
        The final status of a shard that went missing while its node was
        disconnected: fill in the deployment's last failure with what it
        says (the backoff was already counted).
        """
        self._missing.pop(report.shard_id, None)
        if report.state == FAILED:
            self._shard_failed(report, model, now, backoff=False,
                               note=" (reported after the node came back)")

    def _shard_failed(
        self, report: ShardReport, model: str, now: float, backoff: bool = True, note: str = ""
    ) -> None:
        """
        Record a failed shard: an event with its exit code and last output,
        and the deployment's last failure; C{backoff} also counts it towards
        the deployment's crash backoff.
        """
        failure = {
            "node": report.node_id,
            "replica": report.replica_id,
            "shard": report.shard_id,
            "exit_code": report.exit_code,
            "signal": report.signal,
            "error": report.error,
            "last_output": report.last_output,
            "time": now,
        }
        self._event(
            "shard_failed",
            level="error",
            node=report.node_id,
            replica=report.replica_id,
            shard=report.shard_id,
            reason=(report.error or "the process failed") + note,
            exit_code=report.exit_code,
            signal=report.signal,
            last_output=report.last_output,
        )
        if backoff:
            self._failure(model, failure, now)
        elif model in self.deps:
            self.deps[model].last_failure = failure

    @_republishes  # interim: replaced by the core branch
    def on_shard_status(self, report: ShardReport) -> None:
        now = self.clock.seconds()
        shard = self.shard_recs.get(report.shard_id)
        missing = self._missing.get(report.shard_id)
        if shard is None and missing is not None and missing[0] == report.node_id:
            if report.state in (STOPPED, FAILED):
                self._late_final_status(report, missing[1], now)
                return
        if shard is None or shard.node_id != report.node_id:
            if report.state in (STARTING, READY, DRAINING):
                # Running something nobody wants: stop it.
                self._event(
                    "shard_unclaimed",
                    node=report.node_id,
                    replica=report.replica_id,
                    shard=report.shard_id,
                    reason=f"reported {report.state} but the control plane holds no such shard",
                )
                self._dispatch("stop_shard", report.node_id, report.shard_id)
            return
        rep = self.replica_recs.get(shard.replica_id)
        state = report.state
        if shard.stopping or rep is None:
            if state in (STOPPED, FAILED):
                self._drop_shard(shard)
            return
        if state == FAILED:
            self._set_shard_state(shard, FAILED, now)
            self._shard_failed(replace(report, replica_id=rep.id), rep.model, now)
            self._teardown(rep, f"shard {shard.id} failed")
        elif state == STOPPED:
            self._set_shard_state(shard, STOPPED, now)
            self._event(
                "shard_stopped",
                level="warn",
                node=shard.node_id,
                replica=rep.id,
                shard=shard.id,
                reason=report.error or "stopped without being told to",
            )
            self._teardown(rep, f"shard {shard.id} stopped")
        elif state in (STARTING, READY, DRAINING):
            self._set_shard_state(shard, state, now)
            self._update_ready(rep)

    # -- decisions --------------------------------------------------------------

    def _dispatch(self, verb: str, *args: Any) -> str | None:
        """
        Call the dispatcher; returns why it refused, or C{None}.
        """
        if self.dispatcher is None:
            return "no dispatcher attached"
        try:
            getattr(self.dispatcher, verb)(*args)
        except (NotConnected, NotKeepingUp) as e:
            return _reason(e)
        return None

    def _failure(self, model: str, failure: dict[str, Any], now: float) -> None:
        state = self.deps[model]
        state.last_failure = failure
        delay = state.backoff.failed(now)
        self._event(
            "backoff",
            level="warn",
            replica=failure.get("replica", ""),
            reason=f"deployment {model}: failure {state.backoff.failures}, "
            f"next placement in {delay:g}s",
        )

    def _command(self, rep: ReplicaRec, shard: ShardRec, profile: Profile) -> ShardCommand:
        leader = rep.shards.get(0)
        leader_address = ""
        if leader is not None:
            node = self.inventory.peek(leader.node_id)
            host = leader.host
            if profile.fabric and node is not None and node.fabrics.get(profile.fabric):
                host = node.fabrics[profile.fabric]
            leader_address = format_address(host, leader.port)
        values = {
            "port": str(shard.port),
            "model": rep.model,
            "rank": str(shard.rank),
            "world_size": str(rep.world_size),
            "leader": leader_address,
            "gpus": ",".join(str(g) for g in shard.gpus),
            # engines (issue 11): the node's advertised address, the leader's host
            "host": shard.host,
            "leader_host": leader.host if leader is not None else "",
        }
        launch = profile.launch(shard.rank)  # engines (issue 11): per-rank command
        return ShardCommand(
            node_id=shard.node_id,
            shard_id=shard.id,
            replica_id=rep.id,
            model=rep.model,
            profile=rep.profile,
            argv=tuple(fill(a, values) for a in launch.command),
            gpu_indices=shard.gpus,
            port=shard.port,
            rank=shard.rank,
            world_size=rep.world_size,
            leader_address=leader_address,
            env={k: fill(v, values) for k, v in profile.env.items()},
            health_path=launch.health_path,
            startup_timeout_s=profile.startup_timeout_s,
            stop_grace_s=profile.stop_grace_s,
            drain_timeout_s=profile.drain_timeout_s,
            # engines (issue 11)
            engine=profile.engine,
            metrics_path=launch.metrics_path,
            metric_names=launch.metric_names,
            stop_signal=profile.stop_signal,
        )

    def _send_start(self, rep: ReplicaRec, shard: ShardRec, now: float) -> str | None:
        profile = self._profile(rep.profile)
        shard.sends += 1
        shard.sent_at = now
        if profile is None:
            return f"profile {rep.profile!r} is no longer in the catalog"
        return self._dispatch("start_shard", self._command(rep, shard, profile))

    def _new_replica_id(self, model: str) -> str:
        slug = _SLUG.sub("-", model).strip("-")[:40] or "replica"
        while True:
            self._ids += 1
            rid = f"{slug}-{self._id_prefix}-{self._ids}"
            if rid not in self.replica_recs and rid not in self._retired:
                return rid

    def _place(self, dep: Deployment, profile: Profile, placer: Placer, now: float) -> bool:
        slots = placer.place(
            Request(
                group=dep.model,
                shards=profile.shards,
                gpus_per_shard=profile.gpus_per_shard,
                gpu_memory_mb=profile.gpu_memory_mb,
                fabric=profile.fabric,
            )
        )
        if slots is None:
            return False
        rep = ReplicaRec(
            id=self._new_replica_id(dep.model),
            model=dep.model,
            profile=profile.name,
            world_size=profile.shards,
            created_at=now,
        )
        self._add_replica(rep)
        for slot in slots:
            self._add_shard(
                rep,
                ShardRec(
                    id=f"{rep.id}-s{slot.rank}",
                    replica_id=rep.id,
                    node_id=slot.node_id,
                    rank=slot.rank,
                    gpus=slot.gpu_indices,
                    port=slot.port,
                    host=slot.host,
                    state=PENDING,
                    since=now,
                ),
            )
        self._event(
            "replica_placed",
            node=",".join(s.node_id for s in slots),
            replica=rep.id,
            reason=f"model {dep.model} on "
            + ", ".join(f"{s.node_id} GPUs {list(s.gpu_indices)} port {s.port}" for s in slots),
        )
        for rank in sorted(rep.shards):
            shard = rep.shards[rank]
            why = self._send_start(rep, shard, now)
            if why is not None:
                self._event(
                    "dispatch_refused", level="warn", node=shard.node_id, replica=rep.id, shard=shard.id, reason=why
                )
                self._cap_dirty.add(shard.node_id)
                self._teardown(rep, f"could not start shard {shard.id}: {why}")
                break
        return True

    def _teardown(self, rep: ReplicaRec, reason: str) -> None:
        """
        Stop every shard of C{rep}; it is forgotten once they confirm.
        """
        if rep.phase == STOPPING:
            return
        rep.phase = STOPPING
        for index in (self._active, self._evacuating):
            s = index.get(rep.model)
            if s is not None:
                s.discard(rep.id)
        self._draining.discard(rep.id)
        self._incomplete.discard(rep.id)
        self._update_ready(rep)
        self._event("replica_stopping", replica=rep.id, reason=reason)
        now = self.clock.seconds()
        for shard in list(rep.shards.values()):
            if shard.state in (STOPPED, FAILED):
                self._drop_shard(shard)
                continue
            why = self._dispatch("stop_shard", shard.node_id, shard.id)
            if why is not None:
                # Nothing can tell it now; if the node comes back its
                # registration lists the shard, which nothing claims.
                self._drop_shard(shard)
                continue
            shard.stopping = True
            shard.stop_sent_at = now
            self._unsettled.discard(shard.id)
            self._stopping.add(shard.id)
        if not rep.shards and rep.id in self.replica_recs:
            self._remove_replica(rep)

    def _start_drain(self, rep: ReplicaRec, reason: str, send: bool = True) -> None:
        if rep.phase != ACTIVE:
            return
        rep.phase = DRAINING_PHASE
        self._routes_dirty.add(rep.model)  # interim: replaced by the core branch
        rep.drain_started = self.clock.seconds()
        self._active[rep.model].discard(rep.id)
        self._evacuating[rep.model].discard(rep.id)
        self._draining.add(rep.id)
        self._event("replica_draining", replica=rep.id, reason=reason)
        if send:
            for shard in rep.shards.values():
                self._dispatch("drain_shard", shard.node_id, shard.id)

    def _retire(self, rep: ReplicaRec, reason: str) -> None:
        """
        Take a replica out of service: drain it if it serves, else stop it.
        """
        if rep.id in self._ready[rep.model]:
            self._start_drain(rep, reason)
        else:
            self._teardown(rep, reason)

    def _evacuate(self, rep: ReplicaRec, reason: str) -> None:
        if rep.phase != ACTIVE or rep.evacuating:
            return
        rep.evacuating = reason
        self._active[rep.model].discard(rep.id)
        self._evacuating[rep.model].add(rep.id)
        self._event("replica_evacuating", replica=rep.id, reason=reason)

    # -- the pass -----------------------------------------------------------------

    def run_pass(self) -> None:
        """
        One reconcile pass. Never raises: a failure is logged and counted,
        and the next pass runs as usual.
        """
        if self._in_pass:
            return
        self._in_pass = True
        started = self._timer()
        try:
            self._pass(self.clock.seconds())
        except Exception:
            self.pass_errors += 1
            self.log.failure("reconcile pass failed; the next one runs as usual")
        finally:
            self._in_pass = False
            self.publish_routes()  # interim: replaced by the core branch
            self.passes += 1
            self.last_pass_duration = self._timer() - started
            self.pass_seconds_total += self.last_pass_duration

    def _pass(self, now: float) -> None:
        self._take_inventory(now)
        self._expire(now)
        if self.dispatcher is None:
            return
        self._check_shards(now)
        self._reconcile(now)

    def _take_inventory(self, now: float) -> None:
        for node_id in self.inventory.take_changed():
            if node_id in self.inventory:
                self._note_node(node_id, now)
            else:
                self._forget_node(node_id)

    def _forget_node(self, node_id: str) -> None:
        for sid in list(self._node_shards.get(node_id, ())):
            shard = self.shard_recs[sid]
            rep = self.replica_recs.get(shard.replica_id)
            self._drop_shard(shard)
            if rep is not None:
                self._teardown(rep, f"node {node_id} was removed")
        for s in (self.suspect, self.lost, self.cordoned, self.draining_nodes, self._registered):
            s.discard(node_id)
        self._keep_nodes()
        self._known_since.pop(node_id, None)
        self._capacity.pop(node_id, None)

    def _last_heard(self, node_id: str) -> float | None:
        node = self.inventory.peek(node_id)
        if node is None:
            return None
        return max(node.last_seen, self._known_since.get(node_id, 0.0))

    def _expire(self, now: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, node_id = heapq.heappop(heap)
            if node_id in self.suspect or node_id in self.lost:
                continue
            last = self._last_heard(node_id)
            if last is None:
                continue
            # One expression decides and re-queues, so floating-point
            # rounding can never push back an entry that is already due.
            deadline = last + self.suspect_after
            if deadline <= now:
                self.suspect.add(node_id)
                self._event("node_suspect", level="warn", node=node_id, reason=f"silent for {now - last:.0f}s")
            else:
                heapq.heappush(heap, (deadline, node_id))
        live = len(self._known_since) - len(self.lost)
        frozen = live > 0 and len(self.suspect) > self.freeze_share * live
        if frozen != self.frozen:
            self.frozen = frozen
            if frozen:
                self.frozen_reason = (
                    f"{len(self.suspect)} of {live} nodes are suspect at once: assuming the "
                    "fault is on the control plane's side of the network"
                )
                self._event("replacements_frozen", level="critical", reason=self.frozen_reason)
            else:
                self._event(
                    "replacements_resumed",
                    level="warn",
                    reason=f"{len(self.suspect)} of {live} nodes are suspect",
                )
                self.frozen_reason = ""
        for node_id in sorted(self.suspect):
            last = self._last_heard(node_id)
            if last is None:
                self.suspect.discard(node_id)
                continue
            if last + self.suspect_after > now:
                self.suspect.discard(node_id)
                heapq.heappush(heap, (last + self.suspect_after, node_id))
                self._event("node_ready", node=node_id, reason="heard from again")
            elif now - last >= self.lost_after and not self.frozen:
                self._node_lost(node_id, now - last)

    def _node_lost(self, node_id: str, silent: float) -> None:
        self.suspect.discard(node_id)
        self.lost.add(node_id)
        self._event("node_lost", level="error", node=node_id, reason=f"silent for {silent:.0f}s")
        for sid in sorted(self._node_shards.get(node_id, set())):
            shard = self.shard_recs.get(sid)
            if shard is None:
                continue
            rep = self.replica_recs.get(shard.replica_id)
            self._drop_shard(shard)
            if rep is not None:
                self._teardown(rep, f"node {node_id} is lost; replacing the replica")

    def _check_shards(self, now: float) -> None:
        for sid in sorted(self._unsettled):
            shard = self.shard_recs.get(sid)
            if shard is None or shard.id not in self._unsettled:
                continue
            rep = self.replica_recs[shard.replica_id]
            profile = self._profile(rep.profile)
            if shard.state == PENDING:
                if now - shard.sent_at < self.pending_timeout:
                    continue
                if shard.sends < MAX_SENDS:
                    why = self._send_start(rep, shard, now)
                    self._event(
                        "shard_resent",
                        node=shard.node_id,
                        replica=rep.id,
                        shard=sid,
                        reason=f"nothing heard for {self.pending_timeout:g}s"
                        + (f"; {why}" if why else ""),
                    )
                    continue
                reason = f"nothing heard after {shard.sends} start commands"
                kind = "shard_unresponsive"
            else:
                timeout = profile.startup_timeout_s if profile is not None else 600
                if now - shard.since < timeout:
                    continue
                reason = f"not ready within the startup timeout of {timeout}s"
                kind = "startup_timeout"
            self._event(kind, level="error", node=shard.node_id, replica=rep.id, shard=sid, reason=reason)
            failure = {
                "node": shard.node_id,
                "replica": rep.id,
                "shard": sid,
                "exit_code": None,
                "signal": None,
                "error": reason,
                "last_output": "",
                "time": now,
            }
            self._failure(rep.model, failure, now)
            self._teardown(rep, reason)
        for sid in sorted(self._stopping):
            shard = self.shard_recs.get(sid)
            if shard is None:
                self._stopping.discard(sid)
                continue
            other = self.replica_recs.get(shard.replica_id)
            profile = self._profile(other.profile) if other is not None else None
            grace = profile.stop_grace_s if profile is not None else 30
            if now - shard.stop_sent_at >= grace + STOP_SLACK:
                self._event(
                    "shard_stop_unconfirmed",
                    level="warn",
                    node=shard.node_id,
                    replica=shard.replica_id,
                    shard=sid,
                    reason=f"no stopped report {grace + STOP_SLACK:g}s after the stop",
                )
                self._drop_shard(shard)
        for rid in sorted(self._draining):
            other = self.replica_recs.get(rid)
            if other is None:
                self._draining.discard(rid)
                continue
            profile = self._profile(other.profile)
            timeout = profile.drain_timeout_s if profile is not None else 60
            if self.in_flight is not None and self.in_flight.in_flight(rid) == 0:
                self._teardown(other, "drained: no request in flight")
            elif now - other.drain_started >= timeout:
                self._teardown(other, f"drain timeout of {timeout}s passed")
        if now >= self.grace_end:
            for rid in sorted(self._incomplete):
                other = self.replica_recs.get(rid)
                if other is None or len(other.shards) == other.world_size:
                    self._incomplete.discard(rid)
                    continue
                if now - other.created_at >= self.adoption_grace:
                    self._event(
                        "replica_incomplete",
                        level="warn",
                        replica=rid,
                        reason=f"{len(other.shards)} of {other.world_size} shards reported",
                    )
                    self._teardown(other, "incomplete after adoption")
        drained = False
        for node_id in sorted(self.draining_nodes):
            # A node not registered since start may still have shards that
            # its agent has not reported yet.
            if node_id in self._registered and not self._node_shards.get(node_id):
                self.draining_nodes.discard(node_id)
                self._event("node_drained", node=node_id, reason="no shards left")
                drained = True
        if drained:
            self._keep_nodes()

    def _reconcile(self, now: float) -> None:
        placer: Placer | None = None
        placing = now >= self.grace_end and not self.frozen
        for model in sorted(self.catalog.deployments):
            dep = self.catalog.deployments[model]
            desired = self.desired.get(model, dep.replicas)
            state = self.deps[model]
            active = self._active[model]
            ready = self._ready[model]
            if state.backoff.failures:
                for rid in ready:
                    rs = self.replica_recs[rid].ready_since
                    if rs is not None and state.backoff.ready_for(now - rs):
                        state.backoff.reset()
                        self._event("backoff_reset", replica=rid, reason=f"deployment {model} ready long enough")
                        break
            evac = self._evacuating.get(model)
            if evac:
                fresh = len(ready & active)
                if fresh >= desired:
                    for rid in sorted(evac):
                        rep = self.replica_recs[rid]
                        self._retire(rep, f"replaced ({rep.evacuating})")
            surplus = len(active) - desired
            if surplus > 0:
                for rep in self._victims(active, surplus):
                    self._retire(rep, f"scale down of {model} to {desired}")
            elif surplus < 0 and placing and not state.backoff.blocked(now):
                profile = self.catalog.profiles[dep.profile]
                if placer is None:
                    placer = self._placer()
                placed = 0
                for _ in range(-surplus):
                    if not self._place(dep, profile, placer, now):
                        break
                    placed += 1
                if placed < -surplus:
                    why = f"no room for {-surplus - placed} replica(s) of profile {profile.name}"
                    if state.unplaceable != why:
                        state.unplaceable = why
                        self._event("unplaceable", level="warn", reason=f"deployment {model}: {why}")
                else:
                    state.unplaceable = ""

    def _victims(self, active: set[str], count: int) -> list[ReplicaRec]:
        """
        Surplus replicas: not ready first, then on the most loaded nodes,
        then the newest (DESIGN §6.6).
        """

        def key(rid: str) -> tuple[int, int, float, str]:
            rep = self.replica_recs[rid]
            load = max((len(self._node_shards.get(s.node_id, ())) for s in rep.shards.values()), default=0)
            return (rep.id in self._ready[rep.model], -load, -rep.created_at, rid)

        return [self.replica_recs[r] for r in sorted(active, key=key)[:count]]

    # -- placement view --------------------------------------------------------------

    def _node_capacity(self, node_id: str) -> NodeCapacity | None:
        node = self.inventory.peek(node_id)
        if node is None:
            return None
        given = self._gpus_given.get(node_id, ())
        # A GPU is given whole to one shard, so a placed shard that has not
        # reported yet reserves all of its GPU: memory it will take is never
        # counted as free.
        free = [
            (g.memory_total_mb - g.memory_used_mb, g.index)
            for g in node.gpus
            if not g.problems and g.index not in given
        ]
        return NodeCapacity(
            id=node_id, host=node.address or "127.0.0.1", fabrics=dict(node.fabrics), free=free
        )

    def _placer(self) -> Placer:
        for node_id in self._cap_dirty:
            cap = self._node_capacity(node_id)
            if cap is None:
                self._capacity.pop(node_id, None)
            else:
                self._capacity[node_id] = cap
        self._cap_dirty.clear()
        connected = set(self.dispatcher.connected_nodes()) if self.dispatcher is not None else set()
        excluded = self.suspect | self.lost | self.cordoned
        return Placer(
            (c for n, c in self._capacity.items() if n in connected and n not in excluded),
            self._spread,
            self.ports,
        )

    # -- interim: replaced by the core branch ------------------------------------------

    def publish_routes(self) -> None:
        """
        Publish the routes of every model whose ready replicas or draining
        marks may have changed, and the declared models, to
        C{routing_table}. Called after every pass, status report, adoption,
        registration and catalog change.
        """
        table = self.routing_table
        table.set_known(self.catalog.deployments)
        dirty, self._routes_dirty = self._routes_dirty, set()
        for model in sorted(dirty):
            table.publish_model(model, self.routes(model))

    # -- IRoutingTable ------------------------------------------------------------

    def routes(self, model: str) -> list[Route]:
        out = []
        for rid in sorted(self._ready.get(model, ())):
            rep = self.replica_recs[rid]
            leader = rep.shards.get(0)
            if leader is None:
                continue
            out.append(Route(rid, model, leader.address, draining=rep.phase != ACTIVE,
                             signals=self.engine_signals.signals(leader.id)))  # engines (issue 11)
        return out

    def models(self) -> list[str]:
        return sorted(
            m
            for m, ready in self._ready.items()
            if any(self.replica_recs[r].phase == ACTIVE for r in ready)
        )

    def knows_model(self, model: str) -> bool:
        return model in self.catalog.deployments

    # -- IFleetAdmin ----------------------------------------------------------------

    def _node_state(self, node_id: str) -> str:
        if node_id in self.lost:
            return "lost"
        if node_id in self.suspect:
            return "suspect"
        return "ready"

    def _connected(self) -> set[str]:
        return set(self.dispatcher.connected_nodes()) if self.dispatcher is not None else set()

    def status(self) -> dict[str, Any]:
        snap = self.metrics_snapshot()
        ready = sum(
            1
            for m in self.catalog.deployments
            if len(self._ready.get(m, ())) >= self.desired.get(m, 0)
        )
        now = self.clock.seconds()
        return {
            "epoch": self.epoch,
            "catalog": self.catalog.path,
            "nodes": snap["nodes"],
            "connected": len(self._connected()),
            "deployments": {
                "total": len(self.catalog.deployments),
                "satisfied": ready,
                "unsatisfied": len(self.catalog.deployments) - ready,
                "in_backoff": sum(1 for m in self.catalog.deployments if self.deps[m].backoff.blocked(now)),
            },
            "replicas": snap["replicas"],
            "shards": snap["shards"],
            "replacements_frozen": self.frozen,
            "frozen_reason": self.frozen_reason or None,
            "placing_after": self.grace_end if now < self.grace_end else None,
            "last_pass_seconds": self.last_pass_duration,
        }

    def nodes(self) -> list[dict[str, Any]]:
        connected = self._connected()
        out = []
        for node in self.inventory.list():
            out.append(
                {
                    "id": node.id,
                    "state": self._node_state(node.id),
                    "connected": node.id in connected,
                    "cordoned": node.id in self.cordoned,
                    "draining": node.id in self.draining_nodes,
                    "last_seen": node.last_seen,
                    "address": node.address,
                    "agent_version": node.agent_version,
                    "gpus": [
                        {
                            "index": g.index,
                            "uuid": g.uuid,
                            "name": g.name,
                            "memory_total_mb": g.memory_total_mb,
                            "memory_used_mb": g.memory_used_mb,
                            "problems": list(g.problems),
                        }
                        for g in node.gpus
                    ],
                    "fabrics": dict(node.fabrics),
                    "shards": sorted(self._node_shards.get(node.id, ())),
                }
            )
        return out

    def deployments(self) -> list[dict[str, Any]]:
        now = self.clock.seconds()
        out = []
        for model in sorted(self.catalog.deployments):
            dep = self.catalog.deployments[model]
            state = self.deps[model]
            out.append(
                {
                    "model": model,
                    "profile": dep.profile,
                    "desired": self.desired.get(model, dep.replicas),
                    "ready": len(self._ready.get(model, ())),
                    "replicas": len(self._by_model.get(model, ())),
                    "backoff_until": state.backoff.until if state.backoff.blocked(now) else None,
                    "failures": state.backoff.failures,
                    "last_failure": dict(state.last_failure) if state.last_failure else None,
                    "unplaceable": state.unplaceable or None,
                }
            )
        return out

    def replicas(self) -> list[dict[str, Any]]:  # type: ignore[override]
        now = self.clock.seconds()
        out = []
        for rid in sorted(self.replica_recs):
            rep = self.replica_recs[rid]
            out.append(
                {
                    "id": rid,
                    "model": rep.model,
                    "profile": rep.profile,
                    "state": self.replica_state(rep),
                    "draining": rep.phase == DRAINING_PHASE,
                    "evacuating": rep.evacuating or None,
                    "adopted": rep.adopted,
                    "created": rep.created_at,
                    "ready_since": rep.ready_since,
                    "shards": [
                        {
                            "id": s.id,
                            "node": s.node_id,
                            "rank": s.rank,
                            "state": "stopping" if s.stopping else s.state,
                            "address": s.address,
                            "gpus": list(s.gpus),
                            # engines (issue 11)
                            "signals": signals_json(self.engine_signals.get(s.id), now),
                        }
                        for _, s in sorted(rep.shards.items())
                    ],
                }
            )
        return out

    def events(self, since: float = 0.0) -> list[dict[str, Any]]:  # type: ignore[override]
        return [e.as_dict() for e in self.event_log.since(since)]

    def _known(self, node_id: str) -> None:
        # A node cordoned or draining before a restart is known from the state
        # file even before it registers again, so it can be uncordoned.
        if (
            node_id not in self.inventory
            and node_id not in self._known_since
            and node_id not in self.cordoned
            and node_id not in self.draining_nodes
        ):
            raise UnknownNode(f"no node {node_id!r}")

    def _keep_nodes(self, action: str | None = None, node_id: str | None = None) -> None:
        """
        Write the cordoned and draining nodes to the state file if they
        changed. For an operator's C{action} a failure is an L{AdminError}
        (the change holds in memory, but would not survive a restart);
        otherwise it is logged.
        """
        try:
            self.fleet_state.set_nodes(self.cordoned, self.draining_nodes)
        except OSError as e:
            reason = f"could not keep cordoned and draining nodes in {self.fleet_state.path}: {e}"
            if action is None:
                self.log.error("{reason}; they will not survive a restart", reason=reason)
                return
            err = AdminError(f"node {node_id} is {action} now, but {reason}; this will not survive a restart")
            err.status = 500
            raise err from e

    def cordon(self, node_id: str) -> None:
        self._known(node_id)
        if node_id not in self.cordoned:
            self.cordoned.add(node_id)
            self._event("node_cordoned", node=node_id, reason="no new placements")
        self._keep_nodes("cordoned", node_id)

    def uncordon(self, node_id: str) -> None:
        self._known(node_id)
        was_draining = node_id in self.draining_nodes
        if node_id in self.cordoned or was_draining:
            self.cordoned.discard(node_id)
            self.draining_nodes.discard(node_id)
            self._event("node_uncordoned", node=node_id, reason="placements allowed again")
        for sid in sorted(self._node_shards.get(node_id, ())):
            rep = self.replica_recs.get(self.shard_recs[sid].replica_id)
            if rep is None or rep.evacuating != "node drain" or rep.phase != ACTIVE:
                continue
            if any(s.node_id in self.draining_nodes for s in rep.shards.values()):
                continue
            rep.evacuating = ""
            self._evacuating[rep.model].discard(rep.id)
            self._active[rep.model].add(rep.id)
        self._keep_nodes("uncordoned", node_id)

    def drain_node(self, node_id: str) -> None:
        self._known(node_id)
        if node_id not in self.cordoned:
            self.cordoned.add(node_id)
            self._event("node_cordoned", node=node_id, reason="no new placements")
        if node_id not in self.draining_nodes:
            self.draining_nodes.add(node_id)
            self._event("node_draining", node=node_id, reason="moving its replicas, make-before-break")
            for sid in sorted(self._node_shards.get(node_id, ())):
                rep = self.replica_recs.get(self.shard_recs[sid].replica_id)
                if rep is not None:
                    self._evacuate(rep, "node drain")
        self._keep_nodes("draining", node_id)

    def scale(self, model: str, replicas: int) -> None:
        dep = self.catalog.deployments.get(model)
        if dep is None:
            raise UnknownDeployment(f"no deployment serves model {model!r}")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise AdminError(f"replicas must be a whole number of at least 0, not {replicas!r}")
        try:
            self.fleet_state.set(model, replicas, dep.replicas)
        except OSError as e:
            err = AdminError(f"could not keep the new scale in {self.fleet_state.path}: {e}")
            err.status = 500
            raise err from e
        old = self.desired.get(model, dep.replicas)
        self.desired[model] = replicas
        self._event("scaled", reason=f"deployment {model} from {old} to {replicas} replicas")

    # -- metrics ----------------------------------------------------------------

    def metrics_snapshot(self) -> dict[str, Any]:
        """
        Counts for C{/metrics}, each a plain dict:

          - C{nodes}: node count by state (C{ready}, C{suspect}, C{lost});
          - C{shards}: shard count by last known state (C{pending},
            C{starting}, C{ready}, C{draining}, C{stopped}, C{failed}), and
            C{stopping}: those told to stop and not yet confirmed (also
            counted under their last known state);
          - C{replicas}: replica count by state (a replica's worst shard's
            state, or C{stopping});
          - C{events}: events ever logged, by kind;
          - C{last_pass_seconds}: how long the last pass took (C{None}
            before the first);
          - C{passes}, C{pass_seconds_total}, C{pass_errors}: passes run,
            their summed duration, and passes that raised;
          - C{replacements_frozen}: whether replacements are frozen
            (too many nodes suspect at once).
        """
        total = len(self._known_since)
        shards = {s: 0 for s in SEVERITY}
        for state, n in self._shard_states.items():
            if n:
                shards[state] = n
        stopping = len(self._stopping)
        shards["stopping"] = stopping
        replicas = collections.Counter(self.replica_state(r) for r in self.replica_recs.values())
        return {
            "nodes": {
                "ready": total - len(self.suspect) - len(self.lost),
                "suspect": len(self.suspect),
                "lost": len(self.lost),
            },
            "shards": shards,
            "replicas": {s: replicas.get(s, 0) for s in (*SEVERITY, "stopping")},
            "events": dict(self.event_log.counts),
            "last_pass_seconds": self.last_pass_duration if self.passes else None,
            "passes": self.passes,
            "pass_seconds_total": self.pass_seconds_total,
            "pass_errors": self.pass_errors,
            "replacements_frozen": self.frozen,
        }

    # -- helpers for tests and embedding -------------------------------------------------

    def replica_ids(self, model: str | None = None) -> list[str]:
        if model is None:
            return sorted(self.replica_recs)
        return sorted(self._by_model.get(model, ()))

    def known_nodes(self) -> Iterable[str]:
        return self._known_since.keys()
