"""
The leader's fleet views (C{GET /api/v1/nodes}, C{/replicas}, C{/events}
and C{/status}'s fleet parts), published in etcd for the members that do
not lead, which answer those requests from them (DESIGN §17). The
lease-guarded write, the debounce, the size bound and the fail-static
follower are L{llmgw.control.ha.publishing}'s.

One key, C{PREFIX/published/fleet}, holds a document of parts, each its own
zlib stream (L{FleetPack}). The leader (L{FleetPublisher}) packs it every
L{FLEET_INTERVAL} seconds, a slice per reactor turn, coarsened where it
changes with every heartbeat, and writes it when it changed; over the size
bound the nodes are cut. A member that does not lead (L{FleetFollower})
holds the last good document (L{FleetDocument}) and inflates a part only
when asked for it.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import zlib
from collections.abc import Callable
from typing import Any

from twisted.internet.interfaces import IDelayedCall, IReactorTime

from llmgw.control.ha.publishing import (
    MAX_INFLATED,
    MAX_PUBLISHED,
    PACK_LEVEL,
    KeyFollower,
    LeasedPublisher,
)
from llmgw.routing import RoutesDataError

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


def fleet_key(prefix: str) -> bytes:
    """Where the leader's fleet views (nodes, replicas, events) are published."""
    return (prefix.rstrip("/") + "/published/fleet").encode()


def _coarse_gpu(gpu: Any) -> Any:
    used = gpu.get("memory_used_mb") if isinstance(gpu, dict) else None
    if isinstance(used, int) and not isinstance(used, bool):
        return {**gpu, "memory_used_mb": used // MEMORY_STEP_MB * MEMORY_STEP_MB}
    return gpu



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
    One fleet document being packed, a slice per step (DESIGN §17): each
    part (L{FLEET_PARTS}) is its own zlib stream of the exact JSON a member
    that does not lead answers with (C{nodes} and C{replicas}: the whole
    answer, C{published_at} and C{published_by} included; C{events}: the
    list; C{status}: the object), so that such a member inflates only the
    part asked for and parses only the small ones.
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
        self._connected: frozenset[str] | None = None

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

    def connected(self) -> frozenset[str]:
        """
        The ids of the nodes the leader had connected when it published
        (parsed once). A document whose nodes were cut lists only those
        that fit.

        @raise RoutesDataError: the nodes part is unreadable.
        """
        if self._connected is None:
            try:
                nodes = json.loads(self.part("nodes")).get("nodes")
            except (ValueError, RecursionError, AttributeError) as e:
                raise RoutesDataError(f"the part nodes is not a published answer: {e}") from None
            if not isinstance(nodes, list):
                raise RoutesDataError("the part nodes holds no list of nodes")
            self._connected = frozenset(
                n["id"] for n in nodes
                if isinstance(n, dict) and isinstance(n.get("id"), str) and n.get("connected") is True)
        return self._connected

    def is_connected(self, node_id: str) -> bool:
        """
        Whether C{node_id} is in L{connected}. A name the nodes part does
        not mention is answered from its bytes alone (a few ms at 10,000
        nodes); only one it mentions parses the part (once per document,
        some 400 ms at that size).

        @raise RoutesDataError: the nodes part is unreadable.
        """
        # The part is canonical JSON (_canon): a node listed there has
        # exactly these bytes, so their absence settles it.
        if b'"id":' + json.dumps(node_id).encode() not in self.part("nodes"):
            return False
        return node_id in self.connected()

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
