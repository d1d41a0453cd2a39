"""
Whether an HA member's own catalog file (C{--catalog}) says what the
catalog kept in etcd says.

With C{--etcd} the catalog is etcd's (C{llmgw ctl catalog apply}); a
member's file only seeds an etcd that holds none. A member restarted with
a different file runs etcd's catalog all the same, so an operator who
edited the file and restarted would see nothing change: L{CatalogFileCheck}
compares the two on every member, leading or not, at start and whenever
etcd's changes, and says so (a log line, a status field, an event).
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.logger import Logger

from llmgw.etcd import EtcdError


def same_catalog(own: bytes, kept: bytes) -> bool:
    """
    Whether a catalog file's bytes C{own} and etcd's C{kept} say the same:
    equal bytes, or equal TOML (comments, spacing and key order aside).
    Text that is not TOML is compared as bytes.
    """
    if own == kept:
        return True
    try:
        return tomllib.loads(own.decode("utf-8")) == tomllib.loads(kept.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        return False


class CatalogFileCheck:
    """
    Compares the file at C{path} with the catalog at C{key} in C{store}
    (an etcd client, or L{llmgw.testing.fakeetcd.FakeEtcd}).

    After L{start}, C{differs} is C{True} or C{False} once both were read,
    C{None} while either is unknown (etcd not read yet, holding no catalog,
    or the file unreadable: C{problem} says which). Each time the answer
    becomes C{True}, or etcd's catalog changes while it is, a warning is
    logged and C{on_differs(message)} is called (the member records an
    event); when it becomes C{False} again, that is logged.

    @param reactor: the clock for retries.
    @param retry_interval: seconds before reading or watching again after
        etcd failed to answer.
    """

    log = Logger()

    def __init__(self, reactor: Any, store: Any, key: bytes, path: str,
                 on_differs: Callable[[str], None] = lambda message: None, retry_interval: float = 1.0):
        self.reactor = reactor
        self.store = store
        self.key = key
        self.path = path
        self.on_differs = on_differs
        self.retry_interval = retry_interval
        self.differs: bool | None = None
        #: The mod revision of the etcd catalog last compared (0: none yet).
        self.revision = 0
        self.problem = ""
        self._watch: Any = None
        self._retry: Any = None
        self._running = False

    def status(self) -> dict[str, Any]:
        """What C{GET /api/v1/status} shows of the comparison."""
        return {"path": self.path, "differs_from_etcd": self.differs, "etcd_revision": self.revision,
                "problem": self.problem}

    def start(self) -> None:
        self._running = True
        d = defer.ensureDeferred(self._read())
        d.addErrback(lambda f: self.log.failure("comparing the catalog file with etcd's failed", f))

    def stop(self) -> None:
        self._running = False
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        self._retry = None
        w, self._watch = self._watch, None
        if w is not None:
            w.cancel()

    async def _read(self) -> None:
        self._retry = None
        if not self._running:
            return
        try:
            kv = await defer.ensureDeferred(self.store.get(self.key))
        except EtcdError as e:
            self.problem = f"etcd cannot be read: {e}"
            self._retry = self.reactor.callLater(self.retry_interval, self.start)
            return
        if not self._running:
            return
        if kv is None:
            self.differs, self.problem = None, "etcd holds no catalog yet"
        else:
            self._compare(kv.value, kv.mod_revision)
        start = kv.mod_revision + 1 if kv is not None else 0
        self._watch = w = self.store.watch(self.key, self._changed, start_revision=start)

        def ended(_: Any) -> None:
            if self._watch is w and self._running:
                self._watch = None
                self._retry = self.reactor.callLater(self.retry_interval, self.start)

        w.done.addBoth(ended)

    def _changed(self, events: list[Any], revision: int) -> None:
        for ev in events:
            if ev.kind == "PUT" and ev.kv.mod_revision > self.revision:
                self._compare(ev.kv.value, ev.kv.mod_revision)

    def _compare(self, kept: bytes, revision: int) -> None:
        before, self.revision = self.differs, revision
        try:
            with open(self.path, "rb") as f:
                own = f.read()
        except OSError as e:
            self.differs, self.problem = None, f"the file cannot be read: {e.strerror or e}"
            return
        self.problem = ""
        self.differs = not same_catalog(own, kept)
        if self.differs:
            message = (f"catalog file {self.path} differs from the catalog in etcd (revision {revision}), "
                       f"which every member runs: `llmgw ctl catalog apply {self.path}` stores the file's, "
                       "or put etcd's in the file")
            self.log.warn("{text}", text=message)
            self.on_differs(message)
        elif before:
            self.log.info("catalog file {path} now says what the catalog in etcd says (revision {revision})",
                          path=self.path, revision=revision)
