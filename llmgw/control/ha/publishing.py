"""
One key the leader publishes in etcd and the members that do not lead
follow (DESIGN §17): the machinery the published routing table
(L{llmgw.control.ha.published}) and fleet views
(L{llmgw.control.ha.published_fleet}) share.

- B{The leader} (L{LeasedPublisher}) writes the key with a transaction that
  compares the leader key's lease with the lease it won under, so a deposed
  leader's write changes nothing (and stops its publisher). Writes are
  debounced: at most one each C{interval} seconds, and only when what is
  packed differs from what was last written. A value over C{max_size}
  compressed bytes (L{MAX_PUBLISHED}: etcd refuses a request over 1.5 MiB,
  C{--max-request-bytes}) is not written: the error is logged once per
  term, and followers keep the last value written. A pack that raised is
  packed again an interval on.
- B{Every other member} (L{KeyFollower}) reads the key, then watches it
  from the revision read at, and applies each new value. Fail static: while
  etcd is away, or when the key is deleted or unreadable, the last value
  stays, and the follower reads again every C{retry_interval}. A restart
  applies etcd's value even when it equals the last one applied.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from llmgw.control.ha.election import leader_key
from llmgw.control.ha.following import EtcdFollowing
from llmgw.etcd import Compare, EtcdError, Put, Range
from llmgw.routing import RoutesDataError

#: Seconds between two writes of a published key, at least (the routing
#: table's; the fleet views have their own interval).
PUBLISH_INTERVAL = 1.0
#: The most compressed bytes written: under etcd's default 1.5 MiB request
#: limit with room for the rest of the transaction.
MAX_PUBLISHED = 1024 * 1024
#: zlib's level: fast (the leader packs the whole table on the reactor).
PACK_LEVEL = 1
#: The most bytes a published document may inflate to when read.
MAX_INFLATED = 64 * 1024 * 1024


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


class KeyFollower(EtcdFollowing):
    """
    A member that does not lead: reads one published key, then watches it,
    and hands each new value to L{_take} (see the module docstring: fail
    static, read again every C{retry_interval} while etcd is away).
    """

    log = Logger()
    #: What is followed, in log lines.
    what = "document"

    def __init__(self, clock: IReactorTime, store: Any, prefix: str, key: bytes, retry_interval: float = 1.0):
        super().__init__(clock, store, retry_interval)
        self.prefix = prefix
        self.key = key
        #: The mod revision of the value applied last (0: none yet).
        self.revision = 0
        #: The value applied last since L{start} (None: none yet). Cleared at
        #: each start: while its member led, its own reconciler rewrote the
        #: table, so the first document read after is applied even if equal.
        self.value: bytes | None = None
        self._applied = False
        #: Why the last read failed, if it did.
        self.last_error = ""

    @property
    def applied(self) -> bool:
        """Whether a published value was applied (since this process began)."""
        return self._applied

    def _starting(self) -> None:
        self.value = None

    def _read(self, generation: int) -> None:
        if not self._current(generation):
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
