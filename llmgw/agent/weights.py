"""
Putting a shard's weights on the node before it starts: the supervisor's
collaborator between a shard that is C{fetching} and the node's
L{ModelCache}.

A shard whose source is C{hf://} or C{https://} acquires its model from
the cache (pinned under its shard id, so the model is not evicted while the
shard may use it); shards needing one model share one fetch and one copy.
The pin is released once the shard has ended (its process group is empty),
or when it stops or fails before it had a process. After an agent restart
the re-adopted shards' models are pinned again (L{WeightFetcher.pin}),
before any fetch can evict them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmgw.agent.adapters import AdapterFiles
from llmgw.agent.shard import Shard
from llmgw.crash import FETCH_CLASSES, CrashClass
from llmgw.models.cache import ModelCache, Progress
from llmgw.models.errors import ModelError, SourceInvalid
from llmgw.models.source import LocalSource, Source, cache_key, from_spec

__all__ = ["WeightFetcher", "fetch_failure_class"]

#: The crash classes a fetch's failure may have (L{ModelError.failure_class}).
_FETCH_CLASSES = {c.value for c in (*FETCH_CLASSES, CrashClass.CONFIG)}


def fetch_failure_class(failure: Failure) -> str:
    """
    The crash class a failed fetch is reported under: the model error's
    own failure class, or C{fetch} for anything else (a cancelled fetch
    included: it is reported only when the cache itself gave up).
    """
    value = getattr(failure.value, "failure_class", None)
    return value if isinstance(value, str) and value in _FETCH_CLASSES else CrashClass.FETCH.value


class WeightFetcher:
    """
    The fetches of the shards a supervisor starts, on C{cache} (C{None}:
    this agent has no cache, and a shard that needs one is refused).

    @param fetched: called with the shard and the path of its weights once
        they are on the node.
    @param failed: called with the shard, the error text and the crash
        class when they cannot be had.
    """

    log = Logger()

    def __init__(self, cache: ModelCache | None, fetched: Callable[[Shard, Path], None],
                 failed: Callable[[Shard, str, str], None]) -> None:
        self.cache = cache
        self._fetched = fetched
        self._failed = failed
        self._loaded: defer.Deferred[None] | None = None
        self._load_error = ""
        self._waiting: list[defer.Deferred[None]] = []
        #: The shards' LoRA adapters, acquired after their weights.
        self.adapters = AdapterFiles(cache)

    def load(self) -> defer.Deferred[None]:
        """
        Read the cache's index; fetches asked for before it is read wait
        for it. A cache that cannot be read fails every fetch, saying why.
        """
        assert self.cache is not None
        d = self._loaded = self.cache.load()

        def done(result: None | Failure) -> None:
            if isinstance(result, Failure):
                self._load_error = str(result.value) or repr(result.value)
                self.log.failure("the model cache in {dir} could not be read; every fetch fails",
                                 result, dir=str(self.cache.directory) if self.cache else "")
            waiting, self._waiting = self._waiting, []
            for w in waiting:
                if not w.called:
                    w.callback(None)
        return d.addBoth(done)

    def refusal(self) -> str | None:
        """
        Why no shard's weights can be fetched on this node, or C{None}.
        """
        if self.cache is None:
            return "this agent has no model cache: it cannot fetch hf:// or https:// sources"
        return None

    def source(self, shard: Shard) -> Source | None:
        spec = shard.spec.source
        if spec is None:
            return None
        try:
            return from_spec(spec)
        except SourceInvalid:
            return None

    def start(self, shard: Shard) -> None:
        """
        Acquire C{shard}'s weights; its C{fetch} is the Deferred, cancelled
        by L{cancel}. C{shard.progress} follows the fetch.
        """
        assert self.cache is not None
        try:
            source = from_spec(shard.spec.source) if shard.spec.source is not None else None
            for _, adapter in shard.spec.adapters:
                from_spec(adapter)
        except SourceInvalid as e:
            self._failed(shard, f"the model source is not usable: {e}", CrashClass.CONFIG.value)
            return
        if source is not None and not isinstance(source, LocalSource):
            shard.pinned = cache_key(source)
        d = defer.Deferred.fromCoroutine(self._acquire(shard, source))
        shard.fetch = d
        d.addCallbacks(self._done, self._error, callbackArgs=(shard,), errbackArgs=(shard,))

    async def _acquire(self, shard: Shard, source: Source | None) -> Path:
        assert self.cache is not None
        if self._loaded is not None and not self._loaded.called:
            wait: defer.Deferred[None] = defer.Deferred()
            self._waiting.append(wait)
            await wait
        if self._load_error:
            raise ModelError(f"the model cache could not be read: {self._load_error}")

        def progress(p: Progress) -> None:
            shard.progress = p
        path = Path()
        if source is not None:
            path = await self.cache.acquire(source, shard.shard_id, progress, peers=shard.spec.model_peers)
        await self.adapters.acquire(shard.spec)
        return path

    def _done(self, path: Path, shard: Shard) -> None:
        shard.fetch = None
        self._fetched(shard, path)

    def _error(self, failure: Failure, shard: Shard) -> None:
        shard.fetch = None
        if failure.check(defer.CancelledError):
            return  # stopped while fetching: the stop said what happened
        crash_class = fetch_failure_class(failure)
        if not failure.check(ModelError):
            self.log.failure("fetching the weights of shard {shard} failed", failure,
                             shard=shard.shard_id)
        source = shard.spec.source
        where = source.uri if source is not None else "?"
        self._failed(shard, f"could not put the weights of {shard.spec.model} ({where}) on this "
                            f"node: {failure.getErrorMessage()}", crash_class)

    def cancel(self, shard: Shard) -> None:
        """
        Drop C{shard}'s interest in its fetch (the fetch goes on while
        another shard waits on it) and its pin.
        """
        d, shard.fetch = shard.fetch, None
        if d is not None:
            d.cancel()
        self.release(shard)

    def release(self, shard: Shard) -> None:
        """
        Unpin C{shard}'s model: it uses it no more.
        """
        key, shard.pinned = shard.pinned, ""
        if key and self.cache is not None:
            self.cache.release(key, shard.shard_id)
        self.adapters.release(shard.shard_id)

    def pin(self, shard: Shard) -> None:
        """
        Pin the model of a shard taken over after a restart (its record
        keeps its source), so no fetch evicts it while it runs.
        """
        self.adapters.pin(shard.spec)
        source = self.source(shard)
        if self.cache is None or source is None or isinstance(source, LocalSource):
            return
        shard.pinned = cache_key(source)
        self.cache.pin(shard.pinned, shard.shard_id)

    def progress(self, shards: list[Shard]) -> list[tuple[str, int, int, float]]:
        """
        (shard id, bytes done, total or 0 when unknown, bytes a second) of
        each fetching shard in C{shards}.
        """
        out = []
        for shard in shards:
            if shard.fetch is None:
                continue
            p = shard.progress
            if p is None:
                out.append((shard.shard_id, 0, 0, 0.0))
            else:
                out.append((shard.shard_id, p.done, p.total or 0, p.rate))
        return out
