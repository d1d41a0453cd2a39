"""
Tests for L{llmgw.agent.records}: a shard's record and log in the state
directory, or none without one.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.logtail import LogTail
from llmgw.agent.records import Records, shard_record
from llmgw.agent.shard import FAILED, READY, STOPPING, Shard
from llmgw.agent.state import StateDir
from tests.supervisor_harness import spec


class RecordsTests(SynchronousTestCase):
    """
    L{shard_record} and L{Records}.
    """

    def test_record_round_trip(self) -> None:
        """
        A held shard's record carries its process, groups, log and how it
        ended, and loads back as written.
        """
        state = StateDir(self.mktemp())
        records = Records(state)
        shard = Shard(spec(), STOPPING)
        shard.pid, shard.start_time, shard.pgids = 42, 7, {42, 40}
        shard.main_ended, shard.error, shard.crash_class = True, "boom", "oom"
        log = records.new_log("s1")
        assert log is not None
        shard.tail = LogTail(log)
        records.save(shard)
        (loaded,) = records.load_all()
        self.assertEqual(loaded, shard_record(shard))
        self.assertEqual((loaded.pgids, loaded.log_path, loaded.main_ended),
                         ([40, 42], str(log), True))
        self.assertEqual(records.existing_log("s1"), log)
        records.remove("s1")
        self.assertEqual(records.load_all(), [])

    def test_not_recorded(self) -> None:
        """
        A shard with no pid, an ended one and one whose record was lost are
        not recorded.
        """
        records = Records(StateDir(self.mktemp()))
        shards = [Shard(spec("a")), Shard(spec("b"), FAILED), Shard(spec("c"), READY)]
        shards[1].pid = shards[2].pid = 5
        shards[2].record_lost = True
        for shard in shards:
            records.save(shard)
        self.assertEqual(records.load_all(), [])

    def test_no_state_dir(self) -> None:
        """
        Without a state directory there is no marker, no record and no log.
        """
        records = Records(None)
        shard = Shard(spec())
        shard.pid = 5
        records.save(shard)
        records.remove("s1")
        self.assertEqual((records.marker, records.load_all(), records.new_log("s1"),
                          records.existing_log("s1")), ("", [], None, None))
