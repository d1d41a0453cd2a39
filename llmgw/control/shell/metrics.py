"""
The control plane's Prometheus metrics (DESIGN §11).

Nothing on a hot path counts anything for Prometheus: L{ControlCollector}
reads the agent service's counters and the reconciler's
C{metrics_snapshot()} when C{/metrics} is scraped.

Each control plane has its own C{CollectorRegistry} (L{make_registry}), not
the process-global one, so that several control planes in one process (and
the tests) do not collide. Other parts (the gateway) register their own
collectors or metrics on the same registry; the admin API serves it.

The reconciler's C{metrics_snapshot()} returns a dict; every key is
optional, a missing one leaves its metric out::

    {
        "nodes": {"ready": 9, "suspect": 1, "lost": 0},       # now, by state
        "shards": {"ready": 18, "starting": 2},               # now, by state
        "replicas": {"ready": 9, "starting": 1},              # now, by state
        "events": {"placed": 12, "shard_failed": 1},          # since start, by kind
        "last_pass_seconds": 0.0042,                          # or None before the first pass
        "passes": 1234,                                       # passes since start
        "pass_seconds_total": 5.2,                            # their summed duration
        "replacements_frozen": False,
    }

The deployment metrics (failures by crash class, held deployments) are
read from the reconciler's C{deployments()} view: each deployment's
C{failures} (its consecutive failures, the backoff's count; with
variants, summed over them), the
C{crash_class} of its C{last_failure}, and C{held} (C{None}, or a dict
with C{crash_class}). A view without these fields counts as none.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from twisted.logger import Logger

from llmgw.control.shell.series import NodeMemoryCollector
from llmgw.crash import CrashClass
from llmgw.states import ReplicaState, ShardState

#: States that always have a sample (zero when empty), so that a dashboard's
#: series do not vanish when a state empties.
NODE_STATES = ("ready", "suspect", "lost")
SHARD_STATES = tuple(str(s) for s in ShardState)
REPLICA_STATES = tuple(str(s) for s in ReplicaState)
#: The crash-class label's values: a fixed set, whatever a view carries.
CRASH_CLASSES = tuple(str(c) for c in CrashClass)


def crash_label(value: Any) -> str:
    """
    C{value} as a crash-class label: one of L{CRASH_CLASSES}, anything else
    (an older agent's empty class, say) C{"unknown"}.
    """
    return value if isinstance(value, str) and value in CRASH_CLASSES else str(CrashClass.UNKNOWN)


def make_registry() -> CollectorRegistry:
    """
    A fresh registry for one control plane.
    """
    return CollectorRegistry(auto_describe=False)


def _counts(value: Any) -> dict[str, float]:
    """
    A C{{label: count}} mapping from a snapshot entry, dropping what is not
    a finite number (a broken entry must not break the scrape).
    """
    if not isinstance(value, Mapping):
        return {}
    out: dict[str, float] = {}
    for k, v in value.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            continue
        out[str(k)] = float(v)
    return out


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


class ControlCollector(Collector):
    """
    The control plane's metrics, read at scrape time.

    @param agents: the agent service (C{registrations}, C{dispatch_refusals},
        C{connected_nodes()}, C{open_connections()}).
    @param fleet: returns the reconciler (anything with
        C{metrics_snapshot()}) or C{None}; called at each scrape, so a
        reconciler attached after this collector is seen.
    """

    log = Logger()

    def __init__(
        self,
        agents: Any,
        fleet: Callable[[], Any] | None = None,
        tls: Callable[[], dict[str, Any]] | None = None,
        clock: Callable[[], float] = time.time,
        limiter: Callable[[], Any] | None = None,
        joining: Callable[[], Any] | None = None,
    ):
        self.agents = agents
        self.fleet = fleet if fleet is not None else (lambda: None)
        self.tls = tls
        self.clock = clock
        #: Returns the agent port's L{ConnectionLimiter} (C{refused},
        #: C{registering}, C{paused}, C{pauses}), or C{None}.
        self.limiter = limiter
        #: Returns the join authority (C{answers}, C{pending}), or C{None}
        #: where this control plane issues no certificates.
        self.joining = joining

    def collect(self) -> Iterable[Metric]:
        yield from self._agent_metrics()
        yield from self._fleet_metrics()
        yield from self._tls_metrics()
        yield from self._limit_metrics()
        yield from self._join_metrics()
        yield from self._frame_metrics()
        yield from self._stray_metrics()
        yield from self._deployment_metrics()
        yield from self._fetch_metrics()
        yield from self._cache_metrics()
        yield from self._adapter_metrics()

    def _adapter_metrics(self) -> Iterable[Metric]:
        state = getattr(self.fleet(), "state", None)
        replicas = getattr(state, "replicas", None)
        if not isinstance(replicas, dict):
            return
        held = GaugeMetricFamily(
            "llmgw_replica_adapter",
            "1 for each LoRA adapter a replica holds (as its leader's heartbeat or its start says).",
            labels=["model", "replica", "adapter"])
        for rid, rep in sorted(replicas.items()):
            for adapter in rep.adapters:
                held.add_metric([rep.model, rid, adapter], 1)
        yield held

    def _fetch_metrics(self) -> Iterable[Metric]:
        rows_fn = getattr(self.fleet(), "fetch_rows", None)
        if rows_fn is None:
            return
        labels = ["model", "replica", "shard", "node"]
        done = GaugeMetricFamily(
            "llmgw_shard_fetch_bytes",
            "Bytes of a fetching shard's weights on its node so far.", labels=labels)
        total = GaugeMetricFamily(
            "llmgw_shard_fetch_total_bytes",
            "The size of a fetching shard's weights, once known.", labels=labels)
        rate = GaugeMetricFamily(
            "llmgw_shard_fetch_rate_bytes_per_second",
            "How fast a fetching shard's weights arrive lately.", labels=labels)
        for model, replica, shard, node, progress in rows_fn():
            values = [model, replica, shard, node]
            done.add_metric(values, progress.done)
            if progress.total is not None:
                total.add_metric(values, progress.total)
            rate.add_metric(values, progress.rate)
        yield from (done, total, rate)

    def _stray_metrics(self) -> Iterable[Metric]:
        inventory = getattr(self.agents, "inventory", None)
        if inventory is None:
            return
        strays = GaugeMetricFamily(
            "llmgw_node_stray_processes",
            "Processes carrying a node agent's shard marker that no shard accounts for, as its "
            "latest Register listed them (nodes with none have no sample).",
            labels=["node"],
        )
        for node, n in inventory.stray_counts().items():
            strays.add_metric([node], n)
        yield strays

    def _cache_metrics(self) -> Iterable[Metric]:
        inventory = getattr(self.agents, "inventory", None)
        models = getattr(inventory, "models", None)
        if models is None:
            return
        held = GaugeMetricFamily(
            "llmgw_model_cache_bytes",
            "Bytes each node's weight cache holds, as its agent last reported (nodes without a "
            "report have no sample).",
            labels=["node"],
        )
        present = GaugeMetricFamily(
            "llmgw_model_cached",
            "1 for each model (cache key) a node's cache holds, under its state (complete or partial).",
            labels=["model", "node", "state"],
        )
        for node in models.nodes():
            copies = models.copies(node)
            held.add_metric([node], sum(c.size for c in copies))
            for c in copies:
                present.add_metric([c.key, node, c.state], 1)
        yield held
        yield present

    def _deployment_metrics(self) -> Iterable[Metric]:
        fleet = self.fleet()
        deployments_fn = getattr(fleet, "deployments", None)
        if deployments_fn is None:
            return
        try:
            deployments = list(deployments_fn())
        except Exception:
            self.log.failure("the reconciler's deployments view failed; deployment metrics left out")
            return
        failures = GaugeMetricFamily(
            "llmgw_deployment_failures",
            "Each deployment's consecutive shard failures (what its backoff counts, summed over its "
            "variants), under the "
            "crash class of the latest one.",
            labels=["model", "crash_class"],
        )
        held = dict.fromkeys(CRASH_CLASSES, 0)
        for d in deployments:
            if not isinstance(d, Mapping) or not isinstance(d.get("model"), str):
                continue
            last = d.get("last_failure")
            count = _number(d.get("failures"))
            if isinstance(last, Mapping):
                failures.add_metric(
                    [d["model"], crash_label(last.get("crash_class"))], count if count is not None else 1.0
                )
            hold = d.get("held")
            if isinstance(hold, Mapping):
                held[crash_label(hold.get("crash_class"))] += 1
        yield failures
        yield _rollout_states(deployments)
        g = GaugeMetricFamily(
            "llmgw_deployments_held",
            "Deployments held (not placed) after a failure that retrying cannot mend, by its "
            "crash class, until their profile changes or `llmgw ctl retry MODEL`.",
            labels=["crash_class"],
        )
        for cls in CRASH_CLASSES:
            g.add_metric([cls], held[cls])
        yield g

    def _frame_metrics(self) -> Iterable[Metric]:
        # Kept apart from the agent metrics above.
        frames = getattr(self.agents, "frames_refused", None)
        if frames is None:
            return
        refused = CounterMetricFamily(
            "llmgw_agent_frames_refused",
            "Agent frames refused and their stream closed, by cause (oversized).",
            labels=["cause"],
        )
        for cause in sorted({"oversized", *frames}):
            refused.add_metric([cause], frames.get(cause, 0))
        yield refused

    def _limit_metrics(self) -> Iterable[Metric]:
        limiter = self.limiter() if self.limiter is not None else None
        if limiter is None:
            return
        refused = CounterMetricFamily(
            "llmgw_agent_connections_refused",
            "Agent-port connections closed before TLS by a cap, by cap.",
            labels=["cap"],
        )
        for cap in ("per_address", "total"):
            refused.add_metric([cap], limiter.refused.get(cap, 0))
        yield refused
        yield GaugeMetricFamily(
            "llmgw_agent_connections_registering",
            "Agent connections between their first byte and their Register.",
            value=limiter.registering,
        )
        yield GaugeMetricFamily(
            "llmgw_agent_admission_paused",
            "1 while the agent port is not accepting because too many connections are registering.",
            value=1.0 if limiter.paused else 0.0,
        )
        yield CounterMetricFamily(
            "llmgw_agent_admission_pauses",
            "Times the agent port stopped accepting because too many connections were registering.",
            value=limiter.pauses,
        )

    def _join_metrics(self) -> Iterable[Metric]:
        authority = self.joining() if self.joining is not None else None
        if authority is None:
            return
        answers = CounterMetricFamily(
            "llmgw_certificate_requests",
            "Answers to nodes' certificate requests since start, by kind (join, renewal) and outcome "
            "(issued, pending: waits for an operator, refused).",
            labels=["kind", "outcome"],
        )
        for kind in ("join", "renewal"):
            for outcome in ("issued", "pending", "refused"):
                answers.add_metric([kind, outcome], authority.answers.get((kind, outcome), 0))
        yield answers
        yield GaugeMetricFamily(
            "llmgw_certificate_requests_waiting",
            "Certificate requests (joins and renewals) waiting for an operator (`llmgw ctl csr list`).",
            value=len(authority.pending),
        )

    def _tls_metrics(self) -> Iterable[Metric]:
        if self.tls is None:
            return
        try:
            snap = self.tls()
        except Exception:
            self.log.failure("metrics: reading TLS expiry failed; left out of this scrape")
            return
        if not snap:
            return
        expiry = GaugeMetricFamily(
            "llmgw_tls_expiry_timestamp_seconds",
            "When each certificate (or the CRL's next update) stops being valid, Unix seconds.",
            labels=["certificate"],
        )
        for label, key in (
            ("ca", "ca_not_after"),
            ("server", "server_not_after"),
            ("crl_next_update", "crl_next_update"),
            ("earliest_agent", "earliest_agent_not_after"),
        ):
            value = _number(snap.get(key))
            if value is not None:
                expiry.add_metric([label], value)
        yield expiry
        agents = snap.get("agents_not_after") or {}
        now = self.clock()
        left = GaugeMetricFamily(
            "llmgw_certificate_expiry_seconds",
            "Seconds until each node's certificate ends (negative: ended), as it reported it or as renewed.",
            labels=["node"],
        )
        for node_id, t in sorted(agents.items()):
            left.add_metric([node_id], float(t) - now)
        yield left
        soon = now + 30 * 86400
        yield GaugeMetricFamily(
            "llmgw_agent_certificates_expiring_soon",
            "Connected agents whose certificate expires within 30 days.",
            value=sum(1 for t in agents.values() if t < soon),
        )

    def _agent_metrics(self) -> Iterable[Metric]:
        agents = self.agents
        yield GaugeMetricFamily(
            "llmgw_agents_connected",
            "Nodes with an open, registered agent stream.",
            value=len(agents.connected_nodes()),
        )
        open_connections = getattr(agents, "open_connections", None)
        if open_connections is not None:
            yield GaugeMetricFamily(
                "llmgw_agent_connections_open",
                "Agent connections accepted and not yet closed, registered or not.",
                value=open_connections(),
            )
        regs = CounterMetricFamily(
            "llmgw_agent_registrations",
            "Agent registrations by outcome (ok, or why one was refused).",
            labels=["outcome"],
        )
        for outcome, n in sorted(agents.registrations.items()):
            regs.add_metric([outcome], n)
        yield regs
        refusals = CounterMetricFamily(
            "llmgw_dispatch_refusals",
            "Commands the agent service could not deliver, by reason.",
            labels=["reason"],
        )
        for reason, n in sorted(agents.dispatch_refusals.items()):
            refusals.add_metric([reason], n)
        yield refusals

    def _fleet_metrics(self) -> Iterable[Metric]:
        fleet = self.fleet()
        snapshot_fn = getattr(fleet, "metrics_snapshot", None)
        if snapshot_fn is None:
            return
        try:
            snap = snapshot_fn()
        except Exception:
            # A scrape must not fail because the reconciler's view did;
            # the agent metrics still go out.
            self.log.failure("the reconciler's metrics snapshot failed; fleet metrics left out")
            return
        if not isinstance(snap, Mapping):
            self.log.error(
                "the reconciler's metrics snapshot is a {kind}, not a mapping; fleet metrics left out",
                kind=type(snap).__name__,
            )
            return
        for key, name, doc, always in (
            ("nodes", "llmgw_nodes", "Nodes by state (ready, suspect, lost).", NODE_STATES),
            ("shards", "llmgw_shards", "Shards by state.", SHARD_STATES),
            ("replicas", "llmgw_replicas", "Replicas by state (a replica's state is its worst shard's).", REPLICA_STATES),
        ):
            if key not in snap:
                continue
            counts = dict.fromkeys(always, 0.0)
            counts.update(_counts(snap[key]))
            g = GaugeMetricFamily(name, doc, labels=["state"])
            for state, n in sorted(counts.items()):
                g.add_metric([state], n)
            yield g
        if "events" in snap:
            ev = CounterMetricFamily(
                "llmgw_events", "Reconciler events since start, by kind.", labels=["kind"]
            )
            for kind, n in sorted(_counts(snap["events"]).items()):
                ev.add_metric([kind], n)
            yield ev
        last = _number(snap.get("last_pass_seconds"))
        if last is not None:
            yield GaugeMetricFamily(
                "llmgw_reconcile_last_pass_seconds",
                "How long the last reconcile pass held the reactor, in seconds.",
                value=last,
            )
        passes = _number(snap.get("passes"))
        total = _number(snap.get("pass_seconds_total"))
        if passes is not None and total is not None:
            yield SummaryMetricFamily(
                "llmgw_reconcile_pass_seconds",
                "Reconcile passes since start and the time they took, in seconds.",
                count_value=int(passes),
                sum_value=total,
            )
        elif passes is not None:
            yield CounterMetricFamily(
                "llmgw_reconcile_passes", "Reconcile passes since start.", value=passes
            )
        frozen = snap.get("replacements_frozen")
        if isinstance(frozen, bool):
            yield GaugeMetricFamily(
                "llmgw_replacements_frozen",
                "1 while replacements are frozen because too many nodes are suspect at once.",
                value=1.0 if frozen else 0.0,
            )


def register_control_metrics(
    registry: CollectorRegistry,
    agents: Any,
    fleet: Callable[[], Any] | None = None,
    tls: Callable[[], dict[str, Any]] | None = None,
    limiter: Callable[[], Any] | None = None,
    joining: Callable[[], Any] | None = None,
) -> ControlCollector:
    """
    Register a L{ControlCollector} for C{agents}, C{fleet}, the TLS expiry
    snapshot C{tls}, the agent port's C{limiter} and the join authority
    C{joining} on C{registry} and return it.
    """
    collector = ControlCollector(agents, fleet, tls, limiter=limiter, joining=joining)
    registry.register(collector)
    # Each node's GPU memory, as the console's curves have it.
    registry.register(NodeMemoryCollector(lambda: getattr(agents, "inventory", None)))
    return collector


#: The states a rollout may be in, each a label of C{llmgw_rollout_state}.
ROLLOUT_STATES = ("progressing", "paused", "failed", "done")


def _rollout_states(deployments: Iterable[Any]) -> Metric:
    """
    C{llmgw_rollout_state{model,state}}: 1 for the state of each
    deployment's last rollout, 0 for the others.
    """
    g = GaugeMetricFamily(
        "llmgw_rollout_state",
        "The state of each deployment's last rollout (1 for the state it is in).",
        labels=["model", "state"],
    )
    for d in deployments:
        ro = d.get("rollout") if isinstance(d, Mapping) else None
        if not isinstance(ro, Mapping) or not isinstance(d.get("model"), str):
            continue
        for state in ROLLOUT_STATES:
            g.add_metric([d["model"], state], 1.0 if ro.get("state") == state else 0.0)
    return g
