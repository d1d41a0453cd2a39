"""
The reconciler's autoscaling (DESIGN §16): what feeds the pure
decision of L{llmgw.control.core.autoscale} on every pass, and where its counts
go.

L{Autoscaling} holds what the decision needs between passes: each
autoscaled deployment's memory (L{autoscale.ScalerState}), the demand that
standalone gateways report (L{DemandBoard}) and the embedded gateway's own
(an L{IDemand}). On a pass, L{Autoscaling.tick} reads the context, asks
the decision for each autoscaled deployment and writes the count into
C{ctx.desired}; placement and drain then act on it as on any scale
(L{llmgw.control.core.placing}). Its events go into the pass's L{Outcome}.
"""

from __future__ import annotations

from typing import Any

from twisted.logger import Logger

from llmgw.control.core import autoscale
from llmgw.control.core.catalog import Catalog
from llmgw.control.core.context import Context
from llmgw.control.core.kept import KeptState
from llmgw.control.core.outcome import Outcome
from llmgw.control.state.demand import DemandBoard
from llmgw.control.state.interfaces import AdminError, IInFlight, UnknownDeployment
from llmgw.routing import Demand, IDemand

__all__ = ["Autoscaling"]


class Autoscaling:
    log = Logger()

    def __init__(self) -> None:
        #: Demand reported by standalone gateways (C{POST /api/v1/demand}).
        self.board = DemandBoard()
        #: The embedded gateway's own demand, when it offers one; without
        #: it, in-flight counts come from the reconciler's C{in_flight}.
        self.source: IDemand | None = None
        #: Each autoscaled deployment's memory between passes.
        self.scalers: dict[str, autoscale.ScalerState] = {}
        self._of: Catalog | None = None
        self._models: list[str] = []

    def models(self, catalog: Catalog) -> list[str]:
        """
        The autoscaled models, an index rebuilt when the catalog object
        changes (a reload), so that a pass does not look at every deployment.
        """
        if self._of is not catalog:
            self._of = catalog
            self._models = sorted(m for m, d in catalog.deployments.items() if d.autoscale is not None)
            for gone in set(self.scalers) - set(self._models):
                del self.scalers[gone]
        return self._models

    def demand(self, ctx: Context, in_flight: IInFlight | None, now: float) -> dict[str, Demand]:
        """
        Each model's demand: the standalone gateways' reports plus the
        embedded gateway's (its L{IDemand}, or its in-flight counts); a
        base's includes its adapters'.
        """
        totals = self.board.totals(now)
        own: dict[str, Demand] = {}
        if self.source is not None:
            own = dict(self.source.demand())
        elif in_flight is not None:
            # Without a demand source, one look per replica of each
            # autoscaled deployment (the control plane wires a source).
            for model in self.models(ctx.catalog):
                n = sum(in_flight.in_flight(rid) for rid in ctx.state.by_model.get(model, ()))
                if n:
                    own[model] = Demand(n, 0)
        for model, d in own.items():
            t = totals.get(model)
            totals[model] = d if t is None else Demand(t.in_flight + d.in_flight, t.waiting + d.waiting)
        # Requests for an adapter load its base's replicas: they count for
        # the base too (and stay under the adapter's name for loading it).
        for adapter, base in ctx.catalog.adapter_bases().items():
            asked, t = totals.get(adapter), totals.get(base)
            if asked is not None:
                totals[base] = Demand(asked.in_flight + (t.in_flight if t else 0),
                                      asked.waiting + (t.waiting if t else 0))
        return totals

    def tick(self, ctx: Context, kept: KeptState, in_flight: IInFlight | None, now: float,
             out: Outcome) -> None:
        """
        One pass of autoscaling: set C{ctx.desired} for every autoscaled
        deployment, before placement acts on it.
        """
        models = self.models(ctx.catalog)
        if not models:
            return
        try:
            demand = self.demand(ctx, in_flight, now)
        except Exception:
            # The counts are unknown this pass: hold every count as it is
            # (placement and everything else in the pass go on).
            self.log.failure("autoscaling: reading the gateways' demand failed; no change this pass")
            return
        for model in models:
            try:
                self._tick_one(ctx, kept, model, demand, now, out)
            except Exception:
                self.log.failure("autoscaling {model}: the decision failed; its count stays", model=model)

    def _tick_one(self, ctx: Context, kept: KeptState, model: str, demand: dict[str, Demand], now: float,
                  out: Outcome) -> None:
        st = ctx.state
        dep = ctx.catalog.deployments[model]
        policy = kept.policy(dep)
        if policy is None:
            return
        d = demand.get(model, Demand(0, 0))
        active = st.active.get(model, set())
        engine_waiting = 0.0
        # Only a waiting target reads the engines' figures (one look per
        # ready replica of that deployment).
        for rid in st.ready.get(model, ()) if policy.target_waiting else ():
            leader = st.replicas[rid].shards.get(0)
            sig = leader.signals if leader is not None else None
            if sig is not None and sig.waiting is not None and sig.age(now) <= autoscale.SIGNALS_STALE_AFTER_S:
                engine_waiting += sig.waiting
        # What it holds survives a catalog reload, which resets ctx.desired.
        state = self.scalers.get(model) or autoscale.ScalerState(ctx.desired.get(model, dep.replicas))
        short = max(0, state.desired - len(active)) if ctx.deps[model].unplaceable else 0
        seen = autoscale.Observed(
            active=len(active), in_flight=d.in_flight, waiting=d.waiting, engine_waiting=engine_waiting,
            short=short, settling=now < ctx.grace_end,
        )
        decision = autoscale.decide(policy, state, seen, now)
        self.scalers[model] = decision.state
        ctx.desired[model] = decision.desired
        for ev in decision.events:
            level = "warn" if ev.kind == autoscale.CAPACITY else "info"
            out.event(ev.kind, level=level, reason=f"deployment {model}: {ev.reason}")

    def view(self, ctx: Context, kept: KeptState, model: str) -> dict[str, Any] | None:
        """
        An autoscaled deployment's bounds, targets and what it holds, for
        the admin API; C{None} for a fixed count.
        """
        dep = ctx.catalog.deployments.get(model)
        policy = kept.policy(dep) if dep is not None else None
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


def refuse_fixed_scale(catalog: Catalog, model: str) -> None:
    """
    @raise AdminError: C{model}'s deployment autoscales, so a fixed count
        does not apply to it.
    """
    dep = catalog.deployments.get(model)
    if dep is not None and dep.autoscale is not None:
        raise AdminError(
            f"deployment {dep.model} autoscales; a fixed count does not apply: set its bounds "
            f"instead (llmgw ctl scale {dep.model} --min N --max M)"
        )


def check_bounds(catalog: Catalog, model: str, min_replicas: int, max_replicas: int) -> autoscale.AutoscalePolicy:
    """
    @return: the catalog's autoscaling of C{model}, once the new bounds are
        found sound.
    @raise UnknownDeployment: no deployment serves C{model}.
    @raise AdminError: it does not autoscale, or the bounds are wrong.
    """
    dep = catalog.deployments.get(model)
    if dep is None:
        raise UnknownDeployment(f"no deployment serves model {model!r}")
    if dep.autoscale is None:
        raise AdminError(
            f"deployment {model} has a fixed count of replicas and does not autoscale: "
            f"scale it with a count (llmgw ctl scale {model} N), or give it min_replicas and "
            f"max_replicas in the catalog"
        )
    for name, n in (("min", min_replicas), ("max", max_replicas)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise AdminError(f"{name} must be a whole number of at least 0, not {n!r}")
    if max_replicas < 1 or max_replicas < min_replicas:
        raise AdminError(f"max ({max_replicas}) must be at least 1 and at least min ({min_replicas})")
    return dep.autoscale
