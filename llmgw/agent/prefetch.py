"""
The agent's side of the weight cache towards the control plane: what the
cache holds, for Register and heartbeats (L{CacheReport}), and the
C{PrefetchModel}/C{DropModel} commands (L{Prefetcher}).

The cache itself (L{llmgw.models.cache.ModelCache}) is the agent's; these
only read it, and pin or unpin models in it.
"""

from __future__ import annotations

from twisted.internet.defer import CancelledError
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmgw.api.v1 import agent_pb2 as pb
from llmgw.models.cache import ModelCache
from llmgw.models.errors import ModelError
from llmgw.models.source import LocalSource, cache_key, from_spec
from llmgw.shards import source_of

#: Heartbeats between full cache reports even when nothing changed, so a
#: control plane that lost a report (a new leader) learns it again.
REPORT_EVERY = 12


def cached_messages(cache: ModelCache) -> list[pb.CachedModel]:
    """
    What C{cache} holds, as the wire carries it.
    """
    out = []
    for m in cache.models():
        revision = m.source.partition("@")[2].partition("#")[0] if m.source.startswith("hf://") else ""
        out.append(pb.CachedModel(key=m.key, source=m.source, size=m.size, state=str(m.state),
                                  last_used=m.last_used, revision=revision))
    return out


class CacheReport:
    """
    Fills the cache fields of Register and heartbeats: the whole cache in
    every Register, and in a heartbeat when it changed since the last
    report or every L{REPORT_EVERY} heartbeats; the room (capacity and
    free) with each such report and in a heartbeat when it changed, so
    that the heartbeat of an agent whose cache stands still carries none.
    """

    def __init__(self, cache: ModelCache | None) -> None:
        self.cache = cache
        self._last: list[pb.CachedModel] | None = None
        self._since = 0
        self._room_sent: tuple[int, int] | None = None

    def _room(self) -> tuple[int, int]:
        assert self.cache is not None
        capacity = self.cache.capacity
        return capacity, max(capacity - self.cache.used(), 0)

    def fill_register(self, reg: pb.Register) -> None:
        if self.cache is None:
            return
        self._last = cached_messages(self.cache)
        self._since = 0
        reg.cached_models.extend(self._last)
        reg.cache_capacity, reg.cache_free = self._room_sent = self._room()

    def fill_heartbeat(self, hb: pb.Heartbeat) -> None:
        if self.cache is None:
            return
        now = cached_messages(self.cache)
        self._since += 1
        if now != self._last or self._since >= REPORT_EVERY:
            self._last, self._since = now, 0
            hb.cache_changed = True
            hb.cached_models.extend(now)
        room = self._room()
        # The control plane reads a heartbeat without them as "unchanged".
        if hb.cache_changed or room != self._room_sent:
            hb.cache_capacity, hb.cache_free = self._room_sent = room


class Prefetcher:
    """
    Handles C{PrefetchModel} (fetch into the cache, pinned under the
    message's pin while the control plane wants it) and C{DropModel}
    (unpin; LRU evicts it later as any unused model).
    """

    log = Logger()

    def __init__(self, cache: ModelCache | None) -> None:
        self.cache = cache

    def prefetch(self, msg: pb.PrefetchModel) -> None:
        if self.cache is None:
            self.log.warn("the control plane asked to prefetch {source}, but this agent has no "
                          "model cache (--model-cache)", source=msg.source.repo or msg.source.url)
            return
        try:
            source = from_spec(source_of(msg.source))
        except (ModelError, ValueError) as e:
            self.log.warn("refusing a prefetch from the control plane: {error}", error=str(e))
            return
        if isinstance(source, LocalSource):
            return
        key = cache_key(source)
        if msg.pin:
            self.cache.pin(key, msg.pin)
        self.log.info("prefetching {source} ({pin})", source=str(source), pin=msg.pin or "a pull")
        d = self.cache.ensure(source, peers=tuple(msg.model_peers))
        d.addCallbacks(lambda path: self.log.info("prefetched {source} into {path}", source=str(source),
                                                  path=str(path)),
                       self._failed, errbackArgs=(str(source),))

    def _failed(self, failure: Failure, source: str) -> None:
        if failure.check(CancelledError):
            return
        why = getattr(failure.value, "failure_class", "fetch")
        self.log.warn("prefetching {source} failed ({why}): {error}", source=source, why=why,
                      error=str(failure.value))

    def drop(self, msg: pb.DropModel) -> None:
        if self.cache is not None and msg.key:
            self.cache.unpin(msg.key, msg.pin)
            self.log.info("{key} is no longer kept for {pin}", key=msg.key, pin=msg.pin)
