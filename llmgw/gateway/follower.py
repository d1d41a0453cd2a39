"""
A routing table that follows the control plane's published one, for a
gateway running in its own process.

L{FollowerTable} reads C{GET /api/v1/routes} (the wire form of
L{llmgw.routing.RoutingTable}, see L{llmgw.routing.snapshot_from_json}) and
swaps in each new L{RoutingSnapshot}: the same projection the embedded
gateway routes by, so both follow one set of rules. Once it holds a table it
asks with C{?since=REVISION}, which the control plane holds until the table
changes (a long-poll, at most L{LONG_POLL_MAX_S} seconds), so a change
reaches the gateway as soon as it is published.

When a read fails the table keeps the last snapshot (the gateway fails
static: replicas keep serving while the control plane is away), logs it and
shows it in its metrics; L{FollowerService} retries with a backoff.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from zope.interface import implementer

from llmgw.routing import (
    LONG_POLL_MAX_S,
    IRoutingTable,
    Route,
    RoutesDataError,
    RoutingSnapshot,
    snapshot_from_json,
)

#: How often, at most, a control plane that stays unreachable is logged again.
REPEAT_WARNING_S = 60.0
#: Largest routes document read, in bytes (10,000 routes take about 1.5 MB).
MAX_ROUTES_BODY = 32 * 1024 * 1024
#: Problems with single routes logged per answer; the rest are counted.
PROBLEMS_LOGGED = 5
ROUTES_PATH = "/api/v1/routes"


class RoutesFetchError(Exception):
    """
    The control plane answered, but not with a routes document.
    """


def routes_http_client(reactor: Any, tls: Any = None) -> tuple[Any, Any]:
    """
    The HTTP client a follower reads the routes with, and the connection
    pool it keeps (closed when the follower stops).

    The one place that builds it, so that a client certificate for an
    authenticated admin API has one place to go: C{tls} is an
    C{IPolicyForHTTPS} (L{llmgw.tlsconf.options.ClientTLSPolicy} for an admin
    API behind mutual TLS).
    """
    import treq
    from twisted.web.client import Agent, BrowserLikePolicyForHTTPS, HTTPConnectionPool

    pool = HTTPConnectionPool(reactor, persistent=True)
    policy = tls if tls is not None else BrowserLikePolicyForHTTPS()
    return treq.client.HTTPClient(Agent(reactor, contextFactory=policy, pool=pool)), pool


class _BoundedBody(Protocol):
    """
    Collects a response body up to C{limit} bytes; past it, or when its
    Deferred is cancelled, the connection is dropped.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.parts: list[bytes] = []
        self.size = 0
        self.done: Deferred[bytes] = Deferred(lambda d: self._stop())

    def _stop(self) -> None:
        # A response body's transport is a producer: stopping it drops the
        # connection.
        transport: Any = self.transport
        if transport is not None:
            transport.stopProducing()

    def dataReceived(self, data: bytes) -> None:
        if self.done.called:
            return
        self.size += len(data)
        if self.size > self.limit:
            self._stop()
            self.done.errback(RoutesFetchError(f"the routes document is over {self.limit} bytes"))
            return
        self.parts.append(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self.done.called:
            return
        if reason.check(ResponseDone, PotentialDataLoss):
            self.done.callback(b"".join(self.parts))
        else:
            self.done.errback(reason)


def read_body(response: Any, limit: int = MAX_ROUTES_BODY) -> Deferred[bytes]:
    """
    The body of C{response}, at most C{limit} bytes. Cancelling the
    Deferred drops the connection.
    """
    body = _BoundedBody(limit)
    response.deliverBody(body)
    return body.done


class _FollowerCollector(Collector):
    def __init__(self, table: FollowerTable):
        self._table = table

    def collect(self) -> Iterator[GaugeMetricFamily]:
        t = self._table
        yield GaugeMetricFamily(
            "llmgw_gateway_control_plane_reachable",
            "1 when the last read of the control plane's routes succeeded",
            value=1 if t.reachable else 0,
        )
        yield GaugeMetricFamily(
            "llmgw_gateway_routing_table_age_seconds",
            "Seconds since the control plane last answered a read of the routes (-1 before "
            "the first answer); a quiet table reads up to the long-poll's 30 s",
            value=t.age() if t.loaded else -1,
        )
        yield GaugeMetricFamily(
            "llmgw_gateway_routing_table_revision",
            "Revision of the control plane's routing table this gateway holds",
            value=t.snapshot.revision,
        )
        yield GaugeMetricFamily(
            "llmgw_gateway_routes",
            "Ready replicas in the routing table",
            value=len(t.snapshot),
        )


@implementer(IRoutingTable)
class FollowerTable:
    """
    The routing table of a standalone gateway: the last snapshot read from
    the control plane whose admin API is at C{admin_url}.

    Until the first read succeeds every model counts as known (requests get
    503 with C{Retry-After}, not 404), since nothing is known yet.

    @param http: a treq-like client (C{get(url)}); by default
        L{routes_http_client}'s.
    @param timeout: seconds a read may take beyond the long-poll's hold.
    """

    log = Logger()

    def __init__(
        self,
        clock: Any,
        admin_url: str,
        http: Any = None,
        timeout: float = 5.0,
        registry: CollectorRegistry | None = None,
        tls: Any = None,
        hold: float = LONG_POLL_MAX_S,
    ):
        self.clock = clock
        self.admin_url = admin_url.rstrip("/")
        self._pool: Any = None
        if http is None:
            http, self._pool = routes_http_client(clock, tls)
        self.http = http
        self.timeout = timeout
        self.hold = hold
        self.snapshot = RoutingSnapshot()
        self.loaded = False
        self.reachable = False
        self.last_success: float | None = None
        self.failures_in_a_row = 0
        # After a failure the next read asks for the whole table at once: a
        # control plane that restarted counts its revisions from zero again.
        self._resync = True
        self._last_warning = -REPEAT_WARNING_S
        self.listeners: list[Callable[[RoutingSnapshot], None]] = []
        registry = registry if registry is not None else CollectorRegistry()
        self.poll_failures = Counter(
            "llmgw_gateway_control_poll_failures",
            "Reads of the control plane's routes that failed",
            registry=registry,
        )
        registry.register(_FollowerCollector(self))

    # IRoutingTable

    def routes(self, model: str) -> Sequence[Route]:
        return self.snapshot.routes(model)

    def models(self) -> list[str]:
        return self.snapshot.models()

    def knows_model(self, model: str) -> bool:
        return self.snapshot.knows_model(model) or not self.loaded

    def policy(self, model: str) -> str | None:
        return self.snapshot.policy(model)

    def age(self) -> float:
        if self.last_success is None:
            return 0.0
        return float(self.clock.seconds() - self.last_success)

    def close(self) -> Deferred[None] | None:
        """
        Close the connections this table keeps to the admin API.
        """
        if self._pool is None:
            return None
        return self._pool.closeCachedConnections()  # type: ignore[no-any-return]

    # reading

    def url(self) -> str:
        """
        What the next read asks for: the whole table, or (once one is held
        and nothing failed since) the next revision after it.
        """
        if self._resync or not self.loaded:
            return self.admin_url + ROUTES_PATH
        return f"{self.admin_url}{ROUTES_PATH}?since={self.snapshot.revision}"

    def poll(self) -> Deferred[bool]:
        """
        Read the routes once (held by the control plane until they change,
        when the table is current) and swap in the answer; on failure keep
        the old table. Fires with whether the read succeeded; never fails,
        except with L{CancelledError} when cancelled.
        """
        url = self.url()
        cancelled = False
        current: list[Deferred[Any]] = []

        def cancel(_: Deferred[bool]) -> None:
            nonlocal cancelled
            cancelled = True
            current[-1].cancel()

        outer: Deferred[bool] = Deferred(cancel)
        request: Deferred[Any] = self.http.get(url)
        request.addTimeout(self.hold + self.timeout, self.clock)
        current.append(request)

        def got_response(response: Any) -> Deferred[tuple[int, bytes]]:
            body = read_body(response)
            body.addTimeout(self.timeout, self.clock)
            current.append(body)
            return body.addCallback(lambda raw: (response.code, raw))

        def parse(answer: tuple[int, bytes]) -> tuple[RoutingSnapshot, list[str]]:
            code, body = answer
            if code != 200:
                raise RoutesFetchError(f"{url} answered HTTP {code}: {body[:200]!r}")
            try:
                data = json.loads(body)
            except ValueError as e:
                raise RoutesFetchError(f"{url} answered with malformed JSON: {e}") from None
            try:
                return snapshot_from_json(data, self.clock.seconds())
            except RoutesDataError as e:
                raise RoutesFetchError(f"{url} answered something that is not a routes document: {e}") from None

        def done(result: Any) -> None:
            if cancelled:  # the Deferred's own cancel answers the caller
                return
            if isinstance(result, Failure):
                self._failed(result)
                outer.callback(False)
            else:
                self._got(*result)
                outer.callback(True)

        request.addCallback(got_response)
        request.addCallback(parse)
        request.addBoth(done)
        return outer

    def _got(self, snapshot: RoutingSnapshot, problems: list[str]) -> None:
        for p in problems[:PROBLEMS_LOGGED]:
            self.log.warn("control plane's routes: {problem}; entry skipped", problem=p)
        if len(problems) > PROBLEMS_LOGGED:
            self.log.warn(
                "control plane's routes: {n} more bad entries skipped",
                n=len(problems) - PROBLEMS_LOGGED,
            )
        if self.failures_in_a_row:
            self.log.info(
                "control plane at {url} reachable again after {n} failed reads; "
                "{routes} routes at revision {revision}",
                url=self.admin_url,
                n=self.failures_in_a_row,
                routes=len(snapshot),
                revision=snapshot.revision,
            )
        elif not self.loaded:
            self.log.info(
                "routing table loaded from {url}: {routes} routes, {models} models, revision {revision}",
                url=self.admin_url,
                routes=len(snapshot),
                models=len(snapshot.models()),
                revision=snapshot.revision,
            )
        changed = not self.loaded or snapshot.revision != self.snapshot.revision
        self.snapshot = snapshot
        self.loaded = True
        self.reachable = True
        self._resync = False
        self.failures_in_a_row = 0
        self.last_success = self.clock.seconds()
        if not changed:
            return
        for listener in self.listeners:
            try:
                listener(snapshot)
            except Exception:
                self.log.failure("routing table listener {listener!r} failed", listener=listener)

    def _failed(self, reason: Failure) -> None:
        self.poll_failures.inc()
        self.reachable = False
        self._resync = True
        self.failures_in_a_row += 1
        now = self.clock.seconds()
        if self.failures_in_a_row == 1 or now - self._last_warning >= REPEAT_WARNING_S:
            self._last_warning = now
            if self.loaded:
                self.log.warn(
                    "control plane at {url} unreachable ({error}); failing static: keeping "
                    "the {routes} routes known {age:.0f} s ago ({n} failed reads so far)",
                    url=self.admin_url,
                    error=reason.getErrorMessage(),
                    routes=len(self.snapshot),
                    age=self.age(),
                    n=self.failures_in_a_row,
                )
            else:
                self.log.warn(
                    "control plane at {url} unreachable ({error}); no routing table yet, "
                    "answering 503 ({n} failed reads so far)",
                    url=self.admin_url,
                    error=reason.getErrorMessage(),
                    n=self.failures_in_a_row,
                )


class FollowerService(Service):
    """
    Keeps one read of C{table}'s routes outstanding while running: the next
    starts when one answers (at least C{min_gap} seconds after the last
    began), or after a failure waits C{retry} seconds, doubled on each
    failure in a row up to C{max_retry}, with up to C{jitter} of it added at
    random so that many gateways do not retry in step.

    C{stopService} cancels the read in flight and the retry timer, so a
    stopped follower leaves nothing behind on its reactor.
    """

    def __init__(
        self,
        table: FollowerTable,
        retry: float = 2.0,
        max_retry: float = 30.0,
        min_gap: float = 0.1,
        jitter: float = 0.2,
        rng: random.Random | None = None,
    ):
        self.table = table
        self.retry = retry
        self.max_retry = max(retry, max_retry)
        self.min_gap = min_gap
        self.jitter = jitter
        self.rng = rng if rng is not None else random.Random()
        self._reading: Deferred[bool] | None = None
        self._next: IDelayedCall | None = None
        self._started_at = 0.0

    def startService(self) -> None:
        super().startService()
        self._read()

    def retry_delay(self, failures: int) -> float:
        """
        Seconds to wait after C{failures} failed reads in a row.
        """
        base = min(self.max_retry, self.retry * 2 ** max(0, failures - 1))
        return base * (1 + self.jitter * self.rng.random())

    def _read(self) -> None:
        self._next = None
        if not self.running:
            return
        clock = self.table.clock
        self._started_at = clock.seconds()
        d = self._reading = self.table.poll()

        def answered(ok: bool) -> None:
            self._reading = None
            if not self.running:
                return
            if ok:
                delay = max(0.0, self._started_at + self.min_gap - clock.seconds())
            else:
                delay = self.retry_delay(self.table.failures_in_a_row)
            self._next = clock.callLater(delay, self._read)

        d.addCallback(answered)
        d.addErrback(lambda f: f.trap(CancelledError))

    def stopService(self) -> Any:
        super().stopService()
        nxt, self._next = self._next, None
        if nxt is not None and nxt.active():
            nxt.cancel()
        reading, self._reading = self._reading, None
        if reading is not None:
            reading.cancel()
        return self.table.close()
