"""
The agent's model cache as a service: the node's L{ModelCache} and the
bounded thread pool its disk and network work runs in, started and
stopped with the agent.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from twisted.application.service import Service
from twisted.logger import Logger
from twisted.python.threadpool import ThreadPool

from llmgw.models.cache import ModelCache, Peering, default_fetchers, thread_runner
from llmgw.models.fetching import IFetcher

__all__ = ["ModelCacheService", "default_capacity", "CACHE_THREADS", "MARGIN_FRACTION"]

#: Threads for the cache's blocking work: fetches of different models run
#: side by side, a few at most (each is bounded by the network anyway).
CACHE_THREADS = 4
#: The share of the cache's filesystem kept free by the default size bound.
MARGIN_FRACTION = 0.05


def default_capacity(directory: Path) -> int:
    """
    The default bound of a cache in C{directory}: the bytes it holds now
    plus its filesystem's free space, less L{MARGIN_FRACTION} of that
    filesystem's size (at least one byte). Blocking: call it at setup,
    before the reactor runs.
    """
    directory.mkdir(parents=True, exist_ok=True)
    held = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    usage = shutil.disk_usage(directory)
    return max(1, held + usage.free - int(usage.total * MARGIN_FRACTION))


class ModelCacheService(Service):
    """
    C{cache}, its threads in a pool of at most C{threads}, started and
    stopped with the service. At stop, fetches in flight are cancelled
    (what they fetched is kept for the next start) before the pool stops.

    @param capacity: the size bound in bytes; C{None} for
        L{default_capacity}.
    """

    log = Logger()

    def __init__(self, reactor: Any, directory: Path, capacity: int | None = None,
                 fetchers: Mapping[str, IFetcher] | None = None, threads: int = CACHE_THREADS,
                 peering: Peering | None = None):
        self.directory = directory
        self.defaulted = capacity is None
        self.capacity = default_capacity(directory) if capacity is None else capacity
        self.pool = ThreadPool(0, threads, name="llmgw-model-cache")
        self.cache = ModelCache(directory, self.capacity,
                                default_fetchers() if fetchers is None else fetchers,
                                reactor, thread_runner(reactor, self.pool), peering=peering)

    def startService(self) -> None:
        super().startService()
        self.log.info("model cache in {dir}, at most {size} bytes{how}", dir=str(self.directory),
                      size=self.capacity,
                      how=" (its free space less a margin: --model-cache-size sets it)"
                      if self.defaulted else "")
        self.pool.start()

    def stopService(self) -> Any:
        super().stopService()
        self.cache.stop()
        self.pool.stop()
