"""
LoRA adapters on a node (DESIGN §22): their files come through the node's
model cache as weights do, and an engine gets them in its own way.

llama.cpp's server takes its adapters only at its start: a shard's spec
lists them (in the order of the ids requests select them by), the agent
puts each on the node before the shard starts and adds C{--lora PATH} per
adapter to its argv, whether llmgw wrote the argv or the profile did.

vLLM loads and unloads adapters while it runs (L{RuntimeAdapters}).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from llmgw.models.cache import ModelCache
from llmgw.models.source import LocalSource, cache_key, from_spec
from llmgw.shards import ShardSpec
from llmgw.sourcespec import ModelSource

__all__ = ["AdapterFiles", "local_paths", "lora_args"]

#: The schemes whose files come through the cache (the others are paths).
_FETCHED = ("hf", "https")


def lora_args(paths: Iterable[str]) -> list[str]:
    """
    llama.cpp's server flags that load C{paths}, in their order (the
    position of each is the id a request selects it by).
    """
    return [arg for path in paths for arg in ("--lora", path)]


def local_paths(spec: ShardSpec) -> tuple[str, ...]:
    """
    The paths of C{spec}'s adapters when none needs a fetch (C{file://}
    sources): where they are already.
    """
    return tuple(source.path for _, source in spec.adapters)


class AdapterFiles:
    """
    The adapters' files of the shards a supervisor starts, on C{cache}:
    each acquired (fetched if need be, and pinned under the shard's id, so
    that it is not evicted while the shard may use it) before the shard
    starts, and released with the shard's weights.
    """

    def __init__(self, cache: ModelCache | None) -> None:
        self.cache = cache
        #: shard id -> its adapters' paths, in its spec's order
        self.paths: dict[str, tuple[str, ...]] = {}
        #: shard id -> the cache keys pinned for it
        self._pins: dict[str, list[str]] = {}
        #: shard id -> adapters loaded into its engine while it runs, least
        #: recently asked for first (L{RuntimeAdapters})
        self.loaded: dict[str, list[str]] = {}

    async def acquire(self, spec: ShardSpec) -> tuple[str, ...]:
        """
        Put C{spec}'s adapters on the node, one after the other; their
        paths, also kept in L{paths}.

        @raise llmgw.models.errors.ModelError: one cannot be had (as a
            fetch of weights fails).
        """
        out = []
        for _, source in spec.adapters:
            out.append(str(await self._one(spec.shard_id, source)))
        self.paths[spec.shard_id] = paths = tuple(out)
        return paths

    async def _one(self, holder: str, spec_source: ModelSource) -> Path:
        source = from_spec(spec_source)
        if isinstance(source, LocalSource) or self.cache is None:
            return Path(spec_source.path)
        self._pins.setdefault(holder, []).append(cache_key(source))
        return await self.cache.acquire(source, holder)

    def pin(self, spec: ShardSpec) -> None:
        """
        Pin the adapters of a shard taken over after a restart.
        """
        for _, spec_source in spec.adapters:
            if spec_source.scheme in _FETCHED and self.cache is not None:
                key = cache_key(from_spec(spec_source))
                self._pins.setdefault(spec.shard_id, []).append(key)
                self.cache.pin(key, spec.shard_id)

    def release(self, shard_id: str) -> None:
        """
        The shard uses its adapters no more.
        """
        self.paths.pop(shard_id, None)
        self.loaded.pop(shard_id, None)
        for key in self._pins.pop(shard_id, ()):
            if self.cache is not None:
                self.cache.release(key, shard_id)

    def held(self, spec: ShardSpec) -> list[str]:
        """
        The names of the adapters C{spec}'s engine holds, for heartbeats:
        those it started with, in id order, or those loaded into it while
        it runs (L{RuntimeAdapters}).
        """
        if spec.adapters:
            return [name for name, _ in spec.adapters]
        return list(self.loaded.get(spec.shard_id, ()))

    def args(self, spec: ShardSpec) -> list[str]:
        """
        The flags that give C{spec}'s engine its adapters: C{--lora PATH}
        each (paths acquired, or the C{file://} paths), none for an engine
        that loads them at runtime.
        """
        if not spec.adapters:
            return []
        paths: Sequence[str] = self.paths.get(spec.shard_id) or local_paths(spec)
        return lora_args(paths)
