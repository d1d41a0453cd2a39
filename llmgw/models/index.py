"""
The cache's index: one small JSON file per entry (C{entry.json} in the
entry's directory, replaced atomically), and the pure decisions taken on
it: which entries to evict to make room, and whether an entry's files on
disk are still the ones it recorded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

#: The index file in each entry's directory.
INDEX = "entry.json"
#: The directory under an entry's that holds the model's files.
FILES = "files"
#: The index's format; an entry in another is treated as unreadable.
VERSION = 1


class EntryState(StrEnum):
    #: Being fetched, or a fetch ended before it was whole: resumed by the next.
    PARTIAL = "partial"
    #: Every file was fetched and checked.
    COMPLETE = "complete"


@dataclass(frozen=True)
class FileRecord:
    """
    A file of a complete entry as it was when checked: its path under the
    entry's C{files} directory, size, checksum and modification time (ns).
    """

    path: str
    size: int
    mtime_ns: int
    sha256: str | None = None
    git_sha1: str | None = None


@dataclass(frozen=True)
class Entry:
    """
    One model in the cache. C{size}: its bytes when complete, the bytes it
    will take (and holds in reserve) while partial. C{last_used}: seconds
    since the epoch, by the cache's clock. C{target}: the path under
    C{files} that an engine is given.
    """

    key: str
    source: str
    state: EntryState
    size: int
    last_used: float
    revision: str = ""
    target: str = ""
    files: tuple[FileRecord, ...] = field(default=())

    def to_json(self) -> bytes:
        body: dict[str, Any] = asdict(self)
        body["version"] = VERSION
        body["state"] = str(self.state)
        body["files"] = [asdict(f) for f in self.files]
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Entry:
        """
        @raise ValueError: C{data} is not an entry of this format.
        """
        body = json.loads(data)
        if not isinstance(body, dict) or body.get("version") != VERSION:
            raise ValueError(f"not a cache entry of version {VERSION}")
        try:
            return cls(
                key=str(body["key"]), source=str(body["source"]), state=EntryState(body["state"]),
                size=int(body["size"]), last_used=float(body["last_used"]),
                revision=str(body.get("revision", "")), target=str(body.get("target", "")),
                files=tuple(FileRecord(**f) for f in body.get("files", ())))
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed cache entry: {e}") from None

    def touched(self, now: float) -> Entry:
        return replace(self, last_used=now)


def write_entry(directory: Path, entry: Entry) -> None:
    """
    Write C{entry}'s index into C{directory} atomically: a reader (or an
    agent restarted after a crash) sees the old index or the new, whole.
    Blocks; run in a thread.
    """
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / (INDEX + ".tmp")
    with tmp.open("wb") as f:
        f.write(entry.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / INDEX)


def read_entries(root: Path) -> tuple[list[Entry], list[Path]]:
    """
    The entries under the cache directory C{root}, and the directories in
    it that hold no readable entry (left by a fetch killed before its first
    index write, or by another program): the caller removes those. Blocks.
    """
    entries: list[Entry] = []
    strays: list[Path] = []
    if not root.exists():
        return entries, strays
    for child in sorted(root.iterdir()):
        if not child.is_dir() or child.name.startswith("."):
            continue
        try:
            entry = Entry.from_json((child / INDEX).read_bytes())
        except (OSError, ValueError):
            strays.append(child)
            continue
        if entry.key != child.name:
            strays.append(child)
            continue
        entries.append(entry)
    return entries, strays


def unchanged(files_dir: Path, entry: Entry) -> list[str]:
    """
    The paths of C{entry}'s files that are missing, or whose size or
    modification time differs from its record: these must be checked again.
    Only stats files. Blocks.
    """
    changed = []
    for record in entry.files:
        try:
            st = (files_dir / record.path).stat()
        except OSError:
            changed.append(record.path)
            continue
        if st.st_size != record.size or st.st_mtime_ns != record.mtime_ns:
            changed.append(record.path)
    return changed


def victims(
    entries: Iterable[Entry], keep: Collection[str], need: int, capacity: int,
) -> list[Entry] | None:
    """
    The entries to evict so that C{need} more bytes fit in C{capacity}:
    none of those in C{keep} (pinned, being fetched, or the one being made
    room for), partial ones first (nothing uses them), then least recently
    used first. C{None} when even evicting every other entry is not enough.

    Pure: takes the entries as they are, decides, touches nothing.
    """
    entries = list(entries)
    used = sum(e.size for e in entries)
    free = capacity - used
    if free >= need:
        return []
    candidates = sorted(
        (e for e in entries if e.key not in keep),
        key=lambda e: (e.state == EntryState.COMPLETE, e.last_used, e.key))
    chosen: list[Entry] = []
    for entry in candidates:
        chosen.append(entry)
        free += entry.size
        if free >= need:
            return chosen
    return None


def held(entries: Mapping[str, Entry], keep: Collection[str]) -> int:
    """
    The bytes that no eviction can free: those of the entries in C{keep}.
    """
    return sum(e.size for k, e in entries.items() if k in keep)
