"""
Tests for L{llmgw.agent.state}: the agent's state directory and shard ids, and
the shard record files: the file an agent writes stays the one an older
agent wrote, and an older agent's files load.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from hypothesis import given
from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.state import ShardRecord, StateDir, StateDirError
from llmgw.shards import ShardSpec
from tests.supervisor_harness import spec
from tests.test_shards import specs


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


#: A record as the agent wrote it before the shard's fields were shared
#: with the control plane (its JSON, key for key).
PREVIOUS: dict[str, Any] = {
    "crash_class": "", "error": "", "exit_code": 0,
    "log_path": "/var/lib/llmgw/logs/demo-1-s0.log", "main_ended": False, "pgids": [4242],
    "pid": 4242, "signal": 0, "start_time": 777, "state": "ready", "stop_error": "",
    "spec": {
        "argv": ["{python}", "-m", "x", "--port", "20000"], "drain_timeout_s": 60,
        "engine": "vllm", "env": {"A": "1"}, "epoch": 3, "gpu_indices": [0, 1],
        "health_path": "/health", "leader_address": "",
        "metric_names": {"waiting": "vllm:num_requests_waiting"}, "metrics_path": "/metrics",
        "model": "demo", "port": 20000, "profile": "one", "rank": 0, "replica_id": "demo-1",
        "shard_id": "demo-1-s0", "startup_timeout_s": 600, "stop_grace_s": 30,
        "stop_signal": "SIGTERM", "world_size": 1,
    },
}


def previous_bytes(raw: dict[str, Any]) -> bytes:
    # How ShardRecord.to_json wrote a record before.
    return json.dumps(raw, sort_keys=True, indent=1).encode()


class ShardRecordTests(SynchronousTestCase):
    def test_previous_format(self) -> None:
        """
        A record written before loads, and is written back byte for byte as
        it was.
        """
        record = ShardRecord.from_json(previous_bytes(PREVIOUS))
        self.assertEqual(record.spec, ShardSpec(
            shard_id="demo-1-s0", replica_id="demo-1", model="demo", profile="one",
            argv=("{python}", "-m", "x", "--port", "20000"), gpu_indices=(0, 1), port=20000,
            env={"A": "1"}, epoch=3, engine="vllm", metrics_path="/metrics",
            metric_names={"waiting": "vllm:num_requests_waiting"},
        ))
        self.assertEqual((record.pid, record.pgids, record.state), (4242, [4242], "ready"))
        self.assertEqual(record.to_json(), previous_bytes(PREVIOUS))

    def test_stall_threshold_kept_when_set(self) -> None:
        """
        A shard's own stall threshold is kept in its record and read back;
        the default one is left out, as records were before the field.
        """
        record = ShardRecord.from_json(previous_bytes(PREVIOUS))
        changed = replace(record, spec=replace(record.spec, stall_after_s=4.0))
        again = ShardRecord.from_json(changed.to_json())
        self.assertEqual(again.spec.stall_after_s, 4.0)
        self.assertNotIn(b"stall_after_s", record.to_json())

    def test_before_engines(self) -> None:
        """
        A record from an agent that knew no engines, drain timeouts or
        process groups loads, with the defaults of what it lacks.
        """
        raw = json.loads(previous_bytes(PREVIOUS))
        for key in ("engine", "metrics_path", "metric_names", "stop_signal", "drain_timeout_s"):
            del raw["spec"][key]
        for key in ("pgids", "main_ended", "crash_class", "stop_error"):
            del raw[key]
        state = StateDir(self.mktemp())
        state.shards.joinpath("demo-1-s0.json").write_bytes(previous_bytes(raw))
        (record,) = state.load_all()
        spec = record.spec
        self.assertEqual((spec.engine, spec.metrics_path, spec.metric_names, spec.stop_signal,
                          spec.drain_timeout_s, spec.gpu_indices),
                         ("generic", "", {}, "SIGTERM", 60, (0, 1)))
        self.assertEqual((record.pgids, record.main_ended), ([], False))

    def test_unknown_field_moved_aside(self) -> None:
        """
        A spec with a field this agent does not know (a newer agent's) is
        unreadable: moved aside and logged, not half-loaded.
        """
        raw = json.loads(previous_bytes(PREVIOUS))
        raw["spec"]["novel"] = 1
        state = StateDir(self.mktemp())
        state.shards.joinpath("demo-1-s0.json").write_bytes(previous_bytes(raw))
        self.assertEqual(state.load_all(), [])
        self.assertTrue(state.shards.joinpath("demo-1-s0.bad").exists())
        self.flushLoggedErrors()

    @given(specs)
    def test_round_trip(self, spec: ShardSpec) -> None:
        """
        Any spec saved in a record is read back equal.
        """
        record = ShardRecord(spec, 1, 2, "starting", "/dev/null", pgids=[1])
        self.assertEqual(ShardRecord.from_json(record.to_json()), record)
