"""
Tests for L{llmgw.agent.state}: the agent's state directory and shard ids.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.state import ShardRecord, StateDir, StateDirError
from tests.supervisor_harness import spec


class StateDirTests(SynchronousTestCase):
    """
    Records in the state directory, and its lock.
    """

    def test_older_record_loads(self) -> None:
        """
        A record written by an agent before process groups were recorded
        loads, with no groups, nothing ended and no error.
        """
        state = StateDir(self.mktemp())
        raw = json.loads(ShardRecord(spec("ok"), 1, 2, "ready", "/dev/null").to_json())
        for key in ("pgids", "main_ended", "error", "exit_code", "signal", "crash_class",
                    "stop_error"):
            del raw[key]
        state.shards.joinpath("ok.json").write_text(json.dumps(raw))
        (record,) = state.load_all()
        self.assertEqual((record.pgids, record.main_ended, record.error), ([], False, ""))

    def test_bad_record_moved_aside(self) -> None:
        """
        An unreadable record is moved aside as .bad, and the others load.
        """
        state = StateDir(self.mktemp())
        state.save(ShardRecord(spec("ok"), 1, 2, "ready", "/dev/null"))
        state.shards.joinpath("bad.json").write_text("{not json")
        records = state.load_all()
        self.assertEqual([r.spec.shard_id for r in records], ["ok"])
        self.assertTrue(state.shards.joinpath("bad.bad").exists())
        self.flushLoggedErrors()

    def test_lock(self) -> None:
        """
        Two agents cannot share a state directory: the second is refused
        with the first one's pid.
        """
        path = self.mktemp()
        first = StateDir(path)
        first.lock()
        self.addCleanup(first.unlock)
        e = self.assertRaises(StateDirError, StateDir(path).lock)
        self.assertIn(f"pid {os.getpid()}", str(e))

    def test_unusable(self) -> None:
        """
        A state directory that cannot be created is a clear error naming it.
        """
        blocker = Path(self.mktemp())
        blocker.write_text("a file")
        e = self.assertRaises(StateDirError, StateDir, blocker / "sub")
        self.assertIn(str(blocker / "sub"), str(e))

    def test_records_private(self) -> None:
        """
        Records are written with mode 0600 (they hold the shard's env).
        """
        state = StateDir(self.mktemp())
        state.save(ShardRecord(spec("ok"), 1, 2, "ready", "/dev/null"))
        self.assertEqual(state.shards.joinpath("ok.json").stat().st_mode & 0o777, 0o600)


class ShardIdTests(SynchronousTestCase):
    """
    The grammar of shard ids.
    """

    def test_whole_id_checked(self) -> None:
        """
        A shard id names files in the state directory: all of it must be in
        the grammar, a trailing newline included.
        """
        from llmgw.agent.state import valid_shard_id

        self.assertTrue(valid_shard_id("demo-1-s0"))
        for bad in ("s1\n", "../etc", "", "a/b", "x" * 129):
            self.assertFalse(valid_shard_id(bad), bad)
