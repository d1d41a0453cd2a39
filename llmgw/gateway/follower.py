"""
A routing table that follows the control plane's admin API, for a gateway
running in its own process.

L{table_from_admin} turns the admin API's replicas and deployments into a
L{RoutingSnapshot} (pure code). L{FollowerTable} polls the API and swaps
in each new snapshot; when a poll fails it keeps the last one (the gateway
fails static: replicas keep serving while the control plane is away), logs
it and shows it in its metrics.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import treq
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from twisted.application.service import Service
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from zope.interface import implementer

from llmgw.routing import IRoutingTable, Route

#: How often, at most, a control plane that stays unreachable is logged again.
REPEAT_WARNING_S = 60.0


class AdminDataError(ValueError):
    """
    The admin API answered something that is not the expected JSON.
    """


@implementer(IRoutingTable)
class RoutingSnapshot:
    """
    An immutable routing table: routes per model and the known models.
    """

    def __init__(self, routes: Iterable[Route] = (), known: Iterable[str] = ()):
        by_model: dict[str, list[Route]] = {}
        for r in routes:
            by_model.setdefault(r.model, []).append(r)
        for lst in by_model.values():
            lst.sort(key=lambda r: r.replica_id)
        self._routes = by_model
        self._known = frozenset(known) | frozenset(by_model)
        self._models = sorted(m for m, rs in by_model.items() if any(not r.draining for r in rs))

    def routes(self, model: str) -> list[Route]:
        return self._routes.get(model, [])

    def models(self) -> list[str]:
        return list(self._models)

    def knows_model(self, model: str) -> bool:
        return model in self._known

    def replica_ids(self) -> set[str]:
        return {r.replica_id for rs in self._routes.values() for r in rs}

    def __len__(self) -> int:
        return sum(len(rs) for rs in self._routes.values())


def _entries(data: Any, key: str) -> list[Any]:
    if isinstance(data, dict) and isinstance(data.get(key), list):
        return data[key]  # type: ignore[no-any-return]
    if isinstance(data, list):
        return data
    raise AdminDataError(f"expected a JSON list of {key} (or {{{key!r}: [...]}})")


def table_from_admin(replicas: Any, deployments: Any) -> tuple[RoutingSnapshot, list[str]]:
    """
    The routing table described by the admin API's C{/api/v1/replicas} and
    C{/api/v1/deployments} answers (decoded JSON), and a list of problems
    with single entries, which are skipped.

    A replica is routed when its C{state} is C{ready}, to the address of
    its rank 0 shard; C{draining} marks it so that it gets nothing new.

    @raise AdminDataError: either answer is not a list (or an object
        holding the list under its name).
    """
    problems: list[str] = []
    routes: list[Route] = []
    for i, rep in enumerate(_entries(replicas, "replicas")):
        if not isinstance(rep, dict):
            problems.append(f"replicas[{i}] is not an object")
            continue
        rid, model = rep.get("id"), rep.get("model")
        if not isinstance(rid, str) or not isinstance(model, str) or not rid or not model:
            problems.append(f"replicas[{i}] has no string id and model")
            continue
        if rep.get("state") != "ready":
            continue
        shards = rep.get("shards")
        leader = None
        if isinstance(shards, list):
            for s in shards:
                if isinstance(s, dict) and s.get("rank", 0) == 0:
                    leader = s
                    break
        address = leader.get("address") if leader else None
        if not isinstance(address, str) or ":" not in address:
            problems.append(f"replica {rid} is ready but has no rank 0 shard with a host:port address")
            continue
        routes.append(Route(rid, model, address, bool(rep.get("draining", False))))
    known: list[str] = []
    for i, dep in enumerate(_entries(deployments, "deployments")):
        if isinstance(dep, dict) and isinstance(dep.get("model"), str):
            known.append(dep["model"])
        else:
            problems.append(f"deployments[{i}] has no string model")
    return RoutingSnapshot(routes, known), problems


class _FollowerCollector(Collector):
    def __init__(self, table: FollowerTable):
        self._table = table

    def collect(self) -> Iterator[GaugeMetricFamily]:
        t = self._table
        yield GaugeMetricFamily(
            "llmgw_gateway_control_plane_reachable",
            "1 when the last poll of the control plane's admin API succeeded",
            value=1 if t.reachable else 0,
        )
        yield GaugeMetricFamily(
            "llmgw_gateway_routing_table_age_seconds",
            "Seconds since the routing table was last refreshed from the control plane "
            "(-1 before the first refresh)",
            value=t.age() if t.loaded else -1,
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
    the control plane at C{admin_url}.

    Until the first poll succeeds every model counts as known (requests get
    503 with C{Retry-After}, not 404), since nothing is known yet.
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
    ):
        self.clock = clock
        self.admin_url = admin_url.rstrip("/")
        self._pool: Any = None
        if http is None:
            from twisted.web.client import Agent, BrowserLikePolicyForHTTPS, HTTPConnectionPool

            self._pool = HTTPConnectionPool(clock, persistent=True)
            # tls: an IPolicyForHTTPS (llmgw.tlsconf.options.ClientTLSPolicy
            # for an admin API behind mutual TLS).
            policy = tls if tls is not None else BrowserLikePolicyForHTTPS()
            http = treq.client.HTTPClient(Agent(clock, contextFactory=policy, pool=self._pool))
        self.http = http
        self.timeout = timeout
        self.snapshot = RoutingSnapshot()
        self.loaded = False
        self.reachable = False
        self.last_success: float | None = None
        self.failures_in_a_row = 0
        self._last_warning = -REPEAT_WARNING_S
        self.listeners: list[Callable[[RoutingSnapshot], None]] = []
        registry = registry if registry is not None else CollectorRegistry()
        self.poll_failures = Counter(
            "llmgw_gateway_control_poll_failures",
            "Polls of the control plane's admin API that failed",
            registry=registry,
        )
        registry.register(_FollowerCollector(self))

    # IRoutingTable

    def routes(self, model: str) -> list[Route]:
        return self.snapshot.routes(model)

    def models(self) -> list[str]:
        return self.snapshot.models()

    def knows_model(self, model: str) -> bool:
        return self.snapshot.knows_model(model) or not self.loaded

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

    # polling

    def poll(self) -> Deferred[None]:
        """
        Read the admin API once and swap in the new table; on failure keep
        the old one. The Deferred never fails.
        """
        d = self._fetch()
        d.addCallbacks(self._got, self._failed)
        return d

    @inlineCallbacks
    def _fetch(self) -> Any:
        replicas = yield self._get_json("/api/v1/replicas")
        deployments = yield self._get_json("/api/v1/deployments")
        return table_from_admin(replicas, deployments)

    @inlineCallbacks
    def _get_json(self, path: str) -> Any:
        url = self.admin_url + path
        d = self.http.get(url)
        d.addTimeout(self.timeout, self.clock)
        response = yield d
        d = treq.content(response)
        d.addTimeout(self.timeout, self.clock)
        body = yield d
        if response.code != 200:
            raise AdminDataError(f"{url} answered HTTP {response.code}: {body[:200]!r}")
        try:
            return json.loads(body)
        except ValueError as e:
            raise AdminDataError(f"{url} answered with malformed JSON: {e}") from None

    def _got(self, result: tuple[RoutingSnapshot, list[str]]) -> None:
        snapshot, problems = result
        for p in problems:
            self.log.warn("control plane's routing data: {problem}; entry skipped", problem=p)
        if self.failures_in_a_row:
            self.log.info(
                "control plane at {url} reachable again after {n} failed polls; "
                "{routes} routes",
                url=self.admin_url,
                n=self.failures_in_a_row,
                routes=len(snapshot),
            )
        elif not self.loaded:
            self.log.info(
                "routing table loaded from {url}: {routes} routes, {models} models",
                url=self.admin_url,
                routes=len(snapshot),
                models=len(snapshot.models()),
            )
        self.snapshot = snapshot
        self.loaded = True
        self.reachable = True
        self.failures_in_a_row = 0
        self.last_success = self.clock.seconds()
        for listener in self.listeners:
            try:
                listener(snapshot)
            except Exception:
                self.log.failure("routing table listener {listener!r} failed", listener=listener)

    def _failed(self, reason: Any) -> None:
        self.poll_failures.inc()
        self.reachable = False
        self.failures_in_a_row += 1
        now = self.clock.seconds()
        if self.failures_in_a_row == 1 or now - self._last_warning >= REPEAT_WARNING_S:
            self._last_warning = now
            if self.loaded:
                self.log.warn(
                    "control plane at {url} unreachable ({error}); failing static: keeping "
                    "the {routes} routes known {age:.0f} s ago ({n} failed polls so far)",
                    url=self.admin_url,
                    error=reason.getErrorMessage(),
                    routes=len(self.snapshot),
                    age=self.age(),
                    n=self.failures_in_a_row,
                )
            else:
                self.log.warn(
                    "control plane at {url} unreachable ({error}); no routing table yet, "
                    "answering 503 ({n} failed polls so far)",
                    url=self.admin_url,
                    error=reason.getErrorMessage(),
                    n=self.failures_in_a_row,
                )


class FollowerService(Service):
    """
    Polls C{table} every C{interval} seconds while running; polls never
    overlap and a failed one does not stop the loop.
    """

    def __init__(self, table: FollowerTable, interval: float = 2.0):
        self.table = table
        self.interval = interval
        self._loop: LoopingCall | None = None

    def startService(self) -> None:
        super().startService()
        self._loop = LoopingCall(self.table.poll)
        self._loop.clock = self.table.clock
        self._loop.start(self.interval, now=True)

    def stopService(self) -> Any:
        super().stopService()
        loop, self._loop = self._loop, None
        if loop is not None and loop.running:
            loop.stop()
        return self.table.close()
