"""
The routing table: what every gateway, embedded or standalone, routes by.

It sits below C{llmgw.control} and C{llmgw.gateway} and imports neither.
The control plane publishes a L{RoutingTable} projected from its fleet
state; the embedded gateway reads that object, a standalone one the same
projection through C{GET /api/v1/routes} (L{snapshot_to_json} /
L{snapshot_from_json}), so both follow one set of rules. Every change
increases L{RoutingTable.revision}; L{RoutingTable.wait_newer} answers a
long-poll. Per model the table may carry a routing policy (L{POLICIES})
and admission-queue limits (L{QueueLimits}); a gateway that queues offers
what it holds as L{IDemand}, the autoscaler's load figures. Engine signals
travel with each route with their age, not a timestamp, so that a gateway
on another host judges staleness by its own clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from zope.interface import Interface, implementer

#: The longest a long-poll of the routes is held before it answers anyway.
LONG_POLL_MAX_S = 30.0

#: Most long-polls waiting at once; past it the oldest is answered early
#: (it re-asks) so that waiting clients cannot grow memory without bound.
MAX_WAITERS = 10_000

#: The routing policies a deployment may name (see L{llmgw.gateway.policy}).
POLICIES = ("prefix", "least_loaded", "round_robin", "cache_aware")

#: The admission queue's defaults (L{llmgw.gateway.admission}): requests
#: that may wait per model, and seconds each may wait.
DEFAULT_QUEUE_DEPTH = 1000
DEFAULT_QUEUE_TIMEOUT_S = 60.0
#: The longest wait a deployment may set (a client holds a connection open).
MAX_QUEUE_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class QueueLimits:
    """
    One model's admission queue limits as its deployment sets them;
    C{None} leaves the gateway's default.

    @ivar depth: most requests waiting (0: none wait, all get 503 at once).
    @ivar timeout_s: the longest a request waits before it gets 503.
    @ivar room_s: set while the control plane makes room for the model
        (swaps it in): the seconds a request may wait past C{timeout_s}.
    """

    depth: int | None = None
    timeout_s: float | None = None
    room_s: float | None = None

    def __post_init__(self) -> None:
        if self.depth is not None and (isinstance(self.depth, bool) or self.depth < 0):
            raise ValueError(f"queue depth must be a non-negative integer, not {self.depth!r}")
        for what, t in (("queue timeout", self.timeout_s), ("room wait", self.room_s)):
            if t is not None and not (math.isfinite(t) and 0 < t <= MAX_QUEUE_TIMEOUT_S):
                raise ValueError(f"{what} must be in (0, {MAX_QUEUE_TIMEOUT_S:g}] seconds, not {t!r}")


@dataclass(frozen=True)
class EngineSignals:
    """
    Load figures an engine exported on its metrics endpoint, normalised
    across engines. C{None} means the engine does not export that figure.

    C{sampled_at} is on the clock of whoever holds the object (the
    publisher's, or the receiver's after L{snapshot_from_json}).
    """

    sampled_at: float
    waiting: float | None = None
    running: float | None = None
    kv_cache_usage: float | None = None  # a fraction, 0..1
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    generated_tokens: float | None = None  # output tokens since the engine started
    #: Whether the engine sleeps now (DESIGN §22); C{None}: it does not sleep.
    sleeping: bool | None = None
    #: The path a gateway POSTs to wake it; "": a request wakes it itself.
    wake_path: str = ""

    def age(self, now: float) -> float:
        return max(0.0, now - self.sampled_at)


@dataclass(frozen=True)
class Route:
    """
    One ready replica a gateway may send a model's requests to.

    C{draining} replicas are listed (their requests in flight finish) but
    get nothing new.
    """

    replica_id: str
    model: str
    address: str  # host:port of the leader shard
    draining: bool = False
    signals: EngineSignals | None = None
    #: Whether a stream broken off here may be continued on another replica
    #: (the deployment's C{resume_streams}; L{llmgw.gateway.resume}).
    resume: bool = True
    #: The LoRA adapters it holds; with C{lora_ids}, a request selects one
    #: by its position here in the body's "lora" field (llama.cpp), else
    #: by its name as "model" (vLLM).
    adapters: tuple[str, ...] = ()
    lora_ids: bool = False


class IRoutingTable(Interface):
    """
    What a gateway routes by. (L{RoutingTable} and L{RoutingSnapshot} also
    carry C{revision}, an int that increases whenever anything routed
    changes.)
    """

    def routes(model: str) -> Sequence[Route]:
        """
        The ready replicas of C{model}, sorted by replica id; draining ones
        are marked.
        """

    def models() -> list[str]:
        """
        Every model with at least one ready replica that is not draining,
        sorted.
        """

    def knows_model(model: str) -> bool:
        """
        Whether C{model} is declared at all (unknown models get 404, known
        ones without a ready replica 503).
        """


class IInFlight(Interface):
    """
    The gateway's count of requests in flight per replica, which lets the
    reconciler stop a draining replica as soon as it is idle.
    """

    def in_flight(replica_id: str) -> int:
        """
        Requests now being proxied to C{replica_id}.
        """


@dataclass(frozen=True)
class Demand:
    """
    A model's load as a gateway sees it: requests being proxied to its
    replicas (C{in_flight}) and requests held for want of a replica that can
    take them (C{waiting}, the admission queue). What the autoscaler scales
    on (L{llmgw.control.core.autoscale}).
    """

    in_flight: int
    waiting: int


class IDemand(Interface):
    """
    A gateway's demand per model, for the autoscaler: the embedded gateway's
    router provides it directly, a standalone gateway's is reported through
    the admin API (C{POST /api/v1/demand}).
    """

    def demand() -> Mapping[str, Demand]:
        """
        Each model with anything in flight or waiting, and its figures.
        Models absent have none of either.
        """


def _checked_policies(policies: Mapping[str, str]) -> dict[str, str]:
    new = dict(policies)
    for model, name in new.items():
        if name not in POLICIES:
            raise ValueError(f"{model!r}: routing policy {name!r} is not one of {', '.join(POLICIES)}")
    return new


def _by_model(routes: Iterable[Route]) -> dict[str, tuple[Route, ...]]:
    grouped: dict[str, list[Route]] = {}
    for r in routes:
        grouped.setdefault(r.model, []).append(r)
    return {m: tuple(sorted(rs, key=lambda r: r.replica_id)) for m, rs in grouped.items()}


@implementer(IRoutingTable)
class RoutingSnapshot:
    """
    An immutable routing table: routes per model, the declared models and
    the revision they were published at.
    """

    def __init__(
        self,
        routes: Iterable[Route] = (),
        known: Iterable[str] = (),
        revision: int = 0,
        policies: Mapping[str, str] | None = None,
        queues: Mapping[str, QueueLimits] | None = None,
        adapters: Mapping[str, str] | None = None,
    ):
        self._routes = _by_model(routes)
        #: adapter -> its base's model (the catalog's C{[[adapters]]})
        self.adapters: Mapping[str, str] = dict(adapters or {})
        self._known = frozenset(known) | frozenset(self._routes)
        self._models = sorted(m for m, rs in self._routes.items() if any(not r.draining for r in rs))
        self.revision = revision
        self._policies: dict[str, str] = dict(policies or {})
        self._queues: dict[str, QueueLimits] = dict(queues or {})

    def policy(self, model: str) -> str | None:
        """
        The routing policy named for C{model}, or C{None} (the gateway's
        default).
        """
        return self._policies.get(model)

    def policies(self) -> dict[str, str]:
        return dict(self._policies)

    def queue_limits(self, model: str) -> QueueLimits | None:
        """
        C{model}'s admission queue limits, or C{None} (the gateway's
        defaults).
        """
        return self._queues.get(model)

    def all_queue_limits(self) -> dict[str, QueueLimits]:
        return dict(self._queues)

    def routes(self, model: str) -> Sequence[Route]:
        return self._routes.get(model, ())

    def models(self) -> list[str]:
        return list(self._models)

    def knows_model(self, model: str) -> bool:
        return model in self._known

    def known_models(self) -> frozenset[str]:
        return self._known

    def all_routes(self) -> list[Route]:
        return [r for m in sorted(self._routes) for r in self._routes[m]]

    def replica_ids(self) -> set[str]:
        return {r.replica_id for rs in self._routes.values() for r in rs}

    def __len__(self) -> int:
        return sum(len(rs) for rs in self._routes.values())


@implementer(IRoutingTable)
class RoutingTable:
    """
    The published routing table: a L{RoutingSnapshot} that its owner
    replaces whole (L{publish}) or model by model (L{publish_model}).

    Readers get the current snapshot's answers; a publication that changes
    nothing keeps the revision, one that changes anything increases it and
    fires the long-polls waiting for it.
    """

    log = Logger()

    def __init__(self, clock: IReactorTime):
        self.clock = clock
        self._routes: dict[str, tuple[Route, ...]] = {}
        self._known: frozenset[str] = frozenset()
        self._policies: dict[str, str] = {}
        #: Where L{set_known} reads the model -> policy map from, if set
        #: (the control plane's catalog), so that whoever publishes the
        #: declared models publishes their policies with them.
        self.policy_source: Callable[[], Mapping[str, str]] | None = None
        self._queues: dict[str, QueueLimits] = {}
        #: Where L{set_known} reads the model -> queue limits map from, if
        #: set (the catalog again).
        self.queue_source: Callable[[], Mapping[str, QueueLimits]] | None = None
        #: The models whose streams are not continued on another replica
        #: (the catalog's C{resume_streams = false}): their routes are
        #: published with C{resume} off.
        self.resume_off_source: Callable[[], frozenset[str]] | None = None
        #: adapter -> its base's model, and where L{set_known} reads it
        #: from (the catalog), as the policies.
        self.adapters: Mapping[str, str] = {}
        self.adapter_source: Callable[[], Mapping[str, str]] | None = None
        self.revision = 0
        self._snapshot: RoutingSnapshot | None = RoutingSnapshot()
        self._waiters: dict[Deferred[int], IDelayedCall] = {}
        self._subscribers: list[Callable[[int, frozenset[str], bool], None]] = []

    # -- IRoutingTable ----------------------------------------------------------------

    def routes(self, model: str) -> Sequence[Route]:
        return self._routes.get(model, ())

    def models(self) -> list[str]:
        return self.snapshot().models()

    def knows_model(self, model: str) -> bool:
        return model in self._known or model in self._routes

    def policy(self, model: str) -> str | None:
        return self._policies.get(model)

    def queue_limits(self, model: str) -> QueueLimits | None:
        return self._queues.get(model)

    # -- publishing ---------------------------------------------------------------------

    def publish(self, routes: Iterable[Route], known: Iterable[str]) -> bool:
        """
        Replace the whole table. Returns whether anything changed.
        """
        by_model = _by_model(self._switched(routes))
        known_set = frozenset(known)
        if by_model == self._routes and known_set == self._known:
            return False
        models = frozenset(
            m for m in self._routes.keys() | by_model.keys() if self._routes.get(m) != by_model.get(m)
        )
        known_changed = known_set != self._known
        self._routes = by_model
        self._known = known_set
        self._changed(models, known_changed)
        return True

    def publish_model(self, model: str, routes: Iterable[Route]) -> bool:
        """
        Replace the routes of one model. Returns whether anything changed.
        """
        new = tuple(sorted(self._switched(routes), key=lambda r: r.replica_id))
        if any(r.model != model for r in new):
            raise ValueError(f"a route for another model was published under {model!r}")
        if self._routes.get(model, ()) == new:
            return False
        if new:
            self._routes[model] = new
        else:
            del self._routes[model]
        self._changed(frozenset((model,)), False)
        return True

    def _switched(self, routes: Iterable[Route]) -> Iterable[Route]:
        off = self.resume_off_source() if self.resume_off_source is not None else frozenset()
        if not off:
            return routes
        return [replace(r, resume=False) if r.model in off and r.resume else r for r in routes]

    def set_known(self, known: Iterable[str]) -> bool:
        """
        Replace the set of declared models. Returns whether it changed.
        """
        known_set = frozenset(known)
        policies = self._policies
        if self.policy_source is not None:
            policies = _checked_policies(self.policy_source())
        queues = self._queues
        if self.queue_source is not None:
            queues = dict(self.queue_source())
        adapters = dict(self.adapter_source()) if self.adapter_source is not None else self.adapters
        if (known_set, policies, queues, adapters) == (self._known, self._policies, self._queues, self.adapters):
            return False
        self._known, self.adapters = known_set, adapters
        self._policies = policies
        self._queues = queues
        self._changed(frozenset(), True)
        return True

    def set_policies(self, policies: Mapping[str, str]) -> bool:
        """
        Replace the model -> routing policy map (models left out get the
        gateway's default). Returns whether it changed.

        @raise ValueError: a policy is not one of L{POLICIES}.
        """
        new = _checked_policies(policies)
        if new == self._policies:
            return False
        self._policies = new
        self._changed(frozenset(), True)
        return True

    def set_queue_limits(self, queues: Mapping[str, QueueLimits]) -> bool:
        """
        Replace the model -> admission queue limits map (models left out
        get the gateway's defaults). Returns whether it changed.
        """
        new = dict(queues)
        if new == self._queues:
            return False
        self._queues = new
        self._changed(frozenset(), True)
        return True

    def replace(self, snapshot: RoutingSnapshot) -> bool:
        """
        Make the table what C{snapshot} holds (routes, declared models,
        policies and queue limits) in one change; the revision is this
        table's own. Returns whether anything changed. (An HA member that
        does not lead takes the leader's published table so.)
        """
        by_model = _by_model(snapshot.all_routes())
        known = snapshot.known_models()
        policies, queues = snapshot.policies(), snapshot.all_queue_limits()
        if (by_model, known, policies, queues, snapshot.adapters) == (
                self._routes, self._known, self._policies, self._queues, self.adapters):
            return False
        self.adapters = snapshot.adapters
        models = frozenset(
            m for m in self._routes.keys() | by_model.keys() if self._routes.get(m) != by_model.get(m)
        )
        known_changed = (known, policies, queues) != (self._known, self._policies, self._queues)
        self._routes, self._known, self._policies, self._queues = by_model, known, policies, queues
        self._changed(models, known_changed)
        return True

    def snapshot(self) -> RoutingSnapshot:
        """
        The table as it stands, immutable (built once per revision).
        """
        if self._snapshot is None:
            self._snapshot = RoutingSnapshot(
                (r for rs in self._routes.values() for r in rs), self._known, self.revision, self._policies,
                self._queues, self.adapters,
            )
        return self._snapshot

    def _changed(self, models: frozenset[str], known_changed: bool) -> None:
        self.revision += 1
        self._snapshot = None
        for callback in list(self._subscribers):
            try:
                callback(self.revision, models, known_changed)
            except Exception:
                self.log.failure("routing table subscriber {callback!r} failed", callback=callback)
        if self._waiters:
            waiters, self._waiters = self._waiters, {}
            for d, call in waiters.items():
                call.cancel()
                d.callback(self.revision)

    # -- change notifications ------------------------------------------------------------

    def subscribe(self, callback: Callable[[int, frozenset[str], bool], None]) -> Callable[[], None]:
        """
        Call C{callback(revision, models, known_changed)} after every change,
        synchronously: C{models} are the models whose routes changed,
        C{known_changed} whether the declared models did. A callback that
        raises is logged and stays subscribed. Returns the function that
        unsubscribes it.
        """
        self._subscribers.append(callback)

        def unsubscribe() -> None:
            if callback in self._subscribers:
                self._subscribers.remove(callback)

        return unsubscribe

    # -- long-poll ----------------------------------------------------------------------

    def wait_newer(self, since: int, timeout: float = LONG_POLL_MAX_S) -> Deferred[int]:
        """
        A L{Deferred} that fires with the revision as soon as it is greater
        than C{since}: at once if it already is, else at the next change or
        after C{timeout} seconds, whichever comes first. Cancelling it
        forgets the waiter (a client that went away).
        """
        if self.revision > since or since < 0:
            d: Deferred[int] = Deferred()
            d.callback(self.revision)
            return d
        if len(self._waiters) >= MAX_WAITERS:
            oldest = next(iter(self._waiters))
            self._waiters.pop(oldest).cancel()
            oldest.callback(self.revision)

        def forget(d: Deferred[int]) -> None:
            call = self._waiters.pop(d, None)
            if call is not None and call.active():
                call.cancel()

        d = Deferred(forget)

        def expire() -> None:
            if self._waiters.pop(d, None) is not None:
                d.callback(self.revision)

        self._waiters[d] = self.clock.callLater(max(0.0, timeout), expire)
        return d

    def waiting(self) -> int:
        """
        How many long-polls are being held.
        """
        return len(self._waiters)


# -- the wire form of GET /api/v1/routes --------------------------------------------------


class RoutesDataError(ValueError):
    """
    A routes document is not what L{snapshot_to_json} writes.
    """


_SIGNAL_FIELDS = ("waiting", "running", "kv_cache_usage", "prefix_cache_queries", "prefix_cache_hits",
                  "generated_tokens")


def _signals_json(s: EngineSignals, now: float) -> dict[str, Any]:
    out: dict[str, Any] = {"age_s": round(s.age(now), 3)}
    for name in _SIGNAL_FIELDS:
        value = getattr(s, name)
        if value is not None:
            out[name] = value
    if s.sleeping is not None:
        out["sleeping"] = s.sleeping
    if s.wake_path:
        out["wake_path"] = s.wake_path
    return out


def snapshot_to_json(table: IRoutingTable | RoutingSnapshot, now: float) -> dict[str, Any]:
    """
    The document C{GET /api/v1/routes} answers with: the revision, the
    declared models and every route, signals with their age in seconds.
    """
    snap = table.snapshot() if isinstance(table, RoutingTable) else table
    if not isinstance(snap, RoutingSnapshot):
        raise TypeError("snapshot_to_json needs a RoutingTable or RoutingSnapshot")
    routes = []
    for r in snap.all_routes():
        entry: dict[str, Any] = {
            "replica": r.replica_id,
            "model": r.model,
            "address": r.address,
            "draining": r.draining,
        }
        if r.signals is not None:
            entry["signals"] = _signals_json(r.signals, now)
        if not r.resume:
            entry["resume"] = False
        if r.adapters:
            entry["adapters"] = list(r.adapters)
        if r.lora_ids:
            entry["lora_ids"] = True
        routes.append(entry)
    return {
        "revision": snap.revision,
        "known": sorted(snap.known_models()),
        "routes": routes,
        "policies": dict(sorted(snap.policies().items())),
        "queues": {m: _queue_json(q) for m, q in sorted(snap.all_queue_limits().items())},
        "adapters": dict(sorted(snap.adapters.items())),
    }


def _queue_json(q: QueueLimits) -> dict[str, Any]:
    return {k: v for k, v in (("depth", q.depth), ("timeout_s", q.timeout_s), ("room_s", q.room_s))
            if v is not None}


def _queue_from(model: Any, data: Any) -> QueueLimits:
    """
    @raise RoutesDataError: C{data} is not what L{_queue_json} writes.
    """
    where = f"queues[{model!r}]"
    if not isinstance(model, str) or not isinstance(data, Mapping):
        raise RoutesDataError(f"{where} is not an object under a model name")
    depth = data.get("depth")
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int)):
        raise RoutesDataError(f"{where}.depth is not an integer")
    timeout, room = data.get("timeout_s"), data.get("room_s")
    try:
        return QueueLimits(depth, None if timeout is None else _number(timeout, f"{where}.timeout_s"),
                           None if room is None else _number(room, f"{where}.room_s"))
    except ValueError as e:
        raise RoutesDataError(f"{where}: {e}") from None


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RoutesDataError(f"{where} is not a finite number")
    return float(value)


def _signals_from(data: Any, where: str, now: float) -> EngineSignals | None:
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise RoutesDataError(f"{where}.signals is not an object")
    age = _number(data.get("age_s", 0.0), f"{where}.signals.age_s")
    values: dict[str, float | None] = {}
    for name in _SIGNAL_FIELDS:
        v = data.get(name)
        values[name] = None if v is None else _number(v, f"{where}.signals.{name}")
    sleeping, wake = data.get("sleeping"), data.get("wake_path", "")
    if not (sleeping is None or isinstance(sleeping, bool)) or not isinstance(wake, str) or (
            wake and not wake.startswith("/")):
        raise RoutesDataError(f"{where}.signals: sleeping must be a boolean and wake_path a path")
    return EngineSignals(sampled_at=now - max(0.0, age), sleeping=sleeping, wake_path=wake, **values)


def snapshot_from_json(data: Any, now: float) -> tuple[RoutingSnapshot, list[str]]:
    """
    The snapshot a routes document describes, and the problems with single
    entries (which are left out, so one bad route costs only itself).

    @raise RoutesDataError: the document as a whole is not a routes document.
    """
    if not isinstance(data, Mapping):
        raise RoutesDataError("expected a JSON object with revision, known and routes")
    revision = data.get("revision")
    if isinstance(revision, bool) or not isinstance(revision, int) or revision < 0:
        raise RoutesDataError("revision is not a non-negative integer")
    known = data.get("known")
    entries = data.get("routes")
    if not isinstance(known, list) or not isinstance(entries, list):
        raise RoutesDataError("known and routes must be lists")
    problems: list[str] = []
    names = []
    for i, m in enumerate(known):
        if isinstance(m, str) and m:
            names.append(m)
        else:
            problems.append(f"known[{i}] is not a model name")
    routes = []
    for i, e in enumerate(entries):
        where = f"routes[{i}]"
        if not isinstance(e, Mapping):
            problems.append(f"{where} is not an object")
            continue
        rid, model, address = e.get("replica"), e.get("model"), e.get("address")
        if not (isinstance(rid, str) and isinstance(model, str) and isinstance(address, str)) or not (
            rid and model and ":" in address
        ):
            problems.append(f"{where} needs string replica, model and a host:port address")
            continue
        try:
            signals = _signals_from(e.get("signals"), where, now)
        except RoutesDataError as err:
            problems.append(str(err))
            signals = None
        held = e.get("adapters", [])
        if not isinstance(held, list) or not all(isinstance(a, str) for a in held):
            problems.append(f"{where}.adapters is not a list of names")
            held = []
        routes.append(Route(rid, model, address, bool(e.get("draining", False)), signals,
                            e.get("resume", True) is not False, tuple(held), e.get("lora_ids") is True))
    # Absent from documents of control planes that predate routing policies.
    raw_policies = data.get("policies", {})
    policies: dict[str, str] = {}
    if not isinstance(raw_policies, Mapping):
        problems.append("policies is not an object")
    else:
        for model, name in raw_policies.items():
            if isinstance(model, str) and name in POLICIES:
                policies[model] = name
            else:
                problems.append(
                    f"policies[{model!r}] is {name!r}, not one of {', '.join(POLICIES)}"
                )
    # Absent from documents of control planes that predate admission queues.
    raw_queues = data.get("queues", {})
    queues: dict[str, QueueLimits] = {}
    if not isinstance(raw_queues, Mapping):
        problems.append("queues is not an object")
    else:
        for model, limits in raw_queues.items():
            try:
                queues[model] = _queue_from(model, limits)
            except RoutesDataError as e:
                problems.append(str(e))
    # Absent from documents of control planes that predate adapters.
    raw_adapters = data.get("adapters", {})
    raw_adapters = raw_adapters if isinstance(raw_adapters, Mapping) else {None: None}
    adapters = {a: b for a, b in raw_adapters.items() if isinstance(a, str) and isinstance(b, str) and a and b}
    if len(adapters) != len(raw_adapters):
        problems.append("adapters is not an object of adapter -> base model names")
    return RoutingSnapshot(routes, names, revision, policies, queues, adapters), problems
