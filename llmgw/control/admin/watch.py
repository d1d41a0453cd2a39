"""
The watch stream (DESIGN §18): C{GET /api/v1/watch} on the admin API
upgrades to a WebSocket that pushes the fleet's changes as JSON text
messages, one a frame, each carrying the fleet C{revision} (an int that
increases by one per message within one control plane process, whose
C{epoch} tells processes apart).

Messages (C{type}):

  - C{snapshot}: the whole state at C{revision}: C{routes} (the document
    C{GET /api/v1/routes} answers), and for roles that may read them
    C{nodes}, C{replicas}, C{deployments} and the last 50 C{events}.
  - C{routes}: the routes of C{models} (model to its routes, an empty list
    when it has none left) as of the routing table's C{routes_revision};
    C{known} (the declared models) when that changed.
  - C{node} / C{replica} / C{deployment}: one entry's new view (C{node},
    C{replica}, C{deployment}), or C{removed: true}; C{id} names it.
  - C{event}: one event of the reconciler's log (C{event}).
  - C{reset}: the revision asked for cannot be resumed from (too old, or
    from another process: C{reason} says which); a C{snapshot} follows.

C{?only=routes} narrows the stream to what a gateway follows (the
C{gateway} role gets only that anyway). C{?since=REVISION} (with
C{&epoch=EPOCH}) resumes: the messages after
C{REVISION} are sent from a bounded ring, without a gap, or a C{reset}.

Route changes come from L{RoutingTable.subscribe} as they happen; nodes,
replicas and deployments are diffed from the fleet's views every
C{views_interval} seconds while anyone may see them, events read from
C{events(since)} on the same pass. Messages are framed once and written to
every client in one write per flush: at most every C{flush_interval}
(100 ms) to clients of the whole stream, every C{routes_flush_interval}
(20 ms) to those that follow routes only.

A client that does not read is dropped: once its transport's buffer is
full (the transport pauses us), what is sent to it is held up to
C{max_buffer} bytes; past that the connection is aborted and logged.
The C{gateway} role sees only C{snapshot} routes and C{routes} messages.

This module is the stream's source, L{WatchHub}; its clients' side (the
upgrade, the WebSocket protocol, requests over the socket) is
L{llmgw.control.admin.websocket}.
"""

from __future__ import annotations

import collections
import json
import secrets
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from autobahn.twisted.websocket import WebSocketServerFactory
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from llmgw.engines import SIGNALS
from llmgw.routing import RoutingTable, snapshot_to_json

if TYPE_CHECKING:
    from llmgw.control.admin.websocket import WatchProtocol

#: Messages kept for resuming.
RING_SIZE = 10_000
#: Bytes held for a client whose transport is full before it is dropped.
MAX_CLIENT_BUFFER = 4 * 1024 * 1024
#: Seconds between diffs of the node, replica and deployment views.
VIEWS_INTERVAL = 0.5
#: Least seconds between two flushes to the clients that read the whole
#: stream (ops tools, pages): bursts are coalesced into one write a client,
#: which is what keeps a thousand of them cheap.
FLUSH_INTERVAL = 0.1
#: The same for clients that follow the routes only (gateways, whose
#: routes should be current within 100 ms, and are few).
ROUTES_FLUSH_INTERVAL = 0.02
#: Seconds between checks of the clients' certificates against the CRL.
REVOCATION_CHECK_S = 2.0
#: The latest events a snapshot carries.
SNAPSHOT_EVENTS = 50
#: Seconds the views are diffed on after the last fleet reader left.
RESUME_GRACE = 60.0

#: Message classes: what every role sees, and what needs a fleet reader.
ROUTES, FLEET = "routes", "fleet"
#: Fields left out when comparing views (they change on every heartbeat;
#: and a replica's shards' signals are compared without their age_s).
VOLATILE = {"node": ("last_seen",)}


def encode_message(message: dict[str, Any]) -> bytes:
    """
    C{message} as compact JSON, the text of one WebSocket message.
    """
    return json.dumps(message, allow_nan=False, separators=(",", ":"), default=_default).encode("utf-8")


def _default(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _route_json(table: RoutingTable, model: str, now: float) -> list[dict[str, Any]]:
    out = []
    for r in table.routes(model):
        entry: dict[str, Any] = {"replica": r.replica_id, "model": r.model, "address": r.address,
                                 "draining": r.draining}
        if r.signals is not None:
            entry["signals"] = {"age_s": round(r.signals.age(now), 3)} | {
                k: v for k in SIGNALS
                if (v := getattr(r.signals, k)) is not None
            }
        if r.adapters:
            entry["adapters"], entry["lora_ids"] = list(r.adapters), r.lora_ids
        out.append(entry)
    return out


class ResumeError(ValueError):
    """
    A C{since} or C{epoch} parameter is malformed.
    """


def parse_resume(args: dict[bytes, list[bytes]]) -> tuple[int | None, str | None, bool]:
    """
    C{since}, C{epoch} and whether C{only=routes} was asked, from a
    request's query arguments.

    @raise ResumeError: one is given twice, C{since} is not a whole
        number, or C{only} is not C{routes}.
    """
    out: list[Any] = []
    for name in (b"since", b"epoch", b"only"):
        values = args.get(name) or []
        if len(values) > 1:
            raise ResumeError(f"give {name.decode()!r} once")
        out.append(values[0].decode("utf-8", "replace") if values else None)
    since_raw, epoch, only = out
    if only not in (None, "routes"):
        raise ResumeError(f"only={only[:40]!r}: the stream can be narrowed to only=routes")
    since = None
    if since_raw is not None:
        if not (since_raw.isascii() and since_raw.isdigit()) or len(since_raw) > 18:
            raise ResumeError(f"since={since_raw!r} is not a revision (a whole number, 0 or more)")
        since = int(since_raw)
    if epoch is not None and (len(epoch) > 64 or not epoch.isalnum()):
        raise ResumeError(f"epoch={epoch[:70]!r} is not an epoch this API hands out")
    return since, epoch, only == "routes"


class _Batch:
    """
    The messages pending for one audience (the clients that read the whole
    stream, or those that follow routes only), written to each of its
    clients at most every C{interval} seconds.
    """

    def __init__(self, clock: Any, interval: float, fleet: bool):
        self.clock = clock
        self.interval = interval
        self.fleet = fleet
        self.clients: set[WatchProtocol] = set()
        self.pending: list[bytes] = []
        self.call: IDelayedCall | None = None
        self.last = -interval

    def add(self, framed: bytes) -> None:
        self.pending.append(framed)
        if self.call is None:
            delay = max(0.0, self.last + self.interval - self.clock.seconds())
            self.call = self.clock.callLater(delay, self.flush)

    def cancel(self) -> None:
        if self.call is not None and self.call.active():
            self.call.cancel()
        self.call = None

    def flush(self) -> None:
        self.cancel()
        if not self.pending:
            return
        self.last = self.clock.seconds()
        data, self.pending = b"".join(self.pending), []
        for client in list(self.clients):
            client.send_framed(data)


class WatchHub:
    """
    The stream's source: numbers the fleet's changes, keeps the last
    C{ring_size} messages and sends each to the attached clients.

    @param fleet: the reconciler (or a fake): C{nodes()}, C{replicas()},
        C{deployments()}, C{events(since)}, and C{routing_table} if it
        publishes one.
    """

    log = Logger()

    def __init__(
        self,
        fleet: Any,
        clock: Any,
        ring_size: int = RING_SIZE,
        views_interval: float = VIEWS_INTERVAL,
        flush_interval: float = FLUSH_INTERVAL,
        routes_flush_interval: float = ROUTES_FLUSH_INTERVAL,
        max_buffer: int = MAX_CLIENT_BUFFER,
        timeouts: bool = True,
        resume_grace: float = RESUME_GRACE,
    ):
        #: Seconds the views are still diffed after the last client that
        #: reads them left, so that it can resume without a gap.
        self.resume_grace = resume_grace
        #: Whether clients get autobahn's handshake timeout and keep-alive
        #: pings (timers on txaio's reactor: tests on a Clock turn them off).
        self.timeouts = timeouts
        self.fleet = fleet
        self.clock = clock
        self.epoch = secrets.token_hex(8)
        self.revision = 0
        self.views_interval = views_interval
        self.flush_interval = flush_interval
        self.max_buffer = max_buffer
        #: (revision, class, framed bytes), oldest first.
        self._ring: collections.deque[tuple[int, str, bytes]] = collections.deque(maxlen=ring_size)
        self._fleet_batch = _Batch(clock, flush_interval, fleet=True)
        self._routes_batch = _Batch(clock, routes_flush_interval, fleet=False)
        self._batches = (self._fleet_batch, self._routes_batch)
        self.clients: set[WatchProtocol] = set()
        self.running = False
        self.dropped = 0
        #: The serials the CRL in force lists (the admin API's), checked
        #: every L{REVOCATION_CHECK_S} seconds against the clients'.
        self.revoked: Callable[[], frozenset[int]] | None = None
        self._revocation_loop: LoopingCall | None = None
        self._fleet_readers = 0
        #: Revision from which fleet messages are complete (views are
        #: diffed only while a fleet reader is attached).
        self._fleet_from: int | None = None
        self._views: dict[str, dict[str, Any]] = {}
        self._event_key: tuple[float, int] = (0.0, 0)
        self._seen_at_time: set[Any] = set()
        self._views_loop: LoopingCall | None = None
        self._views_stop: IDelayedCall | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._framer = WebSocketServerFactory()
        table = getattr(fleet, "routing_table", None)
        self.table = table if isinstance(table, RoutingTable) else None

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self.running = True
        if self.table is not None and self._unsubscribe is None:
            self._unsubscribe = self.table.subscribe(self._routes_changed)
        if self.revoked is not None and self._revocation_loop is None:
            loop = self._revocation_loop = LoopingCall(self.drop_revoked)
            loop.clock = self.clock
            loop.start(REVOCATION_CHECK_S, now=False).addErrback(
                lambda f: self.log.failure("watch: the revocation check stopped", failure=f)
            )

    def drop_revoked(self) -> None:
        """
        Drop the clients whose admin certificate a CRL now lists (TLS checks
        the CRL only at the handshake; the stream would flow on).
        """
        if self.revoked is None or not self.clients:
            return
        try:
            revoked = self.revoked()
            for client in list(self.clients):
                if client.serial is not None and client.serial in revoked:
                    self.log.warn("watch: dropping {who}: its certificate has been revoked", who=client.who)
                    self.detach(client)
                    client.attached = False
                    transport: Any = client.transport
                    if transport is not None:
                        transport.abortConnection()
        except Exception:
            self.log.failure("watch: checking the clients' certificates failed")

    def stop(self) -> None:
        self.running = False
        if self._revocation_loop is not None and self._revocation_loop.running:
            self._revocation_loop.stop()
        self._revocation_loop = None
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self._stop_views()
        for batch in self._batches:
            batch.cancel()
        for client in list(self.clients):
            client.dropConnection(abort=True)

    # -- producing messages ----------------------------------------------------------

    def frame(self, message: dict[str, Any]) -> bytes:
        """
        C{message} framed as one WebSocket text message, ready to write.
        """
        framed: bytes = self._framer.prepareMessage(encode_message(message)).payloadHybi
        return framed

    def _append(self, message: dict[str, Any], cls: str) -> None:
        self.revision += 1
        message["revision"] = self.revision
        framed = self.frame(message)
        self._ring.append((self.revision, cls, framed))
        for batch in self._batches:
            if batch.clients and (cls == ROUTES or batch.fleet):
                batch.add(framed)

    def _routes_changed(self, routes_revision: int, models: frozenset[str], known_changed: bool) -> None:
        assert self.table is not None
        now = self.clock.seconds()
        message: dict[str, Any] = {
            "type": "routes",
            "routes_revision": routes_revision,
            "models": {m: _route_json(self.table, m, now) for m in sorted(models)},
        }
        if known_changed:
            message["known"] = sorted(self.table.snapshot().known_models())
        self._append(message, ROUTES)

    def flush(self) -> None:
        """
        Send what is pending to every client now.
        """
        for batch in self._batches:
            batch.flush()

    # -- views ---------------------------------------------------------------------------

    def _start_views(self) -> None:
        self._views = {
            "node": self._index("node", self.fleet.nodes()),
            "replica": self._index("replica", self.fleet.replicas()),
            "deployment": self._index("deployment", self.fleet.deployments()),
        }
        self._note_events(self.fleet.events(0.0))
        # A revision of its own, with no message: whoever holds an earlier
        # one may have missed fleet changes made while nobody watched.
        self.revision += 1
        self._fleet_from = self.revision
        loop = self._views_loop = LoopingCall(self._poll_views)
        loop.clock = self.clock
        loop.start(self.views_interval, now=False).addErrback(
            lambda f: self.log.failure("watch: the views loop stopped", failure=f)
        )

    def _stop_views(self) -> None:
        if self._views_stop is not None and self._views_stop.active():
            self._views_stop.cancel()
        self._views_stop = None
        if self._views_loop is not None and self._views_loop.running:
            self._views_loop.stop()
        self._views_loop = None
        self._fleet_from = None
        self._views = {}

    @staticmethod
    def _key(kind: str, view: dict[str, Any]) -> str:
        return str(view.get("model") if kind == "deployment" else view.get("id"))

    def _index(self, kind: str, views: Iterable[dict[str, Any]]) -> dict[str, Any]:
        return {self._key(kind, v): v for v in views}

    def _comparable(self, kind: str, view: dict[str, Any]) -> Any:
        if kind == "replica":
            # A shard's engine signals carry their age, new on every pass.
            shards = view.get("shards")
            if not isinstance(shards, list):
                return view
            return dict(view, shards=[
                dict(s, signals={k: v for k, v in s["signals"].items() if k != "age_s"})
                if isinstance(s, dict) and isinstance(s.get("signals"), dict) else s
                for s in shards
            ])
        drop = VOLATILE.get(kind)
        if not drop:
            return view
        return {k: v for k, v in view.items() if k not in drop}

    def _poll_views(self) -> None:
        # Wrapped so that one bad pass never stops the loop for good.
        try:
            self.diff_views()
        except Exception:
            self.log.failure("watch: diffing the fleet's views failed")

    def diff_views(self) -> None:
        """
        Compare the fleet's views with the last ones and send what changed.
        """
        if self._fleet_from is None:
            return
        for kind, views in (
            ("node", self.fleet.nodes()),
            ("replica", self.fleet.replicas()),
            ("deployment", self.fleet.deployments()),
        ):
            old = self._views[kind]
            new = self._index(kind, views)
            for key, view in new.items():
                before = old.get(key)
                if before is None or self._comparable(kind, before) != self._comparable(kind, view):
                    self._append({"type": kind, "id": key, kind: view}, FLEET)
            for key in old.keys() - new.keys():
                self._append({"type": kind, "id": key, "removed": True}, FLEET)
            self._views[kind] = new
        time, _ = self._event_key
        for event in self._note_events(self.fleet.events(max(0.0, time - 0.001))):
            self._append({"type": "event", "event": event}, FLEET)

    def _note_events(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """
        The events not seen before (by sequence number where they carry
        one, else by content at the newest time seen), remembered as seen.
        """
        new = []
        last_time, last_seq = self._event_key
        for e in events:
            t = float(e.get("time", 0.0))
            seq = e.get("seq")
            if isinstance(seq, int):
                if seq <= last_seq:
                    continue
            elif t < last_time or (t == last_time and encode_message(e) in self._seen_at_time):
                continue
            if t > last_time:
                self._seen_at_time = set()
            self._seen_at_time.add(encode_message(e))
            last_time = max(last_time, t)
            if isinstance(seq, int):
                last_seq = seq
            new.append(e)
        self._event_key = (last_time, last_seq)
        return new

    # -- clients -------------------------------------------------------------------------

    def snapshot(self, fleet_reader: bool) -> dict[str, Any]:
        """
        The C{snapshot} message for a client now (its revision the current).
        """
        message: dict[str, Any] = {"type": "snapshot", "revision": self.revision, "epoch": self.epoch}
        if self.table is not None:
            message["routes"] = snapshot_to_json(self.table, self.clock.seconds())
        if fleet_reader:
            message["nodes"] = list(self._views["node"].values())
            message["replicas"] = list(self._views["replica"].values())
            message["deployments"] = list(self._views["deployment"].values())
            message["events"] = self.fleet.events(0.0)[-SNAPSHOT_EVENTS:]
        return message

    def attach(self, client: WatchProtocol, since: int | None, epoch: str | None) -> None:
        """
        Start sending to C{client}: what follows C{since} from the ring, or
        (with no C{since}, or one that cannot be resumed) a snapshot.
        """
        # Send what is pending first, so that this client's start lines up
        # with what the others have.
        batch = self._fleet_batch if client.fleet_reader else self._routes_batch
        batch.flush()
        self.clients.add(client)
        batch.clients.add(client)
        if client.fleet_reader:
            self._fleet_readers += 1
            if self._views_stop is not None:
                if self._views_stop.active():
                    self._views_stop.cancel()
                self._views_stop = None
            if self._fleet_from is None:
                self._start_views()
        problem = self._resume_problem(since, epoch, client.fleet_reader)
        if since is not None and problem is None:
            assert since is not None
            data = b"".join(
                f for rev, c, f in self._ring if rev > since and (client.fleet_reader or c == ROUTES)
            )
            if data:
                client.send_framed(data)
            return
        out = []
        if problem is not None:
            out.append(self.frame({"type": "reset", "revision": self.revision, "epoch": self.epoch,
                                   "reason": problem}))
        out.append(self.frame(self.snapshot(client.fleet_reader)))
        client.send_framed(b"".join(out))

    def _resume_problem(self, since: int | None, epoch: str | None, fleet_reader: bool) -> str | None:
        if since is None:
            return None
        if epoch is not None and epoch != self.epoch:
            return f"epoch {epoch} is another control plane process's (this one is {self.epoch}); re-read"
        if since > self.revision:
            return f"revision {since} is newer than this control plane's {self.revision}; re-read"
        oldest = self._ring[0][0] if self._ring else self.revision + 1
        if since < oldest - 1:
            return f"revision {since} is older than the oldest kept ({oldest}); re-read"
        if fleet_reader and self._fleet_from is not None and since < self._fleet_from:
            return f"fleet changes are kept from revision {self._fleet_from} only; re-read"
        return None

    def detach(self, client: WatchProtocol) -> None:
        if client not in self.clients:
            return
        self.clients.discard(client)
        self._fleet_batch.clients.discard(client)
        self._routes_batch.clients.discard(client)
        if client.fleet_reader:
            self._fleet_readers -= 1
            if not self.running:
                self._stop_views()
            elif self._fleet_readers == 0 and self._views_stop is None:
                self._views_stop = self.clock.callLater(self.resume_grace, self._stop_views)
