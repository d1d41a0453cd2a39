"""
The agent's engine scraper (DESIGN §15): about once a
second it GETs the metrics endpoint of every ready (or draining) shard whose profile has
one, normalises what the engine exports (L{llmgw.engines.normalise}) and
keeps the newest sample per shard for the next heartbeat.

Each scrape is bounded: at most one in flight per shard, an answer within
C{timeout} seconds and C{max_bytes} bytes or it is abandoned (the
connection is dropped), parsed on the reactor only once whole. A failed
scrape keeps the previous figures, records why, and the figures' age keeps
growing: the control plane sees staleness, never a stale figure passed off
as fresh. Scraping never changes a shard's state; health checks do that.

The scraper also watches each shard's progress (L{Standstill}): while a
sample says requests run, how long its generated-token and prompt-token
counters have stayed flat (a failed scrape counts as flat). When that
reaches the shard's C{stall_after_s} it calls C{on_stall} once per
standstill, so that the agent heartbeats at once rather than at its next
interval: a wedged replica leaves routing within a scrape of its threshold.
"""

from __future__ import annotations

import io
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twisted.internet import defer, error
from twisted.internet.endpoints import HostnameEndpoint, TCP4ClientEndpoint, TCP6ClientEndpoint
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IAgentEndpointFactory
from zope.interface import implementer

from llmgw.agent.shard import DRAINING, READY, Shard
from llmgw.agent.supervisor import Supervisor
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.engines import SIGNALS, MetricsError, normalise
from llmgw.periodic import Periodic
from llmgw.routing import EngineSignals

#: Seconds between scrapes of one shard.
SCRAPE_INTERVAL = 1.0
#: Longest a scrape may take, connect to last byte.
SCRAPE_TIMEOUT = 0.8
#: Most bytes read from one metrics response (vLLM's is ~100 KiB).
SCRAPE_MAX_BYTES = 2 * 1024 * 1024


class ResponseTooLarge(Exception):
    pass


class _CappedBody(Protocol):
    def __init__(self, finished: defer.Deferred[bytes], limit: int):
        self.finished = finished
        self.limit = limit
        self.parts: list[bytes] = []
        self.size = 0

    def dataReceived(self, data: bytes) -> None:
        if self.finished.called:
            return
        self.size += len(data)
        if self.size > self.limit:
            self.transport.stopProducing()  # type: ignore[union-attr]
            self.finished.errback(ResponseTooLarge(f"the response is over {self.limit} bytes"))
            return
        self.parts.append(data)

    def connectionLost(self, reason: Failure = Failure(error.ConnectionDone())) -> None:  # noqa: B008
        if self.finished.called:
            return
        from twisted.web.client import ResponseDone
        from twisted.web.http import PotentialDataLoss

        if reason.check(ResponseDone, PotentialDataLoss):
            self.finished.callback(b"".join(self.parts))
        else:
            self.finished.errback(reason)


class _Discard(Protocol):
    def dataReceived(self, data: bytes) -> None:
        pass

    def connectionLost(self, reason: Failure = Failure(error.ConnectionDone())) -> None:  # noqa: B008
        pass


@implementer(IAgentEndpointFactory)
class _LiteralFirstEndpoints:
    """
    Endpoints for the scraper's URLs. Shards are reached at an address the
    agent advertises, nearly always an IP literal: that gets a plain TCP
    endpoint, with no name resolution in the thread pool once a second per
    shard (which a loaded machine can delay past the scrape's bound). A name
    goes through L{HostnameEndpoint}.
    """

    def __init__(self, reactor: Any, timeout: float):
        self.reactor = reactor
        self.timeout = timeout

    def endpointForURI(self, uri: Any) -> Any:  # noqa: N802
        host = uri.host.decode("ascii")
        literal = host.strip("[]")
        try:
            ip = ipaddress.ip_address(literal)
        except ValueError:
            return HostnameEndpoint(self.reactor, uri.host, uri.port, timeout=self.timeout)
        if ip.version == 6:
            return TCP6ClientEndpoint(self.reactor, literal, uri.port, timeout=self.timeout)
        return TCP4ClientEndpoint(self.reactor, literal, uri.port, timeout=self.timeout)


class HttpFetcher:
    """
    C{get(url)}: a GET whose body must be 200, within C{timeout} seconds and
    C{max_bytes}. Connections are kept alive between scrapes.
    """

    def __init__(self, reactor: Any, timeout: float = SCRAPE_TIMEOUT,
                 max_bytes: int = SCRAPE_MAX_BYTES):
        from twisted.web.client import Agent, HTTPConnectionPool

        class QuietPool(HTTPConnectionPool):
            class _factory(HTTPConnectionPool._factory):  # type: ignore[valid-type,misc]
                noisy = False

        self.reactor = reactor
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.pool = QuietPool(reactor, persistent=True)
        self.pool.maxPersistentPerHost = 1
        self.pool.cachedConnectionTimeout = 30
        self.agent = Agent.usingEndpointFactory(
            reactor, _LiteralFirstEndpoints(reactor, timeout), pool=self.pool
        )

    def get(self, url: str) -> defer.Deferred[bytes]:
        return self.call(b"GET", url)

    def call(self, method: bytes, url: str, data: bytes | None = None) -> defer.Deferred[bytes]:
        """
        As L{get}, with another method and an optional JSON body C{data}.
        """
        from twisted.web.client import FileBodyProducer
        from twisted.web.http_headers import Headers

        producer = FileBodyProducer(io.BytesIO(data)) if data is not None else None
        headers = Headers({b"Content-Type": [b"application/json"]}) if data is not None else None
        d: defer.Deferred[Any] = self.agent.request(method, url.encode(), headers, producer)

        def body(response: Any) -> defer.Deferred[bytes]:
            if response.code != 200:
                response.deliverBody(_Discard())
                raise ValueError(f"HTTP {response.code}")
            holder: dict[str, Any] = {}

            def cancel(_: defer.Deferred[bytes]) -> None:
                transport = holder.get("transport")
                if transport is not None:
                    transport.stopProducing()

            finished: defer.Deferred[bytes] = defer.Deferred(cancel)
            proto = _CappedBody(finished, self.max_bytes)
            response.deliverBody(proto)
            holder["transport"] = proto.transport
            return finished

        d.addCallback(body)
        d.addTimeout(self.timeout, self.reactor)
        return d

    def close(self) -> defer.Deferred[None]:
        return self.pool.closeCachedConnections()  # type: ignore[no-any-return]


@dataclass
class Standstill:
    """
    How long a shard's progress counters (generated and prompt tokens) have
    been flat while requests ran, from its scrapes. The standstill counts
    from the first scrape that saw the counters at their present values (a
    lower bound: the last token came at most one scrape before), and is
    measured up to the latest scrape; a failed scrape extends it (an engine
    that stops answering while it had requests running counts as flat).
    C{flat_for_s} is C{None} while the shard is not watched: nothing
    running, or no generated-token counter.
    """

    mark: tuple[float | None, float | None] | None = None
    since: float = 0.0
    flat_for_s: float | None = None
    #: C{on_stall} was called for this standstill.
    reported: bool = False

    def scraped(self, signals: EngineSignals, at: float) -> None:
        """
        A good scrape started at C{at} read C{signals}.
        """
        if signals.generated_tokens is None or not signals.running:
            self.mark, self.flat_for_s, self.reported = None, None, False
            return
        mark = (signals.generated_tokens, signals.prefix_cache_queries)
        if mark != self.mark:
            self.mark, self.since, self.reported = mark, at, False
        self.flat_for_s = at - self.since

    def failed(self, at: float) -> None:
        """
        A scrape at C{at} got no figures: a watched standstill goes on.
        """
        if self.mark is not None:
            self.flat_for_s = at - self.since

    def reached(self, stall_after_s: float) -> bool:
        """
        The standstill just reached C{stall_after_s} (true once per
        standstill; never for 0).
        """
        if (stall_after_s <= 0 or self.reported or self.flat_for_s is None
                or self.flat_for_s < stall_after_s):
            return False
        self.reported = True
        return True


@dataclass
class Sample:
    """
    A shard's newest figures (C{None} before the first good scrape), on the
    agent's clock, and why the latest scrape failed ("" if it did not).
    """

    signals: EngineSignals | None = None
    error: str = ""
    scrapes: int = 0
    failures: int = 0
    standstill: Standstill = field(default_factory=Standstill)


def _describe(failure: Failure) -> str:
    e = failure.value
    if isinstance(e, defer.TimeoutError | error.TimeoutError | defer.CancelledError):
        return "no answer in time"
    return str(e) or type(e).__name__


class Scraper(Periodic):
    """
    Scrapes the supervisor's ready shards. C{host()} is the address to dial
    (the one the agent advertises); C{fetch(url)} returns a Deferred of the
    body (L{HttpFetcher.get}).
    """

    log = Logger()
    failed = "an engine scrape pass failed; the next one goes on"

    def __init__(
        self,
        clock: Any,
        supervisor: Supervisor,
        fetch: Callable[[str], defer.Deferred[bytes]],
        host: Callable[[], str] = lambda: "127.0.0.1",
        interval: float = SCRAPE_INTERVAL,
    ):
        self.clock = clock
        self.supervisor = supervisor
        self.fetch = fetch
        self.host = host
        self.interval = interval
        self.samples: dict[str, Sample] = {}
        #: Called with a shard id when its standstill reaches its threshold.
        self.on_stall: Callable[[str], None] = lambda shard_id: None
        #: Whether a shard sleeps and the path that wakes it, for heartbeats
        #: (L{llmgw.agent.sleep.Sleeper.state_of}).
        self.sleep_state: Callable[[str], tuple[bool | None, str]] = lambda shard_id: (None, "")
        #: Why a sleep the control plane asked of a shard did not happen,
        #: told once (L{llmgw.agent.sleep.Sleeper.take_refusal}).
        self.sleep_refused: Callable[[str], str] = lambda shard_id: ""
        self._in_flight: set[str] = set()
        #: One-off checks due when a standstill would reach its threshold
        #: between two scrapes.
        self._checks: dict[str, IDelayedCall] = {}

    def stopService(self) -> Any:
        for check in self._checks.values():
            if check.active():
                check.cancel()
        self._checks.clear()
        return super().stopService()

    def tick(self) -> None:
        """
        Start a scrape of every ready shard with a metrics path that has none
        in flight; forget the samples of shards that are no longer live.
        """
        live: set[str] = set()
        for shard in self.supervisor.live_shards():
            live.add(shard.shard_id)
            # Draining shards still serve their requests in flight: keep their figures fresh.
            if shard.state not in (READY, DRAINING) or not shard.spec.metrics_path or shard.stopping:
                continue
            if shard.shard_id in self._in_flight:
                continue
            self._scrape(shard)
        for shard_id in [s for s in self.samples if s not in live]:
            del self.samples[shard_id]
            check = self._checks.pop(shard_id, None)
            if check is not None and check.active():
                check.cancel()

    def _scrape(self, shard: Shard) -> None:
        from llmgw.addresses import format_address

        spec = shard.spec
        url = f"http://{format_address(self.host(), spec.port)}{spec.metrics_path}"
        self._in_flight.add(spec.shard_id)
        # The standstill is measured to when the scrape started: the figures
        # are at least that fresh.
        started = self.clock.seconds()
        d = defer.maybeDeferred(self.fetch, url)
        d.addCallbacks(lambda body: self._scraped(shard, body, None, started),
                       lambda f: self._scraped(shard, b"", f, started))
        d.addErrback(lambda f: self.log.failure("recording a scrape of {shard} failed",
                                                f, shard=spec.shard_id))

    def _scraped(self, shard: Shard, body: bytes, failure: Failure | None,
                 started: float | None = None) -> None:
        shard_id = shard.shard_id
        self._in_flight.discard(shard_id)
        if not shard.live:
            return
        sample = self.samples.setdefault(shard_id, Sample())
        sample.scrapes += 1
        problem = ""
        if failure is not None:
            problem = _describe(failure)
        else:
            try:
                sample.signals = normalise(
                    body.decode("utf-8", "replace"), shard.spec.metric_names, self.clock.seconds()
                )
            except MetricsError as e:
                problem = f"the metrics could not be read: {e}"
        if problem:
            sample.failures += 1
            if not sample.error:
                # Once per run of failures, not once a second.
                self.log.warn("scraping the metrics of shard {shard} failed: {error}; its "
                              "figures age until a scrape succeeds", shard=shard_id, error=problem)
        elif sample.error:
            self.log.info("scraping the metrics of shard {shard} works again", shard=shard_id)
        sample.error = problem
        at = self.clock.seconds() if started is None else started
        if problem:
            sample.standstill.failed(at)
        elif sample.signals is not None:
            sample.standstill.scraped(sample.signals, at)
        self._judge(shard, sample)

    def _judge(self, shard: Shard, sample: Sample) -> None:
        """
        Report a standstill that reached the shard's threshold, or check
        again exactly when it would if that comes before the next scrape.
        """
        shard_id, stall_after_s = shard.shard_id, shard.spec.stall_after_s
        still = sample.standstill
        if still.reached(stall_after_s):
            self.log.warn("shard {shard} has had requests running with its token counters flat "
                          "for {flat:.1f}s (stall_after_s {stall:g}): telling the control plane "
                          "now", shard=shard_id, flat=still.flat_for_s, stall=stall_after_s)
            self.on_stall(shard_id)
            return
        if still.flat_for_s is None or still.reported or stall_after_s <= 0:
            return
        due = still.since + stall_after_s - self.clock.seconds()
        if due <= self.interval and shard_id not in self._checks:
            self._checks[shard_id] = self.clock.callLater(max(0.0, due), self._check, shard)

    def _check(self, shard: Shard) -> None:
        # A failing engine needs no scrape to stay flat; one that answers
        # gets a scrape whose figures decide.
        self._checks.pop(shard.shard_id, None)
        sample = self.samples.get(shard.shard_id)
        if sample is None or not shard.live or shard.stopping:
            return
        if sample.error:
            sample.standstill.failed(self.clock.seconds())
            self._judge(shard, sample)
        elif shard.shard_id not in self._in_flight:
            self._scrape(shard)

    def heartbeat_signals(self) -> list[pb.ShardSignals]:
        """
        The samples for the next heartbeat, each with its age.
        """
        now = self.clock.seconds()
        out = []
        # The adapters each engine holds (a test's fake supervisor has none).
        weights = getattr(self.supervisor, "weights", None)
        for shard_id, sample in sorted(self.samples.items()):
            msg = pb.ShardSignals(shard_id=shard_id, error=sample.error)
            shard = self.supervisor.shards.get(shard_id)
            if shard is not None and weights is not None:
                msg.adapters.extend(weights.adapters.held(shard.spec))
            if sample.standstill.flat_for_s is not None:
                msg.flat_for_s = sample.standstill.flat_for_s
            sleeping, wake_path = self.sleep_state(shard_id)
            if sleeping is not None:
                msg.sleeping, msg.wake_path = sleeping, wake_path
            msg.sleep_refused = self.sleep_refused(shard_id)
            if sample.signals is not None:
                msg.age_s = sample.signals.age(now)
                for name in SIGNALS:
                    value = getattr(sample.signals, name)
                    if value is not None:
                        setattr(msg, name, value)
            out.append(msg)
        return out

