"""
The reconciler (DESIGN §6, §6.7): the control plane's thin shell around
its decisions. It is the agent service's status sink (L{IStatusSink}) and
the admin API's fleet (L{IFleetAdmin}), and owns the published routing
table (L{routing_table}) that every gateway routes from.

Data flows one way:

  1. agent reports, admin calls and passes (a C{LoopingCall} every
     C{pass_interval}; passes never overlap, a failed one is logged and
     the loop goes on) come in here, with the time from the injected clock;
  2. a decision takes the L{Context} (the L{FleetState}, the catalog, the
     rules, each deployment's backoff), the input and the time, and returns
     an L{Outcome}: commands and events (L{reports}, L{nodes},
     L{deadlines}, L{placing}, L{lifecycle} and the smaller modules of
     C{llmgw.control.core});
  3. this shell logs the events and queues the commands (L{Outbox}), sent
     after the handler that caused them has returned (never re-entrantly
     into the agent service), then projects the models whose routes
     changed into L{routing_table}, whose revision increases.

A pass with more to place than its budget (C{pass_budget}, 20 ms) allows
stops there, and the next one runs at once; so does one that judged
L{nodes.EXPIRY_BATCH} nodes' checks with more of them due. Without a catalog file the
catalog is empty: nothing is placed, and every shard reported is stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from twisted.application.service import Service
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from zope.interface import implementer

from llmgw.control.core import deadlines, lifecycle, nodes, placing, prefetching, reports, scaler
from llmgw.control.core.adapterloads import AdapterLoading
from llmgw.control.core.backoff import Backoff
from llmgw.control.core.catalog import Catalog, CatalogError, load_catalog
from llmgw.control.core.commands import send
from llmgw.control.core.context import MAX_SENDS, STOP_SLACK, Context, DeploymentState, Rules
from llmgw.control.core.kept import KeptState
from llmgw.control.core.outcome import Outcome
from llmgw.control.core.sleeping import record as record_sleep
from llmgw.control.core.swapping import Swapping
from llmgw.control.core.wedged import Progress, check_node
from llmgw.control.core.wedged import check as check_wedged
from llmgw.control.shell import views
from llmgw.control.shell.modelviews import ModelControl
from llmgw.control.shell.outbox import Outbox
from llmgw.control.shell.rollouts import RolloutControl
from llmgw.control.state.events import EventLog, log_event
from llmgw.control.state.fetches import FetchProgress
from llmgw.control.state.fleetstate import FleetState, ReplicaRec, format_address
from llmgw.control.state.interfaces import (
    AdminError,
    IDispatcher,
    IFleetAdmin,
    IInFlight,
    IStatusSink,
    ReportedShard,
    ShardReport,
)
from llmgw.control.state.inventory import Inventory
from llmgw.control.state.placement import PortBook
from llmgw.control.state.signals import ShardSignals, SignalStore  # engines
from llmgw.routing import Demand, EngineSignals, IDemand, IRoutingTable, Route, RoutingTable

__all__ = ["MAX_SENDS", "STOP_SLACK", "DeploymentState", "Reconciler", "format_address"]

DEFAULT_PASS_INTERVAL = 1.0
DEFAULT_SUSPECT_AFTER = 15.0
DEFAULT_LOST_AFTER = 300.0
DEFAULT_ADOPTION_GRACE = 30.0
DEFAULT_PENDING_TIMEOUT = 30.0
DEFAULT_FREEZE_SHARE = 0.5
#: The events after which the held deployments are kept again.
HOLD_EVENTS = frozenset({"deployment_held", "deployment_released"})
#: The longest a pass may hold the reactor before it leaves the rest of
#: its placements to the next pass.
DEFAULT_PASS_BUDGET = 0.020
#: The share of a pass's budget that placement may use, counting what
#: the pass is yet to do with what it decided (L{TAIL_COST}): the rest is
#: the margin for a collection or the machine's load.
PLACING_SHARE = 0.6
#: What logging one event or sending one command at the end of a pass is
#: taken to cost (seconds) until passes have measured it: placing stops
#: once the time spent and this, for everything decided so far, reach the
#: placing share.
TAIL_COST = 20e-6
#: A pass that decided fewer events and commands than this does not change
#: the measured cost of them.
TAIL_SAMPLE = 20
#: Shards added since the last call of C{after_growth} that make the next
#: pass call it (the control plane freezes the collector's heap there).
GROWTH_STEP = 1000


def _rule(name: str, of: Callable[[Any], Any] = lambda rec: rec.ctx.rules) -> Any:
    # The reconciler's attributes that live in its context, kept by name.
    return property(lambda self: getattr(of(self), name), lambda self, v: setattr(of(self), name, v))


def _ctx_attr(name: str) -> Any:
    return _rule(name, lambda rec: rec.ctx)


@implementer(IStatusSink, IRoutingTable, IFleetAdmin)
class Reconciler(RolloutControl, ModelControl, Service):
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
    @param after_growth: called at the end of a pass after the fleet grew by
        L{GROWTH_STEP} shards or more since its last call (the control
        plane's process freezes its collector's heap there, so that full
        collections do not scan the long-lived records).
    """

    log = Logger()

    suspect_after = _rule("suspect_after")
    lost_after = _rule("lost_after")
    adoption_grace = _rule("adoption_grace")
    pending_timeout = _rule("pending_timeout")
    freeze_share = _rule("freeze_share")
    catalog = _ctx_attr("catalog")
    state = _ctx_attr("state")
    backoff = _ctx_attr("backoff")
    desired = _ctx_attr("desired")
    frozen = _ctx_attr("frozen")
    frozen_reason = _ctx_attr("frozen_reason")
    started_at = _ctx_attr("started_at")
    epoch = property(lambda self: self.ctx.epoch)

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
        after_growth: Callable[[], None] | None = None,
    ):
        self.inventory = inventory
        self.clock = clock
        self.dispatcher = dispatcher
        self.in_flight = in_flight
        self.pass_interval = pass_interval
        self.pass_budget = pass_budget
        self.after_growth = after_growth
        #: The decisions' inputs, the fleet state among them.
        self.ctx = Context(
            FleetState(PortBook(*catalog.port_range)), catalog, inventory,
            Rules(suspect_after, lost_after, adoption_grace, pending_timeout, freeze_share),
            backoff if backoff is not None else Backoff(), epoch, clock.seconds(),
        )
        self.fleet_state = fleet_state if fleet_state is not None else KeptState.beside(catalog.path)
        for warning in self.fleet_state.load():
            self.log.error("{warning}", warning=warning)
        self.event_log = EventLog(event_limit)
        #: Engine signals from heartbeats, per shard (engines).
        self.engine_signals = SignalStore()
        #: Leader shards running requests, with when their progress last moved.
        self.progress: dict[str, Progress] = {}
        self._timer = timer
        #: The routing table, a projection of L{state}.
        self.routing_table = RoutingTable(clock)
        self.routing_table.set_known(catalog.deployments)
        # Kept across restarts in the fleet state file: a cordoned node stays
        # cordoned, and a draining node's replicas are moved off it once it
        # registers again with them.
        self.state.cordoned.update(self.fleet_state.cordoned)
        self.state.draining_nodes.update(self.fleet_state.draining)
        self.take_up_rollouts()
        self.last_pass_duration = self.max_pass_duration = self.pass_seconds_total = 0.0
        self.passes = self.pass_errors = 0
        #: A pass stopped at its budget with placements left to make, or
        #: with node checks left (more fell due than L{nodes.EXPIRY_BATCH}).
        self.pass_unfinished = False
        self._pass_started = 0.0
        #: What the running pass has decided so far (None between passes),
        #: and when its decisions ended and how many events and commands
        #: they made, for measuring what those cost.
        self._pass_out: Outcome | None = None
        self._decided: tuple[float, int] = (0.0, 0)
        #: The measured cost of each event logged and command sent at the
        #: end of a pass (L{TAIL_COST} until measured).
        self.tail_cost = TAIL_COST
        #: The connected nodes as a pass that placed last asked the
        #: dispatcher (a look at every connection), and when: a pass that
        #: continues an unfinished one within C{pass_interval} uses them
        #: again, until a command is refused.
        self._connected_seen: tuple[float, set[str]] | None = None
        self._continuing = False
        self._loop: LoopingCall | None = None
        #: Commands decided, sent after the handler that decided them.
        self.outbox = Outbox(clock, self.ctx, self.routing_table,
                             lambda cmd: send(self.dispatcher, cmd), self._apply)
        self._next_pass: IDelayedCall | None = None
        self._placing = placing.Placing(self.ctx)
        self._grown_from = 0
        self.desired = {m: self.fleet_state.desired(d) for m, d in catalog.deployments.items()}
        #: Autoscaled deployments' memory and the demand they follow.
        self.autoscaling = scaler.Autoscaling()
        self.adapter_loading = AdapterLoading()
        self.swapping = Swapping()
        #: Called (no arguments) when L{end_adoption_grace} ends the grace
        #: early: an HA leader republishes its routes then, not at the old end.
        self.grace_ended_listeners: list[Callable[[], None]] = []

    # -- compatibility views of the state -----------------------------------------------

    deps = property(lambda self: self.ctx.deps, doc="Each deployment's failure bookkeeping.")
    shard_recs = property(lambda self: self.state.shards)
    replica_recs = property(lambda self: self.state.replicas)
    cordoned = property(lambda self: self.state.cordoned)
    draining_nodes = property(lambda self: self.state.draining_nodes)
    suspect = property(lambda self: self.state.suspect)
    lost = property(lambda self: self.state.lost)
    ports = property(lambda self: self.state.ports)
    grace_end = property(lambda self: self.ctx.grace_end)

    # -- wiring -----------------------------------------------------------------

    def attach(self, dispatcher: IDispatcher, epoch: int | None = None) -> None:
        """
        Give the reconciler its dispatcher (the agent service), which is
        built after it because it needs the reconciler as its sink.
        """
        self.dispatcher = dispatcher
        if epoch is not None:
            self.ctx.set_epoch(epoch)

    def set_in_flight(self, source: IInFlight | None) -> None:
        self.in_flight = source

    def startService(self) -> None:
        super().startService()
        self.started_at = self.clock.seconds()
        # Every node this process learns of gets a fresh clock (DESIGN §6.3).
        for node_id in list(self.state.known_since):
            self.state.known_since[node_id] = self.started_at
        loop = self._loop = LoopingCall(self.run_pass)
        loop.clock = self.clock
        loop.start(self.pass_interval, now=False)
        self.log.info(
            "reconciler started: {deployments} deployments, pass every {interval}s, "
            "placing nothing for {grace}s while agents report what they run",
            deployments=len(self.catalog.deployments), interval=self.pass_interval,
            grace=self.adoption_grace,
        )

    def stopService(self) -> Any:
        super().stopService()
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None
        self.outbox.cancel()
        if self._next_pass is not None and self._next_pass.active():
            self._next_pass.cancel()
        self._next_pass = None
        return None

    # -- applying outcomes; commands are sent after the handler returns -------------------

    def _event(self, kind: str, *, level: str = "info", **fields: Any) -> None:
        log_event(self.log, level, self.event_log.add(self.clock.seconds(), kind, **fields))

    def _apply(self, out: Outcome) -> None:
        """
        Take what a decision returned: log its events, queue its commands,
        keep the nodes file if it changed.
        """
        holds = False
        for ev in out.events:
            if ev.kind == "dispatch_refused":
                # Its node may have gone: the next pass asks again.
                self._connected_seen = None
            elif ev.kind in HOLD_EVENTS:
                holds = True
            self._event(ev.kind, level=ev.level, **ev.fields)
        self.outbox.extend(out.commands)
        if out.nodes_changed:
            self._keep_nodes()
        if holds and self.fleet_state.keeps_holds:
            self._keep_holds()

    def _decide(self, decide: Callable[..., Any], *args: Any) -> Any:
        """
        Run C{decide(ctx, *args, outcome)} and apply its outcome (also what
        it decided before it raised); its commands go out once the caller
        has returned.
        """
        out = Outcome()
        try:
            return decide(self.ctx, *args, out)
        finally:
            self._apply(out)
            self.outbox.settle()

    def flush(self) -> None:
        self.outbox.flush()

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

    def apply_catalog(self, new: Catalog) -> dict[str, Any]:
        """
        Make C{new} the running catalog (L{lifecycle.new_catalog}); returns
        what changed.
        """
        desired = {m: self.fleet_state.desired(d) for m, d in new.deployments.items()}
        self.routing_table.set_known(new.deployments)
        changes: dict[str, Any] = self._decide(lifecycle.new_catalog, new, desired, self.clock.seconds())
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
        self._event(
            "catalog_reloaded",
            reason=", ".join(f"{k}: {','.join(v)}" for k, v in changes.items() if v) or "no changes",
        )
        return {"path": path, **changes}

    # -- IStatusSink --------------------------------------------------------------

    def adopt(self, node_id: str, shards: list[ReportedShard]) -> list[ReportedShard]:
        """
        Claim what a registering node runs (DESIGN §6.5). Returns the
        shards nothing claims, for the caller to log; the reconciler stops
        them itself, after the caller has returned.
        """
        refused: list[ReportedShard] = self._decide(reports.adopt, node_id, shards, self.clock.seconds())
        return refused

    def node_registered(self, node_id: str) -> None:
        self._decide(reports.registered, node_id, self.clock.seconds())

    def on_shard_status(self, report: ShardReport) -> None:
        self._decide(reports.shard_status, report, self.clock.seconds())

    def shard_node(self, shard_id: str) -> str | None:
        return reports.shard_node(self.ctx, shard_id)

    def record_engine_signals(self, node_id: str, msgs: Iterable[Any]) -> None:
        now = self.clock.seconds()
        if self.ctx.state.node_shards.get(node_id):
            self._decide(record_sleep, self.engine_signals, node_id, msgs, now)
            self._decide(check_node, self.engine_signals, self.progress, node_id, now)
        else:  # a node without shards has none to wedge or to wake: no decision to make
            reports.engine_signals(self.ctx, self.engine_signals, node_id, msgs, now)
            self.outbox.settle()

    def record_fetches(self, node_id: str, msgs: Iterable[Any]) -> None:
        if self.ctx.state.node_shards.get(node_id):  # else none of its shards is fetching
            reports.fetches(self.ctx, node_id, msgs)

    def fetch_rows(self) -> list[tuple[str, str, str, str, FetchProgress]]:
        return views.fetch_rows(self)

    def shard_signals(self, node_id: str, shard_id: str, signals: EngineSignals | None) -> None:
        reports.shard_signals(self.ctx, node_id, shard_id, signals)
        self.outbox.settle()

    def engine_signal_rows(self) -> list[tuple[str, str, str, ShardSignals]]:
        return views.engine_signal_rows(self)

    def replica_state(self, rep: ReplicaRec) -> str:
        return self.state.replica_state(rep)

    # -- the pass -----------------------------------------------------------------

    def run_pass(self) -> None:
        """
        One reconcile pass. Never raises: a failure is logged and counted,
        and the next pass runs as usual. Commands it decides are sent when
        it ends; if it stopped at its budget, the next pass runs at once.
        """
        if self.outbox.held:
            return
        if self._next_pass is not None and self._next_pass.active():
            self._next_pass.cancel()
        self._next_pass = None
        self.outbox.held = True
        self._continuing = self.pass_unfinished
        self.pass_unfinished = False
        self._decided = (0.0, 0)
        started = self._pass_started = self._timer()
        try:
            self._pass(self.clock.seconds())
        except Exception:
            self.pass_errors += 1
            self.log.failure("reconcile pass failed; the next one runs as usual")
        finally:
            self.outbox.held = False
            try:
                self.flush()
            except Exception:
                self.log.failure("sending a pass's commands failed")
            self._learn_tail()
            self._grown()
            self.passes += 1
            self.last_pass_duration = self._timer() - started
            self.max_pass_duration = max(self.max_pass_duration, self.last_pass_duration)
            self.pass_seconds_total += self.last_pass_duration
        if self.pass_unfinished and self._loop is not None:
            self._next_pass = self.clock.callLater(0, self.run_pass)

    def _grown(self) -> None:
        size = len(self.state.shards)
        if size < self._grown_from:
            self._grown_from = size
        elif size - self._grown_from >= GROWTH_STEP and self.after_growth is not None:
            self._grown_from = size
            self.after_growth()

    def _connected_for(self, now: float) -> set[str]:
        # Asking the dispatcher looks at every connection: a burst of
        # placements over passes that follow at once asks once.
        seen = self._connected_seen
        if seen is None or not self._continuing or now - seen[0] >= self.pass_interval:
            seen = self._connected_seen = (now, self.connected())
        return seen[1]

    def _learn_tail(self) -> None:
        # Up at once to a dearer cost measured, down slowly: a pass that
        # under-estimated it went over its budget.
        decided_at, items = self._decided
        if items >= TAIL_SAMPLE:
            per = (self._timer() - decided_at) / items
            self.tail_cost = max(per, 0.75 * self.tail_cost + 0.25 * per)

    def _over_budget(self) -> bool:
        # Placing stops short of the budget: the events it decided are
        # still to be logged and its commands sent within it.
        out = self._pass_out
        pending = len(out.events) + len(out.commands) if out is not None else 0
        spent = self._timer() - self._pass_started + pending * self.tail_cost
        return spent >= PLACING_SHARE * self.pass_budget

    def _pass(self, now: float) -> None:
        out = self._pass_out = Outcome()
        try:
            self._tick(self.ctx, now, out)
        finally:
            self._pass_out = None
            self._decided = (self._timer(), len(out.events) + len(out.commands))
            self._apply(out)

    def _tick(self, ctx: Context, now: float, out: Outcome) -> None:
        nodes.inventory_changed(ctx, self.inventory.take_changed(), now, out)
        # Checks left over (many nodes fell due at once) are the next pass's, which runs at once.
        expiry_left = nodes.expire(ctx, now, out)
        self.pass_unfinished = expiry_left
        if self.dispatcher is None:
            return
        deadlines.check(ctx, self.in_flight, now, out)
        check_wedged(ctx, self.engine_signals, self.progress, now, out)
        self.autoscaling.tick(ctx, self.fleet_state, self.in_flight, now, out)
        self.adapter_loading.tick(ctx, lambda: self.autoscaling.demand(ctx, self.in_flight, now), now, out)
        p, connected = self._placing, lambda: self._connected_for(now)
        placing_left = placing.reconcile(ctx, now, p.placer, lambda: p.sync(ctx, connected(), self._over_budget),
                                         self._over_budget, out)
        sw = self.swapping  # idle unless room is short or being made, or a GPU is lent
        if sw.pending or sw.incoming or ctx.room or ctx.short_of_room() or ctx.state.displaced:
            sw.tick(ctx, self.autoscaling.scalers, connected, now, out)
        prefetching.step(ctx, ctx.prefetch, connected, now, out)
        self.pass_unfinished = expiry_left or placing_left

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

    def _keep_holds(self) -> None:
        """
        Keep the held deployments where the fleet state keeps them (an
        HA leader's etcd), after a deployment was held or released.
        """
        held = {m: st.held for m, st in self.ctx.deps.items() if st.held is not None}
        try:
            self.fleet_state.set_holds(held)
        except OSError as e:
            self.log.error("could not keep held deployments in {path}: {error}",
                           path=str(self.fleet_state.path), error=str(e))

    def _node_action(self, node_id: str, decide: Callable[[Context, str, Outcome], None],
                     action: str) -> None:
        nodes.known(self.ctx, node_id)
        self._decide(decide, node_id)
        self._keep_nodes(action, node_id)

    def cordon(self, node_id: str) -> None:
        self._node_action(node_id, nodes.cordon, "cordoned")

    def uncordon(self, node_id: str) -> None:
        self._node_action(node_id, nodes.uncordon, "uncordoned")

    def drain_node(self, node_id: str) -> None:
        self._node_action(node_id, nodes.drain, "draining")

    def take_up_kept(self) -> None:
        """
        Adopt what L{fleet_state} holds now (an HA leader's, read from
        etcd at take-over): its cordoned and draining nodes and scale.
        """
        st, kept = self.state, self.fleet_state
        st.eligibility_changed(set(st.cordoned) ^ set(kept.cordoned))
        st.cordoned.clear(), st.draining_nodes.clear()
        st.cordoned.update(kept.cordoned), st.draining_nodes.update(kept.draining)
        self.desired = {m: kept.desired(d) for m, d in self.catalog.deployments.items()}
        self.take_up_rollouts()
        if kept.keeps_holds:
            # The held deployments, as the previous leader kept them.
            deps = self.ctx.deps
            for model in [m for m, d in deps.items() if d.held is not None and m not in kept.held]:
                deps[model].held = None
            for model, hold in kept.held.items():
                if model in self.catalog.deployments:
                    deps[model].held = hold

    def scale(self, model: str, replicas: int) -> None:
        dep = placing.check_scale(self.ctx, model, replicas)
        scaler.refuse_fixed_scale(self.catalog, model)
        try:
            self.fleet_state.set(model, replicas, dep.replicas)
        except OSError as e:
            err = AdminError(f"could not keep the new scale in {self.fleet_state.path}: {e}")
            err.status = 500
            raise err from e
        old = self.desired.get(model, dep.replicas)
        self.desired[model] = replicas
        self._event("scaled", reason=f"deployment {model} from {old} to {replicas} replicas")

    def scale_bounds(self, model: str, min_replicas: int, max_replicas: int) -> None:
        """
        Set an autoscaled deployment's bounds; kept across restarts until
        the catalog's own bounds are edited.
        """
        policy = scaler.check_bounds(self.catalog, model, min_replicas, max_replicas)
        try:
            self.fleet_state.set_bounds(model, min_replicas, max_replicas, policy)
        except OSError as e:
            err = AdminError(f"could not keep the new bounds in {self.fleet_state.path}: {e}")
            err.status = 500
            raise err from e
        self._event("autoscale_bounds_set",
                    reason=f"deployment {model} autoscales between {min_replicas} and {max_replicas} replicas")

    def report_demand(self, gateway_id: str, models: dict[str, Demand]) -> None:
        """
        A standalone gateway's demand (C{POST /api/v1/demand}); it counts
        until it expires (L{DemandBoard.expire_after}).
        """
        # Only deployments that autoscale, and adapters (loaded where busy),
        # are kept: a report cannot grow the board with names of its choosing.
        auto = set(self.autoscaling.models(self.catalog)) | set(self.catalog.adapters)
        kept = {m: d for m, d in models.items() if m in auto}
        self.autoscaling.board.report(gateway_id, kept, self.clock.seconds())

    def set_demand_source(self, source: IDemand | None) -> None:
        self.autoscaling.source = source

    def demand(self) -> dict[str, Demand]:
        return self.autoscaling.demand(self.ctx, self.in_flight, self.clock.seconds())

    def autoscale_view(self, model: str) -> dict[str, Any] | None:
        return self.autoscaling.view(self.ctx, self.fleet_state, model)

    def model_of(self, replica_id: str) -> str | None:
        rep = self.state.replicas.get(replica_id)
        return rep.model if rep is not None else None

    def republish_routes(self) -> bool:
        """
        Publish the whole routing table from the fleet state as it
        stands, dropping routes it does not hold (an HA leader whose table
        was the previous leader's, once its adoption grace is over).
        Returns whether anything changed.
        """
        st = self.state
        st.take_routes_dirty()
        changed = self.routing_table.publish(
            [r for m in sorted(st.ready) for r in st.routes(m)], self.catalog.deployments)
        return self.routing_table.set_known(self.catalog.deployments) or changed

    def end_adoption_grace(self, reason: str) -> None:
        """
        Stop waiting for agents to report what they run: every node that is
        expected has registered (C{reason} says how that is known).
        """
        now = self.clock.seconds()
        if now < self.grace_end:
            self.adoption_grace = now - self.started_at
            self._event("adoption_grace_ended", reason=reason)
            # Placing may start now, not at the next interval's pass.
            if self._loop is not None and self._next_pass is None:
                self._next_pass = self.clock.callLater(0, self.run_pass)
            for listener in list(self.grace_ended_listeners):
                try:
                    listener()
                except Exception:
                    self.log.failure("a listener of the adoption grace's end failed")

    def retry(self, model: str) -> None:
        placing.deployment(self.ctx, model)
        self._decide(lifecycle.release, model, "an operator asked for a retry")

    # -- helpers for tests and embedding -------------------------------------------------

    def replica_ids(self, model: str | None = None) -> list[str]:
        if model is None:
            return sorted(self.state.replicas)
        return sorted(self.state.by_model.get(model, ()))

    def known_nodes(self) -> Iterable[str]:
        return self.state.known_since.keys()

