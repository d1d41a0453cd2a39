"""
The node-local model cache: one copy of each model per node, in
C{DIRECTORY/KEY/files}, under a size bound the operator sets.

Every disk and network operation runs in a thread (the injected runner,
normally a bounded L{ThreadPool}); every change to the cache's state
happens on the reactor, so its decisions need no locks. A model's entry is
written (as partial, with its whole size reserved) before its first byte,
so an agent killed mid-fetch finds it and the next fetch resumes it.

    cache = ModelCache(directory, capacity, default_fetchers(), reactor, run)
    await cache.load()
    path = await cache.acquire(source, user="shard-3", progress=report)
    ...
    cache.release(cache_key(source), "shard-3")
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from twisted.internet.defer import Deferred, DeferredLock
from twisted.internet.interfaces import IReactorThreads, IReactorTime
from twisted.internet.task import LoopingCall
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

from llmgw.models.errors import DiskFull, FetchCancelled, ModelError, SourceNotFound
from llmgw.models.fetching import IFetcher, Plan, Transfer
from llmgw.models.index import (
    FILES,
    Entry,
    EntryState,
    FileRecord,
    held,
    read_entries,
    unchanged,
    victims,
    write_entry,
)
from llmgw.models.source import LocalSource, Source, cache_key, canonical

__all__ = ["ModelCache", "Progress", "CachedModel", "Peering", "ThreadRunner", "thread_runner",
           "default_fetchers"]

T = TypeVar("T")
#: Runs a blocking callable with its arguments in a thread: a Deferred of its result.
ThreadRunner = Callable[..., "Deferred[Any]"]
#: Wraps a source's fetcher so that it tries the given peers (HOST:PORT) first.
Peering = Callable[[IFetcher, tuple[str, ...]], IFetcher]


@dataclass(frozen=True)
class Progress:
    """
    A fetch's progress: bytes done, the total (C{None} when unknown) and
    the rate in bytes a second over the last reporting interval.
    """

    key: str
    done: int
    total: int | None
    rate: float


@dataclass(frozen=True)
class CachedModel:
    """
    What the cache holds of one model, for heartbeats and listings.
    """

    key: str
    source: str
    state: EntryState
    size: int
    last_used: float
    pinned_by: frozenset[str]
    progress: Progress | None


def thread_runner(reactor: IReactorThreads, pool: ThreadPool) -> ThreadRunner:
    """
    A L{ThreadRunner} on C{pool} (started by the caller, stopped at shutdown).
    """
    def run(f: Callable[..., T], *args: Any, **kwargs: Any) -> Deferred[T]:
        return deferToThreadPool(reactor, pool, f, *args, **kwargs)
    return run


def default_fetchers() -> dict[str, IFetcher]:
    """
    The fetchers by source kind, reading their settings from the environment.
    """
    from llmgw.models.https import HttpsFetcher
    from llmgw.models.hub import HubFetcher

    return {"hf": HubFetcher(), "https": HttpsFetcher()}


class _Fetch:
    """
    One fetch (or check) of one model and the callers waiting on it.
    """

    def __init__(self, key: str, source: Source, now: float, peers: tuple[str, ...] = ()) -> None:
        self.key = key
        self.source = source
        self.peers = peers
        self.waiters: list[Deferred[Path]] = []
        self.observers: dict[int, Callable[[Progress], None]] = {}
        self.transfer = Transfer()
        self.total: int | None = None
        self.started = False
        self.last = (0, now)
        self.rate = 0.0
        self.loop: LoopingCall | None = None

    def join(self, progress: Callable[[Progress], None] | None) -> Deferred[Path]:
        d: Deferred[Path] = Deferred(canceller=self._leave)
        self.waiters.append(d)
        if progress is not None:
            self.observers[id(d)] = progress
        return d

    def _leave(self, d: Deferred[Path]) -> None:
        # The Deferred errbacks with CancelledError once this returns.
        self.waiters.remove(d)
        self.observers.pop(id(d), None)
        if not self.waiters:
            self.transfer.cancel()

    def progress(self) -> Progress:
        return Progress(self.key, self.transfer.done, self.total, self.rate)


class ModelCache:
    """
    The cache in C{directory}, holding at most C{capacity} bytes of models.

    @param fetchers: the L{IFetcher} for each source kind (C{"hf"}, C{"https"}).
    @param clock: times progress reports and stamps last use.
    @param run: runs blocking work in a thread (L{thread_runner}).
    @param progress_interval: seconds between progress reports of a fetch.
    @param peering: wraps a source's fetcher for a fetch given peers
        (L{llmgw.models.peerfetch}); without it, peers given are ignored.
    """

    log = Logger()

    def __init__(
        self, directory: Path | str, capacity: int, fetchers: Mapping[str, IFetcher],
        clock: IReactorTime, run: ThreadRunner, progress_interval: float = 1.0,
        peering: Peering | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.capacity = capacity
        self._fetchers = dict(fetchers)
        self._clock = clock
        self._run = run
        self._interval = progress_interval
        self._peering = peering
        self._entries: dict[str, Entry] = {}
        self._pins: dict[str, set[str]] = {}
        self._fetches: dict[str, _Fetch] = {}
        self._evicting: dict[str, Deferred[None]] = {}
        self._writes = DeferredLock()

    # -- what callers use -------------------------------------------------

    def load(self) -> Deferred[None]:
        """
        Read the index from disk and remove directories that hold no entry.
        Call once, before anything else.
        """
        async def load() -> None:
            await self._run(self.directory.mkdir, parents=True, exist_ok=True)
            entries, strays = await self._run(read_entries, self.directory)
            for stray in strays:
                self.log.warn("removing {path}: no readable cache entry in it", path=str(stray))
                await self._run(shutil.rmtree, stray, True)
            self._entries = {e.key: e for e in entries}
        return Deferred.fromCoroutine(load())

    def ensure(
        self, source: Source, progress: Callable[[Progress], None] | None = None, peers: Sequence[str] = (),
    ) -> Deferred[Path]:
        """
        The local path of C{source}'s model (a file, or a directory for a hub
        snapshot), fetched first if the cache lacks it or holds it damaged.
        Callers asking for one model at once share one fetch. C{progress} is
        called on the reactor with a L{Progress} every interval of a fetch.

        Cancelling the Deferred drops this caller; the fetch stops when no
        caller is left, and what it fetched is kept for a later resume.

        A local source is used in place: its path, once seen to exist.

        C{peers} (HOST:PORT of nodes holding a complete copy) are tried
        before the source for each file when the cache was given a
        C{peering}; the fetch already under way for a later caller keeps the
        peers it started with.

        @return: fails with a L{ModelError} (L{DiskFull}, L{ChecksumMismatch},
            L{SourceNotFound}, ...), or L{twisted.internet.defer.CancelledError} when cancelled.
        """
        if isinstance(source, LocalSource):
            return self._local(source, progress)
        key = cache_key(source)
        fetch = self._fetches.get(key)
        if fetch is None:
            fetch = self._fetches[key] = _Fetch(key, source, self._clock.seconds(), tuple(peers))
            Deferred.fromCoroutine(self._drive(fetch))
        return fetch.join(progress)

    def acquire(
        self, source: Source, user: str, progress: Callable[[Progress], None] | None = None,
        peers: Sequence[str] = (),
    ) -> Deferred[Path]:
        """
        L{pin} C{source}'s model for C{user}, then L{ensure} it. The pin holds
        until L{release}, whatever the fetch's outcome.
        """
        if not isinstance(source, LocalSource):
            self.pin(cache_key(source), user)
        return self.ensure(source, progress, peers)

    def release(self, key: str, user: str) -> None:
        """
        L{unpin} C{key} for C{user}, and count now as the model's last use.
        """
        self.unpin(key, user)
        entry = self._entries.get(key)
        if entry is not None and key not in self._fetches:
            self._entries[key] = entry = entry.touched(self._clock.seconds())
            self._write(entry).addErrback(self._write_failed, key)

    def pin(self, key: str, user: str) -> None:
        """
        Keep C{key}'s model from eviction while C{user} uses it (a key not in
        the cache yet may be pinned). Pins are not kept across restarts: a
        restarted agent pins its shards' models again before fetching.
        """
        self._pins.setdefault(key, set()).add(user)

    def unpin(self, key: str, user: str) -> None:
        users = self._pins.get(key)
        if users is not None:
            users.discard(user)
            if not users:
                del self._pins[key]

    def complete_files(self, key: str) -> tuple[Path, tuple[FileRecord, ...]] | None:
        """
        The directory of C{key}'s files and their records, when its entry is
        complete and not being checked or fetched again; else C{None}. What
        a peer may be served.
        """
        entry = self._entries.get(key)
        if entry is None or entry.state != EntryState.COMPLETE or key in self._fetches:
            return None
        return self.directory / key / FILES, entry.files

    def used(self) -> int:
        """
        Bytes held by entries: complete ones' sizes, partial ones' reservations.
        """
        return sum(e.size for e in self._entries.values())

    def models(self) -> list[CachedModel]:
        """
        The models the cache holds or is fetching, newest use first.
        """
        out = []
        for key, entry in self._entries.items():
            fetch = self._fetches.get(key)
            out.append(CachedModel(
                key=key, source=entry.source, state=entry.state, size=entry.size,
                last_used=entry.last_used, pinned_by=frozenset(self._pins.get(key, ())),
                progress=fetch.progress() if fetch is not None and fetch.started else None))
        return sorted(out, key=lambda m: (-m.last_used, m.key))

    def stop(self) -> None:
        """
        Cancel every fetch in flight (at shutdown: their threads end soon
        after, so the pool can be stopped). What they fetched is kept.
        """
        for fetch in list(self._fetches.values()):
            fetch.transfer.cancel()

    # -- how it works -----------------------------------------------------

    def _local(self, source: LocalSource, progress: Callable[[Progress], None] | None) -> Deferred[Path]:
        def look() -> tuple[Path, int]:
            path = Path(source.path)
            if not path.exists():
                raise SourceNotFound(f"{source}: no such file or directory on this node")
            if path.is_file():
                return path, path.stat().st_size
            return path, sum(p.stat().st_size for p in path.rglob("*") if p.is_file())

        def seen(found: tuple[Path, int]) -> Path:
            path, size = found
            if progress is not None:
                progress(Progress(str(source), size, size, 0.0))
            return path
        return self._run(look).addCallback(seen)

    async def _drive(self, fetch: _Fetch) -> None:
        try:
            path = await self._obtain(fetch)
        except Exception:
            failure = Failure()
            self._finish(fetch)
            if failure.check(FetchCancelled) and fetch.waiters:
                # Callers came after the last one left: fetch again for them.
                self._fetches[fetch.key] = again = _Fetch(
                    fetch.key, fetch.source, self._clock.seconds(), fetch.peers)
                again.waiters, again.observers = fetch.waiters, fetch.observers
                Deferred.fromCoroutine(self._drive(again))
                return
            self._report_failure(fetch, failure)
            for d in fetch.waiters:
                d.errback(failure)
            return
        self._finish(fetch)
        for d in fetch.waiters:
            d.callback(path)

    def _finish(self, fetch: _Fetch) -> None:
        if fetch.loop is not None and fetch.loop.running:
            fetch.loop.stop()
        if self._fetches.get(fetch.key) is fetch:
            del self._fetches[fetch.key]

    def _report_failure(self, fetch: _Fetch, failure: Failure) -> None:
        if failure.check(FetchCancelled):
            self.log.info("{key}: fetch cancelled; what it fetched is kept", key=fetch.key)
        elif failure.check(ModelError):
            self.log.error("{key}: {source} failed ({why}): {message}", key=fetch.key,
                           source=str(fetch.source), why=getattr(failure.value, "failure_class", "fetch"),
                           message=str(failure.value))
        else:
            self.log.failure("{key}: fetch of {source} failed", failure, key=fetch.key,
                             source=str(fetch.source))

    async def _obtain(self, fetch: _Fetch) -> Path:
        key, source = fetch.key, fetch.source
        if key in self._evicting:
            await self._evicting[key]
        root = self.directory / key
        files = root / FILES
        entry = self._entries.get(key)
        if entry is not None and entry.state == EntryState.COMPLETE:
            changed = await self._run(unchanged, files, entry)
            if not changed:
                self._entries[key] = entry = entry.touched(self._clock.seconds())
                await self._write(entry)
                return files / entry.target if entry.target else files
            self.log.warn("{key}: {count} cached file(s) changed on disk ({first}...): checking them "
                          "and fetching what is damaged", key=key, count=len(changed), first=changed[0])
        fetcher = self._fetchers.get(source.kind)
        if fetcher is None:
            raise ModelError(f"{source}: this node has no fetcher for {source.kind} sources")
        if fetch.peers and self._peering is not None:
            fetcher = self._peering(fetcher, fetch.peers)
        plan: Plan = await self._run(fetcher.plan, source)
        fetch.transfer.check()
        await self._make_room(fetch, plan)
        fetch.total = plan.total
        fetch.started = True
        fetch.last = (0, self._clock.seconds())
        fetch.loop = LoopingCall(self._tick, fetch)
        fetch.loop.clock = self._clock
        fetch.loop.start(self._interval, now=False)
        await self._run(fetcher.fetch, source, plan, files, fetch.transfer)
        records = await self._run(_records, files, plan)
        done = Entry(
            key=key, source=canonical(source), state=EntryState.COMPLETE,
            size=sum(r.size for r in records), last_used=self._clock.seconds(),
            revision=plan.revision, target=plan.target, files=records)
        self._entries[key] = done
        await self._write(done)
        self.log.info("{key}: {source} is cached ({size} bytes)", key=key, source=str(source), size=done.size)
        return files / plan.target if plan.target else files

    async def _make_room(self, fetch: _Fetch, plan: Plan) -> None:
        """
        Reserve room for C{plan} (evicting what must go), and write the
        partial entry, before the fetch writes a byte.

        @raise DiskFull: the model cannot fit, in the bound or on the disk.
        """
        key, source = fetch.key, fetch.source
        previous = self._entries.get(key)
        others = {k: e for k, e in self._entries.items() if k != key}
        keep = set(self._pins) | set(self._fetches)
        total = plan.total
        if total is not None:
            held_bytes = held(others, keep)
            chosen = victims(others.values(), keep, total, self.capacity)
            if chosen is None:
                raise DiskFull(
                    f"{source} needs {total} bytes; the model cache holds at most {self.capacity}, "
                    f"and {held_bytes} of it is models in use or being fetched")
            reserve = total
        else:
            chosen = []
            reserve = self.capacity - sum(e.size for e in others.values())
            if reserve <= 0:
                raise DiskFull(f"{source}: its size is unknown and the model cache has no free room")
            fetch.transfer.limit = reserve
        # The reservation and the evictions are decided here, on the reactor,
        # before anything else can look at the entries.
        for victim in chosen:
            del self._entries[victim.key]
        partial = Entry(
            key=key, source=canonical(source), state=EntryState.PARTIAL, size=reserve,
            last_used=self._clock.seconds(), revision=plan.revision, target=plan.target)
        self._entries[key] = partial
        try:
            for victim in chosen:
                self.log.info("evicting {key} ({size} bytes, unused since {last}) to make room for {new}",
                              key=victim.key, size=victim.size, last=victim.last_used, new=key)
                await self._evict(victim.key)
            if total is not None:
                present, free = await self._run(_room, self.directory, self.directory / key / FILES)
                if total - present > free:
                    raise DiskFull(
                        f"{source} needs {total - present} more bytes; the filesystem holding the "
                        f"model cache has {free} free")
            await self._write(partial)
        except DiskFull:
            if self._entries.get(key) is partial:
                if previous is None:
                    del self._entries[key]
                else:
                    self._entries[key] = previous
            raise

    async def _evict(self, key: str) -> None:
        d = self._run(shutil.rmtree, self.directory / key, True)
        self._evicting[key] = waiting = Deferred[None]()
        try:
            await d
        finally:
            del self._evicting[key]
            waiting.callback(None)

    def _tick(self, fetch: _Fetch) -> None:
        done, now = fetch.transfer.done, self._clock.seconds()
        before, then = fetch.last
        fetch.rate = (done - before) / (now - then) if now > then else 0.0
        fetch.last = (done, now)
        report = fetch.progress()
        for observer in list(fetch.observers.values()):
            try:
                observer(report)
            except Exception:
                self.log.failure("{key}: a progress observer failed", key=fetch.key)

    def _write(self, entry: Entry) -> Deferred[None]:
        return self._writes.run(self._run, write_entry, self.directory / entry.key, entry)

    def _write_failed(self, failure: Failure, key: str) -> None:
        self.log.failure("{key}: writing its cache entry failed", failure, key=key)


def _records(files: Path, plan: Plan) -> tuple[FileRecord, ...]:
    out = []
    for spec in plan.files:
        st = (files / spec.path).stat()
        out.append(FileRecord(path=spec.path, size=st.st_size, mtime_ns=st.st_mtime_ns,
                              sha256=spec.sha256, git_sha1=spec.git_sha1))
    return tuple(out)


def _room(directory: Path, files: Path) -> tuple[int, int]:
    """
    The bytes already under C{files} (counted toward the model) and the
    bytes free on C{directory}'s filesystem.
    """
    present = sum(p.stat().st_size for p in files.rglob("*") if p.is_file()) if files.exists() else 0
    return present, shutil.disk_usage(directory).free

