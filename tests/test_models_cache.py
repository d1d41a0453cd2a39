"""
Tests for L{llmgw.models.cache}: the node-local model cache, with a fake
fetcher and a thread runner stepped by the test.
"""

from __future__ import annotations

import json
from pathlib import Path

from twisted.internet.defer import CancelledError
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.models.cache import ModelCache, Progress
from llmgw.models.errors import ChecksumMismatch, DiskFull, SourceNotFound
from llmgw.models.index import INDEX, EntryState
from llmgw.models.source import cache_key, parse_source
from llmgw.testing.fakefetch import FakeFetcher, StepRunner

A = parse_source("hf://acme/a")
B = parse_source("hf://acme/b")
C = parse_source("hf://acme/c")


def model(tag: bytes, size: int = 100) -> dict[str, bytes]:
    return {"config.json": b'{"tag": "%s"}' % tag, "weights.bin": (tag * size)[:size]}


class CacheCase(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        self.clock = Clock()
        self.clock.advance(1000)
        self.runner = StepRunner()
        self.fetcher = FakeFetcher({str(A): model(b"a"), str(B): model(b"b"), str(C): model(b"c")})
        self.cache = self.make(capacity=300)

    def make(self, capacity: int) -> ModelCache:
        cache = ModelCache(self.dir, capacity, {"hf": self.fetcher}, self.clock, self.runner)
        d = cache.load()
        self.runner.drain()
        self.successResultOf(d)
        return cache

    def fetch(self, source, cache: ModelCache | None = None) -> Path:  # type: ignore[no-untyped-def]
        d = (cache or self.cache).ensure(source)
        self.runner.drain()
        return self.successResultOf(d)


class FetchTests(CacheCase):
    def test_cold_fetch(self) -> None:
        """
        A model the cache lacks is fetched into its entry's files directory,
        and its index on disk says complete with its size and files.
        """
        path = self.fetch(A)
        self.assertEqual(path, self.dir / cache_key(A) / "files")
        self.assertEqual((path / "weights.bin").read_bytes(), model(b"a")["weights.bin"])
        index = json.loads((self.dir / cache_key(A) / INDEX).read_bytes())
        self.assertEqual(index["state"], "complete")
        self.assertEqual(index["size"], sum(len(v) for v in model(b"a").values()))
        self.assertEqual(sorted(f["path"] for f in index["files"]), ["config.json", "weights.bin"])

    def test_hit(self) -> None:
        """
        A cached model is returned without planning or fetching again, and
        its last use moves to now.
        """
        self.fetch(A)
        self.clock.advance(50)
        self.fetch(A)
        self.assertEqual(self.fetcher.plans, [str(A)])
        [entry] = self.cache.models()
        self.assertEqual(entry.last_used, 1050)

    def test_shared(self) -> None:
        """
        Two callers asking for one model while it is fetched share one fetch.
        """
        first = self.cache.ensure(A)
        second = self.cache.ensure(A)
        self.runner.drain()
        self.assertEqual(self.successResultOf(first), self.successResultOf(second))
        self.assertEqual(self.fetcher.plans, [str(A)])
        self.assertEqual(self.fetcher.written.count("weights.bin"), 1)

    def test_restart_keeps_index(self) -> None:
        """
        A new cache on the same directory finds what the old one fetched.
        """
        self.fetch(A)
        again = self.make(capacity=300)
        self.fetch(A, again)
        self.assertEqual(self.fetcher.plans, [str(A)])

    def test_wrong_checksum(self) -> None:
        """
        A file fetched with bytes that do not match its checksum fails the
        fetch as a checksum failure, and the bad file is gone.
        """
        self.fetcher.corrupt.add("weights.bin")
        d = self.cache.ensure(A)
        self.runner.drain()
        failure = self.failureResultOf(d, ChecksumMismatch)
        self.assertEqual(failure.value.failure_class, "checksum")
        self.assertFalse((self.dir / cache_key(A) / "files" / "weights.bin").exists())
        self.flushLoggedErrors()

    def test_not_found(self) -> None:
        """
        A source the fetcher cannot find fails with L{SourceNotFound}, and
        nothing is left in the cache.
        """
        d = self.cache.ensure(parse_source("hf://acme/nothing"))
        self.runner.drain()
        self.failureResultOf(d, SourceNotFound)
        self.assertEqual(self.cache.models(), [])

    def test_local(self) -> None:
        """
        A file:// source is used in place, its size reported, nothing copied.
        """
        target = Path(self.mktemp())
        target.write_bytes(b"gguf" * 10)
        seen: list[Progress] = []
        d = self.cache.ensure(parse_source(f"file://{target.absolute()}"), seen.append)
        self.runner.drain()
        self.assertEqual(self.successResultOf(d), target.absolute())
        self.assertEqual((seen[0].done, seen[0].total), (40, 40))
        self.assertEqual(self.cache.models(), [])

    def test_local_missing(self) -> None:
        """
        A file:// source naming nothing fails with L{SourceNotFound}.
        """
        d = self.cache.ensure(parse_source("file:///no/such/model.gguf"))
        self.runner.drain()
        self.failureResultOf(d, SourceNotFound)


class RoomTests(CacheCase):
    def test_too_big_refused_before_writing(self) -> None:
        """
        A model bigger than the whole cache is refused with L{DiskFull}
        before anything of it is written.
        """
        small = self.make(capacity=50)
        d = small.ensure(A)
        self.runner.drain()
        failure = self.failureResultOf(d, DiskFull)
        self.assertEqual(failure.value.failure_class, "disk_full")
        self.assertFalse((self.dir / cache_key(A)).exists())
        self.assertEqual(self.fetcher.written, [])
        self.flushLoggedErrors()

    def test_lru_eviction(self) -> None:
        """
        To make room, the least recently used model no one pins is evicted,
        from the index and from the disk.
        """
        self.fetch(A)
        self.clock.advance(1)
        self.fetch(B)
        self.clock.advance(1)
        self.fetch(A)  # A is now newer than B
        self.clock.advance(1)
        self.fetch(C)
        keys = {m.key for m in self.cache.models()}
        self.assertEqual(keys, {cache_key(A), cache_key(C)})
        self.assertFalse((self.dir / cache_key(B)).exists())

    def test_pinned_not_evicted(self) -> None:
        """
        A pinned model is never evicted: the unpinned one goes even when it
        was used more recently.
        """
        self.cache.acquire(A, "shard-1")
        self.runner.drain()
        self.clock.advance(1)
        self.fetch(B)
        self.clock.advance(1)
        self.fetch(C)
        self.assertEqual({m.key for m in self.cache.models()}, {cache_key(A), cache_key(C)})
        [a] = [m for m in self.cache.models() if m.key == cache_key(A)]
        self.assertEqual(a.pinned_by, {"shard-1"})

    def test_all_pinned_refused(self) -> None:
        """
        When the models in use fill the cache, another is refused with
        L{DiskFull}; released, they may be evicted.
        """
        self.cache.acquire(A, "s1")
        self.cache.acquire(B, "s2")
        self.runner.drain()
        d = self.cache.ensure(C)
        self.runner.drain()
        self.assertIn("in use", str(self.failureResultOf(d, DiskFull).value))
        self.cache.release(cache_key(A), "s1")
        self.fetch(C)
        self.assertEqual({m.key for m in self.cache.models()}, {cache_key(B), cache_key(C)})
        self.flushLoggedErrors()


class RepairTests(CacheCase):
    def test_damaged_refetched(self) -> None:
        """
        A cached file changed on disk is checked on the next use; damaged,
        it is fetched again (and only it).
        """
        path = self.fetch(A)
        (path / "weights.bin").write_bytes(b"garbage")
        self.fetcher.written.clear()
        again = self.fetch(A)
        self.assertEqual((again / "weights.bin").read_bytes(), model(b"a")["weights.bin"])
        self.assertEqual(self.fetcher.written, ["weights.bin"])

    def test_partial_resumed_after_restart(self) -> None:
        """
        A fetch killed midway leaves a partial entry; a cache started on the
        directory keeps it (its room reserved) and the next fetch resumes,
        fetching only what is missing.
        """
        d = self.cache.ensure(A)
        # Run up to the partial index write, then "kill" the agent after one
        # file landed.
        while self.runner.queue and self.runner.queue[0][1].__name__ != "fetch":
            self.runner.step()
        files = self.dir / cache_key(A) / "files"
        files.mkdir(parents=True)
        (files / "config.json").write_bytes(model(b"a")["config.json"])
        self.assertNoResult(d)
        self.runner.queue.clear()  # the old agent's thread died with it
        again = self.make(capacity=300)
        [entry] = again.models()
        self.assertEqual(entry.state, EntryState.PARTIAL)
        self.fetcher.written.clear()
        self.fetch(A, again)
        self.assertEqual(self.fetcher.written, ["weights.bin"])
        self.assertEqual(again.models()[0].state, EntryState.COMPLETE)

    def test_stray_removed(self) -> None:
        """
        A directory in the cache without a readable entry is removed on load.
        """
        stray = self.dir / "junk"
        stray.mkdir(parents=True)
        (stray / "x").write_bytes(b"x")
        self.make(capacity=300)
        self.assertFalse(stray.exists())


class ProgressTests(CacheCase):
    def test_progress_and_rate(self) -> None:
        """
        While a fetch runs, each caller hears its bytes done, total and rate
        every interval, on the cache's clock.
        """
        seen: list[Progress] = []
        self.cache.ensure(A, seen.append)
        while self.runner.queue[0][1].__name__ != "fetch":
            self.runner.step()
        self.runner.step()  # the fetch itself: every byte lands
        self.clock.advance(2)  # the first report, at 1 s, is the LoopingCall's
        total = sum(len(v) for v in model(b"a").values())
        self.assertEqual([(p.done, p.total) for p in seen][-1], (total, total))
        self.runner.drain()

    def test_cancel_all_stops_fetch(self) -> None:
        """
        When every caller cancels, the fetch is cancelled and nothing
        further is fetched; a caller cancelling alone does not stop it.
        """
        first = self.cache.ensure(A)
        second = self.cache.ensure(A)
        first.cancel()
        self.failureResultOf(first, CancelledError)
        self.runner.drain()
        self.successResultOf(second)
        third = self.cache.ensure(B)
        while self.runner.queue[0][1].__name__ != "fetch":
            self.runner.step()
        third.cancel()
        self.failureResultOf(third, CancelledError)
        self.runner.drain()
        self.assertNotIn("weights.bin", [p for p in self.fetcher.written[2:]])
        [b] = [m for m in self.cache.models() if m.key == cache_key(B)]
        self.assertEqual(b.state, EntryState.PARTIAL)
