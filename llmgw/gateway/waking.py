"""
Waking sleeping replicas on demand (DESIGN §22).

A replica whose engine sleeps (L{llmgw.routing.EngineSignals.sleeping})
stays in the routing table. Routing prefers awake replicas: a sleeping one
is taken only when no awake one can take the request, so a wake is paid
only when the awake capacity is used up. Two kinds of sleep:

  - one a request wakes by itself (llama.cpp, no C{wake_path}): the
    replica is routable, last;
  - one that needs a call (vLLM's C{/wake_up}, SGLang's resume): it takes
    nothing until woken. When its model's admission queue holds requests
    that no awake replica can take, L{Waker} POSTs the wake call to one
    sleeping replica (one at a time per model), and on its answer counts
    the replica awake and has the queue dispatch.

The gateway learns of the wake before the control plane does (the agent
sees it at its next look and heartbeats at once): until the table carries
signals sampled well after the wake (L{AGENT_LOOK_S}), the gateway's own
word holds, so a fresh sample that says the replica sleeps again (the
agent put it back to sleep) wins. Each wake is timed in C{llmgw_gateway_wake_seconds}.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

from prometheus_client import CollectorRegistry, Histogram
from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmgw.routing import Route
from llmgw.untrusted import clip

#: What L{Waker.state} says of a route.
AWAKE: Final = 0
#: Asleep, and a request wakes it itself (routable, after awake ones).
WAKES_ON_REQUEST: Final = 1
#: Asleep until a wake call answers (not routable).
NEEDS_WAKE: Final = 2

#: Longest a wake call may take (vLLM's wake from level 2 reloads weights).
WAKE_TIMEOUT_S: Final = 300.0
#: Seconds after a wake during which signals saying the replica sleeps
#: may predate it: the agent looks at an engine's sleep once a second,
#: apart from its metrics scrape that dates the signals.
AGENT_LOOK_S: Final = 2.0
#: Wake times' histogram buckets, in seconds: from a resume in memory to a
#: reload of weights from disk.
WAKE_BUCKETS: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def sleeping(r: Route) -> bool:
    """Whether C{r}'s newest signals say its engine sleeps."""
    return r.signals is not None and bool(r.signals.sleeping)


class _Drain(Protocol):
    """Reads an answer's body and drops it (nothing of it is kept)."""

    def __init__(self, done: defer.Deferred[None]):
        self.done = done

    def dataReceived(self, data: bytes) -> None:  # noqa: N802
        pass

    def connectionLost(self, reason: Failure | None = None) -> None:  # noqa: N802
        if not self.done.called:
            self.done.callback(None)


def http_post(reactor: Any) -> Callable[[str, bytes], defer.Deferred[None]]:
    """
    C{post(url, body)}: a POST whose answer must be a 2xx, its body read
    and dropped.
    """
    from twisted.web.client import Agent, FileBodyProducer, HTTPConnectionPool
    from twisted.web.http_headers import Headers

    pool = HTTPConnectionPool(reactor, persistent=False)
    agent = Agent(reactor, pool=pool, connectTimeout=10)

    def post(url: str, body: bytes) -> defer.Deferred[None]:
        import io

        d: defer.Deferred[Any] = agent.request(
            b"POST", url.encode("ascii"), Headers({b"Content-Type": [b"application/json"]}),
            FileBodyProducer(io.BytesIO(body)),
        )

        def answered(response: Any) -> defer.Deferred[None]:
            done: defer.Deferred[None] = defer.Deferred()
            response.deliverBody(_Drain(done))
            if not 200 <= response.code < 300:
                def refuse(_: None) -> None:
                    raise ValueError(f"HTTP {response.code}")
                done.addCallback(refuse)
            return done

        return d.addCallback(answered)

    return post


class Waker:
    """
    The gateway's word on which replicas it woke, and the wake calls.

    @param post: C{post(url, body)} fires when the engine answered the
        wake call with a 2xx (L{http_post}).
    @param on_awake: called with a model when one of its replicas woke
        (the admission queue dispatches its waiters).
    @param label: the model's metric label (bounded, as the gateway's).
    """

    log = Logger()

    def __init__(self, clock: IReactorTime, post: Callable[[str, bytes], defer.Deferred[Any]],
                 registry: CollectorRegistry | None = None,
                 label: Callable[[str], str] = lambda model: model,
                 on_awake: Callable[[str], None] = lambda model: None,
                 timeout: float = WAKE_TIMEOUT_S):
        self.clock = clock
        self.post = post
        self.label = label
        self.on_awake = on_awake
        self.timeout = timeout
        #: replica -> when this gateway's wake call was answered
        self.woken: dict[str, float] = {}
        #: model -> the replica being woken for it
        self.waking: dict[str, str] = {}
        self.wakes = 0
        self.failed = 0
        self.histogram = Histogram(
            "llmgw_gateway_wake_seconds",
            "Time from a gateway's wake call to a sleeping replica to the engine's answer, "
            "per model and outcome (woken, failed).",
            ["model", "outcome"], registry=registry, buckets=WAKE_BUCKETS,
        )

    def state(self, r: Route) -> int:
        """
        L{AWAKE}, L{WAKES_ON_REQUEST} or L{NEEDS_WAKE}.
        """
        s = r.signals
        if s is None or not s.sleeping:
            return AWAKE
        at = self.woken.get(r.replica_id)
        if at is not None and at + AGENT_LOOK_S >= s.sampled_at:
            return AWAKE
        return NEEDS_WAKE if s.wake_path else WAKES_ON_REQUEST

    def asleep(self, r: Route) -> bool:
        """Whether C{r} takes nothing until woken (L{NEEDS_WAKE})."""
        return self.state(r) == NEEDS_WAKE

    def needed(self, model: str, routes: Sequence[Route]) -> bool:
        """
        C{model}'s awake replicas cannot take its requests: wake one of its
        sleeping ones that needs a call, unless one is being woken. Returns
        whether a wake is under way.
        """
        if model in self.waking:
            return True
        for r in routes:
            if not r.draining and self.state(r) == NEEDS_WAKE:
                self.wake(r)
                return True
        return False

    def wake(self, r: Route) -> None:
        """
        POST C{r}'s wake call; its answer makes it awake here and tells
        C{on_awake}.
        """
        assert r.signals is not None
        model, rid = r.model, r.replica_id
        self.waking[model] = rid
        started = self.clock.seconds()
        self.log.info("{model}: waking sleeping replica {replica} for requests no awake replica can "
                      "take", model=clip(model), replica=rid)
        d = defer.maybeDeferred(self.post, f"http://{r.address}{r.signals.wake_path}", b"{}")
        d.addTimeout(self.timeout, self.clock)

        def done(result: Any) -> None:
            self.waking.pop(model, None)
            now = self.clock.seconds()
            took = now - started
            if isinstance(result, Failure):
                self.failed += 1
                self.histogram.labels(self.label(model), "failed").observe(took)
                self.log.warn("{model}: waking replica {replica} failed after {took:.3f}s: {why}; "
                              "its requests wait, and the next look tries again", model=clip(model),
                              replica=rid, took=took, why=result.getErrorMessage())
                return
            self.wakes += 1
            self.woken[rid] = now
            self.histogram.labels(self.label(model), "woken").observe(took)
            self.log.info("{model}: replica {replica} woke in {took:.3f}s", model=clip(model),
                          replica=rid, took=took)
            self.on_awake(model)

        d.addBoth(done)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop what is known of replicas not in C{keep} (gone from the table)."""
        kept = set(keep)
        for rid in [r for r in self.woken if r not in kept]:
            del self.woken[rid]
