"""
The admin API's JSON views of the fleet and the C{/metrics} snapshot: read
only, built from the reconciler's L{FleetState} on request.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

from llmgw.control.core.backoff import Backoff
from llmgw.control.core.context import variants_of
from llmgw.control.core.sleeping import asleep
from llmgw.control.state.fetches import FetchProgress
from llmgw.control.state.fleetstate import Phase
from llmgw.control.state.signals import ShardSignals, signals_json
from llmgw.states import SEVERITY, ReplicaState, ShardState

if TYPE_CHECKING:
    from llmgw.control.shell.reconciler import Reconciler


def metrics_snapshot(rec: Reconciler) -> dict[str, Any]:
    """
    Counts for C{/metrics}, each a plain dict:

      - C{nodes}: node count by state (C{ready}, C{suspect}, C{lost});
      - C{shards}: shard count by last known state; C{stopping} also counts
        those told to stop and not yet confirmed (counted under their last
        known state too);
      - C{replicas}: replica count by state (a replica's worst shard's
        state, or C{stopping});
      - C{events}: events ever logged, by kind;
      - C{last_pass_seconds}: how long the last pass took (C{None} before
        the first); C{passes}, C{pass_seconds_total}, C{pass_errors};
        C{max_pass_seconds}: the longest pass so far;
      - C{replacements_frozen}: whether replacements are frozen.
    """
    st = rec.state
    total = len(st.known_since)
    shards = {str(s): 0 for s in SEVERITY}
    for state, n in st.shard_counts.items():
        if n:
            shards[str(state)] = n
    # Told to stop and not confirmed (counted under their last state too),
    # besides those that report stopping themselves.
    shards["stopping"] = len(st.stopping) + st.shard_counts.get(ShardState.STOPPING, 0)
    replicas = collections.Counter(st.replica_state(r) for r in st.replicas.values())
    return {
        "nodes": {
            "ready": total - len(st.suspect) - len(st.lost),
            "suspect": len(st.suspect),
            "lost": len(st.lost),
        },
        "shards": shards,
        "replicas": {str(s): replicas.get(s, 0) for s in ReplicaState},
        "events": dict(rec.event_log.counts),
        "last_pass_seconds": rec.last_pass_duration if rec.passes else None,
        "max_pass_seconds": rec.max_pass_duration if rec.passes else None,
        "passes": rec.passes,
        "pass_seconds_total": rec.pass_seconds_total,
        "pass_errors": rec.pass_errors,
        "replacements_frozen": rec.frozen,
    }


def status(rec: Reconciler) -> dict[str, Any]:
    snap = metrics_snapshot(rec)
    st = rec.state
    deps = rec.catalog.deployments
    ready = sum(1 for m in deps if len(st.ready.get(m, ())) >= rec.desired.get(m, 0))
    now = rec.clock.seconds()
    return {
        "epoch": rec.epoch,
        "catalog": rec.catalog.path,
        "nodes": snap["nodes"],
        "connected": len(rec.connected()),
        "deployments": {
            "total": len(deps),
            "satisfied": ready,
            "unsatisfied": len(deps) - ready,
            "in_backoff": sum(1 for m in deps if rec.deps[m].blocked(now, variants_of(rec.ctx, m))),
        },
        "replicas": snap["replicas"],
        "shards": snap["shards"],
        "replacements_frozen": rec.frozen,
        "frozen_reason": rec.frozen_reason or None,
        "placing_after": rec.grace_end if now < rec.grace_end else None,
        "last_pass_seconds": rec.last_pass_duration,
    }


def nodes(rec: Reconciler) -> list[dict[str, Any]]:
    connected = rec.connected()
    st = rec.state
    out = []
    for node in rec.inventory.list():
        out.append(
            {
                "id": node.id,
                "state": st.node_state(node.id),
                "connected": node.id in connected,
                "cordoned": node.id in st.cordoned,
                "draining": node.id in st.draining_nodes,
                "last_seen": node.last_seen,
                "address": node.address,
                "agent_version": node.agent_version,
                "certificate_not_after": node.certificate_not_after or None,
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
                "shards": sorted(st.node_shards.get(node.id, ())),
            }
        )
    return out


def deployments(rec: Reconciler) -> list[dict[str, Any]]:
    now = rec.clock.seconds()
    st = rec.state
    out = []
    for model in sorted(rec.catalog.deployments):
        dep = rec.catalog.deployments[model]
        state = rec.deps[model]
        out.append(
            {
                "model": model,
                "profile": dep.profile,
                # Its variants, cheapest first, with the replicas on each;
                # None: the one profile.
                "variants": [
                    {"profile": v.profile, "cost": v.cost,
                     "replicas": sum(1 for r in st.by_model.get(model, ()) if st.replicas[r].profile == v.profile)}
                    for v in dep.variants
                ] or None,
                "desired": rec.desired.get(model, dep.replicas),
                "ready": len(st.ready.get(model, ())),
                "replicas": len(st.by_model.get(model, ())),
                # When placement may resume if nothing can be placed now
                # (with variants: every variant in backoff); failures: the
                # counts of the deployment and all its variants summed.
                "backoff_until": state.blocked_until(now, variants_of(rec.ctx, model)),
                "failures": state.failures(variants_of(rec.ctx, model)),
                # Each variant's own backoff; None: no variants.
                "variants_backoff": {
                    v.profile: _backoff_view(state.variant_backoff.get(v.profile), now) for v in dep.variants
                } or None,
                "last_failure": state.last_failure.as_dict() if state.last_failure else None,
                "unplaceable": state.unplaceable or None,
                "held": state.held.as_dict() if state.held else None,
                # Bounds and targets of an autoscaled deployment; None: fixed.
                "autoscale": rec.autoscale_view(model),
                # Its last rollout (None: none since the process started).
                "rollout": rollout.view() if (rollout := rec.ctx.rollouts.rollouts.get(model)) else None,
            }
        )
    return out


def _backoff_view(backoff: Backoff | None, now: float) -> dict[str, Any]:
    """
    One variant's backoff as the deployments view shows it.
    """
    if backoff is None:
        return {"failures": 0, "backoff_until": None}
    return {"failures": backoff.failures, "backoff_until": backoff.until if backoff.blocked(now) else None}


def replicas(rec: Reconciler) -> list[dict[str, Any]]:
    st = rec.state
    now = rec.clock.seconds()
    out = []
    lenders: dict[str, list[str]] = {}
    for rid in sorted(st.replicas):
        for borrower in st.replicas[rid].displaced_by:
            lenders.setdefault(borrower, []).append(rid)
    for rid in sorted(st.replicas):
        rep = st.replicas[rid]
        start_at = st.lend_starts.get(rid)
        out.append(
            {
                "id": rid,
                "model": rep.model,
                "profile": rep.profile,
                "state": str(st.replica_state(rep)),
                "draining": rep.phase == Phase.DRAINING,
                "evacuating": rep.evacuating or None,
                "adapters": list(rep.adapters),
                "adopted": rep.adopted,
                "created": rep.created_at,
                "ready_since": rep.ready_since,
                # Its engine sleeps (DESIGN §22); None: it does not sleep.
                "sleeping": asleep(rep),
                # The replicas that borrowed its GPUs while it sleeps: while
                # any do it is displaced, out of the routes and never woken.
                "displaced_by": list(rep.displaced_by),
                # The sleepers whose GPUs it borrows, and (in the lend's
                # grace, its shards not started yet) seconds until they start.
                "borrowing_from": lenders.get(rid, []),
                "starts_in": max(0.0, round(start_at - now, 1)) if start_at is not None else None,
                "shards": [
                    {
                        "id": s.id,
                        "node": s.node_id,
                        "rank": s.rank,
                        "state": str(s.shown_state),
                        "address": s.address,
                        "gpus": list(s.gpus),
                        # engines
                        "signals": signals_json(rec.engine_signals.get(s.id), now),
                        # Its weights' fetch while it is fetching, else None.
                        "fetch": s.fetch.as_json() if s.fetch is not None else None,
                    }
                    for _, s in sorted(rep.shards.items())
                ],
            }
        )
    return out


def engine_signal_rows(rec: Reconciler) -> list[tuple[str, str, str, ShardSignals]]:
    """
    (model, replica, shard, signals) for every held shard with engine
    signals, for the metrics collector.
    """
    rows = []
    for rep in rec.state.replicas.values():
        for shard in rep.shards.values():
            entry = rec.engine_signals.get(shard.id)
            if entry is not None:
                rows.append((rep.model, rep.id, shard.id, entry))
    return rows


def fetch_rows(rec: Reconciler) -> list[tuple[str, str, str, str, FetchProgress]]:
    """
    (model, replica, shard, node, progress) for every shard fetching its
    weights with progress heard, for the metrics collector.
    """
    rows = []
    for rep in rec.state.replicas.values():
        for shard in rep.shards.values():
            if shard.fetch is not None:
                rows.append((rep.model, rep.id, shard.id, shard.node_id, shard.fetch))
    return rows
