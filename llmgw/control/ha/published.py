"""
The leader's routing table, published in etcd for the members that do not
lead (DESIGN §17, issue 14 items 5 and 6): their embedded gateways keep
serving, and they answer C{GET /api/v1/routes} themselves.

One key, C{PREFIX/published/routes}, holds the table as
C{GET /api/v1/routes} writes it (L{llmgw.routing.snapshot_to_json}),
zlib-compressed, without engine signals (see below).

- B{The leader} (L{RoutesPublisher}) writes it with a transaction that
  compares the leader key's lease with the lease it won under, so a deposed
  leader's write changes nothing (and stops its publisher). Writes are
  debounced: at most one each L{PUBLISH_INTERVAL} seconds, and only when the
  document differs from the one last written. Engine signals (queue depth,
  KV-cache use) are left out: they change with every heartbeat, and etcd
  keeps every revision until it is compacted; a follower's gateway routes
  without load figures, as for a replica whose figures are stale.
- B{Size}: etcd refuses a request over 1.5 MiB (C{--max-request-bytes}).
  Compressed, a route costs some 13 bytes (C{bench/published_routes.py}),
  so some 80,000 routes fit; a document over L{MAX_PUBLISHED} compressed bytes is
  not written: the error is logged (once per term) and followers keep the
  last table written.
- B{Every other member} (L{RoutesFollower}) reads the key, then watches it,
  and replaces its routing table with each new document. Fail static: while
  etcd is away, or when the key is deleted or unreadable, the last table
  stays, and the follower reads again every C{retry_interval}.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import zlib
from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from llmgw.control.ha.election import leader_key
from llmgw.etcd import Compare, EtcdError, Put, Range
from llmgw.routing import (
    RoutesDataError,
    RoutingSnapshot,
    RoutingTable,
    snapshot_from_json,
    snapshot_to_json,
)

#: Seconds between two writes of the published table, at least.
PUBLISH_INTERVAL = 1.0
#: The most compressed bytes written: under etcd's default 1.5 MiB request
#: limit with room for the rest of the transaction.
MAX_PUBLISHED = 1024 * 1024
#: zlib's level: fast (the leader packs the whole table on the reactor).
PACK_LEVEL = 1
#: The most bytes a published document may inflate to when read.
MAX_INFLATED = 64 * 1024 * 1024
#: Seconds between two packs (and writes) of the published fleet views.
FLEET_INTERVAL = 2.0
#: The most events published (the newest).
FLEET_EVENTS = 1000
#: A node's C{last_seen} is published rounded down to this many seconds.
LAST_SEEN_STEP = 10.0
#: A GPU's C{memory_used_mb} is published rounded down to this many MB.
MEMORY_STEP_MB = 1024
#: The most of the leader's reactor time packing the fleet views may take:
#: a pack that took C{t} seconds is followed by the next C{t / FLEET_SHARE}
#: seconds later at the soonest (about 0.5 s at 10,000 nodes: every 5 s).
FLEET_SHARE = 0.1


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


def unpack_object(value: bytes) -> dict[str, Any]:
    """
    The JSON object a published etcd value holds (compressed JSON).

    @raise RoutesDataError: not compressed JSON, too large inflated, or not
        a JSON object.
    """
    inflate = zlib.decompressobj()
    try:
        raw = inflate.decompress(value, MAX_INFLATED)
    except zlib.error as e:
        raise RoutesDataError(f"not zlib-compressed: {e}") from None
    if inflate.unconsumed_tail:
        raise RoutesDataError(f"inflates past {MAX_INFLATED} bytes")
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise RoutesDataError(f"not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise RoutesDataError("not a JSON object")
    return doc


def fleet_key(prefix: str) -> bytes:
    """Where the leader's fleet views (nodes, replicas, events) are published."""
    return (prefix.rstrip("/") + "/published/fleet").encode()


def _coarse_gpu(gpu: Any) -> Any:
    used = gpu.get("memory_used_mb") if isinstance(gpu, dict) else None
    if isinstance(used, int) and not isinstance(used, bool):
        return {**gpu, "memory_used_mb": used // MEMORY_STEP_MB * MEMORY_STEP_MB}
    return gpu


def _shape(routes: Any) -> tuple[tuple[str, str, bool], ...]:
    return tuple((r.replica_id, r.address, r.draining) for r in routes)


class LeasedPublisher:
    """
    The leader's side of one published key: writes what L{pack} makes under
    C{prefix} while L{start}ed with a lease, with the transaction, the
    debounce and the size bound the module docstring describes. Subclasses
    say what is packed (L{pack}) and when it may have changed (L{_dirty}).

    @param may_write: whether this member may still write (the election's
        own deadline); checked before each write, beside etcd's lease check.
    """

    log = Logger()
    #: What is published, in log lines.
    what = "document"

    def __init__(self, clock: IReactorTime, store: Any, prefix: str, key: bytes,
                 may_write: Callable[[], bool] = lambda: True, interval: float = PUBLISH_INTERVAL,
                 max_size: int = MAX_PUBLISHED):
        self.clock = clock
        self.store = store
        self.prefix = prefix
        self.key = key
        self.may_write = may_write
        self.interval = interval
        self.max_size = max_size
        self.lease: int | None = None
        #: The value last written (or read as current): an equal one is not
        #: written again.
        self.last: bytes | None = None
        #: What L{pack} said of the value last written, to compare with.
        self._last_print: bytes | None = None
        self._last_at = float("-inf")
        self._call: IDelayedCall | None = None
        self._writing = False
        self._too_large_logged = False
        #: What is published may have changed since it was last packed.
        self._dirty = False
        #: Writes etcd took, writes refused (deposed), documents too large,
        #: and how often the document was packed.
        self.writes = self.refused = self.too_large = self.packs = 0

    def pack(self) -> tuple[bytes, bytes] | None:
        """
        The value to write now and its fingerprint (what must differ from
        the last one's for it to be written: the value without a time
        stamp, say); C{None}: nothing under the size bound (logged).
        """
        raise NotImplementedError

    def start(self, lease: int, current: bytes | None = None) -> None:
        """
        Publish under C{lease} from now: the document as it stands (unless
        it is C{current}, the value etcd is known to hold), then each change.
        """
        self.stop()
        self.lease = lease
        self.last = self._last_print = current
        self._too_large_logged = False
        self._dirty = True
        self._schedule()

    def stop(self) -> None:
        """Write nothing more (a write under way is refused by etcd)."""
        self.lease = None
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None

    def _too_large(self, size: int, extra: str = "") -> None:
        self.too_large += 1
        if not self._too_large_logged:
            self._too_large_logged = True
            self.log.error(
                "the published {what} is {size} bytes compressed, over the {limit} bytes that are "
                "published in etcd {key}{extra}", what=self.what, size=size, limit=self.max_size,
                key=self.key.decode(), extra=extra)

    def _schedule(self) -> None:
        if self.lease is None or self._call is not None or self._writing:
            return
        delay = max(0.0, self._last_at + self.interval - self.clock.seconds())
        self._call = self.clock.callLater(delay, self._flush)

    def _take_flush(self) -> int | None:
        """
        The scheduled flush came: the lease to write under, or C{None} when
        there is no lease or nothing changed (then nothing is done).
        """
        self._call = None
        lease = self.lease
        if lease is None or not self._dirty:
            return None
        self._dirty = False
        self.packs += 1
        return lease

    def _start_write(self, lease: int, value: bytes, fingerprint: bytes) -> None:
        self._writing = True
        self._last_at = self.clock.seconds()
        d = defer.ensureDeferred(self._write(lease, value, fingerprint))
        d.addErrback(lambda f: self.log.failure("publishing the {what} failed", f, what=self.what))
        d.addBoth(lambda _: self._written(fingerprint))

    def _flush(self) -> None:
        lease = self._take_flush()
        if lease is None:
            return
        try:
            packed = self.pack()
        except Exception:
            # Not lost: packed again an interval on (a bug, logged each time).
            self.log.failure("packing the {what} to publish failed; trying again in {interval}s",
                             what=self.what, interval=self.interval)
            self._dirty = True
            self._last_at = self.clock.seconds()
            self._schedule()
            return
        self._packed()
        if packed is None:
            return
        value, fingerprint = packed
        if fingerprint == self._last_print:
            return
        if not self.may_write():
            return
        self._start_write(lease, value, fingerprint)

    def _packed(self) -> None:
        """Called after each pack (a periodic publisher schedules the next)."""

    def _written(self, fingerprint: bytes) -> None:
        self._writing = False
        if fingerprint != self._last_print:
            self._dirty = True  # not taken: try again
        # Changes made while writing (or a failed write) go out next.
        if self.lease is not None and self._dirty:
            self._schedule()

    async def _write(self, lease: int, value: bytes, fingerprint: bytes) -> None:
        try:
            result = await defer.ensureDeferred(self.store.txn(
                [Compare.held_by(leader_key(self.prefix), lease)],
                [Put(self.key, value)],
                [Range(leader_key(self.prefix))],
            ))
        except EtcdError as e:
            self.log.warn("etcd: the {what} could not be published ({error}); trying again",
                          what=self.what, error=str(e))
            return
        if result.succeeded:
            self.writes += 1
            self.last, self._last_print = value, fingerprint
            return
        self.refused += 1
        if self.lease == lease:
            self.stop()
        self.log.error("etcd refused to publish the {what}: this member no longer leads "
                       "(its lease is not the leader's); it publishes nothing more", what=self.what)


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


#: Nodes (or replicas) coarsened, encoded and compressed in one reactor
#: turn by L{FleetPublisher} (the leader builds a node's view in that turn too:
#: some 8 ms at 100 nodes of 8 GPUs in all, on 2 CPUs).
FLEET_SLICE = 100
#: The parts of a published fleet document, in the order they are packed
#: (the nodes last: they are what is cut to fit).
FLEET_PARTS = ("status", "events", "replicas", "nodes")


def _canon(value: Any) -> bytes:
    # No NaN or Infinity: followers pass these bytes on as JSON answers.
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _coarse_node(node: Any) -> Any:
    """
    What is published of a node of the leader's C{GET /api/v1/nodes}: the
    same, coarsened where it changes with every heartbeat (each write is
    kept by etcd until compacted): C{last_seen} rounded down to
    L{LAST_SEEN_STEP} seconds, a GPU's C{memory_used_mb} to
    L{MEMORY_STEP_MB}. (A replica's shards go without their engine
    C{signals}, L{_coarse_replica}; the newest L{FLEET_EVENTS} events.)
    """
    if not isinstance(node, dict):
        return node
    seen = node.get("last_seen")
    if isinstance(seen, (int, float)) and not isinstance(seen, bool):
        node = {**node, "last_seen": math.floor(seen / LAST_SEEN_STEP) * LAST_SEEN_STEP}
    gpus = node.get("gpus")
    if isinstance(gpus, list):
        node = {**node, "gpus": [_coarse_gpu(g) for g in gpus]}
    return node


def _coarse_replica(rep: Any) -> Any:
    shards = rep.get("shards") if isinstance(rep, dict) else None
    if isinstance(shards, list):
        rep = {**rep, "shards": [{**sh, "signals": None} if isinstance(sh, dict) else sh for sh in shards]}
    return rep


class FleetPack:
    """
    One fleet document being packed, a slice per L{step} (DESIGN §17,
    ha5): each part (L{FLEET_PARTS}) is its own zlib stream of the exact
    JSON a member that does not lead answers with (C{nodes} and
    C{replicas}: the whole answer, C{published_at} and C{published_by}
    included; C{events}: the list; C{status}: the object), so that such a
    member inflates only the part asked for and parses only the small ones.
    The etcd value: one line of JSON (C{published_at}, C{leader},
    C{leader_admin_url}, C{truncated}, C{parts}: each part's offset and
    length after the line), then the parts. The fingerprint
    (L{fingerprint}) is a BLAKE2b of the parts without the time stamp.
    Over C{max_size} the nodes are cut at a slice and the nodes part says
    C{"truncated": {"nodes": TOTAL}}.
    """

    def __init__(self, views: dict[str, Any], published_at: float, max_size: int = MAX_PUBLISHED,
                 slice_size: int = FLEET_SLICE):
        self.views = views
        self.published_at = published_at
        self.max_size = max_size
        self.slice_size = slice_size
        self.leader = views.get("leader")
        self.digest = hashlib.blake2b(digest_size=32)
        self.digest.update(_canon([self.leader, views.get("leader_admin_url")]))
        self.parts: dict[str, bytes] = {}
        #: The nodes there are, and those published (fewer when cut).
        self.total_nodes = len(views.get("nodes", []))
        self.nodes_published = 0
        #: The value, once the last step is done (C{None} before, or when
        #: even the nodes cut to none do not fit).
        self.value: bytes | None = None
        #: The compressed size when nothing fitted.
        self.size = 0
        #: Steps taken.
        self.steps = 0

    @property
    def fingerprint(self) -> bytes:
        return self.digest.digest()

    def _prefix(self) -> bytes:
        return (b'{"published_at":' + json.dumps(self.published_at).encode()
                + b',"published_by":' + json.dumps(self.leader).encode())

    def _header(self, truncated: bool) -> bytes:
        offsets: dict[str, list[int]] = {}
        at = 0
        for name in FLEET_PARTS:
            offsets[name] = [at, len(self.parts.get(name, b""))]
            at += offsets[name][1]
        return _canon({"published_at": self.published_at, "leader": self.leader,
                       "leader_admin_url": self.views.get("leader_admin_url"),
                       "truncated": {"nodes": self.total_nodes} if truncated else None,
                       "parts": offsets}) + b"\n"

    def steps_iter(self) -> Any:
        """A generator: each C{next} packs one slice (the reactor turn's share)."""
        views = self.views
        status = views.get("status", {})
        raw = _canon(status)
        self.digest.update(b"status" + raw)
        self.parts["status"] = zlib.compress(raw, PACK_LEVEL)
        yield
        raw = _canon(list(views.get("events", []))[-FLEET_EVENTS:])
        self.digest.update(b"events" + raw)
        self.parts["events"] = zlib.compress(raw, PACK_LEVEL)
        yield
        # Replicas, whole, a slice a turn.
        co = zlib.compressobj(PACK_LEVEL)
        out = [co.compress(self._prefix() + b',"replicas":[')]
        self.digest.update(b"replicas")
        replicas = views.get("replicas", [])
        emitted = False
        for i in range(0, len(replicas), self.slice_size):
            raw = _canon([_coarse_replica(r) for r in replicas[i:i + self.slice_size]])[1:-1]
            if raw and emitted:
                raw = b"," + raw
            emitted = emitted or bool(raw)
            self.digest.update(raw)
            out.append(co.compress(raw))
            yield
        out.append(co.compress(b"]}"))
        out.append(co.flush())
        self.parts["replicas"] = b"".join(out)
        # Nodes, cut at a slice past the bound: each slice flushed (its
        # output counted) from a copy of the stream before it.
        budget = (self.max_size - len(self.parts["status"]) - len(self.parts["events"])
                  - len(self.parts["replicas"]) - len(self._header(True)) - 64)
        co = zlib.compressobj(PACK_LEVEL)
        out = [co.compress(self._prefix() + b',"nodes":['), co.flush(zlib.Z_SYNC_FLUSH)]
        used = sum(map(len, out))
        self.digest.update(b"nodes")
        nodes = views.get("nodes", [])
        cut = False
        emitted = False
        for i in range(0, len(nodes), self.slice_size):
            chunk = nodes[i:i + self.slice_size]
            raw = _canon([_coarse_node(n) for n in chunk])[1:-1]
            if not raw:
                # Every node of the slice went while the pack ran.
                yield
                continue
            if emitted:
                raw = b"," + raw
            before = co.copy()
            more = co.compress(raw) + co.flush(zlib.Z_SYNC_FLUSH)
            if used + len(more) > budget:
                co, cut = before, True
                break
            out.append(more)
            used += len(more)
            emitted = True
            self.digest.update(raw)
            self.nodes_published += len(chunk)
            yield
        tail = b"]" + (b',"truncated":' + _canon({"nodes": self.total_nodes}) if cut else b"") + b"}"
        self.digest.update(tail)
        out.append(co.compress(tail))
        out.append(co.flush())
        self.parts["nodes"] = b"".join(out)
        value = self._header(cut) + b"".join(self.parts[name] for name in FLEET_PARTS)
        if budget < 0 or len(value) > self.max_size:
            self.size = len(value)
            return
        self.value = value

    def run(self) -> bytes | None:
        """All steps at once (tests, benchmarks): the value, or C{None}."""
        for _ in self.steps_iter():
            self.steps += 1
        return self.value


def pack_fleet(views: dict[str, Any], published_at: float, max_size: int = MAX_PUBLISHED) -> bytes | None:
    """The etcd value of the fleet views C{views}, packed at once (L{FleetPack})."""
    return FleetPack(views, published_at, max_size).run()


class FleetPublisher(LeasedPublisher):
    """
    The leader's side: publishes its admin views (C{views()}: C{nodes},
    C{replicas}, C{events}, C{status} as the admin API answers them, and
    C{leader}, C{leader_admin_url}) under C{prefix} while L{start}ed with a lease:
    packed every C{interval} seconds a slice per reactor turn
    (L{FleetPack}), written when they changed (the time stamp aside).
    A pack under way when this member stops leading (or leads again under
    another lease) is dropped. Over the size bound, nodes are cut (the
    rest is whole) and the nodes part says C{"truncated": {"nodes": TOTAL}}.
    """

    what = "fleet views"

    def __init__(self, clock: IReactorTime, store: Any, prefix: str, views: Callable[[], dict[str, Any]],
                 may_write: Callable[[], bool] = lambda: True, interval: float = FLEET_INTERVAL,
                 max_size: int = MAX_PUBLISHED, timer: Callable[[], float] = time.perf_counter,
                 slice_size: int = FLEET_SLICE):
        super().__init__(clock, store, prefix, fleet_key(prefix), may_write, interval, max_size)
        self.views = views
        self.timer = timer
        self.slice_size = slice_size
        #: Seconds of the reactor the last pack took (all its turns), and
        #: its longest turn.
        self.pack_seconds = 0.0
        self.pack_max_turn = 0.0
        #: Reactor turns the last pack took.
        self.pack_turns = 0
        #: Packs dropped because leadership changed while they ran.
        self.dropped = 0
        self._packing: IDelayedCall | None = None
        self._term = 0

    def stop(self) -> None:
        super().stop()
        self._term += 1
        if self._packing is not None and self._packing.active():
            self._packing.cancel()
            self.dropped += 1
        self._packing = None

    def _schedule(self) -> None:
        if self._packing is not None:
            return
        super()._schedule()

    def pack(self) -> tuple[bytes, bytes] | None:
        """The whole pack at once (tests, benchmarks; the reactor uses L{_flush})."""
        job = FleetPack(self.views(), self.clock.seconds(), self.max_size, self.slice_size)
        value = job.run()
        if value is None:
            self._too_large(job.size, ": not published even with its nodes cut; members that do not "
                                      "lead answer from the last one published")
            return None
        return value, job.fingerprint

    def _flush(self) -> None:
        lease = self._take_flush()
        if lease is None:
            return
        self.pack_seconds = self.pack_max_turn = 0.0
        self.pack_turns = 0
        began = self.timer()
        try:
            job = FleetPack(self.views(), self.clock.seconds(), self.max_size, self.slice_size)
        except Exception:
            job = None
            self.log.failure("reading the {what} to publish failed; trying again in {interval}s",
                             what=self.what, interval=self.interval)
        self._turn_done(began)
        if job is None:
            self._pack_done(None, None)
            return
        self._packing = self.clock.callLater(0, self._step, lease, self._term, job, job.steps_iter())

    def _turn_done(self, began: float) -> None:
        took = self.timer() - began
        self.pack_seconds += took
        self.pack_max_turn = max(self.pack_max_turn, took)
        self.pack_turns += 1

    def _step(self, lease: int, term: int, job: FleetPack, steps: Any) -> None:
        self._packing = None
        if self.lease != lease or self._term != term:
            self.dropped += 1
            return
        began = self.timer()
        try:
            next(steps)
        except StopIteration:
            self._turn_done(began)
            self._pack_done(lease, job)
            return
        except Exception:
            self._turn_done(began)
            self.log.failure("packing the {what} to publish failed; trying again in {interval}s",
                             what=self.what, interval=self.interval)
            self._pack_done(None, None)
            return
        job.steps += 1
        self._turn_done(began)
        self._packing = self.clock.callLater(0, self._step, lease, term, job, steps)

    def _pack_done(self, lease: int | None, job: FleetPack | None) -> None:
        if job is None or lease is None:
            # Not lost: packed again an interval on (a bug, logged).
            self._dirty = True
            self._last_at = self.clock.seconds()
            self._again()
            return
        self._packed()
        if job.value is None:
            self._too_large(job.size, ": not published even with its nodes cut; members that do not "
                                      "lead answer from the last one published")
        elif job.fingerprint != self._last_print and self.may_write():
            self._start_write(lease, job.value, job.fingerprint)
        self._again()

    def _again(self) -> None:
        if self.lease is not None:
            # Periodic: the views change with no one telling (heartbeats);
            # a large fleet is packed less often (FLEET_SHARE).
            self._dirty = True
            stretch = max(0.0, self.pack_seconds / FLEET_SHARE - self.interval)
            self._last_at = max(self._last_at, self.clock.seconds() + stretch)
            self._schedule()


class KeyFollower:
    """
    A member that does not lead: reads one published key, then watches it,
    and hands each new value to L{_take} (see the module docstring: fail
    static, read again every C{retry_interval} while etcd is away).
    """

    log = Logger()
    #: What is followed, in log lines.
    what = "document"

    def __init__(self, clock: IReactorTime, store: Any, prefix: str, key: bytes, retry_interval: float = 1.0):
        self.clock = clock
        self.store = store
        self.prefix = prefix
        self.key = key
        self.retry_interval = retry_interval
        self.following = False
        #: The mod revision of the value applied last (0: none yet).
        self.revision = 0
        #: The value applied last since L{start} (None: none yet). Cleared at
        #: each start: while its member led, its own reconciler rewrote the
        #: table, so the first document read after is applied even if equal.
        self.value: bytes | None = None
        self._applied = False
        #: Why the last read failed, if it did.
        self.last_error = ""
        self._watch: Any = None
        self._retry: IDelayedCall | None = None
        self._reading: defer.Deferred[None] | None = None
        self._generation = 0

    @property
    def applied(self) -> bool:
        """Whether a published value was applied (since this process began)."""
        return self._applied

    def start(self) -> None:
        if self.following:
            return
        self.following = True
        self.value = None
        self._generation += 1
        self._read(self._generation)

    def stop(self) -> None:
        self.following = False
        self._generation += 1
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        self._retry = None
        if self._reading is not None and not self._reading.called:
            self._reading.cancel()
        self._reading = None
        if self._watch is not None:
            w, self._watch = self._watch, None
            w.cancel()

    def _later(self, generation: int) -> None:
        if self.following and generation == self._generation and self._retry is None:
            self._retry = self.clock.callLater(self.retry_interval, self._again, generation)

    def _again(self, generation: int) -> None:
        self._retry = None
        self._read(generation)

    def _read(self, generation: int) -> None:
        if not self.following or generation != self._generation:
            return
        d = self._reading = defer.ensureDeferred(self.store.range(self.key))

        def read(answer: tuple[list[Any], int]) -> None:
            self._reading = None
            if not self.following or generation != self._generation:
                return
            self.last_error = ""
            try:
                kvs, revision = answer
                if kvs:
                    self._apply(kvs[0].value, kvs[0].mod_revision)
                # From the revision read at: no write between the read and
                # the watch is missed.
                self._follow(generation, revision + 1)
            except Exception:
                # Following goes on: read again, as after a failed read.
                self.log.failure("following the published {what} failed; reading again in "
                                 "{interval}s", what=self.what, interval=self.retry_interval)
                self.last_error = "following failed"
                self._later(generation)

        def failed(f: Any) -> None:
            self._reading = None
            if f.check(defer.CancelledError):
                return
            if not self.following or generation != self._generation:
                return
            if not self.last_error:
                self.log.warn("etcd: the published {what} cannot be read ({error}); the last "
                              "one stays, reading again every {interval}s",
                              what=self.what, error=f.getErrorMessage(), interval=self.retry_interval)
            self.last_error = f.getErrorMessage()
            self._later(generation)

        d.addCallbacks(read, failed)

    def _follow(self, generation: int, start: int) -> None:
        def on_events(events: list[Any], revision: int) -> None:
            if not self.following or generation != self._generation:
                return
            for ev in events:
                if ev.kind == "PUT" and ev.kv.mod_revision > self.revision:
                    self._apply(ev.kv.value, ev.kv.mod_revision)
                elif ev.kind == "DELETE":
                    self.log.warn("the published {what} {key} was deleted: the last one stays",
                                  what=self.what, key=self.key.decode())

        def ended(result: Any) -> None:
            if self._watch is w:
                self._watch = None
            if self.following and generation == self._generation:
                # Read again (what changed meanwhile), then watch again.
                self._later(generation)
            return None

        w = self._watch = self.store.watch(self.key, on_events, start_revision=start)
        w.done.addBoth(ended)

    def _apply(self, value: bytes, revision: int) -> None:
        try:
            self._take(value, revision)
        except Exception:
            # A bug (a raise in the table, say): said, and the next
            # document is still taken.
            self.revision = revision
            self.log.failure("applying the {what} published in etcd {key} (revision {revision}) "
                             "failed; the last one stays", what=self.what, key=self.key.decode(),
                             revision=revision)

    def _take(self, value: bytes, revision: int) -> None:
        """
        Apply C{value}, written at C{revision}: set L{value}, L{revision}
        and L{_applied} once applied; log (and keep the last) if unreadable.
        """
        raise NotImplementedError


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


class FleetDocument:
    """
    A fleet document as a member that does not lead holds it (L{FleetPack}
    wrote it): the header read, each part inflated when first asked for
    (and kept), C{events} and C{status} parsed then.

    @raise RoutesDataError: (at construction) the header is not one line
        of JSON as L{FleetPack} writes, or its parts are not within the value.
    """

    def __init__(self, value: bytes):
        end = value.find(b"\n", 0, 64 * 1024)
        if end < 0:
            raise RoutesDataError("no header line (JSON, under 64 KiB) before the parts")
        try:
            header = json.loads(value[:end])
        except ValueError as e:
            raise RoutesDataError(f"the header is not JSON: {e}") from None
        if not isinstance(header, dict):
            raise RoutesDataError("the header is not a JSON object")
        at = header.get("published_at")
        if isinstance(at, bool) or not isinstance(at, (int, float)):
            raise RoutesDataError("the header's published_at is not a time")
        parts = header.get("parts")
        if not isinstance(parts, dict):
            raise RoutesDataError("the header's parts is not an object")
        body = len(value) - end - 1
        self._spans: dict[str, tuple[int, int]] = {}
        for name in FLEET_PARTS:
            span = parts.get(name)
            if (not isinstance(span, list) or len(span) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in span)
                    or span[0] + span[1] > body):
                raise RoutesDataError(f"the part {name} is not within the value")
            self._spans[name] = (end + 1 + span[0], span[1])
        self.value = value
        self.published_at: float = at
        leader = header.get("leader")
        self.leader: str | None = leader if isinstance(leader, str) else None
        url = header.get("leader_admin_url")
        self.leader_admin_url: str | None = url if isinstance(url, str) else None
        self.truncated = header.get("truncated")
        self._raw: dict[str, bytes] = {}
        self._parsed: dict[str, Any] = {}

    def part(self, name: str) -> bytes:
        """
        The JSON bytes of part C{name}, inflated (once).

        @raise RoutesDataError: not zlib, or too large inflated.
        """
        raw = self._raw.get(name)
        if raw is None:
            at, size = self._spans[name]
            inflate = zlib.decompressobj()
            try:
                raw = inflate.decompress(self.value[at:at + size], MAX_INFLATED)
            except zlib.error as e:
                raise RoutesDataError(f"the part {name} is not zlib-compressed: {e}") from None
            if inflate.unconsumed_tail:
                raise RoutesDataError(f"the part {name} inflates past {MAX_INFLATED} bytes")
            if not inflate.eof or inflate.unused_data:
                # A stream cut short inflates to a plausible prefix without
                # an error: only its end says it is whole.
                raise RoutesDataError(f"the part {name} is not one whole zlib stream")
            self._raw[name] = raw
        return raw

    def _json(self, name: str, kind: type) -> Any:
        if name not in self._parsed:
            try:
                parsed = json.loads(self.part(name))
            except (ValueError, RecursionError) as e:
                raise RoutesDataError(f"the part {name} is not JSON: {e}") from None
            if not isinstance(parsed, kind):
                raise RoutesDataError(f"the part {name} is not a JSON {kind.__name__}")
            self._parsed[name] = parsed
        return self._parsed[name]

    def events(self) -> list[Any]:
        """The events published (parsed once). @raise RoutesDataError: unreadable."""
        return self._json("events", list)  # type: ignore[no-any-return]

    def status(self) -> dict[str, Any]:
        """The leader's status, fleet parts (parsed once). @raise RoutesDataError: unreadable."""
        return self._json("status", dict)  # type: ignore[no-any-return]

    def views(self) -> dict[str, Any]:
        """Everything, parsed (tests and tools; costly at fleet sizes)."""
        nodes = self._json("nodes", dict)
        views = {"leader": self.leader, "leader_admin_url": self.leader_admin_url, "nodes": nodes.get("nodes"),
                 "replicas": self._json("replicas", dict).get("replicas"), "events": self.events(),
                 "status": self.status()}
        if "truncated" in nodes:
            views["truncated"] = nodes["truncated"]
        return views


def unpack_fleet(value: bytes) -> dict[str, Any]:
    """C{{"published_at": T, "views": {...}}}: a fleet value, all parsed (tests, tools)."""
    doc = FleetDocument(value)
    return {"published_at": doc.published_at, "views": doc.views()}


class FleetFollower(KeyFollower):
    """
    A member that does not lead: holds the fleet views the leader
    published (L{document}, a L{FleetDocument}; None before the first), to
    answer C{GET /api/v1/nodes}, C{/replicas}, C{/events} and
    C{/status}'s fleet parts from. Applying a value reads its header only.
    """

    what = "fleet views"

    def __init__(self, clock: IReactorTime, store: Any, prefix: str, retry_interval: float = 1.0):
        super().__init__(clock, store, prefix, fleet_key(prefix), retry_interval)
        self.document: FleetDocument | None = None

    def _take(self, value: bytes, revision: int) -> None:
        if value == self.value:
            self.revision = revision
            return
        self.revision = revision
        try:
            doc = FleetDocument(value)
            # Every part whole, and the small ones JSON, before the last
            # good document is replaced (nodes and replicas are answered
            # as they are: their bytes are checked for a whole stream and
            # for the answer's shape only).
            doc.status(), doc.events()
            for name in ("nodes", "replicas"):
                raw = doc.part(name)
                if not (raw.startswith(b'{"published_at":') and raw.endswith(b"}")):
                    raise RoutesDataError(f"the part {name} is not a published answer")
        except RoutesDataError as e:
            self.log.error("the fleet views published in etcd {key} (revision {revision}) are unreadable: "
                           "{error}; the last ones stay", key=self.key.decode(), revision=revision,
                           error=str(e))
            return
        self.document = doc
        self.value = value
        self._applied = True
