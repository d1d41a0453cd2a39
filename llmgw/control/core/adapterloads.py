"""
Loading LoRA adapters onto more replicas when those that hold one are
busy (DESIGN §22), for engines that load them while they run (vLLM).

The gateways report their demand per model name, an adapter's under its
own name (the requests for it in flight and waiting). On each pass, an
adapter with demand whose holders are none, or all busy (requests waiting,
or more in flight per holder than its base's autoscaling target, else
L{BUSY_IN_FLIGHT}), is loaded onto one more ready replica of its base: the
one holding the fewest adapters. One load per adapter is outstanding at a
time (until a heartbeat shows it held, or L{PENDING_S} pass); the engine
unloads its least recently asked for adapter when it holds its most, and
holders of an adapter in demand are reminded of it every L{TOUCH_S}.

A decision like the others: it takes the L{Context} and appends to an
L{Outcome}.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final

from llmgw.control.core.adapters import ADAPTER_ENGINES, Adapter
from llmgw.control.core.commands import LoadAdapter
from llmgw.control.core.context import Context
from llmgw.control.core.outcome import Outcome
from llmgw.control.state.fleetstate import Phase, ReplicaRec
from llmgw.routing import Demand

#: Requests in flight per holder past which an adapter's holders are busy,
#: when its base does not autoscale on a target of its own.
BUSY_IN_FLIGHT: Final = 4.0
#: Seconds a load is waited for before another may be asked for.
PENDING_S: Final = 30.0
#: Seconds between reminders to a holder that an adapter is in use (a
#: LoadAdapter of one it holds), which keep it off the engine's least
#: recently used end while it is asked for: the agent does not see requests.
TOUCH_S: Final = 15.0


class AdapterLoading:
    """
    The loads asked for and not yet seen held: (replica, adapter) -> when.
    """

    def __init__(self) -> None:
        self.pending: dict[tuple[str, str], float] = {}
        #: (replica, adapter) -> when its holder was last reminded
        self.touched: dict[tuple[str, str], float] = {}

    def tick(self, ctx: Context, demand: Callable[[], Mapping[str, Demand]], now: float, out: Outcome) -> None:
        """
        One pass: ask for the loads the demand calls for.
        """
        if not ctx.catalog.adapters and not self.pending and not self.touched:
            return  # the catalog has no adapters, and none was asked for
        runtime = [a for a in ctx.catalog.adapters.values()
                   if ADAPTER_ENGINES.get(self._engine(ctx, a.base)) == "runtime"]
        if not runtime:
            self.pending.clear()
            self.touched.clear()
            return
        wanted = demand()
        for key, since in list(self.pending.items()):
            rep = ctx.state.replicas.get(key[0])
            if rep is None or key[1] in rep.adapters or now - since >= PENDING_S:
                del self.pending[key]
        for key in [k for k in self.touched if k[0] not in ctx.state.replicas]:
            del self.touched[key]
        for adapter in runtime:
            d = wanted.get(adapter.name)
            if d is None or d.in_flight + d.waiting <= 0:
                continue
            if any(name == adapter.name for _, name in self.pending):
                continue
            ready = [ctx.state.replicas[r] for r in sorted(ctx.state.ready.get(adapter.base, ()))]
            ready = [r for r in ready if r.phase == Phase.ACTIVE]
            holders = [r for r in ready if adapter.name in r.adapters]
            self._touch(holders, adapter, now, out)
            if holders and d.waiting <= 0 and d.in_flight <= self._busy(ctx, adapter.base) * len(holders):
                continue
            others = [r for r in ready if adapter.name not in r.adapters]
            if not others:
                continue
            target = min(others, key=lambda r: (len(r.adapters), r.id))
            leader = target.shards.get(0)
            if leader is None:
                continue
            self.pending[(target.id, adapter.name)] = now
            out.send(LoadAdapter(leader.node_id, leader.id, adapter.name, adapter.source))
            out.event("adapter_load", replica=target.id,
                      reason=f"adapter {adapter.name} of {adapter.base}: "
                             f"{len(holders)} holder(s), {d.in_flight} in flight, {d.waiting} waiting")

    def _touch(self, holders: list[ReplicaRec], adapter: Adapter, now: float, out: Outcome) -> None:
        for rep in holders:
            leader = rep.shards.get(0)
            if leader is not None and now - self.touched.get((rep.id, adapter.name), -TOUCH_S) >= TOUCH_S:
                self.touched[(rep.id, adapter.name)] = now
                out.send(LoadAdapter(leader.node_id, leader.id, adapter.name, adapter.source))

    @staticmethod
    def _engine(ctx: Context, base: str) -> str:
        dep = ctx.catalog.deployments.get(base)
        profile = ctx.catalog.profiles.get(dep.profile) if dep is not None else None
        return profile.engine if profile is not None else ""

    @staticmethod
    def _busy(ctx: Context, base: str) -> float:
        dep = ctx.catalog.deployments.get(base)
        target = dep.autoscale.target_in_flight if dep is not None and dep.autoscale is not None else None
        return float(target) if target else BUSY_IN_FLIGHT

