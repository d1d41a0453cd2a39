"""
A shard's record on disk: what an agent restarted later needs to find it
again (L{shard_record}), kept in the agent's state directory through
L{Records}, which also names each shard's log file. An agent without a
state directory keeps no records, and its shards write no logs.
"""

from __future__ import annotations

import os
from pathlib import Path

from twisted.logger import Logger

from llmgw.agent.shard import FETCHING, Shard
from llmgw.agent.state import ShardRecord, StateDir


def shard_record(shard: Shard) -> ShardRecord:
    """
    The record of a shard that has a pid: its spec, process, state, log,
    groups and, once its main process ended, how it ended.
    """
    return ShardRecord(
        spec=shard.spec, pid=shard.pid or 0, start_time=shard.start_time or 0,
        state=shard.state,
        log_path=str(shard.tail.path) if shard.tail is not None else os.devnull,
        pgids=sorted(shard.pgids), main_ended=shard.main_ended,
        error=shard.error, exit_code=shard.exit_code, signal=shard.signal,
        crash_class=shard.crash_class, stop_error=shard.stop_error,
    )


class Records:
    """
    The shards' records and logs in C{state_dir}, or none when it is
    C{None}.
    """

    log = Logger()

    def __init__(self, state_dir: StateDir | None):
        self.state_dir = state_dir

    @property
    def marker(self) -> str:
        """
        This agent's mark in its shards' environments: its state directory,
        resolved; C{""} without one.
        """
        return str(self.state_dir.path.resolve()) if self.state_dir is not None else ""

    def load_all(self) -> list[ShardRecord]:
        """
        Every readable record (see L{StateDir.load_all}).
        """
        return self.state_dir.load_all() if self.state_dir is not None else []

    def save(self, shard: Shard) -> None:
        """
        Record a held shard that has a pid, or is fetching its weights (so
        an agent restarted mid-fetch fetches on); a shard whose record was
        lost stays unrecorded (its profile is unknown). A record that cannot be
        written is logged, not raised: the shard runs on, but will not be
        re-adopted after a restart.
        """
        if self.state_dir is None or not shard.held or shard.record_lost:
            return
        if shard.pid is None and shard.state != FETCHING:
            return
        try:
            self.state_dir.save(shard_record(shard))
        except OSError:
            self.log.failure("could not record shard {shard} in {dir}; it will not be "
                             "re-adopted after a restart", shard=shard.shard_id,
                             dir=str(self.state_dir.path))

    def remove(self, shard_id: str) -> None:
        """
        Forget the shard's record: it has ended.
        """
        if self.state_dir is not None:
            self.state_dir.remove(shard_id)

    def new_log(self, shard_id: str) -> Path | None:
        """
        An empty log file for a new run of the shard, or C{None} without a
        state directory.
        """
        if self.state_dir is None:
            return None
        path = self.state_dir.log_path(shard_id)
        path.write_bytes(b"")
        return path

    def existing_log(self, shard_id: str) -> Path | None:
        """
        The shard's log file if it has one.
        """
        if self.state_dir is None:
            return None
        path = self.state_dir.log_path(shard_id)
        return path if path.exists() else None
