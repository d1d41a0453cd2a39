"""
Health probing and readiness: a starting shard is probed until its health
check answers (then it is ready) or its startup timeout passes; a ready or
draining shard is probed at a slower pace, and so many failed probes in a
row make it unhealthy. L{HealthWatch} moves a shard between starting and
ready itself and says so through C{changed}; what to do with an unhealthy
shard (stop it) is its owner's, through C{unhealthy}.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet import defer, error
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmgw.agent.shard import DRAINING, READY, STARTING, Shard, ShardTimers
from llmgw.engines import health_url


def probe_error(failure: Failure) -> str:
    """
    A failed probe in a few words, for the log and the shard's error.
    """
    e = failure.value
    if isinstance(e, defer.TimeoutError | error.TimeoutError):
        return "no answer in time"
    return str(e) or type(e).__name__


class HealthWatch:
    """
    Probes shards' health checks on C{clock} with C{prober} (anything with
    C{probe(url) -> Deferred}, or C{None}: then no shard is ever probed, so
    none becomes ready).

    @param host: the address probes go to (the one the agent advertises),
        asked at each probe.
    @param changed: called after the watch moved a shard between starting
        and ready.
    @param unhealthy: called with a shard and why, when its startup timeout
        passed or it failed C{unhealthy_after} probes in a row: its owner
        stops it (a stopping shard is probed no more).
    """

    log = Logger()

    def __init__(
        self,
        clock: Any,
        prober: Any,
        host: Callable[[], str],
        changed: Callable[[Shard], None],
        unhealthy: Callable[[Shard, str], None],
        interval_starting: float = 1.0,
        interval_ready: float = 10.0,
        unhealthy_after: int = 3,
    ):
        self.timers = ShardTimers(clock)
        self.prober = prober
        self.host = host
        self.changed = changed
        self.unhealthy = unhealthy
        self.interval_starting = interval_starting
        self.interval_ready = interval_ready
        self.unhealthy_after = unhealthy_after
        #: Probes a starting shard has had unanswered, by shard id: the
        #: first few follow each other quickly (see L{_starting_delay}).
        self._tries: dict[str, int] = {}

    def watch_start(self, shard: Shard) -> None:
        """
        A new shard: its startup timeout runs from now, and the first probe
        goes out at once.
        """
        self._watch_startup(shard)
        self._schedule(shard, 0)

    def cancel_startup(self, shard: Shard) -> None:
        """
        The startup timeout no longer applies (the shard drains).
        """
        self.timers.cancel(shard, "startup")

    def forget(self, shard: Shard) -> None:
        """
        Probe the shard no more: it is stopping or ended.
        """
        self.timers.cancel(shard, "startup", "probe")
        self._tries.pop(shard.shard_id, None)

    def _starting_delay(self, shard: Shard) -> float:
        """
        The wait before a starting shard's next probe: 0.1 s, doubling up
        to C{interval_starting}. An engine that is up in a fraction of a
        second (a small model, weights already in memory) is routed that
        much sooner; one that takes minutes costs a handful of probes more.
        """
        tries = self._tries.get(shard.shard_id, 0)
        self._tries[shard.shard_id] = tries + 1
        return min(self.interval_starting, 0.1 * (2 ** min(tries, 16)))

    def first_probe(self, shard: Shard) -> defer.Deferred[None]:
        """
        Probe a re-adopted live shard once now, then keep watching it: ready
        if it answers; starting again (with its startup timeout running) if
        it does not. Fires when that first probe is answered, never failing.
        """
        if self.prober is None:
            return defer.succeed(None)
        url = health_url(self.host(), shard.spec)
        d = defer.maybeDeferred(self.prober.probe, url) if url else defer.succeed(None)

        def healthy(_: Any) -> None:
            if shard.live and shard.state == STARTING:
                shard.state = READY
                self.changed(shard)
            self._schedule(shard, self.interval_ready)

        def unhealthy(f: Failure) -> None:
            shard.last_probe_error = str(f.value) or type(f.value).__name__
            if shard.live and shard.state != STARTING:
                self.log.warn("re-adopted shard {shard} does not answer its health check "
                              "({error}); it is starting again", shard=shard.shard_id,
                              error=shard.last_probe_error)
                shard.state = STARTING
                self.changed(shard)
            if shard.live:
                self._watch_startup(shard)
                self._schedule(shard, self._starting_delay(shard))

        d.addCallbacks(healthy, unhealthy)
        return d

    def _watch_startup(self, shard: Shard) -> None:
        self.timers.set(shard, "startup", shard.spec.startup_timeout_s, self._startup_expired,
                        shard)

    def _startup_expired(self, shard: Shard) -> None:
        self.timers.fired(shard, "startup")
        why = f"not healthy within its startup timeout of {shard.spec.startup_timeout_s}s"
        if shard.last_probe_error:
            why += f" (last health check: {shard.last_probe_error})"
        self.unhealthy(shard, why)

    def _schedule(self, shard: Shard, delay: float) -> None:
        if self.prober is None:
            return
        self.timers.set(shard, "probe", delay, self._probe, shard)

    def _probe(self, shard: Shard) -> None:
        self.timers.fired(shard, "probe")
        if not shard.live or shard.stopping:
            return
        url = health_url(self.host(), shard.spec)
        d = defer.maybeDeferred(self.prober.probe, url) if url else defer.succeed(None)
        d.addCallbacks(lambda _: self._probed(shard, None),
                       lambda f: self._probed(shard, f))

    def _probed(self, shard: Shard, failure: Failure | None) -> None:
        if not shard.live or shard.stopping:
            return
        if failure is None:
            shard.probe_failures = 0
            shard.last_probe_error = ""
            if shard.state == STARTING:
                self.timers.cancel(shard, "startup")
                self._tries.pop(shard.shard_id, None)
                shard.state = READY
                self.log.info("shard {shard} is ready (health check on port {port} answered)",
                              shard=shard.shard_id, port=shard.spec.port)
                self.changed(shard)
        else:
            shard.last_probe_error = probe_error(failure)
            if shard.state in (READY, DRAINING):
                shard.probe_failures += 1
                self.log.warn(
                    "shard {shard} failed a health check ({n} of {limit}): {error}",
                    shard=shard.shard_id, n=shard.probe_failures, limit=self.unhealthy_after,
                    error=shard.last_probe_error,
                )
                if shard.probe_failures >= self.unhealthy_after:
                    self.unhealthy(
                        shard,
                        f"failed {shard.probe_failures} health checks in a row "
                        f"(last: {shard.last_probe_error})",
                    )
                    return
        delay = self._starting_delay(shard) if shard.state == STARTING else self.interval_ready
        self._schedule(shard, delay)
