"""
A member's copy of every key under one etcd prefix (L{PrefixMirror}): read
whole, then watched from the revision read at, read whole again after a
watch ends or a read fails (every C{retry_interval} while etcd is away).
While etcd is away the last copy stays: a member that cannot reach etcd
keeps letting in the users and sessions it last knew, as the rest of an HA
member keeps serving what it last followed.

Callers read L{PrefixMirror.values} (key → value) synchronously; a change
is applied to it before L{PrefixMirror.changed} is called.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from llmgw.control.ha.following import EtcdFollowing
from llmgw.etcd import prefix_end


class PrefixMirror(EtcdFollowing):
    """
    Every key under C{prefix} (bytes, ending in C{/}) and its value, kept
    current while started.

    @param what: what the keys are, in log lines ("users").
    """

    log = Logger()

    def __init__(self, clock: IReactorTime, store: Any, prefix: bytes, what: str,
                 retry_interval: float = 1.0):
        super().__init__(clock, store, retry_interval)
        self.prefix = prefix
        self.what = what
        #: The copy: full key → value.
        self.values: dict[bytes, bytes] = {}
        #: The lease each key is attached to (0: none).
        self.leases: dict[bytes, int] = {}
        #: Whether a whole read has succeeded since start (an empty copy
        #: before then says nothing about etcd).
        self.loaded = False
        #: Why the last read failed ("" once one succeeds).
        self.last_error = ""
        #: Called after each change to L{values} (no argument).
        self.changed: Callable[[], None] = lambda: None

    def _read(self, generation: int) -> None:
        if not self._current(generation):
            return
        d = self._reading = defer.ensureDeferred(self.store.range(self.prefix, prefix_end(self.prefix)))

        def read(answer: tuple[list[Any], int]) -> None:
            self._reading = None
            if not self._current(generation):
                return
            kvs, revision = answer
            self.values = {kv.key: kv.value for kv in kvs}
            self.leases = {kv.key: kv.lease for kv in kvs}
            self.loaded = True
            if self.last_error:
                self.log.info("etcd: the {what} can be read again", what=self.what)
            self.last_error = ""
            self._changed()
            # From the revision read at: no write between the read and the
            # watch is missed.
            w = self._watch = self.store.watch(
                self.prefix, lambda events, rev: self._events(generation, events),
                range_end=prefix_end(self.prefix), start_revision=revision + 1)
            w.done.addBoth(lambda _: self._ended(generation, w))

        def failed(f: Any) -> None:
            self._reading = None
            if f.check(defer.CancelledError) or not self._current(generation):
                return
            if f.getErrorMessage() != self.last_error:
                self.log.warn("etcd: the {what} cannot be read ({error}); the last copy stays, "
                              "reading again every {interval}s", what=self.what,
                              error=f.getErrorMessage(), interval=self.retry_interval)
            self.last_error = f.getErrorMessage()
            self._later(generation)

        d.addCallbacks(read, failed)

    def _events(self, generation: int, events: list[Any]) -> None:
        if not self._current(generation):
            return
        for ev in events:
            if ev.kind == "DELETE":
                self.values.pop(ev.kv.key, None)
                self.leases.pop(ev.kv.key, None)
            else:
                self.values[ev.kv.key] = ev.kv.value
                self.leases[ev.kv.key] = ev.kv.lease
        self._changed()

    def _ended(self, generation: int, w: Any) -> None:
        if self._watch is w:
            self._watch = None
        # Read everything again (what changed meanwhile), then watch again.
        self._later(generation)

    def _changed(self) -> None:
        try:
            self.changed()
        except Exception:
            self.log.failure("taking up a change of the {what} from etcd failed", what=self.what)
