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

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from twisted.internet import defer
from twisted.logger import Logger

from llmgw.models.cache import ModelCache
from llmgw.models.source import LocalSource, cache_key, from_spec
from llmgw.shards import ShardSpec
from llmgw.sourcespec import ModelSource

__all__ = ["AdapterError", "AdapterFiles", "RuntimeAdapters", "local_paths", "lora_args", "max_loras"]

#: POST C{body} (JSON) to a URL: a Deferred of the answer's status and body.
Post = Callable[[str, bytes], "defer.Deferred[tuple[int, bytes]]"]

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
        #: What loads them, made at the first load (L{load_adapter}).
        self.runtime: RuntimeAdapters | None = None

    async def acquire(self, spec: ShardSpec) -> tuple[str, ...]:
        """
        Put C{spec}'s adapters on the node, one after the other; their
        paths, also kept in L{paths}.

        @raise llmgw.models.errors.ModelError: one cannot be had (as a
            fetch of weights fails).
        """
        out = []
        for _, source in spec.adapters:
            out.append(str(await self.acquire_one(spec.shard_id, source)))
        self.paths[spec.shard_id] = paths = tuple(out)
        return paths

    async def acquire_one(self, holder: str, spec_source: ModelSource) -> Path:
        """
        Put one adapter on the node for shard C{holder} (pinned for it
        until L{release} or L{release_one}): its path.
        """
        source = from_spec(spec_source)
        if isinstance(source, LocalSource) or self.cache is None:
            return Path(spec_source.path)
        self._pins.setdefault(holder, []).append(cache_key(source))
        return await self.cache.acquire(source, holder)

    def release_one(self, holder: str, spec_source: ModelSource) -> None:
        """
        Shard C{holder} uses this adapter no more (unloaded from its engine).
        """
        if spec_source.scheme not in _FETCHED or self.cache is None:
            return
        key = cache_key(from_spec(spec_source))
        pins = self._pins.get(holder, [])
        if key in pins:
            pins.remove(key)
            if key not in pins:
                self.cache.release(key, holder)

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
        if self.runtime is not None:
            self.runtime.forget(shard_id)
        for key in self._pins.pop(shard_id, ()):
            if self.cache is not None:
                self.cache.release(key, shard_id)

    def load(self, supervisor: Any, msg: Any) -> None:
        """
        Carry out a C{LoadAdapter} command (L{load_adapter}).
        """
        load_adapter(supervisor, msg)

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


class AdapterError(Exception):
    """
    An engine refused to load or unload an adapter; the message says which and why.
    """


def max_loras(spec: ShardSpec) -> int:
    """
    How many adapters C{spec}'s engine holds at once: its C{--max-loras}
    (which llmgw writes for a profile with C{max_loras}); 0 for none.
    """
    argv = list(spec.argv)
    for i, arg in enumerate(argv[:-1]):
        if arg == "--max-loras" and argv[i + 1].isdigit():
            return int(argv[i + 1])
    return 0


class RuntimeAdapters:
    """
    Loads adapters into engines that take them while they run (vLLM's
    C{POST /v1/load_lora_adapter} and C{/v1/unload_lora_adapter}, with
    C{{"lora_name", "lora_path"}}): at most the engine's C{max_loras} at
    once, the least recently asked for unloaded first. Files come through
    C{files} (the node's cache); what each engine holds is
    C{files.loaded}, which heartbeats carry.

    @param post: POSTs a JSON body to a URL (L{treq_post} in an agent).
    @param host: the address the shards are reached on.
    """

    log = Logger()

    def __init__(self, files: AdapterFiles, post: Post, host: Callable[[], str] = lambda: "127.0.0.1"):
        self.files = files
        self.post = post
        self.host = host
        self._locks: dict[str, defer.DeferredLock] = {}
        #: (shard id, adapter) -> where it came from, to unpin it when unloaded
        self._sources: dict[tuple[str, str], ModelSource] = {}

    def ensure(self, spec: ShardSpec, name: str, source: ModelSource) -> defer.Deferred[None]:
        """
        Have C{spec}'s engine hold adapter C{name} (from C{source}),
        unloading the least recently asked for when it holds its most; one
        change at a time per engine. Fails with L{AdapterError} when the
        engine refuses, or as a fetch of weights fails.
        """
        lock = self._locks.setdefault(spec.shard_id, defer.DeferredLock())
        return lock.run(lambda: defer.Deferred.fromCoroutine(self._ensure(spec, name, source)))

    async def _ensure(self, spec: ShardSpec, name: str, source: ModelSource) -> None:
        loaded = self.files.loaded.setdefault(spec.shard_id, [])
        if name in loaded:
            loaded.remove(name)
            loaded.append(name)
            return
        path = await self.files.acquire_one(spec.shard_id, source)
        while loaded and len(loaded) >= max(1, max_loras(spec)):
            victim = loaded[0]
            await self._call(spec, "/v1/unload_lora_adapter", {"lora_name": victim}, (200, 404))
            loaded.remove(victim)
            gone = self._sources.pop((spec.shard_id, victim), None)
            if gone is not None:
                self.files.release_one(spec.shard_id, gone)
            self.log.info("shard {shard}: adapter {adapter} unloaded (least recently asked for)",
                          shard=spec.shard_id, adapter=victim)
        status, body = await self._call(spec, "/v1/load_lora_adapter",
                                        {"lora_name": name, "lora_path": str(path)}, (200, 400))
        if status == 400 and b"already been loaded" not in body:
            raise AdapterError(f"shard {spec.shard_id} refused adapter {name!r}: {body[:300].decode('utf-8', 'replace')}")
        loaded.append(name)
        self._sources[(spec.shard_id, name)] = source
        self.log.info("shard {shard}: adapter {adapter} loaded from {path}", shard=spec.shard_id, adapter=name,
                      path=str(path))

    async def _call(self, spec: ShardSpec, path: str, doc: dict[str, Any], ok: tuple[int, ...]) -> tuple[int, bytes]:
        url = f"http://{self.host()}:{spec.port}{path}"
        status, body = await self.post(url, json.dumps(doc).encode())
        if status not in ok:
            raise AdapterError(f"{path} of shard {spec.shard_id} answered {status}: "
                               f"{body[:300].decode('utf-8', 'replace')}")
        return status, body

    def forget(self, shard_id: str) -> None:
        """
        The shard has ended: its engine holds nothing.
        """
        self._locks.pop(shard_id, None)
        for key in [k for k in self._sources if k[0] == shard_id]:
            del self._sources[key]


def treq_post(reactor: Any, timeout: float = 60.0) -> Post:
    """
    A L{Post} that sends with C{treq} on C{reactor}.
    """
    import treq
    from twisted.web.http_headers import Headers

    def post(url: str, body: bytes) -> defer.Deferred[tuple[int, bytes]]:
        headers = Headers({b"Content-Type": [b"application/json"]})
        d = treq.post(url, data=body, headers=headers, timeout=timeout, reactor=reactor)

        def read(response: Any) -> defer.Deferred[tuple[int, bytes]]:
            return treq.content(response).addCallback(lambda content: (response.code, content))

        return d.addCallback(read)

    return post


def load_adapter(supervisor: Any, msg: Any) -> None:
    """
    Carry out a C{LoadAdapter} command (C{msg}) on C{supervisor}'s shard:
    logged, and dropped, when the shard does not run here, is not ready, or
    its engine loads no adapters while it runs; a failure is logged (the
    heartbeats go on saying what the engine holds).
    """
    from llmgw.shards import source_of

    log = RuntimeAdapters.log
    shard = supervisor.shards.get(msg.shard_id)
    if shard is None or not shard.live or max_loras(shard.spec) < 1:
        log.warn("LoadAdapter {adapter} for shard {shard} dropped: no such running shard whose engine loads "
                 "adapters while it runs", adapter=msg.name, shard=msg.shard_id)
        return
    files: AdapterFiles = supervisor.weights.adapters
    if files.runtime is None:
        files.runtime = RuntimeAdapters(files, treq_post(supervisor.clock), lambda: supervisor.probe_host)
    d = files.runtime.ensure(shard.spec, msg.name, source_of(msg.source))
    d.addErrback(lambda f: log.failure("loading adapter {adapter} into shard {shard} failed", f,
                                       adapter=msg.name, shard=msg.shard_id))
