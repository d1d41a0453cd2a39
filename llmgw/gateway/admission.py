"""
The admission queue (DESIGN §16): where a request waits when its model has
no replica that can take it now, instead of failing at once.

A model "can take" a request when one of its routes is not draining, not
cooling down (the router's breaker) and not saturated (fresh engine signals
over the policies' thresholds, L{llmgw.gateway.policy.saturated}). When none
is, or when others already wait, a request joins its model's queue. It
leaves it:

 - dispatched, in fair order, as soon as the model can take requests again
   (a routing table change: a replica turned ready, fresh signals), or when
   one of the model's requests finishes while all its replicas are
   saturated (one waiter per request finished: the capacity it freed);
 - refused with the OpenAI-shaped 503 and C{Retry-After} after waiting the
   model's C{timeout_s}, or at once when C{depth} requests already wait;
   while the control plane makes room for the model (swaps it in: its
   queue limits carry C{room_s}), a waiter is kept up to C{room_s} past
   its C{timeout_s}, and counted (C{llmgw_gateway_queue_kept_total});
 - at once, with nothing sent upstream, when its client disconnects.

Bounded in bytes too: the bodies of a model's waiters may hold at most its
C{max_bytes}, and those of every model's waiters together the process's
C{total_bytes}. A request whose body would take either past its budget
waits nowhere: 503 with C{Retry-After} at once, naming the budget. Its
bytes are released however a waiter leaves; when every queue has emptied
after a burst that held many bytes, C{trimmer} (L{llmgw.memtrim}) returns
the memory they freed to the system.

Fair across clients: each client key (the API key's name, else the client's
address) has its own sub-queue, and the model's queue takes one request from
each key in turn. When the queue is full, a newcomer whose key holds fewer
than the key with the most waiting takes the place of that key's newest
request (which gets the 503): one key's burst cannot starve another's.

Every operation is O(1): sub-queues are insertion-ordered dicts, and keys are
indexed by how many they hold, so the longest is found without a scan.

L{Admission} also counts the requests in flight per model, and offers both
figures as L{llmgw.routing.IDemand}, for the autoscaler.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Final

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import classImplements

from llmgw.gateway import errors
from llmgw.gateway.adapters import NO_ADAPTERS, AdapterRouting
from llmgw.gateway.fairqueue import FairQueue, Waiter
from llmgw.gateway.metrics import LATENCY_BUCKETS
from llmgw.gateway.policy import PolicyConfig, saturated
from llmgw.gateway.waking import Waker, http_post, sleeping
from llmgw.memtrim import Trimmer, malloc_trim
from llmgw.routing import DEFAULT_QUEUE_DEPTH, DEFAULT_QUEUE_TIMEOUT_S, Demand, IDemand, Route
from llmgw.untrusted import clip

#: What L{capacity} says of a model.
NONE: Final = 0  # no route that is ready, not draining and not cooling down
SATURATED: Final = 1  # such routes, but every one saturated
FREE: Final = 2  # a route that can take a request now

#: How often models with waiters are looked at again with no event (a
#: cool-down ending, signals going stale, which no table change announces).
TICK_S: Final = 1.0

#: Why a waiter left the queue: the C{outcome} label of the wait metric.
DISPATCHED: Final = "dispatched"
TIMEOUT: Final = "timeout"
FULL: Final = "full"
DISCONNECTED: Final = "disconnected"
OVER_BUDGET: Final = "over_budget"
OUTCOMES: Final = (DISPATCHED, TIMEOUT, FULL, DISCONNECTED, OVER_BUDGET)

#: The byte budgets' defaults: the bodies waiting for one model, and for
#: every model of the process together.
DEFAULT_QUEUE_BYTES_PER_MODEL: Final = 64 * 1024 * 1024
DEFAULT_QUEUE_BYTES: Final = 256 * 1024 * 1024
#: Which budget a refused body would have passed (L{queue_bytes_full}).
MODEL_BUDGET: Final = "model"
PROCESS_BUDGET: Final = "process"


@dataclass(frozen=True)
class QueueConfig:
    """
    One model's queue limits: C{depth} requests waiting at most (0: none
    wait, all get 503 at once), each for at most C{timeout_s} seconds, their
    bodies holding C{max_bytes} at most together; while room is made for
    the model, C{room_s} more seconds (0: none).
    """

    depth: int = DEFAULT_QUEUE_DEPTH
    timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S
    max_bytes: int = DEFAULT_QUEUE_BYTES_PER_MODEL
    room_s: float = 0.0


def capacity(
    routes: Sequence[Route],
    cooling: Callable[[str], bool],
    now: float,
    config: PolicyConfig,
    asleep: Callable[[Route], bool] | None = None,
) -> int:
    """
    L{FREE} if a route in C{routes} can take a request now, L{SATURATED}
    if some could but for their fresh engine signals, else L{NONE}. Stops
    at the first free route (the common case costs one look).
    """
    state = NONE
    for r in routes:
        # sleeping(r) inline: on every request's path.
        if r.draining or cooling(r.replica_id) or (
            asleep is not None and r.signals is not None and r.signals.sleeping and asleep(r)
        ):
            continue
        if r.signals is None or not saturated(r, now, config):
            return FREE
        state = SATURATED
    return state


class _Episode:
    """
    What happened to a model's queue since it last was empty (for the log).
    """

    __slots__ = ("since", "counts", "longest_wait", "warned_full")

    def __init__(self, since: float):
        self.since = since
        self.counts = dict.fromkeys(OUTCOMES, 0)
        self.longest_wait = 0.0
        self.warned_full = False


class _WaitingCollector(Collector):
    def __init__(self, admission: Admission):
        self._admission = admission

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily(
            "llmgw_gateway_queue_waiting",
            "Requests waiting in the admission queue now, per model",
            labels=["model"],
        )
        for model, n in sorted(self._admission.waiting_by_label().items()):
            g.add_metric([model], n)
        yield g
        b = GaugeMetricFamily(
            "llmgw_gateway_queue_bytes",
            "Bytes of request bodies waiting in the admission queue now, per model",
            labels=["model"],
        )
        for model, n in sorted(self._admission.bytes_by_label().items()):
            b.add_metric([model], n)
        yield b


class Admission:
    """
    Every model's admission queue, and the count of requests in flight per
    model (L{IDemand}).

    @param capacity: model -> L{NONE}, L{SATURATED} or L{FREE}, now.
    @param limits: model -> its L{QueueConfig}.
    @param label: model -> its metrics label (bounded, see
        L{llmgw.gateway.metrics.GatewayMetrics.model_label}).
    @param retry_after: the C{Retry-After} seconds of a refusal.
    @param total_bytes: the most bytes of bodies that wait, all models
        together (each model's own budget is its L{QueueConfig}'s).
    """

    # Named, and a ClassVar (setup.py's rules for compiled classes).
    log: ClassVar[Logger] = Logger(namespace=f"{__name__}.Admission")

    def __init__(
        self,
        clock: IReactorTime,
        capacity: Callable[[str], int],
        limits: Callable[[str], QueueConfig],
        registry: CollectorRegistry | None = None,
        label: Callable[[str], str] = lambda model: model,
        retry_after: int = 5,
        total_bytes: int = DEFAULT_QUEUE_BYTES,
    ):
        self.clock = clock
        self.capacity = capacity
        self.limits = limits
        self.label = label
        self.retry_after = retry_after
        self._queues: dict[str, FairQueue] = {}
        self._episodes: dict[str, _Episode] = {}
        #: model -> requests finished while it was saturated, not yet used
        self._credits: dict[str, int] = {}
        self._in_flight: dict[str, int] = {}
        self.total_bytes = total_bytes
        #: Bytes of the bodies waiting: all models', and per model.
        self.queued_bytes = 0
        self._bytes: dict[str, int] = {}
        #: Whether a refusal over a byte budget was logged since the
        #: queues last held nothing (one line an overload, not one each).
        self._budget_warned = False
        #: Told the most bytes the queues held, each time they all empty.
        self.trimmer: Trimmer | None = None
        self._peak = 0
        self._tick: IDelayedCall | None = None
        self._soon: IDelayedCall | None = None
        self._pumping: set[str] = set()
        #: Undoes what feeds this object table changes (L{close}).
        self.detach: Callable[[], None] | None = None
        #: Wakes sleeping replicas for this queue's models (L{gateway_admission}).
        self.waker: Waker | None = None
        #: The waker's C{asleep}, or C{None} without one: for L{capacity}, on every request's path.
        self.asleep: Callable[[Route], bool] | None = None
        registry = registry if registry is not None else CollectorRegistry()
        self.waits = Histogram(
            "llmgw_gateway_queue_wait_seconds",
            "Time requests spent in the admission queue, by model and how they left it "
            "(dispatched, timeout, full, disconnected, over_budget)",
            ["model", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.kept = Counter(
            "llmgw_gateway_queue_kept",
            "Requests kept waiting past their queue timeout because the control plane was making "
            "room for their model (swapping it in), by model",
            ["model"],
            registry=registry,
        )
        registry.register(_WaitingCollector(self))

    # -- IDemand -------------------------------------------------------------------------

    def demand(self) -> dict[str, Demand]:
        out = {m: Demand(n, 0) for m, n in self._in_flight.items()}
        for m, q in self._queues.items():
            out[m] = Demand(self._in_flight.get(m, 0), len(q))
        return out

    def waiting(self, model: str) -> int:
        q = self._queues.get(model)
        return len(q) if q is not None else 0

    def waiting_by_label(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for m, q in self._queues.items():
            label = self.label(m)
            out[label] = out.get(label, 0) + len(q)
        return out

    def bytes_by_label(self) -> dict[str, int]:
        """
        The bytes of bodies waiting, per model label.
        """
        out: dict[str, int] = {}
        for m, n in self._bytes.items():
            label = self.label(m)
            out[label] = out.get(label, 0) + n
        return out

    # -- in flight -------------------------------------------------------------------------

    def started(self, model: str) -> None:
        """
        A request of C{model} was sent on to a replica.
        """
        self._in_flight[model] = self._in_flight.get(model, 0) + 1

    def ended(self, model: str) -> None:
        """
        A request of C{model} that L{started} is over, however it ended:
        the capacity it held is free for a waiter.
        """
        n = self._in_flight.get(model, 0) - 1
        if n > 0:
            self._in_flight[model] = n
        else:
            self._in_flight.pop(model, None)
        if model in self._queues:
            self._credits[model] = self._credits.get(model, 0) + 1
            self.pump(model)

    # -- entering ----------------------------------------------------------------------------

    def must_wait(self, model: str, state: int) -> bool:
        """
        Whether a request of C{model} arriving now, when the model's
        capacity is C{state}, joins the queue: when others wait (no
        overtaking them) or the model cannot take it.
        """
        return state != FREE or model in self._queues

    def enter(
        self,
        model: str,
        who: str,
        request: Any,
        go: Callable[[], None],
        refuse: Callable[[errors.GatewayError], None],
        size: int = 0,
    ) -> None:
        """
        Queue a request of C{model} from client key C{who}, holding C{size}
        bytes (its body) while it waits; C{go} or C{refuse} is called
        exactly once later (or C{refuse} now, when the queue is full or off,
        or C{size} more bytes would pass a byte budget), unless the client
        goes away first, which L{Admission} learns through
        C{request.on_lost}.
        """
        limits = self.limits(model)
        now = self.clock.seconds()
        if limits.depth <= 0:
            refuse(errors.no_ready_replica(model, self.retry_after))
            return
        # Checked before a place is made (a newcomer pushing out another
        # key's waiter, below), so a refusal here changes nothing.
        if self._bytes.get(model, 0) + size > limits.max_bytes:
            self._refuse_over_budget(model, MODEL_BUDGET, limits.max_bytes, now, refuse)
            return
        if self.queued_bytes + size > self.total_bytes:
            self._refuse_over_budget(model, PROCESS_BUDGET, self.total_bytes, now, refuse)
            return
        q = self._queues.get(model)
        if q is None:
            q = self._queues[model] = FairQueue()
            self._episodes[model] = _Episode(now)
            self.log.info(
                "{model}: no replica can take requests now ({why}); queueing them "
                "(at most {depth}, each for up to {timeout} s)",
                model=clip(model),
                why="all saturated" if self.capacity(model) == SATURATED else "none ready",
                depth=limits.depth,
                timeout=limits.timeout_s,
            )
        if len(q) >= limits.depth:
            top = q.longest()
            assert top is not None
            if q.count(who) + 1 < top[1]:
                # The newcomer's key holds less than the longest: that
                # key's newest gives up its place.
                self._leave(q.newest(top[0]), FULL, now)
            else:
                self._refuse_full(model, limits, now, refuse)
                return
        w = Waiter(model, who, request, go, refuse, now, size)
        q.push(w)
        if size:
            self._bytes[model] = self._bytes.get(model, 0) + size
            self.queued_bytes += size
            self._peak = max(self._peak, self.queued_bytes)
        w.timer = self.clock.callLater(limits.timeout_s, self._expired, w)
        request.on_lost = partial(self._gone, w)
        if self._tick is None:
            self._tick = self.clock.callLater(TICK_S, self._ticked)
        # A model that could take requests (it only had waiters) takes this
        # one too if they have all gone meanwhile.
        self.pump(model)

    def _refuse_full(
        self, model: str, limits: QueueConfig, now: float, refuse: Callable[[errors.GatewayError], None]
    ) -> None:
        ep = self._episodes.get(model)
        if ep is not None:
            ep.counts[FULL] += 1
            if not ep.warned_full:
                ep.warned_full = True
                self.log.warn(
                    "{model}: admission queue full ({depth} waiting); refusing more with 503 "
                    "and Retry-After",
                    model=clip(model),
                    depth=limits.depth,
                )
        self.waits.labels(self.label(model), FULL).observe(0.0)
        refuse(queue_full(model, limits.depth, self.retry_after))

    def _refuse_over_budget(
        self, model: str, which: str, budget: int, now: float, refuse: Callable[[errors.GatewayError], None]
    ) -> None:
        ep = self._episodes.get(model)
        if ep is not None:
            ep.counts[OVER_BUDGET] += 1
        if not self._budget_warned:
            self._budget_warned = True
            self.log.warn(
                "{model}: the bodies waiting in the admission queue are near the {which} byte "
                "budget ({model_bytes} bytes for this model, {total} for all, of {budget}); "
                "refusing the requests that do not fit with 503 and Retry-After",
                model=clip(model),
                which="model's" if which == MODEL_BUDGET else "process's",
                model_bytes=self._bytes.get(model, 0),
                total=self.queued_bytes,
                budget=budget,
            )
        self.waits.labels(self.label(model), OVER_BUDGET).observe(0.0)
        refuse(queue_bytes_full(model, which, budget, self.retry_after))

    # -- leaving -----------------------------------------------------------------------------

    def pump(self, model: str) -> None:
        """
        Dispatch C{model}'s waiters in fair order while it can take them
        (and, while saturated, one per request finished since the last
        pump).
        """
        if model in self._pumping:
            return
        self._pumping.add(model)
        try:
            q = self._queues.get(model)
            now = self.clock.seconds()
            while q:
                state = self.capacity(model)
                if state == SATURATED and self._credits.get(model, 0) > 0:
                    self._credits[model] -= 1
                elif state != FREE:
                    break
                w = q.pop()
                assert w is not None
                self._leave(w, DISPATCHED, now, removed=True)
                self._dispatch(w)
                q = self._queues.get(model)
            # A finished request's capacity is used now or not at all.
            self._credits.pop(model, None)
        finally:
            self._pumping.discard(model)

    def _dispatch(self, w: Waiter) -> None:
        # One waiter's failure to go is its own: the others still go, and
        # whoever finished the request that made room is not disturbed.
        try:
            w.go()
        except Exception:
            self.log.failure("admission queue: sending a waiting request for {model} failed",
                             model=clip(w.model))
            try:
                w.refuse(errors.upstream_failed(w.model, "the gateway failed to send the request on"))
            except Exception:
                self.log.failure("admission queue: answering the failed request failed too")

    def pump_all(self) -> None:
        for model in list(self._queues):
            self.pump(model)

    def pump_soon(self) -> None:
        """
        L{pump_all} on the next reactor turn (once, however often asked):
        for table changes, which arrive inside whoever published them.
        """
        if self._soon is None and self._queues:
            self._soon = self.clock.callLater(0, self._soon_fired)

    def _soon_fired(self) -> None:
        self._soon = None
        try:
            self.pump_all()
        except Exception:
            self.log.failure("admission queue: dispatching waiters failed")

    def _ticked(self) -> None:
        self._tick = None
        try:
            self.pump_all()
        except Exception:
            self.log.failure("admission queue: dispatching waiters failed")
        if self._queues:
            self._tick = self.clock.callLater(TICK_S, self._ticked)

    def _expired(self, w: Waiter) -> None:
        w.timer = None
        if w.done:
            return
        now = self.clock.seconds()
        limits = self.limits(w.model)
        # Room is being made for the model (a drain, then a cold start):
        # the wait is bounded by what the control plane says it may take.
        left = w.since + limits.timeout_s + limits.room_s - now
        if limits.room_s > 0 and left > 0:
            if not w.kept:
                w.kept = True
                self.kept.labels(self.label(w.model)).inc()
            w.timer = self.clock.callLater(left, self._expired, w)
            return
        self._leave(w, TIMEOUT, now)

    def _gone(self, w: Waiter, reason: Failure) -> None:
        if w.done:
            return
        self._leave(w, DISCONNECTED, self.clock.seconds())

    def _leave(self, w: Waiter, outcome: str, now: float, removed: bool = False) -> None:
        """
        C{w} leaves its queue: dispatched (the caller calls C{go}), timed
        out or pushed out (refused here), or its client gone.
        """
        w.done = True
        q = self._queues.get(w.model)
        if not removed and q is not None:
            q.remove(w)
        if w.size:
            self._release(w)
        if w.timer is not None:
            timer, w.timer = w.timer, None
            timer.cancel()
        if w.request.on_lost is not None and outcome != DISCONNECTED:
            w.request.on_lost = None
        waited = max(0.0, now - w.since)
        self.waits.labels(self.label(w.model), outcome).observe(waited)
        ep = self._episodes.get(w.model)
        if ep is not None:
            ep.counts[outcome] += 1
            ep.longest_wait = max(ep.longest_wait, waited)
        if outcome == TIMEOUT:
            w.refuse(queue_timeout(w.model, waited, self.retry_after))
        elif outcome == FULL:
            w.refuse(queue_full(w.model, self.limits(w.model).depth, self.retry_after))
        if q is not None and not q:
            self._emptied(w.model, now)

    def _release(self, w: Waiter) -> None:
        self.queued_bytes -= w.size
        left = self._bytes.get(w.model, 0) - w.size
        if left > 0:
            self._bytes[w.model] = left
        else:
            self._bytes.pop(w.model, None)
        w.size = 0

    def _emptied(self, model: str, now: float) -> None:
        del self._queues[model]
        if not self._queues:
            self._budget_warned = False
            peak, self._peak = self._peak, 0
            if self.trimmer is not None and peak:
                self.trimmer.drained(peak)
        self._credits.pop(model, None)
        ep = self._episodes.pop(model, None)
        if ep is not None:
            c = ep.counts
            self.log.info(
                "{model}: admission queue empty again after {seconds:.1f} s: {dispatched} dispatched, "
                "{timeout} timed out, {full} refused (queue full), {over_budget} refused (byte "
                "budget), {disconnected} clients left; "
                "longest wait {longest:.1f} s",
                model=clip(model),
                seconds=now - ep.since,
                longest=ep.longest_wait,
                **c,
            )

    def close(self) -> None:
        """
        Stop the timers (the gateway is stopping); waiters stay as they are.
        """
        for call in (self._tick, self._soon):
            if call is not None and call.active():
                call.cancel()
        self._tick = self._soon = None
        if self.trimmer is not None:
            self.trimmer.close()
        if self.detach is not None:
            detach, self.detach = self.detach, None
            detach()


# Not @implementer (setup.py's rules for compiled classes).
classImplements(Admission, IDemand)


def queue_full(model: str, depth: int, retry_after: int) -> errors.GatewayError:
    return errors.GatewayError(
        503,
        f"No replica of {clip(model)} can take the request now, and {depth} requests already "
        f"wait for one; retry later",
        "server_error",
        "queue_full",
        {b"Retry-After": b"%d" % retry_after},
    )


def queue_bytes_full(model: str, which: str, budget: int, retry_after: int) -> errors.GatewayError:
    """
    The 503 of a request whose body would take the bodies waiting past a
    byte budget: C{which} is L{MODEL_BUDGET} or L{PROCESS_BUDGET}.
    """
    whose = f"for {clip(model)}" if which == MODEL_BUDGET else "for all models of this gateway"
    return errors.GatewayError(
        503,
        f"No replica of {clip(model)} can take the request now, and the request bodies already "
        f"waiting {whose} would pass their budget of {budget} bytes with this one; retry later",
        "server_error",
        "queue_bytes_full",
        {b"Retry-After": b"%d" % retry_after},
    )


def queue_timeout(model: str, waited: float, retry_after: int) -> errors.GatewayError:
    return errors.GatewayError(
        503,
        f"No replica of {clip(model)} could take the request within {waited:.0f} s of waiting; "
        f"retry later",
        "server_error",
        "queue_timeout",
        {b"Retry-After": b"%d" % retry_after},
    )


def gateway_admission(gateway: Any) -> Admission:
    """
    The admission queues of C{gateway} (an L{llmgw.gateway.proxy.Gateway}):
    capacity judged from its routing table and router, limits from the
    table's per-model L{llmgw.routing.QueueLimits} over the gateway's
    defaults, waiters pumped on every routing table change.
    """
    clock, table, router, config = gateway.reactor, gateway.table, gateway.router, gateway.config
    policy = config.policy

    adapter_routing = AdapterRouting()
    waker = Waker(clock, http_post(clock), gateway.registry, gateway.metrics.model_label)
    router.asleep = waker.state

    def model_capacity(model: str) -> int:
        routes = table.routes(model)
        # An adapter's capacity is its holders' (llmgw.gateway.adapters).
        chosen = adapter_routing.resolve(getattr(table, "adapters", NO_ADAPTERS), table.routes, model, routes)
        if chosen is not None:
            routes = chosen[0]
        state = capacity(routes, router.cooling, clock.seconds(), policy, waker.asleep)
        if state != FREE and any(sleeping(r) for r in routes):
            # The awake replicas are used up: a sleeping one is woken.
            waker.needed(model, routes)
        return state

    default = QueueConfig(config.queue_depth, config.queue_timeout_s, config.queue_bytes_per_model)

    def limits(model: str) -> QueueConfig:
        named = getattr(table, "queue_limits", None)
        q = named(model) if named is not None else None
        if q is None:
            return default
        return QueueConfig(
            config.queue_depth if q.depth is None else q.depth,
            config.queue_timeout_s if q.timeout_s is None else q.timeout_s,
            config.queue_bytes_per_model,
            q.room_s or 0.0,
        )

    admission = Admission(
        clock, model_capacity, limits, gateway.registry, gateway.metrics.model_label, config.retry_after,
        config.queue_bytes,
    )
    admission.waker, admission.asleep = waker, waker.asleep
    waker.on_awake = lambda model: admission.pump_soon()
    trim = malloc_trim()
    if trim is not None:
        admission.trimmer = Trimmer(clock, trim)
    subscribe = getattr(table, "subscribe", None)
    listeners = getattr(table, "listeners", None)
    if callable(subscribe):
        # The control plane's own table (embedded gateway).
        admission.detach = subscribe(lambda revision, models, known_changed: admission.pump_soon())
    elif isinstance(listeners, list):
        # A standalone gateway's follower table.
        def listener(snapshot: Any) -> None:
            admission.pump_soon()

        listeners.append(listener)
        admission.detach = lambda: listeners.remove(listener) if listener in listeners else None
    return admission
