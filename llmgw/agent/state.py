"""
The agent's state directory: what it needs to find its shards again after
a restart (DESIGN §7).

Layout::

    STATE_DIR/agent.lock          held (flock) by the running agent
    STATE_DIR/shards/ID.json      one record per live shard, written atomically
    STATE_DIR/logs/ID.log         the shard's stdout and stderr

A record is written when a shard starts and on every state change, and
removed when the shard has ended. Files that cannot be read are moved
aside (C{.bad}) with a log line, never silently dropped. A record is a
JSON object of its fields by name, the shard's L{ShardSpec} an object under
C{spec}, so a record an older agent wrote (fewer fields) loads with the
defaults of those it lacks.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from twisted.logger import Logger

from llmgw.shards import DEFAULT_STALL_AFTER_S, ShardSpec

__all__ = ["ShardRecord", "ShardSpec", "StateDir", "StateDirError", "valid_shard_id"]

log = Logger()

# Shard ids become file names: a conservative grammar, no dot first.
_SHARD_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")


class StateDirError(Exception):
    """
    The state directory cannot be used; the message names it and says why.
    """


def valid_shard_id(shard_id: str) -> bool:
    return bool(_SHARD_ID.fullmatch(shard_id))


@dataclass
class ShardRecord:
    """
    A live shard as the state directory keeps it.
    """

    spec: ShardSpec
    pid: int
    #: The process's start time from /proc/PID/stat (clock ticks since boot),
    #: which tells a re-used pid from ours.
    start_time: int
    state: str
    log_path: str
    #: The process groups of the shard (its main pid's, and any found by
    #: its marker); empty in records of older agents: the main pid's.
    pgids: list[int] = field(default_factory=list)
    #: Whether the main process had ended (the shard was stopping).
    main_ended: bool = False
    error: str = ""
    exit_code: int = 0
    signal: int = 0
    crash_class: str = ""
    stop_error: str = ""

    def to_json(self) -> bytes:
        """
        The record as the state directory stores it.
        """
        raw = asdict(self)
        # A spec without a model source is written as before the field
        # existed, so an older agent (which refuses unknown fields) reads it.
        if raw["spec"]["source"] is None:
            del raw["spec"]["source"]
        # Peers matter only while fetching, and an older agent refuses the field.
        del raw["spec"]["model_peers"]
        # The default stall threshold is written as before the field existed.
        if raw["spec"].get("stall_after_s") == DEFAULT_STALL_AFTER_S:
            del raw["spec"]["stall_after_s"]
        # No adapters is written as before the field existed, likewise.
        if not raw["spec"]["adapters"]:
            del raw["spec"]["adapters"]
        for key in ("sleep_level", "sleep_after_s"):
            if not raw["spec"].get(key):
                del raw["spec"][key]
        return json.dumps(raw, sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> ShardRecord:
        """
        A stored record; the fields it lacks take their defaults.

        @raise ValueError: it is not JSON.
        @raise TypeError: it names a field no record has, or is not an object.
        @raise KeyError: it has no C{spec}.
        """
        raw: dict[str, Any] = json.loads(data)
        spec = ShardSpec(**raw.pop("spec"))
        return cls(spec=spec, **raw)


class StateDir:
    """
    One agent's state directory.

    @raise StateDirError: from the constructor, when it cannot be created or
        written.
    """

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.shards = self.path / "shards"
        self.logs = self.path / "logs"
        try:
            for d in (self.path, self.shards, self.logs):
                d.mkdir(mode=0o700, parents=True, exist_ok=True)
            probe = self.path / f".probe-{secrets.token_hex(4)}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise StateDirError(
                f"state directory {self.path} cannot be used: {e.strerror or e}"
            ) from e
        self._lock_fd: int | None = None

    def lock(self) -> None:
        """
        Take the directory for this process.

        @raise StateDirError: another agent holds it.
        """
        path = self.path / "agent.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise StateDirError(
                f"state directory {self.path} is in use by another agent (pid {holder}); "
                "give each agent its own --state-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def log_path(self, shard_id: str) -> Path:
        return self.logs / f"{shard_id}.log"

    def _record_path(self, shard_id: str) -> Path:
        return self.shards / f"{shard_id}.json"

    def save(self, record: ShardRecord) -> None:
        """
        Write C{record} atomically (temporary file, fsync, rename).
        """
        final = self._record_path(record.spec.shard_id)
        tmp = final.with_name(f".{final.name}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(record.to_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def remove(self, shard_id: str) -> None:
        self._record_path(shard_id).unlink(missing_ok=True)

    def load_all(self) -> list[ShardRecord]:
        """
        Every readable record; unreadable ones are moved aside and logged.
        """
        out: list[ShardRecord] = []
        for path in sorted(self.shards.glob("*.json")):
            try:
                out.append(ShardRecord.from_json(path.read_bytes()))
            except (OSError, ValueError, TypeError, KeyError) as e:
                aside = path.with_suffix(".bad")
                log.error(
                    "shard record {path} is unreadable ({error}); moved to {aside}",
                    path=str(path), error=f"{type(e).__name__}: {e}", aside=str(aside),
                )
                try:
                    os.replace(path, aside)
                except OSError:
                    pass
        return out
