"""
L{DemandReporter}: a standalone gateway's demand, posted to the control
plane's admin API for the autoscaler.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmgw.gateway.follower import REPEAT_WARNING_S, FollowerTable, RoutesFetchError, read_body
from llmgw.routing import IDemand

DEMAND_PATH = "/api/v1/demand"
#: Seconds between demand reports (the control plane keeps one for 5 s).
DEMAND_INTERVAL_S = 1.0
#: Largest answer to a demand report read, in bytes.
MAX_DEMAND_ANSWER = 64 * 1024


class DemandReporter(Service):
    """
    Posts a standalone gateway's demand (C{source.demand()}, an L{IDemand})
    to the control plane's admin API every C{interval} seconds, as
    C{POST /api/v1/demand}, for the autoscaler. It posts through
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
