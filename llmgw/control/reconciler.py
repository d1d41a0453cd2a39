"""
The reconciler (DESIGN §6): the control plane's brain.

It is the agent service's status sink (L{IStatusSink}) and the admin API's
fleet (L{IFleetAdmin}); it owns the published routing table
(L{routing_table}, an L{IRoutingTable}) that every gateway routes from. A
C{LoopingCall} runs a pass every C{pass_interval} seconds; a pass never
overlaps another, and an exception in one is logged and the loop goes on.

Data flows one way (DESIGN §6.7):

  - agent reports, admin calls and passes come in here;
  - every record and index lives in L{FleetState}, changed only through
    its methods;
  - commands to agents are queued (L{llmgw.control.commands}) and sent
    after the handler that caused them has returned, never from inside
    the agent service's own message handling;
  - after each input, the models whose routes changed are projected from
    the fleet state into L{routing_table}, whose revision then increases.

A pass looks only at what can need work, through the fleet state's
indexes, and has a time budget (C{pass_budget}, 20 ms): a pass with more
to place stops there and the next one runs at once.

Times: every decision uses the injected clock. Views for the admin API
report that same clock, which under the reactor is wall-clock seconds.

Without a catalog file the reconciler runs with an empty catalog: it places
nothing, and every shard an agent reports is unclaimed and stopped (as
DESIGN §5 says of shards nothing in the catalog claims).
"""

from __future__ import annotations

import collections
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from twisted.application.service import Service
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from zope.interface import implementer

from llmgw.control import adoption, views
from llmgw.control import autoscale as autoscaling  # autoscaling (issue 12)
from llmgw.control.backoff import Backoff
from llmgw.control.catalog import (
    Catalog,
    CatalogError,
    Deployment,
    Profile,
    diff,
    load_catalog,
)
from llmgw.control.catalog import (
    FleetState as KeptState,
)
from llmgw.control.commands import Command, Drain, Start, Stop, send, start_command
from llmgw.control.demand import DemandBoard  # autoscaling (issue 12)
from llmgw.control.events import EventLog
from llmgw.control.expiry import ExpiryRules, judge
from llmgw.control.failures import Hold, ShardFailure, on_failure
from llmgw.control.fleetstate import (
    FleetState,
    Phase,
    ReplicaRec,
    ShardRec,
    format_address,
)
from llmgw.control.interfaces import (
    AdminError,
    IDispatcher,
    IFleetAdmin,
    IInFlight,
    IStatusSink,
    ReportedShard,
    ShardReport,
    UnknownDeployment,
    UnknownNode,
)
from llmgw.control.inventory import Inventory
from llmgw.control.placement import BUSY, Placer, PortBook, Request
from llmgw.control.scaling import Candidate, scale_step, victims
from llmgw.control.signals import ShardSignals, SignalStore  # engines (issue 11)
from llmgw.control.signals import from_message as signals_from_message
from llmgw.routing import Demand, EngineSignals, IDemand, IRoutingTable, Route, RoutingTable
from llmgw.states import ENDED, LIVE, ShardState

__all__ = ["Reconciler", "format_address"]

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
#: The longest a pass may hold the reactor before it leaves the rest of
#: its placements to the next pass.
DEFAULT_PASS_BUDGET = 0.020
#: The share of a pass's budget that placement may use.
PLACING_SHARE = 0.6

PENDING, STARTING, READY, DRAINING, STOPPED, FAILED = (
    ShardState.PENDING,
    ShardState.STARTING,
    ShardState.READY,
    ShardState.DRAINING,
    ShardState.STOPPED,
    ShardState.FAILED,
)

_SLUG = re.compile(r"[^A-Za-z0-9.]+")


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


@dataclass
class DeploymentState:
    backoff: Backoff = field(default_factory=Backoff)
    last_failure: ShardFailure | None = None
    unplaceable: str = ""
    #: Nothing is placed while held (a configuration failure).
    held: Hold | None = None


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
    @param timer: a monotonic timer used only to measure passes and to keep
        them within C{pass_budget}.
    @param fleet_state: scale overrides, cordoned and draining nodes kept
        across restarts (the file, not L{FleetState}); by default the file
        beside the catalog, and nothing is kept without a catalog file.
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
        fleet_state: KeptState | None = None,
        event_limit: int = 10000,
        timer: Callable[[], float] = time.perf_counter,
        backoff: Backoff | None = None,
        pass_budget: float = DEFAULT_PASS_BUDGET,
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
        self.pass_budget = pass_budget
        self.fleet_state = fleet_state if fleet_state is not None else KeptState.beside(catalog.path)
        for warning in self.fleet_state.load():
            self.log.error("{warning}", warning=warning)
        self.event_log = EventLog(event_limit)
        #: Engine signals from heartbeats, per shard (engines, issue 11).
        self.engine_signals = SignalStore()
        self._timer = timer
        self.epoch = epoch
        self._id_prefix = _base36(epoch)
        self._ids = 0

        #: Every record and index of the fleet.
        self.state = FleetState(PortBook(*catalog.port_range))
        #: The routing table, a projection of L{state}.
        self.routing_table = RoutingTable(clock)
        self.routing_table.set_known(catalog.deployments)
        #: The backoff each deployment starts with (its timings are copied).
        self.backoff = backoff if backoff is not None else Backoff()
        self.deps: dict[str, DeploymentState] = collections.defaultdict(
            lambda: DeploymentState(
                Backoff(self.backoff.base, self.backoff.cap, self.backoff.reset_after)
            )
        )
        self.desired: dict[str, int] = {}
        # Kept across restarts in the fleet state file: a cordoned node stays
        # cordoned, and a draining node's replicas are moved off it once it
        # registers again with them.
        self.state.cordoned.update(self.fleet_state.cordoned)
        self.state.draining_nodes.update(self.fleet_state.draining)
        #: Every shard id each registering node listed, claimed or not.
        self._listed: dict[str, set[str]] = {}

        self.frozen = False
        self.frozen_reason = ""
        self.started_at = clock.seconds()
        self.last_pass_duration = 0.0
        self.max_pass_duration = 0.0
        self.passes = 0
        self.pass_seconds_total = 0.0
        self.pass_errors = 0
        #: A pass stopped at its budget with placements left to make.
        self.pass_unfinished = False
        self._pass_started = 0.0
        self._in_pass = False
        self._loop: LoopingCall | None = None
        self._outbox: list[Command] = []
        self._flush_call: IDelayedCall | None = None
        self._next_pass: IDelayedCall | None = None
        #: Placement's state, kept from pass to pass and told of each node
        #: that changed (FleetState.sync_placer) before a pass places.
        self._placer = Placer((), self.state.spread, self.state.ports, live_spread=True)
        self._placer_connected: set[str] = set()
        self._placed_this_pass = 0
        self._apply_desired()
        # -- autoscaling (issue 12): see the block at the end of the class.
        #: Demand reported by standalone gateways (C{POST /api/v1/demand}).
        self.demand_board = DemandBoard()
        #: The embedded gateway's own demand, when it offers one (L{IDemand});
        #: without it, in-flight counts come from C{in_flight}.
        self.demand_source: IDemand | None = None
        #: Each autoscaled deployment's memory between passes.
        self.scalers: dict[str, autoscaling.ScalerState] = {}
        self._autoscaled_of: Catalog | None = None
        self._autoscaled_models: list[str] = []

    # -- compatibility views of the state -----------------------------------------------

    @property
    def shard_recs(self) -> dict[str, ShardRec]:
        return self.state.shards

    @property
    def replica_recs(self) -> dict[str, ReplicaRec]:
        return self.state.replicas

    @property
    def cordoned(self) -> set[str]:
        return self.state.cordoned

    @property
    def draining_nodes(self) -> set[str]:
        return self.state.draining_nodes

    @property
    def suspect(self) -> set[str]:
        return self.state.suspect

    @property
    def lost(self) -> set[str]:
        return self.state.lost

    @property
    def ports(self) -> PortBook:
        return self.state.ports

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
        for node_id in list(self.state.known_since):
            self.state.known_since[node_id] = self.started_at
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
        for call in (self._flush_call, self._next_pass):
            if call is not None and call.active():
                call.cancel()
        self._flush_call = self._next_pass = None
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

    # -- commands, sent after the handler returns ---------------------------------------

    def _queue(self, cmd: Command) -> None:
        self._outbox.append(cmd)

    def _settle(self) -> None:
        """
        End of an input: once the caller has returned, send the queued
        commands and publish the routes that changed (inputs of one reactor
        turn share one publication).
        """
        if self._in_pass or self._flush_call is not None:
            return
        if self._outbox or self.state.routes_dirty:
            self._flush_call = self.clock.callLater(0, self.flush)

    def flush(self) -> None:
        """
        Send the queued commands. A refusal is handled here: a new shard
        that cannot be started tears its replica down; a shard that cannot
        be told to stop is forgotten, its port kept until it is seen gone.
        """
        if self._flush_call is not None and self._flush_call.active():
            self._flush_call.cancel()
        self._flush_call = None
        now = self.clock.seconds()
        while self._outbox:
            batch, self._outbox = self._outbox, []
            for cmd in batch:
                self._send(cmd, now)
        self._publish()

    def _send(self, cmd: Command, now: float) -> None:
        st = self.state
        shard = st.shards.get(cmd.shard_id)
        if isinstance(cmd, Start):
            # A start made obsolete before it went out (its replica was torn
            # down meanwhile) is not sent.
            if shard is None or shard.stopping or shard.node_id != cmd.node_id:
                return
            why = send(self.dispatcher, cmd)
            if why is None or not cmd.first:
                return
            rep = st.replicas.get(shard.replica_id)
            self._event("dispatch_refused", level="warn", node=shard.node_id,
                        replica=shard.replica_id, shard=shard.id, reason=why)
            st.cap_dirty.add(shard.node_id)
            if rep is not None:
                self._teardown(rep, f"could not start shard {shard.id}: {why}", now)
        elif isinstance(cmd, Stop):
            why = send(self.dispatcher, cmd)
            if why is not None and shard is not None and shard.stopping:
                # Nothing can tell it now; if the node comes back its
                # registration lists the shard, which nothing claims.
                st.drop_shard(shard, now, confirmed=False)
        else:
            send(self.dispatcher, cmd)

    def _publish(self) -> None:
        for model in sorted(self.state.take_routes_dirty()):
            self.routing_table.publish_model(model, self.state.routes(model))

    # -- IRoutingTable, answered from the state as it stands ------------------------------
    # (gateways route from the published L{routing_table}; these answer at
    # once, before the publication at the end of the reactor turn)

    def routes(self, model: str) -> Sequence[Route]:
        return self.state.routes(model)

    def models(self) -> list[str]:
        return self.state.models()

    def knows_model(self, model: str) -> bool:
        return model in self.catalog.deployments

    # -- catalog ------------------------------------------------------------------

    def _apply_desired(self) -> None:
        self.desired = {
            m: self.fleet_state.desired(d) for m, d in self.catalog.deployments.items()
        }

    def _profile(self, name: str) -> Profile | None:
        return self.catalog.profiles.get(name)

    def apply_catalog(self, new: Catalog) -> dict[str, Any]:
        """
        Make C{new} the running catalog: deployments that went away are
        drained; replicas whose profile changed are replaced
        make-before-break. Returns what changed.
        """
        now = self.clock.seconds()
        old = self.catalog
        changes = diff(old, new)
        self.catalog = new
        self.state.ports.set_range(*new.port_range)
        self._apply_desired()
        self.routing_table.set_known(new.deployments)
        st = self.state
        for model in changes["removed"]:
            for rid in sorted(st.active.get(model, set()) | st.evacuating.get(model, set())):
                self._retire(st.replicas[rid], "its deployment left the catalog", now)
        for model in changes["changed"]:
            dep = new.deployments[model]
            old_dep = old.deployments[model]
            if dep.profile != old_dep.profile or new.profiles[dep.profile] != old.profiles.get(
                old_dep.profile
            ):
                for rid in sorted(st.active.get(model, set())):
                    self._evacuate(st.replicas[rid], "profile changed")
                self._release(model, "its profile changed")
        self._settle()
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

    def _host(self, node_id: str) -> str:
        node = self.inventory.peek(node_id)
        return (node.address if node is not None else "") or "127.0.0.1"

    def _unclaimed(self, node_id: str, shard_id: str, replica_id: str, port: int, why: str) -> None:
        """
        The one place a shard nothing claims is stopped. Its port stays
        reserved until it is seen gone.
        """
        self._event("shard_unclaimed", node=node_id, replica=replica_id, shard=shard_id, reason=why)
        self.state.reserve(shard_id, node_id, self._host(node_id), port)
        self._queue(Stop(node_id, shard_id))

    def adopt(self, node_id: str, shards: list[ReportedShard]) -> list[ReportedShard]:
        """
        Claim what a registering node runs (DESIGN §6.5). Returns the
        shards nothing claims, for the caller to log; the reconciler stops
        them itself, after the caller has returned.
        """
        now = self.clock.seconds()
        st = self.state
        st.note_node(node_id, now, self.suspect_after)
        host = self._host(node_id)
        unclaimed: list[ReportedShard] = []
        reported: set[str] = set()
        self._listed[node_id] = {s.shard_id for s in shards}

        def refuse(s: ReportedShard, why: str) -> None:
            unclaimed.append(s)
            self._unclaimed(node_id, s.shard_id, s.replica_id, s.port, why)

        for s in shards:
            verdict = adoption.verdict(s, node_id, self.catalog, st)
            if isinstance(verdict, adoption.Refuse):
                refuse(s, verdict.reason)
                continue
            state = ShardState(s.state)
            if isinstance(verdict, adoption.Known):
                known = st.shards[s.shard_id]
                self._set_state(known, st.replicas[known.replica_id], state, now)
                reported.add(s.shard_id)
                self._update_ready(st.replicas[known.replica_id], now)
                continue
            if isinstance(verdict, adoption.NewReplica):
                rep = ReplicaRec(
                    id=s.replica_id,
                    model=s.model,
                    profile=s.profile,
                    world_size=verdict.world_size,
                    created_at=now,
                    adopted=True,
                )
                st.add_replica(rep, incomplete=True)
                self._event("replica_adopted", node=node_id, replica=rep.id, reason=f"model {s.model}")
            else:
                rep = st.replicas[s.replica_id]
            shard = ShardRec(
                id=s.shard_id,
                replica_id=rep.id,
                node_id=node_id,
                rank=s.rank,
                gpus=tuple(s.gpu_indices),
                port=s.port,
                host=host,
                state=state,
                since=now,
            )
            st.add_shard(rep, shard)
            if state == STARTING:
                profile = self._profile(rep.profile)
                st.check_at(shard.id, now + (profile.startup_timeout_s if profile is not None else 600))
            reported.add(s.shard_id)
            if state == DRAINING and rep.phase == Phase.ACTIVE:
                self._start_drain(rep, "it was draining when adopted", now, send=False)
            elif node_id in st.draining_nodes:
                # The node was being drained before a restart: go on moving
                # its replicas, make-before-break.
                self._evacuate(rep, "node drain")
            self._update_ready(rep, now)
        st.reported[node_id] = reported
        self._settle()
        return unclaimed

    def node_registered(self, node_id: str) -> None:
        now = self.clock.seconds()
        st = self.state
        st.note_node(node_id, now, self.suspect_after)
        st.registered.add(node_id)
        returned = node_id in st.lost
        was_suspect = node_id in st.suspect
        st.lost.discard(node_id)
        st.suspect.discard(node_id)
        st.lost_clock.pop(node_id, None)
        if returned or was_suspect:
            st.watch(node_id, now + self.suspect_after)
            self._event("node_returned" if returned else "node_ready", node=node_id, reason="registered")
        reported = st.reported.pop(node_id, None)
        listed = self._listed.pop(node_id, None)
        if listed is not None:
            # What the node did not list is not running: its port is free.
            for sid in st.reserved_on(node_id) - listed:
                st.release_reserved(sid)
        if reported is None:
            self._settle()
            return
        # What we hold on the node that it did not list has ended.
        for sid in sorted(st.node_shards.get(node_id, set()) - reported):
            shard = st.shards[sid]
            rep = st.replicas.get(shard.replica_id)
            if shard.stopping or rep is None:
                st.drop_shard(shard, now)
            elif shard.state == PENDING:
                # Sent on an older stream and maybe lost with it: send again.
                self._send_start(rep, shard, now, first=False)
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
                self._record_failure(rep.model, node_id, rep.id, sid, now, exit_code=0, signal=0,
                                     error="the shard ended while its node was disconnected")
                st.remember_missing(sid, node_id, rep.model)
                st.drop_shard(shard, now)
                self._teardown(rep, f"shard {sid} is gone from {node_id}", now)
        self._settle()

    def shard_node(self, shard_id: str) -> str | None:
        shard = self.state.shards.get(shard_id)
        if shard is not None:
            return shard.node_id
        missing = self.state.missing.get(shard_id)
        if missing is not None:
            return missing[0]
        held = self.state.reserved.get(shard_id)
        return held.node_id if held is not None else None

    def record_engine_signals(self, node_id: str, msgs: Iterable[Any]) -> None:
        """
        Keep a heartbeat's engine signals; those for shards not on
        C{node_id} are dropped (a node speaks only for its own shards). A
        leader's go into its replica's route.
        """
        now = self.clock.seconds()
        before = {sid for sid in self.state.node_shards.get(node_id, ())
                  if self.engine_signals.get(sid) is not None}
        self.engine_signals.record(node_id, [
            (m.shard_id, signals_from_message(m, now)) for m in msgs
            if self.shard_node(m.shard_id) == node_id
        ])
        for sid in sorted(before | {m.shard_id for m in msgs}):
            shard = self.state.shards.get(sid)
            if shard is not None and shard.node_id == node_id and shard.rank == 0:
                self.state.set_signals(shard, self.engine_signals.signals(sid))
        self._settle()

    def engine_signal_rows(self) -> list[tuple[str, str, str, ShardSignals]]:
        rows = []
        for rep in self.state.replicas.values():
            for shard in rep.shards.values():
                entry = self.engine_signals.get(shard.id)
                if entry is not None:
                    rows.append((rep.model, rep.id, shard.id, entry))
        return rows

    def shard_signals(self, node_id: str, shard_id: str, signals: EngineSignals | None) -> None:
        """
        An engine's load figures for a shard (from its node's heartbeat);
        a leader's go into its replica's route at the next publication.
        Figures for a shard the node does not hold are ignored.
        """
        shard = self.state.shards.get(shard_id)
        if shard is None or shard.node_id != node_id:
            return
        self.state.set_signals(shard, signals)
        self._settle()

    def _record_failure(
        self,
        model: str,
        node_id: str,
        replica_id: str,
        shard_id: str,
        now: float,
        *,
        exit_code: int | None = None,
        signal: int | None = None,
        error: str = "",
        last_output: str = "",
        crash_class: str = "",
        backoff: bool = True,
    ) -> None:
        """
        The one place a L{ShardFailure} is built: it becomes the
        deployment's last failure, and C{backoff} counts it towards the
        deployment's crash backoff.
        """
        failure = ShardFailure(
            node=node_id, replica=replica_id, shard=shard_id, exit_code=exit_code,
            signal=signal, error=error, last_output=last_output, time=now,
            crash_class=crash_class,
        )
        if not backoff:
            if model in self.deps:
                self.deps[model].last_failure = failure
            return
        state = self.deps[model]
        state.last_failure = failure
        out = on_failure(failure, model, state.held, counts=True)
        state.held = out.hold
        if out.new_hold and out.hold is not None:
            self._event("deployment_held", level="error", replica=replica_id, shard=shard_id,
                        reason=out.hold.reason)
        if not out.backoff:
            return
        delay = state.backoff.failed(now)
        self._event(
            "backoff",
            level="warn",
            replica=replica_id,
            reason=f"deployment {model}: failure {state.backoff.failures}, "
            f"next placement in {delay:g}s",
        )

    def _shard_failed(self, report: ShardReport, replica_id: str, model: str, now: float,
                      backoff: bool = True, note: str = "") -> None:
        self._event(
            "shard_failed",
            level="error",
            node=report.node_id,
            replica=replica_id,
            shard=report.shard_id,
            reason=(report.error or "the process failed") + note,
            exit_code=report.exit_code,
            signal=report.signal,
            last_output=report.last_output,
            crash_class=report.crash_class,
        )
        self._record_failure(model, report.node_id, replica_id, report.shard_id, now,
                             exit_code=report.exit_code, signal=report.signal, error=report.error,
                             last_output=report.last_output, crash_class=report.crash_class,
                             backoff=backoff)

    def on_shard_status(self, report: ShardReport) -> None:
        self._shard_status(report)
        self._settle()

    def _shard_status(self, report: ShardReport) -> None:
        now = self.clock.seconds()
        st = self.state
        shard = st.shards.get(report.shard_id)
        missing = st.missing.get(report.shard_id)
        if shard is None and missing is not None and missing[0] == report.node_id:
            if report.state in ENDED:
                # The final status of a shard that went missing while its
                # node was disconnected: its backoff was already counted.
                st.missing.pop(report.shard_id, None)
                if report.state == FAILED:
                    self._shard_failed(report, report.replica_id, missing[1], now, backoff=False,
                                       note=" (reported after the node came back)")
                return
        if shard is None or shard.node_id != report.node_id:
            held = st.reserved.get(report.shard_id)
            if report.state in ENDED:
                if held is not None and held.node_id == report.node_id:
                    st.release_reserved(report.shard_id)
            elif report.state in LIVE and held is None:
                # Running something nobody wants: stop it.
                self._unclaimed(report.node_id, report.shard_id, report.replica_id, 0,
                                f"reported {report.state} but the control plane holds no such shard")
            return
        rep = st.replicas.get(shard.replica_id)
        state = report.state
        if shard.stopping or rep is None:
            if state in ENDED:
                st.drop_shard(shard, now)
            return
        if state == FAILED:
            st.set_shard_state(shard, FAILED, now)
            self._shard_failed(report, rep.id, rep.model, now)
            self._teardown(rep, f"shard {shard.id} failed", now)
        elif state == STOPPED:
            st.set_shard_state(shard, STOPPED, now)
            self._event(
                "shard_stopped",
                level="warn",
                node=shard.node_id,
                replica=rep.id,
                shard=shard.id,
                reason=report.error or "stopped without being told to",
            )
            self._teardown(rep, f"shard {shard.id} stopped", now)
        elif state in LIVE:
            self._set_state(shard, rep, ShardState(state), now)
            self._update_ready(rep, now)
        elif state == ShardState.STOPPING:
            # Going away unasked, its processes not all gone yet: it serves
            # no more, and holds its GPUs and port until it reports stopped.
            st.set_shard_state(shard, ShardState.STOPPING, now)
            self._update_ready(rep, now)

    # -- changes to replicas ------------------------------------------------------------

    def _set_state(self, shard: ShardRec, rep: ReplicaRec, state: ShardState, now: float) -> None:
        """
        Take a shard's new state; one starting is looked at again at its
        startup timeout.
        """
        was = shard.state
        self.state.set_shard_state(shard, state, now)
        if state == STARTING and was != STARTING and not shard.stopping:
            profile = self._profile(rep.profile)
            timeout = profile.startup_timeout_s if profile is not None else 600
            self.state.check_at(shard.id, now + timeout)

    def _update_ready(self, rep: ReplicaRec, now: float) -> None:
        if self.state.update_ready(rep, now):
            self._event("replica_ready", replica=rep.id, reason=f"model {rep.model}")

    def replica_state(self, rep: ReplicaRec) -> str:
        return self.state.replica_state(rep)

    def _send_start(self, rep: ReplicaRec, shard: ShardRec, now: float, first: bool) -> None:
        profile = self._profile(rep.profile)
        shard.sends += 1
        shard.sent_at = now
        self.state.check_at(shard.id, now + self.pending_timeout)
        if profile is not None:
            leader = rep.shards.get(0)
            node = self.inventory.peek(leader.node_id) if leader is not None else None
            fabrics = node.fabrics if node is not None else {}
            self._queue(Start(start_command(rep, shard, profile, fabrics), first=first))

    def _new_replica_id(self, model: str) -> str:
        slug = _SLUG.sub("-", model).strip("-")[:40] or "replica"
        while True:
            self._ids += 1
            rid = f"{slug}-{self._id_prefix}-{self._ids}"
            if rid not in self.state.replicas and rid not in self.state.retired:
                return rid

    def _place(self, dep: Deployment, profile: Profile, placer: Placer, now: float) -> bool | None:
        """
        Place one replica of C{dep}: whether it was, or C{None} when the
        pass's time ran out first.
        """
        slots = placer.place(
            Request(
                group=dep.model,
                shards=profile.shards,
                gpus_per_shard=profile.gpus_per_shard,
                gpu_memory_mb=profile.gpu_memory_mb,
                fabric=profile.fabric,
            ),
            self._over_budget,
        )
        if slots is BUSY:
            return None
        if slots is None:
            return False
        rep = ReplicaRec(
            id=self._new_replica_id(dep.model),
            model=dep.model,
            profile=profile.name,
            world_size=profile.shards,
            created_at=now,
        )
        self.state.add_replica(rep)
        for slot in slots:
            self.state.add_shard(
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
                port_taken=True,
            )
        self._event(
            "replica_placed",
            node=",".join(s.node_id for s in slots),
            replica=rep.id,
            reason=f"model {dep.model} on "
            + ", ".join(f"{s.node_id} GPUs {list(s.gpu_indices)} port {s.port}" for s in slots),
        )
        for rank in sorted(rep.shards):
            self._send_start(rep, rep.shards[rank], now, first=True)
        return True

    def _teardown(self, rep: ReplicaRec, reason: str, now: float) -> None:
        """
        Stop every shard of C{rep}; it is forgotten once they confirm.
        """
        if rep.phase == Phase.STOPPING:
            return
        st = self.state
        st.set_phase(rep, Phase.STOPPING, now)
        self._event("replica_stopping", replica=rep.id, reason=reason)
        for shard in list(rep.shards.values()):
            if shard.state in ENDED:
                st.drop_shard(shard, now)
                continue
            st.mark_stopping(shard, now)
            profile = self._profile(rep.profile)
            grace = profile.stop_grace_s if profile is not None else 30
            st.check_at(shard.id, now + grace + STOP_SLACK)
            self._queue(Stop(shard.node_id, shard.id))
        if not rep.shards and rep.id in st.replicas:
            st.remove_replica(rep, now)

    def _start_drain(self, rep: ReplicaRec, reason: str, now: float, send: bool = True) -> None:
        if rep.phase != Phase.ACTIVE:
            return
        self.state.set_phase(rep, Phase.DRAINING, now)
        self._event("replica_draining", replica=rep.id, reason=reason)
        if send:
            for shard in rep.shards.values():
                self._queue(Drain(shard.node_id, shard.id))

    def _retire(self, rep: ReplicaRec, reason: str, now: float) -> None:
        """
        Take a replica out of service: drain it if it serves, else stop it.
        """
        if rep.id in self.state.ready[rep.model]:
            self._start_drain(rep, reason, now)
        else:
            self._teardown(rep, reason, now)

    def _evacuate(self, rep: ReplicaRec, reason: str) -> None:
        if rep.phase != Phase.ACTIVE or rep.evacuating:
            return
        self.state.set_evacuating(rep, reason)
        self._event("replica_evacuating", replica=rep.id, reason=reason)

    # -- the pass -----------------------------------------------------------------

    def run_pass(self) -> None:
        """
        One reconcile pass. Never raises: a failure is logged and counted,
        and the next pass runs as usual. Commands it decides are sent when
        it ends; if it stopped at its budget, the next pass runs at once.
        """
        if self._in_pass:
            return
        if self._next_pass is not None and self._next_pass.active():
            self._next_pass.cancel()
        self._next_pass = None
        self._in_pass = True
        self.pass_unfinished = False
        started = self._pass_started = self._timer()
        try:
            self._pass(self.clock.seconds())
        except Exception:
            self.pass_errors += 1
            self.log.failure("reconcile pass failed; the next one runs as usual")
        finally:
            self._in_pass = False
            try:
                self.flush()
            except Exception:
                self.log.failure("sending a pass's commands failed")
            self.passes += 1
            self.last_pass_duration = self._timer() - started
            self.max_pass_duration = max(self.max_pass_duration, self.last_pass_duration)
            self.pass_seconds_total += self.last_pass_duration
        if self.pass_unfinished and self._loop is not None:
            self._next_pass = self.clock.callLater(0, self.run_pass)

    def _over_budget(self) -> bool:
        # Placing stops short of the budget: the commands it decided are
        # still to be sent within it.
        return self._timer() - self._pass_started >= PLACING_SHARE * self.pass_budget

    def _pass(self, now: float) -> None:
        self._take_inventory(now)
        self._expire(now)
        if self.dispatcher is None:
            return
        self._check_shards(now)
        self._autoscale(now)  # autoscaling (issue 12): sets self.desired first
        self._reconcile(now)

    def _take_inventory(self, now: float) -> None:
        for node_id in self.inventory.take_changed():
            if node_id in self.inventory:
                self.state.note_node(node_id, now, self.suspect_after)
            else:
                self._forget_node(node_id, now)

    def _forget_node(self, node_id: str, now: float) -> None:
        st = self.state
        for sid in list(st.node_shards.get(node_id, ())):
            shard = st.shards[sid]
            rep = st.replicas.get(shard.replica_id)
            st.drop_shard(shard, now)
            if rep is not None:
                self._teardown(rep, f"node {node_id} was removed", now)
        st.forget_node(node_id)
        self._keep_nodes()

    def _last_heard(self, node_id: str) -> float | None:
        node = self.inventory.peek(node_id)
        if node is None:
            return None
        return max(node.last_seen, self.state.known_since.get(node_id, 0.0))

    def _expire(self, now: float) -> None:
        st = self.state
        out = judge(
            st.take_due(now), st.suspect, len(st.known_since), len(st.lost), self._last_heard,
            st.lost_clock, self.frozen, now,
            ExpiryRules(self.suspect_after, self.lost_after, self.freeze_share),
        )
        st.eligibility_changed([n for n, _ in out.suspect] + out.back + out.gone + [n for n, _ in out.lost])
        for node_id, silent in out.suspect:
            st.suspect.add(node_id)
            self._event("node_suspect", level="warn", node=node_id, reason=f"silent for {silent:.0f}s")
        if out.frozen is not None:
            self.frozen = out.frozen
            if out.frozen:
                self.frozen_reason = (
                    f"{out.suspect_count} of {out.live_count} nodes are suspect at once: assuming "
                    "the fault is on the control plane's side of the network"
                )
                self._event("replacements_frozen", level="critical", reason=self.frozen_reason)
            else:
                for node_id in out.fresh_clock:
                    st.lost_clock[node_id] = now
                self._event(
                    "replacements_resumed",
                    level="warn",
                    reason=f"{out.suspect_count} of {out.live_count} nodes are suspect; they are "
                    f"lost only after {self.lost_after:g}s more of silence",
                )
                self.frozen_reason = ""
        for node_id in out.gone:
            st.suspect.discard(node_id)
            st.lost_clock.pop(node_id, None)
        for node_id in out.back:
            st.suspect.discard(node_id)
            st.lost_clock.pop(node_id, None)
            self._event("node_ready", node=node_id, reason="heard from again")
        for deadline, node_id in out.recheck:
            st.watch(node_id, deadline)
        for node_id, silent in out.lost:
            self._node_lost(node_id, silent, now)

    def _node_lost(self, node_id: str, silent: float, now: float) -> None:
        st = self.state
        st.suspect.discard(node_id)
        st.lost_clock.pop(node_id, None)
        st.lost.add(node_id)
        self._event("node_lost", level="error", node=node_id, reason=f"silent for {silent:.0f}s")
        for sid in sorted(st.node_shards.get(node_id, set())):
            shard = st.shards.get(sid)
            if shard is None:
                continue
            rep = st.replicas.get(shard.replica_id)
            # Its process may still run: the port stays reserved.
            st.drop_shard(shard, now, confirmed=False)
            if rep is not None:
                self._teardown(rep, f"node {node_id} is lost; replacing the replica", now)

    def _check_shards(self, now: float) -> None:
        st = self.state
        # Only shards whose deadline may have come: each is looked at when
        # it changes and at its deadline, not in every pass.
        for sid in st.take_checks(now):
            shard = st.shards.get(sid)
            if shard is None:
                st.stopping.discard(sid)
                continue
            if sid in st.stopping:
                self._check_stopping(shard, now)
            elif sid in st.unsettled:
                self._check_unsettled(shard, now)
        for rid in sorted(st.draining):
            other = st.replicas.get(rid)
            if other is None:
                st.draining.discard(rid)
                continue
            profile = self._profile(other.profile)
            timeout = profile.drain_timeout_s if profile is not None else 60
            if self.in_flight is not None and self.in_flight.in_flight(rid) == 0:
                self._teardown(other, "drained: no request in flight", now)
            elif now - other.drain_started >= timeout:
                self._teardown(other, f"drain timeout of {timeout}s passed", now)
        if now >= self.grace_end:
            for rid in sorted(st.incomplete):
                other = st.replicas.get(rid)
                if other is None or len(other.shards) == other.world_size:
                    st.incomplete.discard(rid)
                    continue
                if now - other.created_at >= self.adoption_grace:
                    self._event(
                        "replica_incomplete",
                        level="warn",
                        replica=rid,
                        reason=f"{len(other.shards)} of {other.world_size} shards reported",
                    )
                    self._teardown(other, "incomplete after adoption", now)
        drained = False
        for node_id in sorted(st.draining_nodes):
            # A node not registered since start may still have shards that
            # its agent has not reported yet.
            if node_id in st.registered and not st.node_shards.get(node_id):
                st.draining_nodes.discard(node_id)
                self._event("node_drained", node=node_id, reason="no shards left")
                drained = True
        if drained:
            self._keep_nodes()

    def _check_unsettled(self, shard: ShardRec, now: float) -> None:
        st = self.state
        rep = st.replicas[shard.replica_id]
        profile = self._profile(rep.profile)
        sid = shard.id
        if shard.state == PENDING:
            deadline = shard.sent_at + self.pending_timeout
            if now < deadline:
                st.check_at(sid, deadline)
                return
            if shard.sends < MAX_SENDS:
                self._send_start(rep, shard, now, first=False)
                self._event(
                    "shard_resent",
                    node=shard.node_id,
                    replica=rep.id,
                    shard=sid,
                    reason=f"nothing heard for {self.pending_timeout:g}s",
                )
                return
            reason = f"nothing heard after {shard.sends} start commands"
            kind = "shard_unresponsive"
        else:
            timeout = profile.startup_timeout_s if profile is not None else 600
            deadline = shard.since + timeout
            if now < deadline:
                st.check_at(sid, deadline)
                return
            reason = f"not ready within the startup timeout of {timeout}s"
            kind = "startup_timeout"
        self._event(kind, level="error", node=shard.node_id, replica=rep.id, shard=sid, reason=reason)
        self._record_failure(rep.model, shard.node_id, rep.id, sid, now, error=reason)
        self._teardown(rep, reason, now)

    def _check_stopping(self, shard: ShardRec, now: float) -> None:
        st = self.state
        other = st.replicas.get(shard.replica_id)
        profile = self._profile(other.profile) if other is not None else None
        grace = profile.stop_grace_s if profile is not None else 30
        deadline = shard.stop_sent_at + grace + STOP_SLACK
        if now < deadline:
            st.check_at(shard.id, deadline)
            return
        self._event(
            "shard_stop_unconfirmed",
            level="warn",
            node=shard.node_id,
            replica=shard.replica_id,
            shard=shard.id,
            reason=f"no stopped report {grace + STOP_SLACK:g}s after the stop",
        )
        # Not known to have ended: its port stays reserved.
        st.drop_shard(shard, now, confirmed=False)

    def _reconcile(self, now: float) -> None:
        st = self.state
        synced = False
        self._placed_this_pass = 0
        placing = now >= self.grace_end and not self.frozen
        for model in sorted(self.catalog.deployments):
            dep = self.catalog.deployments[model]
            desired = self.desired.get(model, dep.replicas)
            state = self.deps[model]
            active = st.active[model]
            ready = st.ready[model]
            if state.backoff.failures:
                for rid in ready:
                    rs = st.replicas[rid].ready_since
                    if rs is not None and state.backoff.ready_for(now - rs):
                        state.backoff.reset()
                        self._event("backoff_reset", replica=rid, reason=f"deployment {model} ready long enough")
                        break
            evac = st.evacuating.get(model)
            step = scale_step(
                # Fresh ready replicas are counted only where some are being moved off.
                desired, len(active), len(ready & active) if evac else 0, len(evac) if evac else 0,
                placing=placing, held=state.held is not None, backing_off=state.backoff.blocked(now),
            )
            if step.retire_evacuated and evac:
                for rid in sorted(evac):
                    rep = st.replicas[rid]
                    self._retire(rep, f"replaced ({rep.evacuating})", now)
            if step.retire:
                for rid in victims(self._candidates(model, active), step.retire):
                    self._retire(st.replicas[rid], f"scale down of {model} to {desired}", now)
            elif step.place:
                if self.pass_unfinished:
                    continue
                missing = step.place
                profile = self.catalog.profiles[dep.profile]
                if not synced:
                    # Placement hears of every node that changed first; at
                    # the budget the rest is the next pass's, which runs
                    # at once.
                    if not self._sync_placer():
                        self.pass_unfinished = True
                        continue
                    synced = True
                placed = 0
                for _ in range(missing):
                    # Every pass places at least one replica, whatever it
                    # cost to get here.
                    if self._placed_this_pass and self._over_budget():
                        self.pass_unfinished = True
                        break
                    got = self._place(dep, profile, self._placer, now)
                    if got is None:
                        # Still gathering candidates, and the time is up.
                        self.pass_unfinished = True
                        break
                    if not got:
                        break
                    placed += 1
                    self._placed_this_pass += 1
                if self.pass_unfinished:
                    continue
                if placed < missing:
                    why = f"no room for {missing - placed} replica(s) of profile {profile.name}"
                    if state.unplaceable != why:
                        state.unplaceable = why
                        self._event("unplaceable", level="warn", reason=f"deployment {model}: {why}")
                else:
                    state.unplaceable = ""

    def _candidates(self, model: str, active: set[str]) -> list[Candidate]:
        """
        What a scale down of C{model} chooses from (DESIGN §6.6).
        """
        st = self.state
        ready = st.ready[model]
        out = []
        for rid in active:
            rep = st.replicas[rid]
            load = max((len(st.node_shards.get(s.node_id, ())) for s in rep.shards.values()), default=0)
            out.append(Candidate(rid, rid in ready, load, rep.created_at))
        return out

    def _sync_placer(self) -> bool:
        """
        Bring placement up to date with the nodes that changed since it last
        looked (those that connected or went away included), within the
        pass's budget; True when it is.
        """
        connected = self.connected()
        self.state.eligibility_changed(connected ^ self._placer_connected)
        self._placer_connected = connected
        return self.state.sync_placer(self._placer, self.inventory, connected, self._over_budget)

    # -- IFleetAdmin ----------------------------------------------------------------

    def connected(self) -> set[str]:
        return set(self.dispatcher.connected_nodes()) if self.dispatcher is not None else set()

    def status(self) -> dict[str, Any]:
        return views.status(self)

    def nodes(self) -> list[dict[str, Any]]:
        return views.nodes(self)

    def deployments(self) -> list[dict[str, Any]]:
        return views.deployments(self)

    def replicas(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return views.replicas(self)

    def events(self, since: float = 0.0) -> list[dict[str, Any]]:  # type: ignore[override]
        return [e.as_dict() for e in self.event_log.since(since)]

    def metrics_snapshot(self) -> dict[str, Any]:
        return views.metrics_snapshot(self)

    def _known(self, node_id: str) -> None:
        # A node cordoned or draining before a restart is known from the state
        # file even before it registers again, so it can be uncordoned.
        st = self.state
        if (
            node_id not in self.inventory
            and node_id not in st.known_since
            and node_id not in st.cordoned
            and node_id not in st.draining_nodes
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
            self.fleet_state.set_nodes(self.state.cordoned, self.state.draining_nodes)
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
        self.state.eligibility_changed([node_id])
        if node_id not in self.state.cordoned:
            self.state.cordoned.add(node_id)
            self._event("node_cordoned", node=node_id, reason="no new placements")
        self._keep_nodes("cordoned", node_id)

    def uncordon(self, node_id: str) -> None:
        self._known(node_id)
        self.state.eligibility_changed([node_id])
        st = self.state
        was_draining = node_id in st.draining_nodes
        if node_id in st.cordoned or was_draining:
            st.cordoned.discard(node_id)
            st.draining_nodes.discard(node_id)
            self._event("node_uncordoned", node=node_id, reason="placements allowed again")
        for sid in sorted(st.node_shards.get(node_id, ())):
            rep = st.replicas.get(st.shards[sid].replica_id)
            if rep is None or rep.evacuating != "node drain" or rep.phase != Phase.ACTIVE:
                continue
            if any(s.node_id in st.draining_nodes for s in rep.shards.values()):
                continue
            st.set_evacuating(rep, "")
        self._keep_nodes("uncordoned", node_id)

    def drain_node(self, node_id: str) -> None:
        self._known(node_id)
        self.state.eligibility_changed([node_id])
        st = self.state
        if node_id not in st.cordoned:
            st.cordoned.add(node_id)
            self._event("node_cordoned", node=node_id, reason="no new placements")
        if node_id not in st.draining_nodes:
            st.draining_nodes.add(node_id)
            self._event("node_draining", node=node_id, reason="moving its replicas, make-before-break")
            for sid in sorted(st.node_shards.get(node_id, ())):
                rep = st.replicas.get(st.shards[sid].replica_id)
                if rep is not None:
                    self._evacuate(rep, "node drain")
        self._keep_nodes("draining", node_id)

    def scale(self, model: str, replicas: int) -> None:
        dep = self.catalog.deployments.get(model)
        if dep is None:
            raise UnknownDeployment(f"no deployment serves model {model!r}")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise AdminError(f"replicas must be a whole number of at least 0, not {replicas!r}")
        self._refuse_fixed_scale(dep)  # autoscaling (issue 12)
        try:
            self.fleet_state.set(model, replicas, dep.replicas)
        except OSError as e:
            err = AdminError(f"could not keep the new scale in {self.fleet_state.path}: {e}")
            err.status = 500
            raise err from e
        old = self.desired.get(model, dep.replicas)
        self.desired[model] = replicas
        self._event("scaled", reason=f"deployment {model} from {old} to {replicas} replicas")

    def retry(self, model: str) -> None:
        dep = self.catalog.deployments.get(model)
        if dep is None:
            raise UnknownDeployment(f"no deployment serves model {model!r}")
        self._release(model, "an operator asked for a retry")

    def _release(self, model: str, why: str) -> None:
        """
        Lift C{model}'s hold and crash backoff: the next pass places again.
        """
        state = self.deps[model]
        was = state.held
        state.held = None
        state.backoff.reset()
        if was is not None:
            self._event("deployment_released", reason=f"deployment {model}: {why}")

    # -- helpers for tests and embedding -------------------------------------------------

    def replica_ids(self, model: str | None = None) -> list[str]:
        if model is None:
            return sorted(self.state.replicas)
        return sorted(self.state.by_model.get(model, ()))

    def known_nodes(self) -> Iterable[str]:
        return self.state.known_since.keys()

    # -- autoscaling (issue 12) ------------------------------------------------------------
    # The decision is llmgw.control.autoscale.decide; this block only feeds
    # it and applies its count through self.desired (placed or drained by
    # _reconcile, as for any scale).

    def set_demand_source(self, source: IDemand | None) -> None:
        self.demand_source = source

    def model_of(self, replica_id: str) -> str | None:
        rep = self.state.replicas.get(replica_id)
        return rep.model if rep is not None else None

    def report_demand(self, gateway_id: str, models: dict[str, Demand]) -> None:
        """
        A standalone gateway's demand (C{POST /api/v1/demand}); it counts
        until it expires (L{DemandBoard.expire_after}).
        """
        self.demand_board.report(gateway_id, models, self.clock.seconds())

    def demand(self) -> dict[str, Demand]:
        """
        Each model's demand: the standalone gateways' reports plus the
        embedded gateway's (its L{IDemand}, or its in-flight counts).
        """
        now = self.clock.seconds()
        totals = self.demand_board.totals(now)
        own: dict[str, Demand] = {}
        if self.demand_source is not None:
            own = dict(self.demand_source.demand())
        elif self.in_flight is not None:
            # Without a demand source, one look per replica of each
            # autoscaled deployment (the control plane wires a source).
            for model in self._autoscaled():
                n = sum(self.in_flight.in_flight(rid) for rid in self.state.by_model.get(model, ()))
                if n:
                    own[model] = Demand(n, 0)
        for model, d in own.items():
            t = totals.get(model)
            totals[model] = d if t is None else Demand(t.in_flight + d.in_flight, t.waiting + d.waiting)
        return totals

    def _refuse_fixed_scale(self, dep: Deployment) -> None:
        if dep.autoscale is not None:
            raise AdminError(
                f"deployment {dep.model} autoscales; a fixed count does not apply: set its bounds "
                f"instead (llmgw ctl scale {dep.model} --min N --max M)"
            )

    def scale_bounds(self, model: str, min_replicas: int, max_replicas: int) -> None:
        """
        Set an autoscaled deployment's bounds; kept across restarts until
        the catalog's own bounds are edited.

        @raise UnknownDeployment: no deployment serves C{model}.
        @raise AdminError: it does not autoscale, or the bounds are wrong.
        """
        dep = self.catalog.deployments.get(model)
        if dep is None:
            raise UnknownDeployment(f"no deployment serves model {model!r}")
        if dep.autoscale is None:
            raise AdminError(
                f"deployment {model} has a fixed count of replicas and does not autoscale: "
                f"scale it with a count (llmgw ctl scale {model} N), or give it min_replicas, "
                f"max_replicas and a target in the catalog"
            )
        for name, n in (("min", min_replicas), ("max", max_replicas)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise AdminError(f"{name} must be a whole number of at least 0, not {n!r}")
        if max_replicas < 1 or max_replicas < min_replicas:
            raise AdminError(f"max ({max_replicas}) must be at least 1 and at least min ({min_replicas})")
        try:
            self.fleet_state.set_bounds(model, min_replicas, max_replicas, dep.autoscale)
        except OSError as e:
            err = AdminError(f"could not keep the new bounds in {self.fleet_state.path}: {e}")
            err.status = 500
            raise err from e
        self._event("autoscale_bounds_set",
                    reason=f"deployment {model} autoscales between {min_replicas} and {max_replicas} replicas")

    def autoscale_view(self, model: str) -> dict[str, Any] | None:
        """
        An autoscaled deployment's bounds, targets and what it holds, for
        the admin API; C{None} for a fixed count.
        """
        dep = self.catalog.deployments.get(model)
        policy = self.fleet_state.policy(dep) if dep is not None else None
        if policy is None:
            return None
        state = self.scalers.get(model)
        return {
            "min_replicas": policy.min_replicas, "max_replicas": policy.max_replicas,
            "target_in_flight": policy.target_in_flight, "target_waiting": policy.target_waiting,
            "scale_to_zero_after_s": policy.scale_to_zero_after_s if policy.min_replicas == 0 else None,
            "stabilization_s": policy.stabilization_s,
            "last_scale_up": state.last_up_at if state is not None else None,
            "last_busy": state.busy_at if state is not None else None,
        }

    def _autoscaled(self) -> list[str]:
        # An index of the autoscaled models, rebuilt when the catalog object
        # changes (a reload), so a pass does not look at every deployment.
        if self._autoscaled_of is not self.catalog:
            self._autoscaled_of = self.catalog
            self._autoscaled_models = sorted(
                m for m, d in self.catalog.deployments.items() if d.autoscale is not None)
            for gone in set(self.scalers) - set(self._autoscaled_models):
                del self.scalers[gone]
        return self._autoscaled_models

    def _autoscale(self, now: float) -> None:
        st = self.state
        demand: dict[str, Demand] | None = None
        for model in self._autoscaled():
            dep = self.catalog.deployments[model]
            policy = self.fleet_state.policy(dep)
            if policy is None:
                continue
            if demand is None:
                demand = self.demand()
            d = demand.get(model, Demand(0, 0))
            active = st.active.get(model, set())
            engine_waiting = 0.0
            # Only a waiting target reads the engines' figures (one look per
            # ready replica of that deployment).
            for rid in st.ready.get(model, ()) if policy.target_waiting else ():
                leader = st.replicas[rid].shards.get(0)
                sig = leader.signals if leader is not None else None
                if sig is not None and sig.waiting is not None and sig.age(now) <= autoscaling.SIGNALS_STALE_AFTER_S:
                    engine_waiting += sig.waiting
            # What it holds survives a catalog reload, which resets self.desired.
            state = self.scalers.get(model) or autoscaling.ScalerState(self.desired.get(model, dep.replicas))
            short = max(0, state.desired - len(active)) if self.deps[model].unplaceable else 0
            seen = autoscaling.Observed(
                active=len(active), in_flight=d.in_flight, waiting=d.waiting, engine_waiting=engine_waiting,
                short=short, settling=now < self.grace_end,
            )
            decision = autoscaling.decide(policy, state, seen, now)
            self.scalers[model] = decision.state
            self.desired[model] = decision.desired
            for ev in decision.events:
                level = "warn" if ev.kind == autoscaling.CAPACITY else "info"
                self._event(ev.kind, level=level, reason=f"deployment {model}: {ev.reason}")
