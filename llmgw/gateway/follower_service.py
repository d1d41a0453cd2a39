"""
L{FollowerService}: keeps a standalone gateway's L{FollowerTable} following
the control plane, by the long-poll of C{GET /api/v1/routes} or by the admin
API's watch stream, with a backoff while the control plane is away.
"""

from __future__ import annotations

import json
import random
from typing import Any

from autobahn.twisted.websocket import WebSocketClientFactory, WebSocketClientProtocol
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmgw.gateway.follower import MAX_ROUTES_BODY, FollowerTable
from llmgw.routing import RoutesDataError

#: Seconds between the watch stream's pings; as long again without a pong
#: and the stream counts as lost.
WATCH_PING_S = 5.0


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
                # After a failure another member is tried at once.
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
