"""
An in-memory etcd for unit tests: the subset of L{llmgw.etcd.EtcdClient}
that llmgw uses (leases on an injected clock, put/range/delete, txn with
compares, watch from now), with knobs for the faults tests need.

Several L{llmgw.control.ha.election.Election}s may share one L{FakeEtcd}, as
members share a cluster. L{FakeEtcd.available} C{False} makes every call
fail with L{EtcdUnavailable} (no member reachable); L{FakeEtcd.hang}
C{True} makes every call wait forever (a member cut off from its quorum:
the caller's own timeout must end it). Lease expiry is exact: a lease of
TTL t granted or renewed at time s expires at s + t on the clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from llmgw.etcd import (
    GRPC_NOT_FOUND,
    Compare,
    Delete,
    EtcdError,
    EtcdUnavailable,
    KeyValue,
    Op,
    Put,
    Range,
    TxnResult,
    WatchEvent,
)


class FakeWatch:
    def __init__(self, fake: FakeEtcd, key: bytes, range_end: bytes,
                 on_events: Callable[[list[WatchEvent], int], None]):
        self.fake = fake
        self.key = key
        self.range_end = range_end
        self.on_events = on_events
        self.done: defer.Deferred[None] = defer.Deferred()
        self.revision = fake.revision

    def matches(self, key: bytes) -> bool:
        return key == self.key if not self.range_end else self.key <= key < self.range_end

    def cancel(self) -> None:
        self.fake.watches.discard(self)
        if not self.done.called:
            self.done.callback(None)


class FakeEtcd:
    def __init__(self, clock: IReactorTime):
        self.clock = clock
        self.revision = 1
        self.kvs: dict[bytes, KeyValue] = {}
        self.leases: dict[int, float] = {}
        self.lease_ttl: dict[int, int] = {}
        self._expiry: dict[int, IDelayedCall] = {}
        self._next_lease = 1000
        self.available = True
        self.hang = False
        self.watches: set[FakeWatch] = set()
        #: Every call made, by method name: tests read how often a member asked.
        self.calls: list[str] = []

    # -- fault knobs ------------------------------------------------------------

    def _gate(self, name: str) -> defer.Deferred[Any] | None:
        self.calls.append(name)
        if self.hang:
            return defer.Deferred()
        if not self.available:
            return defer.fail(EtcdUnavailable("no etcd member could be reached (fake: unavailable)"))
        return None

    def expire(self, lease: int) -> None:
        """Expire C{lease} now, as etcd would at its deadline."""
        self._revoke(lease)

    # -- state ------------------------------------------------------------------

    def _bump(self) -> int:
        self.revision += 1
        return self.revision

    def _notify(self, events: list[WatchEvent]) -> None:
        for w in list(self.watches):
            mine = [e for e in events if w.matches(e.kv.key)]
            if mine:
                w.revision = self.revision
                w.on_events(mine, self.revision)

    def _revoke(self, lease: int) -> bool:
        if lease not in self.leases:
            return False
        del self.leases[lease]
        self.lease_ttl.pop(lease, None)
        call = self._expiry.pop(lease, None)
        if call is not None and call.active():
            call.cancel()
        gone = [k for k, kv in self.kvs.items() if kv.lease == lease]
        if gone:
            rev = self._bump()
            events = []
            for k in gone:
                old = self.kvs.pop(k)
                events.append(WatchEvent("DELETE", replace(old, value=b"", mod_revision=rev)))
            self._notify(events)
        return True

    def _arm(self, lease: int) -> None:
        call = self._expiry.get(lease)
        if call is not None and call.active():
            call.cancel()
        ttl = self.lease_ttl[lease]
        self.leases[lease] = self.clock.seconds() + ttl
        self._expiry[lease] = self.clock.callLater(ttl, self._revoke, lease)

    def _put(self, key: bytes, value: bytes, lease: int, rev: int) -> WatchEvent:
        if lease and lease not in self.leases:
            raise EtcdError(GRPC_NOT_FOUND, "etcdserver: requested lease not found", "fake")
        old = self.kvs.get(key)
        kv = KeyValue(key, value, old.create_revision if old else rev, rev,
                      (old.version if old else 0) + 1, lease)
        self.kvs[key] = kv
        return WatchEvent("PUT", kv)

    def _range(self, key: bytes, range_end: bytes = b"") -> list[KeyValue]:
        if not range_end:
            return [self.kvs[key]] if key in self.kvs else []
        return [self.kvs[k] for k in sorted(self.kvs) if key <= k < range_end]

    def _holds(self, c: Compare) -> bool:
        kv = self.kvs.get(c.key)
        actual: int | bytes
        if c.target == "CREATE":
            actual = kv.create_revision if kv else 0
        elif c.target == "MOD":
            actual = kv.mod_revision if kv else 0
        elif c.target == "VERSION":
            actual = kv.version if kv else 0
        elif c.target == "LEASE":
            actual = kv.lease if kv else 0
        else:
            actual = kv.value if kv else b""
        op = c.operand
        if c.result == "EQUAL":
            return actual == op
        if c.result == "NOT_EQUAL":
            return actual != op
        if c.result == "GREATER":
            return actual > op  # type: ignore[operator]
        return actual < op  # type: ignore[operator]

    # -- the client's API -------------------------------------------------------

    def grant(self, ttl: int) -> defer.Deferred[tuple[int, int]]:
        return self._gate("grant") or self._grant(ttl)

    def _grant(self, ttl: int) -> defer.Deferred[tuple[int, int]]:
        self._next_lease += 1
        lease = self._next_lease
        self.lease_ttl[lease] = ttl
        self._arm(lease)
        return defer.succeed((lease, ttl))

    def keepalive(self, lease: int) -> defer.Deferred[int]:
        gated = self._gate("keepalive")
        if gated is not None:
            return gated
        if lease not in self.leases:
            return defer.succeed(0)
        self._arm(lease)
        return defer.succeed(self.lease_ttl[lease])

    def revoke(self, lease: int) -> defer.Deferred[None]:
        gated = self._gate("revoke")
        if gated is not None:
            return gated
        self._revoke(lease)
        return defer.succeed(None)

    def put(self, key: bytes, value: bytes, lease: int = 0) -> defer.Deferred[int]:
        gated = self._gate("put")
        if gated is not None:
            return gated
        try:
            rev = self.revision + 1
            ev = self._put(key, value, lease, rev)
        except EtcdError as e:
            return defer.fail(e)
        self._bump()
        self._notify([ev])
        return defer.succeed(rev)

    def range(self, key: bytes, range_end: bytes = b"") -> defer.Deferred[tuple[list[KeyValue], int]]:
        return self._gate("range") or defer.succeed((self._range(key, range_end), self.revision))

    def get(self, key: bytes) -> defer.Deferred[KeyValue | None]:
        gated = self._gate("get")
        if gated is not None:
            return gated
        found = self._range(key)
        return defer.succeed(found[0] if found else None)

    def get_prefix(self, prefix: bytes) -> defer.Deferred[tuple[list[KeyValue], int]]:
        from llmgw.etcd import prefix_end

        return self.range(prefix, prefix_end(prefix))

    def delete(self, key: bytes, range_end: bytes = b"") -> defer.Deferred[int]:
        gated = self._gate("delete")
        if gated is not None:
            return gated
        return defer.succeed(self._delete(key, range_end))

    def _delete(self, key: bytes, range_end: bytes) -> int:
        gone = self._range(key, range_end)
        if gone:
            rev = self._bump()
            for kv in gone:
                del self.kvs[kv.key]
            self._notify([WatchEvent("DELETE", replace(kv, value=b"", mod_revision=rev)) for kv in gone])
        return len(gone)

    def txn(self, compare: Sequence[Compare], success: Sequence[Op],
            failure: Sequence[Op] = ()) -> defer.Deferred[TxnResult]:
        gated = self._gate("txn")
        if gated is not None:
            return gated
        ok = all(self._holds(c) for c in compare)
        ops = success if ok else failure
        writes = any(isinstance(op, Put | Delete) for op in ops)
        rev = self.revision + 1 if writes else self.revision
        responses: list[dict[str, Any]] = []
        events: list[WatchEvent] = []
        # Check leases first so a refused txn changes nothing, as etcd's.
        for op in ops:
            if isinstance(op, Put) and op.lease and op.lease not in self.leases:
                return defer.fail(EtcdError(GRPC_NOT_FOUND, "etcdserver: requested lease not found", "fake"))
        for op in ops:
            if isinstance(op, Put):
                events.append(self._put(op.key, op.value, op.lease, rev))
                responses.append({"response_put": {}})
            elif isinstance(op, Range):
                responses.append({"kvs": self._range(op.key, op.range_end)})
            else:
                gone = self._range(op.key, op.range_end)
                for kv in gone:
                    del self.kvs[kv.key]
                    events.append(WatchEvent("DELETE", replace(kv, value=b"", mod_revision=rev)))
                responses.append({"response_delete_range": {"deleted": len(gone)}})
        if writes:
            self.revision = rev
            self._notify(events)
        return defer.succeed(TxnResult(ok, self.revision, responses))

    def watch(self, key: bytes, on_events: Callable[[list[WatchEvent], int], None],
              range_end: bytes = b"", start_revision: int = 0) -> FakeWatch:
        """A watch from now on (the fake keeps no history)."""
        w = FakeWatch(self, key, range_end, on_events)
        self.watches.add(w)
        return w
