"""
What every fetcher shares: the plan of a fetch (the files, their sizes and
checksums, known before a byte is written), the thread-safe L{Transfer}
a fetch counts its bytes in and is cancelled through, the checks a file
must pass before it is used, and L{IFetcher}, the seam the cache calls.

A fetcher's methods block: the cache runs them in its thread pool, never on
the reactor, and reads a L{Transfer}'s count from the reactor.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from zope.interface import Interface

from llmgw.models.errors import ChecksumMismatch, DiskFull, FetchCancelled, ModelError
from llmgw.models.source import Source

#: How much of a file is read at a time when it is checked.
READ_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileSpec:
    """
    One file of a model: its path under the entry's directory, its size
    (C{None} when the source does not say), and the checksum it must have:
    C{sha256} (hex) or C{git_sha1}, the git blob id of a hub file kept
    outside LFS. A file with neither is checked by size only.
    """

    path: str
    size: int | None
    sha256: str | None = None
    git_sha1: str | None = None


@dataclass(frozen=True)
class Plan:
    """
    A fetch's plan: its files; the revision fetched (a hub's commit id, ""
    for other sources); and C{target}, the path under the entry's directory
    an engine is given ("" for the directory itself).
    """

    files: tuple[FileSpec, ...]
    revision: str = ""
    target: str = ""

    @property
    def total(self) -> int | None:
        """
        The model's size in bytes, or C{None} when a file's size is unknown.
        """
        sizes = [f.size for f in self.files]
        return None if any(s is None for s in sizes) else sum(s for s in sizes if s is not None)


class Transfer:
    """
    A fetch's byte count, written by its thread and read by the reactor;
    and its brakes: L{cancel} from the reactor, and C{limit}, the most
    bytes it may write when its size was not known up front.

    A fetcher calls L{add} as bytes arrive (a negative count when it
    throws bytes away); L{add} raises in the fetcher's thread to stop it.
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self._done = 0
        self._lock = threading.Lock()
        self._cancelled = threading.Event()

    @property
    def done(self) -> int:
        with self._lock:
            return self._done

    def add(self, count: int) -> None:
        """
        Count C{count} more bytes.

        @raise FetchCancelled: L{cancel} was called.
        @raise DiskFull: more than C{limit} bytes were written.
        """
        with self._lock:
            self._done += count
            done = self._done
        self.check()
        if self.limit is not None and done > self.limit:
            raise DiskFull(f"the download passed the {self.limit} bytes the cache had room for")

    def check(self) -> None:
        """
        @raise FetchCancelled: L{cancel} was called.
        """
        if self._cancelled.is_set():
            raise FetchCancelled("the fetch was cancelled")

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


def git_blob_sha1(path: Path, transfer: Transfer | None = None) -> str:
    """
    The git blob id of the file at C{path}: sha1 of C{"blob SIZE\\0"} and its bytes.
    """
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode(), usedforsecurity=False)
    return _digest_file(path, digest, transfer)


def file_sha256(path: Path, transfer: Transfer | None = None) -> str:
    return _digest_file(path, hashlib.sha256(), transfer)


def _digest_file(path: Path, digest: Any, transfer: Transfer | None) -> str:
    with path.open("rb") as f:
        while chunk := f.read(READ_CHUNK):
            digest.update(chunk)
            if transfer is not None:
                transfer.check()
    return digest.hexdigest()


def hash_part(part: Path, digest: Any | None, limit: int | None = None) -> int:
    """
    Feed what a partial download C{part} already holds into C{digest}
    (when there is one), so that a resumed download's checksum covers the
    whole file; the bytes it holds. A part missing, or longer than
    C{limit} (the file's whole size), is removed and counts 0.
    """
    if not part.exists():
        return 0
    if limit is not None and part.stat().st_size > limit:
        part.unlink()
        return 0
    have = 0
    with part.open("rb") as f:
        while chunk := f.read(READ_CHUNK):
            if digest is not None:
                digest.update(chunk)
            have += len(chunk)
    return have


def matches(path: Path, spec: FileSpec, transfer: Transfer | None = None) -> bool:
    """
    Whether the file at C{path} has C{spec}'s size and checksum. A missing
    file does not match.

    @raise FetchCancelled: C{transfer} was cancelled while the file was read.
    """
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return False
    if spec.size is not None and size != spec.size:
        return False
    if spec.sha256 is not None:
        return file_sha256(path, transfer) == spec.sha256
    if spec.git_sha1 is not None:
        return git_blob_sha1(path, transfer) == spec.git_sha1
    return True


def check_file(path: Path, spec: FileSpec, source: str, transfer: Transfer | None = None) -> None:
    """
    Check the file at C{path} against C{spec}; a file that fails is deleted.

    @raise ChecksumMismatch: the size or checksum differs.
    """
    if not matches(path, spec, transfer):
        path.unlink(missing_ok=True)
        expected = spec.sha256 and f"sha256 {spec.sha256}" or spec.git_sha1 and f"git blob {spec.git_sha1}"
        raise ChecksumMismatch(
            f"{source}: {spec.path} does not match the source's checksum "
            f"({expected or f'size {spec.size}'}); the file was deleted")


class IFetcher(Interface):
    """
    Fetches the files of one kind of source. Both methods block and are
    called in a thread, never on the reactor.
    """

    def plan(source: Source) -> Plan:
        """
        The files C{source} is made of, with their sizes and checksums,
        read from the source's metadata; no byte of a file is fetched.

        @raise SourceNotFound, SourceDenied, ModelError: the source cannot
            be read.
        """

    def fetch(source: Source, plan: Plan, directory: Path, transfer: Transfer) -> None:
        """
        Make every file of C{plan} present under C{directory} and checked
        against its L{FileSpec} (with L{check_file}), resuming what an
        earlier fetch left there; count bytes in C{transfer} (bytes already
        there count too), and stop when it raises.

        @raise ChecksumMismatch: a file fetched does not match.
        @raise FetchCancelled, DiskFull: raised by C{transfer}.
        """


class Cut(Exception):
    """
    A download's connection ended before the file did; what arrived is
    kept in its part, for the next try to resume from.
    """


_T = TypeVar("_T")


def resumed(download: Callable[[], _T], retries: int, delay: float, where: str) -> _T:
    """
    C{download()}, tried again after C{delay} seconds each time it is
    L{Cut}, up to C{retries} more times (each try resumes from the part).

    @raise ModelError: naming C{where}, when the last try was cut too.
    """
    attempts = 0
    while True:
        try:
            return download()
        except Cut as cut:
            attempts += 1
            if attempts > retries:
                raise ModelError(f"{where}: {cut}; gave up after {attempts} tries") from None
            time.sleep(delay)
