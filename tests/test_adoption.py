"""
Tests for L{llmgw.agent.adoption} and L{llmgw.agent.supervisor.Supervisor.recover}:
after an agent restart, the shards still running are taken over, those gone
are forgotten, and processes with this agent's marker but no record are
found.
"""

from __future__ import annotations

import signal
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent import adoption
from llmgw.agent.processes import AGENT_MARKER, SHARD_MARKER, MarkedProcess
from llmgw.agent.shard import FAILED, READY, STOPPED, STOPPING, UNKNOWN_EXIT
from llmgw.agent.state import ShardRecord
from llmgw.agent.supervisor import Supervisor
from tests.supervisor_harness import SupervisorCase, spec


class RecoverTests(SupervisorCase):
    """
    Re-adoption of recorded shards.
    """

    def test_recover(self) -> None:
        """
        After a restart, a recorded shard whose process still runs (same
        start time) is re-adopted and ready after a health probe; one whose
        process is gone or whose pid was reused is forgotten and its record
        removed.
        """
        log = self.state.log_path("a")
        log.write_bytes(b"old line 1\nold line 2\n")
        for sid, pid, port in (("a", 501, 9001), ("b", 502, 9002), ("c", 503, 9003)):
            self.state.save(ShardRecord(spec(sid, gpus=(int(pid) - 501,), port=port), pid, 77,
                                        "ready", str(self.state.log_path(sid))))
        self.ops.alive = {501: 77, 502: 99}  # 502: pid reused; 503: gone
        sup = self.make()
        sup.add_listener(self.record)
        d = sup.recover()
        self.assertNoResult(d)
        self.assertEqual(self.prober.answer(True), "http://127.0.0.1:9001/health")
        (shard,) = self.successResultOf(d)
        self.assertEqual((shard.shard_id, shard.state, shard.pid, shard.adopted), ("a", "ready", 501, True))
        self.assertEqual(list(shard.tail.lines), ["old line 1", "old line 2"])
        self.assertEqual(sorted(p.name for p in self.state.shards.iterdir()), ["a.json"])
        self.assertEqual(self.reports, [])  # no transition: it was ready
        # GPU 1 (shard b's) is free again.
        sup.start(spec("n", gpus=(1,), port=9002))
        self.assertEqual(self.reports[-1][:2], ("n", "starting"))

    def test_adopted_exit_by_polling(self) -> None:
        """
        A re-adopted shard's exit is found by polling its pid and start time,
        and reported failed with an unknown exit status.
        """
        self.state.save(ShardRecord(spec("a"), 501, 77, "ready", str(self.state.log_path("a"))))
        self.ops.alive = {501: 77}
        sup = self.make()
        sup.add_listener(self.record)
        sup.startService()
        self.addCleanup(sup.stopService)
        sup.recover()
        self.prober.answer(True)
        self.clock.advance(1)
        self.assertEqual(self.reports, [])
        del self.ops.alive[501]
        self.clock.advance(1)
        self.assertEqual(self.reports[-1][1], "failed")
        self.assertEqual(self.reports[-1][3], UNKNOWN_EXIT)
        self.assertIn("not this agent's child", self.reports[-1][2])

    def test_adopted_stop(self) -> None:
        """
        Stopping a re-adopted shard signals its group while its start time
        still matches, and polling sees it gone: stopped.
        """
        self.state.save(ShardRecord(spec("a"), 501, 77, "ready", str(self.state.log_path("a"))))
        self.ops.alive = {501: 77}
        sup = self.make()
        sup.add_listener(self.record)
        sup.startService()
        self.addCleanup(sup.stopService)
        sup.recover()
        self.prober.answer(True)
        sup.stop("a")
        self.assertEqual(self.ops.signals, [(501, signal.SIGTERM)])
        self.ops.alive[501] = 12345  # the pid now belongs to someone else
        self.clock.advance(1)
        self.assertEqual(self.reports[-1][1], "stopped")
        self.clock.advance(60)
        self.assertEqual(self.ops.signals, [(501, signal.SIGTERM)])

    def test_recover_unhealthy(self) -> None:
        """
        A re-adopted shard that fails its first probe is starting again, with
        its startup timeout running.
        """
        self.state.save(ShardRecord(spec("a", startup_timeout_s=20), 501, 77, "ready",
                                    str(self.state.log_path("a"))))
        self.ops.alive = {501: 77}
        sup = self.make()
        sup.add_listener(self.record)
        sup.recover()
        self.prober.answer(False)
        self.assertEqual(self.reports, [("a", "starting", "", 0, 0)])
        self.clock.advance(1)
        self.prober.answer(True)
        self.assertEqual(self.states(), ["starting", "ready"])


class RecoverGroupTests(SupervisorCase):
    """
    Re-adoption of process groups, and the marker scan.
    """

    def marked(self, pid: int, pgid: int, shard_id: str, **env: str) -> MarkedProcess:
        full = {AGENT_MARKER: str(self.state.path.resolve()), "LLMGW_SHARD_ID": shard_id,
                **env}
        proc = MarkedProcess(pid=pid, pgid=pgid, start_time=1, env=full, command="engine")
        self.ops.marked.append(proc)
        self.ops.add_child(pgid, pid)
        return proc

    def recovered(self) -> Supervisor:
        sup = self.make()
        sup.add_listener(self.record)
        sup.startService()
        self.addCleanup(sup.stopService)
        sup.recover()
        return sup

    def test_lost_record_reported(self) -> None:
        """
        A running shard whose record is damaged is found by its marker: it
        is held (GPUs and port from its environment), listed as record lost
        with its profile unknown, and a stop TERMs its group and ends it
        stopped once the group is empty.
        """
        self.state.shards.joinpath("lost.json").write_text('{"spec": {"shard_id": "lo')
        self.marked(601, 601, "lost", LLMGW_REPLICA_ID="rep-9", LLMGW_MODEL="m",
                    LLMGW_PROFILE="p", LLMGW_PORT="9100", CUDA_VISIBLE_DEVICES="2,3",
                    LLMGW_RANK="1", LLMGW_WORLD_SIZE="2")
        self.marked(602, 601, "lost")
        self.marked(700, 700, "someone-elses", **{AGENT_MARKER: "/other/agent"})
        sup = self.recovered()
        self.flushLoggedErrors()
        (shard,) = sup.held_shards()
        self.assertEqual((shard.shard_id, shard.record_lost, shard.state, shard.pid),
                         ("lost", True, "starting", 601))
        s = shard.spec
        self.assertEqual((s.replica_id, s.model, s.profile, s.gpu_indices, s.port, s.rank,
                          s.world_size), ("rep-9", "m", "", (2, 3), 9100, 1, 2))
        sup.start(spec("n", gpus=(3,), port=9200))
        self.assertEqual(self.reports[-1][2], "GPU 3 is in use by shard lost")
        sup.stop("lost")
        self.assertEqual(self.ops.signals, [(601, signal.SIGTERM)])
        self.clock.advance(1)
        self.assertEqual(self.reports[-1][:2], ("lost", "stopped"))
        self.assertNotIn(700, [pid for pid, _ in self.ops.signals])

    def test_lost_record_ends_alone(self) -> None:
        """
        A record-lost shard whose processes all end by themselves is
        reported failed.
        """
        self.marked(601, 601, "lost")
        sup = self.recovered()
        self.flushLoggedErrors()
        self.ops.groups[601].clear()
        self.clock.advance(1)
        self.assertEqual(self.reports[-1][:2], ("lost", "failed"))
        self.assertEqual(sup.held_shards(), [])

    def test_strays(self) -> None:
        """
        A process with this agent's marker that names no usable shard is a
        stray: listed, never signalled.
        """
        self.marked(801, 801, "../bad")
        sup = self.recovered()
        self.flushLoggedErrors()
        self.assertEqual([(p.pid, p.shard_id) for p in sup.strays], [(801, "../bad")])
        self.assertEqual(sup.held_shards(), [])
        self.assertEqual(self.ops.signals, [])

    def test_main_gone_group_lives(self) -> None:
        """
        A recorded shard whose main process ended while the agent was away,
        but whose children (with its marker) live on, is re-adopted
        stopping: TERM now, KILL after its grace, failed once empty.
        """
        self.state.save(ShardRecord(spec("a", stop_grace_s=4), 501, 77, "ready",
                                    str(self.state.log_path("a"))))
        self.ops.alive = {501: None}  # type: ignore[dict-item]
        self.marked(502, 501, "a")
        self.ops.groups[501][502] = True  # ignores TERM
        sup = self.recovered()
        shard = sup.get("a")
        assert shard is not None
        self.assertEqual((shard.state, shard.main_ended), ("stopping", True))
        self.assertEqual(self.ops.signals, [(501, signal.SIGTERM)])
        self.clock.advance(4)
        self.assertEqual(self.ops.signals[-1], (501, signal.SIGKILL))
        self.clock.advance(1)
        self.assertEqual(self.reports[-1][:2], ("a", "failed"))
        self.assertIn("while the agent was away", self.reports[-1][2])
        self.assertFalse(self.state.shards.joinpath("a.json").exists())

    def test_stop_as_adopted_main_ends(self) -> None:
        """
        A stop for a re-adopted shard whose main process has just ended
        unseen signals nothing at first (its pid may be reused); once the
        poll sees the end, its group, which lives on, gets the TERM, and
        KILL after the grace.
        """
        self.state.save(ShardRecord(spec("a", stop_grace_s=4), 501, 77, "ready",
                                    str(self.state.log_path("a"))))
        self.ops.alive = {501: 77}
        self.marked(502, 501, "a")
        self.ops.groups[501][502] = True  # ignores TERM
        sup = self.recovered()
        self.prober.answer(True)
        self.ops.alive[501] = 999  # ended, and the pid reused
        sup.stop("a")
        self.assertEqual(self.ops.signals, [])
        self.clock.advance(1)
        self.assertEqual(self.ops.signals, [(501, signal.SIGTERM)])
        self.clock.advance(3)
        self.assertEqual(self.ops.signals[-1], (501, signal.SIGKILL))
        self.clock.advance(1)
        self.assertEqual(sup.get("a").state, "stopped")  # type: ignore[union-attr]

    def test_stopping_record_resumed(self) -> None:
        """
        A shard recorded stopping (the agent left during its grace) whose
        main process still runs is TERMed again and KILLed after its grace.
        """
        self.state.save(ShardRecord(spec("a", stop_grace_s=4), 501, 77, "stopping",
                                    str(self.state.log_path("a"))))
        self.ops.alive = {501: 77}
        self.ops.groups[501] = {501: True}
        sup = self.recovered()
        self.assertEqual(self.ops.signals, [(501, signal.SIGTERM)])
        self.clock.advance(4)
        self.assertEqual(self.ops.signals[-1], (501, signal.SIGKILL))
        del self.ops.alive[501]
        del self.ops.groups[501]
        self.ops.alive[501] = None  # type: ignore[assignment]
        self.clock.advance(1)
        self.assertEqual(sup.get("a").state, "stopped")  # type: ignore[union-attr]


def proc(pid: int, pgid: int, shard_id: str, **env: str) -> MarkedProcess:
    return MarkedProcess(pid=pid, pgid=pgid, start_time=5, env={SHARD_MARKER: shard_id, **env},
                         command="engine")


class AdoptTests(SynchronousTestCase):
    """
    The adoption decisions as plain functions.
    """

    def record(self, state: str = "ready", **kw: Any) -> ShardRecord:
        return ShardRecord(spec("a"), 501, 77, state, "/dev/null", **kw)

    def test_main_alive(self) -> None:
        """
        A recorded shard whose main process is the recorded one keeps its
        state and groups; one gone with nothing left of it is not adopted.
        """
        shard = adoption.adopt(self.record(pgids=[501, 600]), [], 77)
        assert shard is not None
        self.assertEqual((shard.state, shard.adopted, shard.pid, shard.pgids, shard.stopping),
                         (READY, True, 501, {501, 600}, False))
        self.assertIsNone(adoption.adopt(self.record(), [], None))
        self.assertIsNone(adoption.adopt(self.record(), [], 78))  # the pid was reused

    def test_main_gone_group_lives(self) -> None:
        """
        A shard whose main process ended while the agent was away, but whose
        marked processes live on, is stopping and fails (exit unknown); one
        that was stopping at the agent's request is stopped; one whose end
        was recorded keeps what the record says.
        """
        procs = [proc(502, 501, "a")]
        failed = adoption.adopt(self.record(), procs, None)
        assert failed is not None
        self.assertEqual((failed.state, failed.main_ended, failed.final_state, failed.exit_code,
                          failed.pgids), (STOPPING, True, FAILED, UNKNOWN_EXIT, {501}))
        self.assertIn("while the agent was away", failed.error)
        stopped = adoption.adopt(self.record("stopping"), procs, None)
        assert stopped is not None
        self.assertEqual((stopped.final_state, stopped.error), (STOPPED, ""))
        ended = adoption.adopt(self.record("stopping", main_ended=True, error="boom",
                                           exit_code=3), procs, 77)
        assert ended is not None
        self.assertEqual((ended.final_state, ended.error, ended.exit_code), (FAILED, "boom", 3))

    def test_outside_group(self) -> None:
        """
        Marked processes outside the main process's group are named.
        """
        procs = [proc(502, 501, "a"), proc(610, 610, "a")]
        self.assertEqual(adoption.outside_group(self.record(), procs), [610])

    def test_lost_record(self) -> None:
        """
        A shard with no record is what its group leader's environment says,
        with its profile and command unknown.
        """
        procs = [proc(9, 8, "lost"), proc(8, 8, "lost", LLMGW_PORT="x", LLMGW_MODEL="m2",
                                          CUDA_VISIBLE_DEVICES="1, 2,z")]
        shard = adoption.lost_record("lost", procs)
        self.assertEqual((shard.pid, shard.pgids, shard.record_lost, shard.main_ended),
                         (8, {8}, True, True))
        self.assertEqual((shard.spec.model, shard.spec.port, shard.spec.gpu_indices,
                          shard.spec.world_size, shard.spec.profile, shard.spec.argv),
                         ("m2", 0, (1, 2), 1, "", ()))

    def test_strays_and_grouping(self) -> None:
        """
        Marked processes are grouped by the shard they name; those naming
        no usable shard are strays, with the reason.
        """
        procs = [proc(1, 1, "a"), proc(2, 2, "../x"), proc(3, 1, "a")]
        groups = adoption.by_shard(procs)
        self.assertEqual({k: [p.pid for p in v] for k, v in groups.items()},
                         {"a": [1, 3], "../x": [2]})
        (stray,) = adoption.strays("../x", groups["../x"])
        self.assertEqual((stray.pid, stray.start_time, stray.reason),
                         (2, 5, f"its {SHARD_MARKER} '../x' is not a shard id"))
