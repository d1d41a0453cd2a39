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

hadmin (issue 14 item 5): the table may be given several admin URLs, the
members of an HA control plane. It reads from one; when a read fails it
tries the next at once, and backs off only once every member failed in a
row. A member that does not lead answers with a redirect to the leader,
which the HTTP client follows; the URL that answered (the leader's) is
where the watch stream is dialled and demand is posted.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from autobahn.twisted.websocket import WebSocketClientFactory, WebSocketClientProtocol
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import Protocol, connectionDone
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from zope.interface import implementer

from llmgw.routing import (
    LONG_POLL_MAX_S,
    IDemand,
    IRoutingTable,
    QueueLimits,
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
WATCH_PATH = "/api/v1/watch"
DEMAND_PATH = "/api/v1/demand"
#: Seconds between demand reports (the control plane keeps one for 5 s).
DEMAND_INTERVAL_S = 1.0
#: Largest answer to a demand report read, in bytes.
MAX_DEMAND_ANSWER = 64 * 1024
#: Seconds between the watch stream's pings; as long again without a pong
#: and the stream counts as lost.
WATCH_PING_S = 5.0


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
        admin_url: str | Sequence[str],
        http: Any = None,
        timeout: float = 5.0,
        registry: CollectorRegistry | None = None,
        tls: Any = None,
        hold: float = LONG_POLL_MAX_S,
    ):
        self.clock = clock
        urls = [admin_url] if isinstance(admin_url, str) else list(admin_url)
        if not urls:
            raise ValueError("a follower needs at least one admin URL")
        #: hadmin: the admin URLs to read from, tried in turn on failure.
        self.admin_urls = [u.rstrip("/") for u in urls]
        self._member = 0
        #: The admin URL that answered the last read, when a redirect (to
        #: the leader) took it elsewhere than the one asked.
        self.answered_by: str | None = None
        #: The TLS policy the watch stream dials with too.
        self.tls = tls
        #: Where the watch stream stands: the fleet revision and epoch of
        #: the last message, to resume from.
        self.watch_revision: int | None = None
        self.watch_epoch: str | None = None
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
        #: Whose count C{snapshot.revision} is: the admin URL a read asked,
        #: or C{"watch " + URL} for the watch stream (the leader's, while a
        #: member that does not lead answers reads with its own count).
        self._source: str | None = None
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

    def queue_limits(self, model: str) -> QueueLimits | None:
        return self.snapshot.queue_limits(model)

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

    @property
    def admin_url(self) -> str:
        """The admin URL reads go to now (L{admin_urls}, in turn on failure)."""
        return self.admin_urls[self._member]

    @property
    def leader_url(self) -> str:
        """
        Where the watch stream and demand go: the URL that answered the
        last read (the leader's, after a member's redirect), else
        L{admin_url}.
        """
        return self.answered_by or self.admin_url

    def untried_members(self) -> bool:
        """
        Whether the failures in a row have not yet covered every admin URL:
        the next read goes to another member at once.
        """
        return len(self.admin_urls) > 1 and self.failures_in_a_row % len(self.admin_urls) != 0

    def url(self) -> str:
        """
        What the next read asks for: the whole table, or (once one is held
        and nothing failed since) the next revision after it.
        """
        if self._resync or not self.loaded or self._source != self.admin_url:
            # A revision counted elsewhere means nothing to this member.
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
        asked = self.admin_url
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
            self._note_answerer(url, response)
            if url.startswith("https://") and self.answered_by is not None \
                    and not self.answered_by.startswith("https://"):
                read_body(response, 0).addErrback(lambda _: None)  # drop the connection
                raise RoutesFetchError(f"{url} was redirected to {self.answered_by}, out of TLS; refused")
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
                self._got(result[0], result[1], asked)
                outer.callback(True)

        request.addCallback(got_response)
        request.addCallback(parse)
        request.addBoth(done)
        return outer

    def _note_answerer(self, asked: str, response: Any) -> None:
        """
        Remember the admin URL behind the answer to C{asked}: the redirect
        target's, when a member sent the read to the leader.
        """
        from urllib.parse import urlsplit

        request = getattr(response, "request", None)
        final = getattr(request, "absoluteURI", None)
        if isinstance(final, bytes):
            final = final.decode("ascii", "replace")
        if not isinstance(final, str) or final == asked:
            # ha3: a member that does not lead answers the routes itself
            # and names the leader in a header (watch stream and demand).
            final = self._named_leader(asked, response)
            if final is None:
                self.answered_by = None
                return
        parts = urlsplit(final)
        base = f"{parts.scheme}://{parts.netloc}"
        if base != self.answered_by:
            self.log.info("control plane at {url} sent the gateway to {leader} (the leader)",
                          url=self.admin_url, leader=base)
        self.answered_by = base

    @staticmethod
    def _named_leader(asked: str, response: Any) -> str | None:
        """
        The leader's admin URL as a member that does not lead named it
        (C{x-llmgw-leader}), if it is an http(s) URL, and https when
        C{asked} was.
        """
        from urllib.parse import urlsplit

        headers = getattr(response, "headers", None)
        values = headers.getRawHeaders(b"x-llmgw-leader") if headers is not None else None
        if not values:
            return None
        url = values[0].decode("ascii", "replace").strip()
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return None
        if asked.startswith("https://") and parts.scheme != "https":
            return None
        return url

    def _got(self, snapshot: RoutingSnapshot, problems: list[str], source: str = "") -> None:
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
        # Revisions of two sources do not compare: a new source is a change.
        changed = not self.loaded or source != self._source or snapshot.revision != self.snapshot.revision
        self._source = source
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

    # following the watch stream

    def watch_url(self) -> str:
        """
        The watch stream's address, resuming after the last message held.
        """
        leader = self.leader_url
        base = "ws" + leader[len("http"):] if leader.startswith("http") else leader
        url = base + WATCH_PATH + "?only=routes"
        if self.watch_revision is not None and self.watch_epoch is not None:
            url += f"&since={self.watch_revision}&epoch={self.watch_epoch}"
        return url

    def apply_watch(self, message: Any) -> None:
        """
        Take one message of the watch stream: a C{snapshot} replaces the
        table, a C{routes} message the routes of the models it names.

        @raise RoutesDataError: the message is not what the stream sends.
        """
        if not isinstance(message, dict) or not isinstance(message.get("type"), str):
            raise RoutesDataError("a watch message is a JSON object with a type")
        kind = message["type"]
        now = self.clock.seconds()
        revision = message.get("revision")
        if kind == "snapshot":
            if not isinstance(message.get("epoch"), str):
                raise RoutesDataError("a snapshot carries the stream's epoch")
            self._got(*snapshot_from_json(message.get("routes"), now), source="watch " + self.leader_url)
            self.watch_epoch = message["epoch"]
        elif kind == "routes":
            models = message.get("models")
            routes_revision = message.get("routes_revision")
            if not isinstance(models, dict):
                raise RoutesDataError("a routes message carries models, an object")
            entries = [e for m in sorted(models) if isinstance(models[m], list) for e in models[m]]
            known = message.get("known")
            if known is None:
                known = sorted(self.snapshot.known_models())
            delta, problems = snapshot_from_json(
                {"revision": routes_revision, "known": known, "routes": entries}, now
            )
            kept = [r for r in self.snapshot.all_routes() if r.model not in models]
            self._got(RoutingSnapshot(kept + delta.all_routes(), delta.known_models(), delta.revision), problems,
                      source="watch " + self.leader_url)
        else:
            self.last_success = now
        if isinstance(revision, int) and not isinstance(revision, bool):
            self.watch_revision = revision

    def _failed(self, reason: Failure) -> None:
        self.poll_failures.inc()
        self.reachable = False
        self._resync = True
        self.answered_by = None
        self.failures_in_a_row += 1
        failed_url = self.admin_url
        if len(self.admin_urls) > 1:
            self._member = (self._member + 1) % len(self.admin_urls)
            self.log.info("control plane at {url} failed ({error}); trying {next} next",
                          url=failed_url, error=reason.getErrorMessage(), next=self.admin_url)
        now = self.clock.seconds()
        if self.failures_in_a_row == 1 or now - self._last_warning >= REPEAT_WARNING_S:
            self._last_warning = now
            if self.loaded:
                self.log.warn(
                    "control plane at {url} unreachable ({error}); failing static: keeping "
                    "the {routes} routes known {age:.0f} s ago ({n} failed reads so far)",
                    url=failed_url,
                    error=reason.getErrorMessage(),
                    routes=len(self.snapshot),
                    age=self.age(),
                    n=self.failures_in_a_row,
                )
            else:
                self.log.warn(
                    "control plane at {url} unreachable ({error}); no routing table yet, "
                    "answering 503 ({n} failed reads so far)",
                    url=failed_url,
                    error=reason.getErrorMessage(),
                    n=self.failures_in_a_row,
                )


class _WatchProtocol(WebSocketClientProtocol):
    """
    The follower's end of the watch stream: each message goes to its
    service's table.
    """

    service: FollowerService

    def onOpen(self) -> None:
        self.service._watch_opened(self)

    def onMessage(self, payload: bytes, isBinary: bool) -> None:  # noqa: N803
        try:
            self.service.table.apply_watch(json.loads(payload))
        except (ValueError, RoutesDataError) as e:
            self.service.log.warn(
                "watch stream of {url}: a message is not what the stream sends ({error}); reconnecting",
                url=self.service.table.admin_url, error=str(e),
            )
            self.service.table.watch_revision = None
            self.dropConnection(abort=True)

    def onPong(self, payload: bytes) -> None:
        self.service.table.last_success = self.service.table.clock.seconds()

    def onClose(self, wasClean: bool, code: int | None, reason: str | None) -> None:  # noqa: N803
        self.service._watch_closed(self, reason)


class FollowerService(Service):
    """
    Keeps one read of C{table}'s routes outstanding while running: the next
    starts when one answers (at least C{min_gap} seconds after the last
    began), or after a failure waits C{retry} seconds, doubled on each
    failure in a row up to C{max_retry}, with up to C{jitter} of it added at
    random so that many gateways do not retry in step.

    With C{watch}, the table follows the admin API's watch stream
    (C{/api/v1/watch}) instead, a change reaching it as it is published;
    while the stream is down (refused, lost, or from a control plane
    without one) it reads the long-poll as above, and dials the stream
    again after the same backoff, resuming from the last revision held.

    C{stopService} cancels the read in flight, the stream and the retry
    timers, so a stopped follower leaves nothing behind on its reactor.
    """

    log = Logger()

    def __init__(
        self,
        table: FollowerTable,
        retry: float = 2.0,
        max_retry: float = 30.0,
        min_gap: float = 0.1,
        jitter: float = 0.2,
        rng: random.Random | None = None,
        watch: bool = False,
    ):
        self.table = table
        self.watch = watch
        self.watching: _WatchProtocol | None = None
        self._dialing: Deferred[Any] | None = None
        self._redial: IDelayedCall | None = None
        self.watch_failures = 0
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
        if self.watch:
            self._dial()
        self._read()

    def retry_delay(self, failures: int) -> float:
        """
        Seconds to wait after C{failures} failed reads in a row.
        """
        base = min(self.max_retry, self.retry * 2 ** max(0, failures - 1))
        return base * (1 + self.jitter * self.rng.random())

    def _read(self) -> None:
        self._next = None
        if not self.running or self.watching is not None:
            return
        clock = self.table.clock
        self._started_at = clock.seconds()
        d = self._reading = self.table.poll()

        def answered(ok: bool) -> None:
            self._reading = None
            if not self.running or self.watching is not None:
                return
            if ok or self.table.untried_members():
                # hadmin: after a failure another member is tried at once.
                delay = max(0.0, self._started_at + self.min_gap - clock.seconds())
            else:
                rounds = -(-self.table.failures_in_a_row // len(self.table.admin_urls))
                delay = self.retry_delay(rounds)
            self._next = clock.callLater(delay, self._read)

        d.addCallback(answered)
        d.addErrback(lambda f: f.trap(CancelledError))

    # the watch stream

    def _dial(self) -> None:
        self._redial = None
        if not self.running or self.watching is not None or self._dialing is not None:
            return
        from urllib.parse import urlsplit

        from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
        from twisted.web.client import BrowserLikePolicyForHTTPS

        url = self.table.watch_url()
        parts = urlsplit(url)
        host = parts.hostname or "127.0.0.1"
        secure = parts.scheme == "wss"
        port = parts.port or (443 if secure else 80)
        clock = self.table.clock
        endpoint: Any = HostnameEndpoint(clock, host, port, timeout=self.table.timeout)
        if secure:
            policy = self.table.tls if self.table.tls is not None else BrowserLikePolicyForHTTPS()
            endpoint = wrapClientTLS(policy.creatorForNetloc(host.encode("idna"), port), endpoint)
        factory = WebSocketClientFactory(url, reactor=clock)
        factory.protocol = _WatchProtocol
        factory.setProtocolOptions(
            autoPingInterval=WATCH_PING_S, autoPingTimeout=WATCH_PING_S,
            openHandshakeTimeout=self.table.timeout, maxMessagePayloadSize=MAX_ROUTES_BODY,
            maxFramePayloadSize=MAX_ROUTES_BODY,
        )
        service = self

        def build(addr: Any) -> Any:
            p: Any = WebSocketClientFactory.buildProtocol(factory, addr)
            p.service = service
            return p

        factory.buildProtocol = build  # type: ignore[method-assign]
        d = self._dialing = endpoint.connect(factory)

        def failed(f: Failure) -> None:
            if self._dialing is d:
                self._dialing = None
                if not f.check(CancelledError):
                    self._watch_closed(None, f.getErrorMessage())

        d.addCallbacks(lambda _: None, failed)

    def _watch_opened(self, protocol: _WatchProtocol) -> None:
        self._dialing = None
        if not self.running:
            protocol.dropConnection(abort=True)
            return
        self.watching = protocol
        if self.watch_failures:
            self.log.info("watch stream of {url} open again; following it", url=self.table.admin_url)
        self.watch_failures = 0
        # The stream carries the changes now: stop the long-poll.
        nxt, self._next = self._next, None
        if nxt is not None and nxt.active():
            nxt.cancel()
        reading, self._reading = self._reading, None
        if reading is not None:
            reading.cancel()

    def _watch_closed(self, protocol: _WatchProtocol | None, reason: str | None) -> None:
        if protocol is not None and self.watching is not protocol:
            if self._dialing is not None:
                self._dialing = None  # the upgrade was refused
            else:
                return
        self.watching = None
        self._dialing = None
        if not self.running:
            return
        self.watch_failures += 1
        delay = self.retry_delay(self.watch_failures)
        if self.watch_failures == 1:
            self.log.info(
                "watch stream of {url} closed ({reason}); reading the long-poll, dialling the "
                "stream again in {delay:.1f} s",
                url=self.table.admin_url, reason=reason or "no reason given", delay=delay,
            )
        self._redial = self.table.clock.callLater(delay, self._dial)
        if self._reading is None and self._next is None:
            self._read()

    def stopService(self) -> Any:
        super().stopService()
        redial, self._redial = self._redial, None
        if redial is not None and redial.active():
            redial.cancel()
        dialing, self._dialing = self._dialing, None
        if dialing is not None:
            dialing.cancel()
        watching, self.watching = self.watching, None
        if watching is not None:
            watching.dropConnection(abort=True)
        nxt, self._next = self._next, None
        if nxt is not None and nxt.active():
            nxt.cancel()
        reading, self._reading = self._reading, None
        if reading is not None:
            reading.cancel()
        return self.table.close()


class DemandReporter(Service):
    """
    Posts a standalone gateway's demand (C{source.demand()}, an L{IDemand})
    to the control plane's admin API every C{interval} seconds, as
    C{POST /api/v1/demand}, for the autoscaler (issue 12). It posts through
    the follower C{table}'s HTTP client (its TLS and admin certificate).

    One report at a time: a pass that finds the last still unanswered
    skips. Nothing is posted while there is nothing to say (no demand now
    and none in the last report). A failing control plane is logged once,
    then at most every L{REPEAT_WARNING_S}; the gateway keeps serving.
    """

    log = Logger()

    def __init__(self, table: FollowerTable, source: IDemand, gateway_id: str,
                 interval: float = DEMAND_INTERVAL_S):
        self.table = table
        self.source = source
        self.gateway_id = gateway_id
        self.interval = interval
        self.sent = 0
        self.failures = 0
        self._loop: LoopingCall | None = None
        self._posting: Deferred[Any] | None = None
        self._last_empty = True
        self._last_warning = -REPEAT_WARNING_S

    @property
    def url(self) -> str:
        """Where reports go: the leader's admin API, as the table knows it."""
        return self.table.leader_url + DEMAND_PATH

    def startService(self) -> None:
        super().startService()
        loop = self._loop = LoopingCall(self.report)
        loop.clock = self.table.clock
        loop.start(self.interval, now=False)

    def stopService(self) -> Any:
        super().stopService()
        loop, self._loop = self._loop, None
        if loop is not None and loop.running:
            loop.stop()
        posting, self._posting = self._posting, None
        if posting is not None:
            posting.cancel()
        return None

    def body(self) -> dict[str, Any] | None:
        """
        The next report's body, or C{None} when there is nothing to say.
        """
        models = {
            m: {"in_flight": d.in_flight, "waiting": d.waiting}
            for m, d in sorted(self.source.demand().items()) if d.in_flight or d.waiting
        }
        if not models and self._last_empty:
            return None
        return {"gateway_id": self.gateway_id, "models": models}

    def report(self) -> None:
        if self._posting is not None:
            return
        try:
            body = self.body()
        except Exception:
            self.log.failure("reading the gateway's demand failed; nothing reported this time")
            return
        if body is None:
            return
        clock = self.table.clock
        d: Deferred[Any] = self.table.http.post(
            self.url, data=json.dumps(body).encode("utf-8"),
            headers={b"Content-Type": [b"application/json"]},
        )
        d.addTimeout(self.table.timeout, clock)
        self._posting = d

        def answered(response: Any) -> Deferred[None]:
            read = read_body(response, MAX_DEMAND_ANSWER)
            read.addTimeout(self.table.timeout, clock)

            def check(raw: bytes) -> None:
                if response.code != 200:
                    raise RoutesFetchError(f"{self.url} answered HTTP {response.code}: {raw[:200]!r}")

            return read.addCallback(check)

        def done(result: Any) -> None:
            if self._posting is d:
                self._posting = None
            if isinstance(result, Failure):
                if result.check(CancelledError) and not self.running:
                    return
                self.failures += 1
                now = clock.seconds()
                if now - self._last_warning >= REPEAT_WARNING_S:
                    self._last_warning = now
                    self.log.warn("demand report to {url} failed: {why}; the gateway keeps serving, "
                                  "the autoscaler sees no demand from it meanwhile",
                                  url=self.url, why=result.getErrorMessage())
                return
            self.sent += 1
            self._last_empty = not body["models"]

        d.addCallback(answered)
        d.addBoth(done)
