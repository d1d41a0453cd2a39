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
shows it in its metrics; L{llmgw.gateway.follower_service.FollowerService}
keeps a read (or the watch stream) going and retries with a backoff, and
L{llmgw.gateway.demand.DemandReporter} posts the gateway's demand to the
leader this table found.

The table may be given several admin URLs, the members of an HA control
plane. It reads from one; when a read fails it tries the next at once, and
backs off only once every member failed in a row. A member that does not
lead answers with a redirect to the leader, which the HTTP client follows;
the URL that answered (the leader's) is where the watch stream is dialled
and demand is posted.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from twisted.internet.defer import Deferred
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from zope.interface import implementer

from llmgw.routing import (
    LONG_POLL_MAX_S,
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
        #: The admin URLs to read from, tried in turn on failure.
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

    @property
    def adapters(self) -> Mapping[str, str]:
        return self.snapshot.adapters

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
            # A member that does not lead answers the routes itself
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
            self._got(RoutingSnapshot(kept + delta.all_routes(), delta.known_models(), delta.revision,
                                      adapters=self.snapshot.adapters), problems,
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
