"""
Tests for L{llmgw.agent.stopping}: TERM, KILL after the grace, the process
group emptying, and how a shard ended; through the supervisor (the shard is
its whole process group) and as plain functions.
"""

from __future__ import annotations

import signal

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.shard import FAILED, STOPPED, STOPPING, UNKNOWN_EXIT, Shard
from llmgw.agent.stopping import KILL_WAIT_S, Stopper, exit_how, final_state, main_exit
from tests.supervisor_harness import FakeOps, SupervisorCase, spec


class StopTests(SupervisorCase):
    """
    Stops and exits of a shard's main process.
    """

    def test_stop_within_grace(self) -> None:
        """
        Stop sends TERM to the group; an exit within the grace is stopped and
        no KILL follows.
        """
        shard = self.start_ready(stop_grace_s=10)
        self.sup.stop("s1")
        self.assertEqual(self.ops.signals, [(shard.pid, signal.SIGTERM)])
        self.clock.advance(2)
        self.spawner.processes[0].end(0)
        self.assertEqual(self.reports[-1], ("s1", "stopped", "", 0, 0))
        self.clock.advance(20)
        self.assertEqual(len(self.ops.signals), 1)
        self.assertFalse(self.state.shards.joinpath("s1.json").exists())

    def test_kill_after_grace(self) -> None:
        """
        A shard that ignores TERM gets KILL after its grace, and is stopped.
        """
        shard = self.start_ready(stop_grace_s=10)
        self.sup.stop("s1")
        self.clock.advance(9.9)
        self.assertEqual(len(self.ops.signals), 1)
        self.clock.advance(0.1)
        self.assertEqual(self.ops.signals[-1], (shard.pid, signal.SIGKILL))
        self.spawner.processes[0].end(1, signal.SIGKILL)
        self.assertEqual(self.reports[-1][:2], ("s1", "stopped"))

    def test_unexpected_exit(self) -> None:
        """
        An exit nobody asked for is failed with its exit code and the last
        output the shard wrote.
        """
        self.start_ready()
        with open(self.state.log_path("s1"), "ab") as f:
            f.write(b"loading weights\nCUDA out of memory\npartial")
        self.spawner.processes[0].end(3)
        shard = self.sup.get("s1")
        assert shard is not None
        self.assertEqual(self.reports[-1][:4], ("s1", "failed", "exited without being asked to (exit code 3)", 3))
        self.assertEqual(shard.last_output(), "loading weights\nCUDA out of memory\npartial")

    def test_signal_exit(self) -> None:
        """
        A shard killed by a signal is failed with that signal.
        """
        self.start_ready()
        self.spawner.processes[0].end(1, signal.SIGSEGV)
        self.assertEqual(self.reports[-1][1], "failed")
        self.assertEqual(self.reports[-1][4], signal.SIGSEGV)
        self.assertIn("signal 11", self.reports[-1][2])


class ProcessGroupTests(SupervisorCase):
    """
    The shard is its whole process group.
    """

    def test_unasked_exit_kills_group_then_frees(self) -> None:
        """
        A main process that dies leaving children makes the shard stopping
        (with its error and crash class): TERM goes to the group at once, and
        its GPUs and port stay held until the group is empty; then it is
        failed and they are free.
        """
        shard = self.start_ready(gpus=(0,), port=8001)
        self.ops.add_child(shard.pid, 5001)
        self.ops.add_child(shard.pid, 5002, ignores_term=True)
        self.spawner.processes[0].end(1, signal.SIGSEGV)
        self.assertEqual(self.reports[-1][:2], ("s1", "stopping"))
        self.assertEqual(shard.crash_class, "engine_crash")
        self.assertEqual(self.ops.signals, [(shard.pid, signal.SIGTERM)])
        self.clock.advance(1)
        self.sup.start(spec("s2", gpus=(0,), port=8002))
        self.assertEqual(self.reports[-1][:3], ("s2", "failed", "GPU 0 is in use by shard s1"))
        self.sup.start(spec("s3", gpus=(1,), port=8001))
        self.assertEqual(self.reports[-1][:3], ("s3", "failed", "port 8001 is in use by shard s1"))
        self.assertTrue(self.state.shards.joinpath("s1.json").exists())
        self.clock.advance(29)  # the grace is 30s: the child that ignores TERM gets KILL
        self.assertEqual(self.ops.signals[-1], (shard.pid, signal.SIGKILL))
        self.clock.advance(1)
        self.assertEqual(self.reports[-1][:2], ("s1", "failed"))
        self.assertIn("signal 11", self.reports[-1][2])
        self.assertFalse(self.state.shards.joinpath("s1.json").exists())
        self.sup.start(spec("s2", gpus=(0,), port=8001))
        self.assertEqual(self.reports[-1][:2], ("s2", "starting"))

    def test_kill_survives_main_exit(self) -> None:
        """
        A stop whose main process exits on TERM while a child ignores it
        still KILLs the group after the grace; the shard is stopping until
        then, and stopped once the group is empty.
        """
        shard = self.start_ready(stop_grace_s=10)
        self.ops.add_child(shard.pid, 5001, ignores_term=True)
        self.sup.stop("s1")
        self.clock.advance(1)
        self.spawner.processes[0].end(0, signal.SIGTERM)
        self.assertEqual(shard.state, "stopping")
        self.clock.advance(8.9)
        self.assertEqual(self.ops.signals, [(shard.pid, signal.SIGTERM)])
        self.clock.advance(0.1)
        self.assertEqual(self.ops.signals[-1], (shard.pid, signal.SIGKILL))
        self.clock.advance(1)
        self.assertEqual(self.states(), ["starting", "ready", "stopping", "stopped"])

    def test_empty_group_ends_at_once(self) -> None:
        """
        A main process that dies alone (its group empty) fails at once, with
        no KILL and no timer left behind.
        """
        self.start_ready()
        self.spawner.processes[0].end(3)
        self.assertEqual(self.states(), ["starting", "ready", "failed"])
        self.clock.advance(100)
        self.assertEqual(self.ops.signals, [])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_group_outlives_kill(self) -> None:
        """
        A group that survives its KILL is named loudly after KILL_WAIT_S and
        KILLed again; the shard stays stopping, holding its GPUs; group
        checks back off to the poll interval.
        """
        shard = self.start_ready(stop_grace_s=5)
        self.ops.add_child(shard.pid, 5001)
        self.spawner.processes[0].end(1)
        self.ops.groups[shard.pid][5001] = True
        kill = self.ops.kill_group
        self.ops.kill_group = lambda pid, sig: self.ops.signals.append((pid, sig))  # type: ignore[method-assign]
        self.addCleanup(setattr, self.ops, "kill_group", kill)
        self.clock.advance(5)
        self.assertEqual(self.ops.signals[-1], (shard.pid, signal.SIGKILL))
        checks = self.ops.checks
        for _ in range(int(KILL_WAIT_S) + 1):
            self.clock.advance(1)
        self.assertLessEqual(self.ops.checks - checks, int(KILL_WAIT_S) + 2)
        self.assertEqual(shard.state, "stopping")
        self.assertTrue(shard.survivors_logged)
        self.assertGreater(self.ops.signals.count((shard.pid, signal.SIGKILL)), 1)
        self.ops.groups[shard.pid].clear()
        self.clock.advance(1)
        self.assertEqual(shard.state, "failed")

    def test_crash_class_in_failure(self) -> None:
        """
        A failed shard carries the class of its failure, from its exit and
        last output; a stop is no failure and has none.
        """
        self.start_ready()
        with open(self.state.log_path("s1"), "ab") as f:
            f.write(b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
        self.spawner.processes[0].end(1)
        self.assertEqual(self.sup.get("s1").crash_class, "oom")  # type: ignore[union-attr]
        self.start_ready(shard_id="s2", port=8002)
        self.sup.stop("s2")
        self.spawner.processes[1].end(0, signal.SIGTERM)
        self.assertEqual((self.sup.get("s2").state, self.sup.get("s2").crash_class),  # type: ignore[union-attr]
                         ("stopped", ""))

    def test_startup_timeout_not_killed(self) -> None:
        """
        A shard the agent itself TERMs (startup timeout) is not classed as
        killed: its TERM was asked for.
        """
        shard = self.sup.start(spec(startup_timeout_s=2))
        self.clock.advance(0)
        self.prober.answer(False)
        self.clock.advance(2)
        self.spawner.processes[0].end(0, signal.SIGTERM)
        self.assertEqual((shard.state, shard.crash_class), ("failed", "unknown"))


class EndingTests(SynchronousTestCase):
    """
    How a shard ended, as plain functions: L{exit_how}, L{main_exit},
    L{final_state}.
    """

    def test_exit_how(self) -> None:
        """
        A signal, an unknown status and an exit code each read as such.
        """
        self.assertEqual([exit_how(0, 9), exit_how(UNKNOWN_EXIT, 0), exit_how(3, 0)],
                         ["killed by signal 9", "exit status unknown (not this agent's child)",
                          "exit code 3"])

    def test_asked_stop(self) -> None:
        """
        A main process that ends after a stop the control plane asked for
        ends stopped, with no error or crash class.
        """
        shard = Shard(spec())
        shard.stopping = True
        self.assertEqual(main_exit(shard, 0, signal.SIGTERM), "killed by signal 15")
        self.assertEqual((shard.final_state, shard.error, shard.crash_class, shard.signal),
                         (STOPPED, "", "", signal.SIGTERM))

    def test_unasked_and_own_stop(self) -> None:
        """
        An exit nobody asked for fails with it; a stop that was the agent's
        own doing fails with its reason first.
        """
        shard = Shard(spec())
        main_exit(shard, 2, 0)
        self.assertEqual((shard.final_state, shard.error, shard.exit_code),
                         (FAILED, "exited without being asked to (exit code 2)", 2))
        self.assertTrue(shard.crash_class)
        timed_out = Shard(spec())
        timed_out.stopping, timed_out.stop_error = True, "not healthy"
        main_exit(timed_out, UNKNOWN_EXIT, 0)
        self.assertEqual(timed_out.error,
                         "not healthy; exit status unknown (not this agent's child)")

    def test_final_state(self) -> None:
        """
        A decided final state stands; with none, a group that emptied by
        itself failed and one the agent stopped is stopped.
        """
        shard = Shard(spec(), STOPPING)
        self.assertEqual(final_state(shard), (FAILED, "its processes ended"))
        shard.stopping = True
        self.assertEqual(final_state(shard), (STOPPED, ""))
        shard.stop_error = "too slow"
        self.assertEqual(final_state(shard), (FAILED, "too slow"))
        shard.final_state, shard.error = STOPPED, ""
        self.assertEqual(final_state(shard), (STOPPED, ""))


class StopperTests(SynchronousTestCase):
    """
    A L{Stopper} alone, on a Clock with fake process operations.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.ops = FakeOps()
        self.emptied: list[Shard] = []
        self.stopper = Stopper(self.clock, self.ops, self.emptied.append, poll_interval=1.0)
        self.shard = Shard(spec(stop_grace_s=5), STOPPING)
        self.shard.pid, self.shard.pgids = 700, {700, 710}
        self.ops.add_child(700, 700, ignores_term=True)

    def test_escalate(self) -> None:
        """
        The stop signal goes to every group of the shard now, KILL after its
        grace; with the main process running, nobody watches the group yet.
        """
        self.stopper.escalate(self.shard, signal.SIGINT)
        self.assertEqual(self.ops.signals, [(700, signal.SIGINT), (710, signal.SIGINT)])
        self.assertFalse(self.shard.term_sent)
        self.clock.advance(5)
        self.assertEqual(self.ops.signals[2:], [(700, signal.SIGKILL), (710, signal.SIGKILL)])
        self.assertEqual(self.emptied, [])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_watch_until_empty(self) -> None:
        """
        Once the main process has ended the group is watched, and the shard
        is emptied as soon as its group is.
        """
        self.shard.main_ended = True
        self.stopper.escalate(self.shard, signal.SIGTERM)
        self.assertTrue(self.shard.term_sent)
        self.clock.advance(0.05)
        self.assertEqual(self.emptied, [])
        self.ops.groups[700].clear()
        self.clock.advance(0.1)
        self.assertEqual(self.emptied, [self.shard])

    def test_adopted_pid_reused(self) -> None:
        """
        A re-adopted shard whose main process is no longer the recorded one
        is not signalled: its pid may be someone else's now.
        """
        self.shard.adopted, self.shard.start_time = True, 1
        self.ops.alive[700] = 2
        self.assertFalse(self.stopper.signal(self.shard, signal.SIGTERM))
        self.assertEqual(self.ops.signals, [])
