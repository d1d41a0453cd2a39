"""
The leader's routing table, published in etcd for the members that do not
lead (DESIGN §17): their embedded gateways keep serving, and they answer
C{GET /api/v1/routes} themselves.

One key, C{PREFIX/published/routes}, holds the table as
C{GET /api/v1/routes} writes it (L{llmgw.routing.snapshot_to_json}),
zlib-compressed, without engine signals (see below). The lease-guarded
write, the debounce, the size bound and the fail-static follower are
L{llmgw.control.ha.publishing}'s.

- B{The leader} (L{RoutesPublisher}) writes it at most one each
  L{PUBLISH_INTERVAL} seconds, when what the routes are changed. Engine
  signals (queue depth, KV-cache use) are left out: they change with every
  heartbeat, and etcd keeps every revision until it is compacted; a
  follower's gateway routes without load figures, as for a replica whose
  figures are stale.
- B{Size}: compressed, a route costs some 13 bytes
  (C{bench/published_routes.py}), so some 80,000 routes fit in
  L{MAX_PUBLISHED}; over it the table is not written, and followers keep
  the last table written.
- B{Every other member} (L{RoutesFollower}) replaces its routing table
  with each new document, and keeps the last one while etcd is away or the
  key is deleted or unreadable.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from typing import Any

from twisted.internet.interfaces import IReactorTime

from llmgw.control.ha.publishing import (
    MAX_PUBLISHED,
    PACK_LEVEL,
    PUBLISH_INTERVAL,
    KeyFollower,
    LeasedPublisher,
    unpack_object,
)
from llmgw.routing import (
    RoutesDataError,
    RoutingSnapshot,
    RoutingTable,
    snapshot_from_json,
    snapshot_to_json,
)


def routes_key(prefix: str) -> bytes:
    """Where the leader's routing table is published in etcd."""
    return (prefix.rstrip("/") + "/published/routes").encode()


def routes_document(table: RoutingTable, now: float) -> dict[str, Any]:
    """
    What is published of C{table}: its C{GET /api/v1/routes} document
    without engine signals and without its revision (which is this process's
    own count, and would make every publication differ).
    """
    snap = table.snapshot()
    # The parts other than the routes as GET /api/v1/routes writes them;
    # the routes built here, without their signals (the bulk of the cost).
    doc = snapshot_to_json(RoutingSnapshot((), snap.known_models(), 0, snap.policies(),
                                           snap.all_queue_limits()), now)
    doc.pop("revision", None)
    doc["routes"] = [{"replica": r.replica_id, "model": r.model, "address": r.address, "draining": r.draining}
                     for r in snap.all_routes()]
    return doc


def pack(doc: dict[str, Any]) -> bytes:
    """The etcd value of a routes document: compressed canonical JSON."""
    return zlib.compress(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode(), PACK_LEVEL)


def unpack(value: bytes) -> dict[str, Any]:
    """
    The routes document an etcd value holds (with revision 0).

    @raise RoutesDataError: not compressed JSON, too large inflated, or not
        a JSON object.
    """
    doc = unpack_object(value)
    doc["revision"] = 0
    return doc



def _shape(routes: Any) -> tuple[tuple[str, str, bool], ...]:
    return tuple((r.replica_id, r.address, r.draining) for r in routes)



class RoutesPublisher(LeasedPublisher):
    """
    The leader's side: publishes C{table} under C{prefix} while
    L{start}ed with a lease (see the module docstring).
    """

    what = "routing table"

    def __init__(self, clock: IReactorTime, store: Any, prefix: str, table: RoutingTable,
                 may_write: Callable[[], bool] = lambda: True, interval: float = PUBLISH_INTERVAL,
                 max_size: int = MAX_PUBLISHED):
        super().__init__(clock, store, prefix, routes_key(prefix), may_write, interval, max_size)
        self.table = table
        self._unsubscribe: Callable[[], None] | None = None
        #: What each model's routes are (not their signals), as last seen.
        self._shapes: dict[str, tuple[tuple[str, str, bool], ...]] = {}

    def start(self, lease: int, current: bytes | None = None) -> None:
        super().start(lease, current)
        snap = self.table.snapshot()
        self._shapes = {m: _shape(snap.routes(m)) for m in snap.known_models()}
        self._unsubscribe = self.table.subscribe(self._changed)

    def stop(self) -> None:
        super().stop()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def pack(self) -> tuple[bytes, bytes] | None:
        value = pack(routes_document(self.table, self.clock.seconds()))
        if len(value) > self.max_size:
            self._too_large(len(value), ": not published; members that do not lead keep the last table "
                                        "published")
            return None
        return value, value

    def _changed(self, revision: int, models: frozenset[str], known_changed: bool) -> None:
        # A change of engine signals alone (every heartbeat) is not published:
        # only one of what the routes are is worth packing the table for.
        dirty = known_changed
        for model in models:
            shape = _shape(self.table.routes(model))
            if self._shapes.get(model, ()) != shape:
                self._shapes[model] = shape
                dirty = True
        if dirty:
            self._dirty = True
            self._schedule()


class RoutesFollower(KeyFollower):
    """
    A member that does not lead: keeps C{table} to what the leader
    published (see the module docstring).
    """

    what = "routing table"

    def __init__(self, clock: IReactorTime, store: Any, prefix: str, table: RoutingTable,
                 retry_interval: float = 1.0):
        super().__init__(clock, store, prefix, routes_key(prefix), retry_interval)
        self.table = table

    def _take(self, value: bytes, revision: int) -> None:
        if value == self.value:
            self.revision = revision
            return
        where = f"etcd {self.key.decode()} (revision {revision})"
        try:
            snapshot, problems = snapshot_from_json(unpack(value), self.clock.seconds())
        except (RoutesDataError, RecursionError) as e:
            self.revision = revision
            self.log.error("the routing table published in {where} is unreadable: {error}; the last "
                           "one stays", where=where, error=str(e) or type(e).__name__)
            return
        for problem in problems:
            self.log.error("the routing table published in {where}: {problem} (left out)",
                           where=where, problem=problem)
        self.revision = revision
        self.value = value
        self._applied = True
        self.table.replace(snapshot)
