"""
What the reconciler's decisions read besides their input (DESIGN §6.7):
the fleet state, the catalog, the inventory, the timing rules, and each
deployment's failure bookkeeping (crash backoff, hold, last failure).

A L{Context} is plain data owned by the reconciler's shell; decisions
(L{llmgw.control.core.lifecycle}, L{llmgw.control.core.reports},
L{llmgw.control.core.nodes}, L{llmgw.control.core.deadlines},
L{llmgw.control.core.placing}) change it through its methods and those of its
L{FleetState}, and return what to send and log in an
L{llmgw.control.core.outcome.Outcome}. Nothing here reads a clock, sends a
command or touches a transport.
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass, field

from llmgw.control.core.backoff import Backoff
from llmgw.control.core.catalog import Catalog, Profile
from llmgw.control.core.failures import Hold, ShardFailure
from llmgw.control.core.rollout import RolloutBook
from llmgw.control.state.fleetstate import FleetState
from llmgw.control.state.inventory import Inventory

#: How long past its stop grace a stopping shard may stay unconfirmed.
STOP_SLACK = 30.0
#: A pending shard is re-sent at most this many times in all, then its
#: replica is replaced.
MAX_SENDS = 3
#: Defaults of a profile the catalog no longer has.
STARTUP_TIMEOUT, STOP_GRACE, DRAIN_TIMEOUT = 600, 30, 60

_SLUG = re.compile(r"[^A-Za-z0-9.]+")


def base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


@dataclass(slots=True)
class Rules:
    """
    The reconciler's timings (DESIGN §6.3, §6.4, §6.5), in seconds.
    """

    suspect_after: float
    lost_after: float
    adoption_grace: float
    #: A pending shard (command sent, nothing heard) is re-sent after this.
    pending_timeout: float
    #: Share of nodes suspect at once beyond which replacements freeze.
    freeze_share: float


@dataclass
class DeploymentState:
    backoff: Backoff = field(default_factory=Backoff)
    last_failure: ShardFailure | None = None
    #: Why placement last found no room for it ("": it had room); the
    #: deployments with one set are L{Context.unplaceable}, kept with it.
    unplaceable: str = ""
    #: When placement first found no room for a replica this deployment
    #: wants (C{None}: it has room, or wants none): among deployments of
    #: one priority, the one that has waited longest is placed, and has
    #: room made for it, first, so none waits behind later arrivals.
    unplaceable_since: float | None = None
    #: Nothing is placed while held (a configuration failure).
    held: Hold | None = None
    #: A deployment with variants keeps a backoff per variant (by profile
    #: name, made on first failure with C{backoff}'s timings), so that one
    #: variant crashing does not keep the others from being placed.
    variant_backoff: dict[str, Backoff] = field(default_factory=dict)

    def backoff_of(self, profile: str, variants: tuple[str, ...]) -> Backoff:
        """
        The backoff a failure of a replica of C{profile} counts against:
        its variant's when C{profile} is one of C{variants} (the
        deployment's variant profiles, empty without variants), else the
        deployment's own.
        """
        if profile not in variants:
            return self.backoff
        b = self.variant_backoff.get(profile)
        if b is None:
            b = self.variant_backoff[profile] = Backoff(self.backoff.base, self.backoff.cap,
                                                        self.backoff.reset_after)
        return b

    def variant_blocked(self, profile: str, now: float) -> bool:
        """
        Whether the variant C{profile} is in its own backoff at C{now}.
        """
        b = self.variant_backoff.get(profile)
        return b is not None and b.blocked(now)

    def blocked(self, now: float, variants: tuple[str, ...]) -> bool:
        """
        Whether nothing can be placed at C{now}: the deployment's own
        backoff runs, or it has variants and every one is in backoff.
        """
        if self.backoff.blocked(now):
            return True
        return bool(variants) and all(self.variant_blocked(p, now) for p in variants)

    def blocked_until(self, now: float, variants: tuple[str, ...]) -> float | None:
        """
        When placement may resume if L{blocked} at C{now} (the earliest
        variant to come out of backoff, or the deployment's own backoff if
        later), else C{None}.
        """
        if not self.blocked(now, variants):
            return None
        until = self.backoff.until if self.backoff.blocked(now) else now
        if variants and all(self.variant_blocked(p, now) for p in variants):
            until = max(until, min(self.variant_backoff[p].until for p in variants))
        return until

    def failures(self, variants: tuple[str, ...]) -> int:
        """
        The consecutive failures counted: the deployment's own plus those
        of each of C{variants} (a variant since dropped from the catalog
        no longer counts).
        """
        if not self.variant_backoff:  # no variant has failed (most deployments: none has variants)
            return self.backoff.failures
        return self.backoff.failures + sum(self.variant_backoff[p].failures
                                           for p in variants if p in self.variant_backoff)

    def reset_backoff(self) -> None:
        """
        Forgive every failure counted, the deployment's and its variants'.
        """
        self.backoff.reset()
        self.variant_backoff.clear()


@dataclass
class Copy:
    """
    A node told to keep a deployment's weights (prefetch): their cache key,
    and the node's registration time when it was told (a newer one means
    the agent restarted, its pins gone, and must be told again).
    """

    key: str
    registered_at: float


@dataclass
class PrefetchState:
    """
    The prefetch copies the control plane wants, by deployment then node
    (L{llmgw.control.core.prefetching}).
    """

    copies: dict[str, dict[str, Copy]] = field(default_factory=dict)
    next_step: float = 0.0

    def nodes(self, model: str) -> list[str]:
        return sorted(self.copies.get(model, {}))


class Deployments(collections.defaultdict[str, DeploymentState]):
    """
    Each deployment's failure bookkeeping, made on first use with a copy of
    the timings of the context's backoff as it is then.
    """

    def __init__(self, ctx: Context):
        super().__init__()
        self._ctx = ctx

    def __missing__(self, model: str) -> DeploymentState:
        b = self._ctx.backoff
        state = self[model] = DeploymentState(Backoff(b.base, b.cap, b.reset_after))
        return state


def variants_of(ctx: Context, model: str) -> tuple[str, ...]:
    """
    The variant profiles of C{model}'s deployment, cheapest first; empty
    when it has none (or is no longer in the catalog).
    """
    dep = ctx.catalog.deployments.get(model)
    return tuple(v.profile for v in dep.variants) if dep is not None else ()


class Context:
    """
    @ivar listed: every shard id each registering node listed, claimed or
        not, until its registration is complete.
    """

    def __init__(self, state: FleetState, catalog: Catalog, inventory: Inventory, rules: Rules,
                 backoff: Backoff, epoch: int, started_at: float):
        self.state = state
        self.catalog = catalog
        self.inventory = inventory
        self.rules = rules
        #: The backoff each deployment starts with (its timings are copied).
        self.backoff = backoff
        self.deps = Deployments(self)
        self.desired: dict[str, int] = {}
        self.listed: dict[str, set[str]] = {}
        self.started_at = started_at
        self.frozen = False
        self.frozen_reason = ""
        self.prefetch = PrefetchState()
        #: Replica -> since when its engine sleeps (L{llmgw.control.core.sleeping}).
        self.sleeping_since: dict[str, float] = {}
        #: Replica -> why its agent did not put it to sleep when asked, as
        #: its leader's heartbeat said, until the next swapping pass reads it.
        self.sleep_refused: dict[str, str] = {}
        #: Model -> seconds its waiting requests may be kept past their
        #: queue timeout while room is made for it (L{llmgw.control.core.swapping}).
        self.room: dict[str, float] = {}
        #: The deployments whose C{unplaceable} is set (L{short_of_room}).
        self.unplaceable: set[str] = set()
        #: Rollouts, and the spec each replica was placed from.
        self.rollouts = RolloutBook()
        self.set_epoch(epoch)
        self._ids = 0
        self._by_priority: tuple[Catalog | None, tuple[str, ...]] = (None, ())

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._id_prefix = base36(epoch)

    @property
    def grace_end(self) -> float:
        return self.started_at + self.rules.adoption_grace

    def profile(self, name: str) -> Profile | None:
        return self.catalog.profiles.get(name)

    def short_of_room(self) -> bool:
        """
        Whether placement last found no room for some deployment (its
        C{unplaceable} or C{unplaceable_since} is set): only then can a
        swap have room to make, or the order of C{placing.waiting_order}
        differ from L{by_priority}.
        """
        # A deployment's unplaceable_since is set only with its unplaceable.
        return bool(self.unplaceable)

    def by_priority(self) -> tuple[str, ...]:
        """
        The catalog's deployments, the higher C{multiplex.priority} first,
        then by name; worked out once per catalog.
        """
        catalog, order = self._by_priority
        if catalog is not self.catalog:
            deps = self.catalog.deployments
            order = tuple(sorted(deps, key=lambda m: (-deps[m].multiplex.priority, m)))
            self._by_priority = (self.catalog, order)
        return order

    def startup_timeout(self, profile_name: str) -> float:
        p = self.profile(profile_name)
        return p.startup_timeout_s if p is not None else STARTUP_TIMEOUT

    def stop_grace(self, profile_name: str) -> float:
        p = self.profile(profile_name)
        return p.stop_grace_s if p is not None else STOP_GRACE

    def drain_timeout(self, profile_name: str) -> float:
        p = self.profile(profile_name)
        return p.drain_timeout_s if p is not None else DRAIN_TIMEOUT

    def host(self, node_id: str) -> str:
        node = self.inventory.peek(node_id)
        return (node.address if node is not None else "") or "127.0.0.1"

    def new_replica_id(self, model: str) -> str:
        slug = _SLUG.sub("-", model).strip("-")[:40] or "replica"
        while True:
            self._ids += 1
            rid = f"{slug}-{self._id_prefix}-{self._ids}"
            if rid not in self.state.replicas and rid not in self.state.retired:
                return rid
