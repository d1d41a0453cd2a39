"""
Replicas that stopped answering, seen from the gateway (DESIGN §23): an
engine can wedge between two of the control plane's looks at it, and the
gateway sees it first, as requests that get no first byte.

A replica is stalled when C{count} or more requests sent to it have waited
past the model's bound for a first byte, while another replica of the same
model sent a first byte within that bound (so that an overloaded model, slow
everywhere, is not taken for a wedged replica). The bound is C{max(min_wait,
factor x the model's recent median time to first byte)}. A stalled replica
is put in the router's cool-down, out of rotation as a replica whose
connections keep failing is, and the requests waiting on it that have had no
byte are sent to another replica at once (L{Unstarted.move}): their clients
see no error. It is logged once and counted in
C{llmgw_gateway_replicas_stalled_total}.

The decision (L{FirstByteWatch.check}) reads a clock and plain data; the
service around it only calls it once a second.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from statistics import median
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter
from twisted.application.service import Service
from twisted.logger import Logger

from llmgw.gateway.unstarted import Unstarted
from llmgw.periodic import Periodic

#: The fewest waiting requests that make a replica stalled.
DEFAULT_COUNT = 3
#: Seconds no model's bound goes under.
DEFAULT_MIN_WAIT = 5.0
#: The bound in multiples of the model's recent median time to first byte.
DEFAULT_FACTOR = 4.0
#: First-byte times kept per model for its median.
RECENT = 64
#: Seconds between checks.
CHECK_INTERVAL = 1.0


class IWaiting(Protocol):
    """
    A request sent to a replica, as L{Unstarted} holds it.
    """

    model: str
    #: When it was sent, on the watch's clock.
    sent_at: float

    def replica_left(self) -> None: ...


class FirstByteWatch:
    """
    Watches the requests L{Unstarted} holds and the first bytes that come,
    and benches replicas that stall. C{bench(replica_id)} takes one out of
    rotation (the router's cool-down); it returns whether it was in it.
    """

    log = Logger()

    def __init__(self, clock: Any, unstarted: Unstarted, bench: Callable[[str], bool],
                 registry: CollectorRegistry | None = None, count: int = DEFAULT_COUNT,
                 min_wait: float = DEFAULT_MIN_WAIT, factor: float = DEFAULT_FACTOR):
        self.clock = clock
        self.unstarted = unstarted
        self.bench = bench
        self.count = count
        self.min_wait = min_wait
        self.factor = factor
        #: model -> the latest first-byte times, in seconds
        self._recent: dict[str, deque[float]] = {}
        #: model -> replica -> when it last sent a first byte
        self._answered: dict[str, dict[str, float]] = {}
        self.stalled = Counter(
            "llmgw_gateway_replicas_stalled", "Replicas taken out of rotation because requests "
            "waited on them for a first byte while other replicas of the model answered.",
            ["model"], registry=registry)

    def answered(self, replica_id: str, call: Any) -> None:
        """
        C{replica_id} sent the first byte of C{call}'s answer (an
        L{IWaiting}).
        """
        now = self.clock.seconds()
        model: str = getattr(call, "model", "")
        recent = self._recent.get(model)
        if recent is None:
            recent = self._recent[model] = deque(maxlen=RECENT)
        recent.append(max(0.0, now - getattr(call, "sent_at", now)))
        answered = self._answered.get(model)
        if answered is None:
            # Made once a model, not a request (setdefault would make one each time).
            answered = self._answered[model] = {}
        answered[replica_id] = now

    def bound(self, model: str) -> float:
        """
        Seconds a request of C{model} may wait for its first byte before it
        counts against its replica.
        """
        recent = self._recent.get(model)
        typical = median(recent) if recent else 0.0
        return max(self.min_wait, self.factor * typical)

    def forget(self, keep: set[str]) -> None:
        """
        Drop what is known of replicas not in C{keep} (left the table).
        """
        for answered in self._answered.values():
            for replica_id in [r for r in answered if r not in keep]:
                del answered[replica_id]

    def check(self) -> list[str]:
        """
        Bench every stalled replica and move its waiting requests; returns
        the replicas benched.
        """
        now = self.clock.seconds()
        benched = []
        for replica_id, calls in self.unstarted.by_replica():
            models: dict[str, int] = {}
            for call in calls:
                model = getattr(call, "model", "")
                if now - getattr(call, "sent_at", now) >= self.bound(model):
                    models[model] = models.get(model, 0) + 1
            for model, late in models.items():
                if late >= self.count and self._others_answered(model, replica_id, now):
                    self._stalled(replica_id, model, late, now)
                    benched.append(replica_id)
                    break
        return benched

    def _others_answered(self, model: str, replica_id: str, now: float) -> bool:
        bound = self.bound(model)
        return any(r != replica_id and now - at <= bound
                   for r, at in self._answered.get(model, {}).items())

    def _stalled(self, replica_id: str, model: str, late: int, now: float) -> None:
        self.bench(replica_id)
        self.stalled.labels(model).inc()
        self.log.warn("replica {replica} of {model}: {late} requests waited over {bound:.1f}s for "
                      "a first byte while other replicas answered; out of rotation, its "
                      "requests not answered yet go elsewhere", replica=replica_id, model=model,
                      late=late, bound=self.bound(model))
        self.unstarted.move(replica_id)


class _Checks(Periodic):
    """
    Runs C{check} every C{interval} seconds on C{clock} while running. Unlike
    Twisted's C{TimerService}, stopping it when it never started (its
    parent's start failed part-way: a port in use) is a no-op.
    """

    log = Logger(namespace="llmgw.gateway.firstbyte")
    failed = "checking for stalled replicas failed; the next check runs as usual"

    def __init__(self, interval: float, check: Any, clock: Any):
        self.interval = interval
        self.check = check
        self.clock = clock

    def tick(self) -> None:
        self.check()


def watch_service(watch: FirstByteWatch, clock: Any) -> Service:
    """
    The service that runs C{watch.check} once a second; a failed check is
    logged and the next one runs.
    """
    return _Checks(CHECK_INTERVAL, watch.check, clock)
