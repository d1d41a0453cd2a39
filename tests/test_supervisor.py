"""
Tests for L{llmgw.agent.supervisor} and L{llmgw.agent.state}: every shard
transition, driven by a C{Clock}, a fake spawner, fake process operations
and a fake health prober.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

from twisted.internet import defer, error
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent import supervisor as sv
from llmgw.agent.state import ShardRecord, ShardSpec, StateDir, StateDirError
from llmgw.agent.supervisor import LAUNCHER, LogTail, ProcessOps, Supervisor


class FakeProcess:
    def __init__(self, proto: Any, pid: int, ops: FakeOps | None = None):
        self.proto = proto
        self.pid = pid
        self.ops = ops

    def end(self, code: int = 0, sig: int | None = None) -> None:
        if self.ops is not None:
            self.ops.groups.get(self.pid, {}).pop(self.pid, None)
        if code == 0 and sig is None:
            self.proto.processEnded(Failure(error.ProcessDone(0)))
        else:
            self.proto.processEnded(Failure(error.ProcessTerminated(code, sig)))


class FakeSpawner:
    def __init__(self, ops: FakeOps | None = None) -> None:
        self.ops = ops
        self.calls: list[dict[str, Any]] = []
        self.processes: list[FakeProcess] = []
        self.next_pid = 1000
        self.fail: Exception | None = None

    def __call__(self, proto: Any, executable: str, args: list[str], env: dict[str, str],
                 path: Any = None) -> FakeProcess:
        if self.fail is not None:
            raise self.fail
        self.calls.append({"executable": executable, "args": args, "env": env})
        self.next_pid += 1
        proc = FakeProcess(proto, self.next_pid, self.ops)
        if self.ops is not None:
            self.ops.groups[self.next_pid] = {self.next_pid: True}
            self.ops.mains.add(self.next_pid)
        self.processes.append(proc)
        return proc


class FakeOps(ProcessOps):
    """
    Processes and groups in memory. C{groups} maps a process group to its
    live members, each with whether it ignores TERM; TERM and KILL to a
    group end the members other than its main process (which the test ends
    through L{FakeProcess.end}), KILL all of them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.alive: dict[int, int] = {}
        self.signals: list[tuple[int, int]] = []
        self.busy_ports: set[int] = set()
        self.groups: dict[int, dict[int, bool]] = {}
        self.marked: list[sv.MarkedProcess] = []
        self.mains: set[int] = set()
        self.checks = 0

    def group_members(self, pgid: int) -> list[int]:
        self.checks += 1
        return sorted(self.groups.get(pgid, {}))

    def marked_processes(self, marker: str) -> list[sv.MarkedProcess]:
        return [p for p in self.marked if p.env.get(sv.AGENT_MARKER) == marker]

    def add_child(self, pgid: int, pid: int, ignores_term: bool = False) -> None:
        self.groups.setdefault(pgid, {})[pid] = ignores_term

    def port_in_use(self, port: int) -> bool:
        return port in self.busy_ports

    def start_time(self, pid: int) -> int | None:
        return self.alive.get(pid, 4242 + pid)

    def kill_group(self, pid: int, sig: int) -> None:
        self.signals.append((pid, sig))
        members = self.groups.get(pid, {})
        for member, ignores_term in list(members.items()):
            if member in self.mains:
                continue  # a spawned main process: the test ends it
            if sig == signal.SIGKILL or not ignores_term:
                del members[member]


class FakeProber:
    def __init__(self) -> None:
        self.pending: list[tuple[str, defer.Deferred[None]]] = []

    def probe(self, url: str) -> defer.Deferred[None]:
        d: defer.Deferred[None] = defer.Deferred()
        self.pending.append((url, d))
        return d

    def answer(self, ok: bool = True) -> str:
        url, d = self.pending.pop(0)
        if ok:
            d.callback(None)
        else:
            d.errback(ValueError("HTTP 503"))
        return url


def spec(shard_id: str = "s1", gpus: tuple[int, ...] = (0,), port: int = 8001, **kw: Any) -> ShardSpec:
    kw.setdefault("argv", ["{python}", "-m", "server", "--port", "{port}"])
    return ShardSpec(shard_id=shard_id, replica_id="r1", model="m", profile="p",
                     gpu_indices=list(gpus), port=port, **kw)


class SupervisorCase(SynchronousTestCase):
    """
    A supervisor on a Clock, a fake spawner, fake process operations and a
    fake prober; no tests of its own.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.ops = FakeOps()
        self.spawner = FakeSpawner(self.ops)
        self.prober = FakeProber()
        self.state = StateDir(self.mktemp())
        self.sup = self.make()
        self.reports: list[tuple[str, str, str, int, int]] = []
        self.sup.add_listener(self.record)

    def make(self) -> Supervisor:
        return Supervisor(self.clock, self.spawner, self.state, gpu_indices=[0, 1, 2, 3],
                          ops=self.ops, prober=self.prober, python="/usr/bin/python3",
                          base_env={"PATH": "/usr/bin"})

    def record(self, shard: Any) -> None:
        self.reports.append((shard.shard_id, shard.state, shard.error, shard.exit_code, shard.signal))

    def states(self) -> list[str]:
        return [r[1] for r in self.reports]

    def start_ready(self, **kw: Any) -> sv.Shard:
        shard = self.sup.start(spec(**kw))
        self.clock.advance(0)
        self.prober.answer(True)
        self.assertEqual(shard.state, "ready")
        return shard


class SupervisorTests(SupervisorCase):
    def test_spawn(self) -> None:
        """
        A start spawns the launcher with the shard's argv (placeholders
        filled) and an explicit environment with its GPUs, port, rank, world
        size and leader; the command's env cannot override ours.
        """
        self.sup.start(spec(gpus=(1, 3), env={"CUDA_VISIBLE_DEVICES": "0", "X": "y"},
                            rank=1, world_size=2, leader_address="10.0.0.1:8001"))
        (call,) = self.spawner.calls
        self.assertEqual(call["executable"], "/usr/bin/python3")
        log_path = str(self.state.log_path("s1"))
        self.assertEqual(call["args"], ["/usr/bin/python3", "-I", "-c", LAUNCHER, log_path,
                                        "/usr/bin/python3", "-m", "server", "--port", "8001"])
        env = call["env"]
        self.assertEqual(env["CUDA_VISIBLE_DEVICES"], "1,3")
        self.assertEqual((env["LLMGW_PORT"], env["LLMGW_RANK"], env["LLMGW_WORLD_SIZE"],
                          env["LLMGW_LEADER"]), ("8001", "1", "2", "10.0.0.1:8001"))
        self.assertEqual((env["X"], env["PATH"]), ("y", "/usr/bin"))
        self.assertNotIn("HOME", env)
        self.assertEqual(self.reports, [("s1", "starting", "", 0, 0)])

    def test_ready_then_slower_probes(self) -> None:
        """
        A shard is starting until its health path answers; then ready, and
        probed at the slower ready interval.
        """
        self.sup.start(spec(health_path="/healthz"))
        self.clock.advance(0)
        self.assertEqual(self.prober.answer(False), "http://127.0.0.1:8001/healthz")
        self.clock.advance(1)
        self.prober.answer(True)
        self.assertEqual(self.states(), ["starting", "ready"])
        self.clock.advance(9)
        self.assertEqual(self.prober.pending, [])
        self.clock.advance(1)
        self.assertEqual(len(self.prober.pending), 1)

    def test_startup_timeout(self) -> None:
        """
        A shard not healthy within its startup timeout is TERMed, and when
        it ends it is failed with the reason and how it ended.
        """
        shard = self.sup.start(spec(startup_timeout_s=5, stop_grace_s=3))
        for _ in range(5):
            self.clock.advance(0)
            self.prober.answer(False)
            self.clock.advance(1)
        self.assertEqual(self.ops.signals, [(shard.pid, signal.SIGTERM)])
        self.spawner.processes[0].end(1, signal.SIGTERM)
        (_, state, err, _, sig) = self.reports[-1]
        self.assertEqual((state, sig), ("failed", signal.SIGTERM))
        self.assertIn("startup timeout of 5s", err)
        self.assertIn("HTTP 503", err)
        self.clock.advance(10)
        self.assertEqual(self.ops.signals, [(shard.pid, signal.SIGTERM)])

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

    def test_drain_timeout(self) -> None:
        """
        Drain reports draining and stops the shard at the drain timeout.
        """
        self.start_ready(drain_timeout_s=30)
        self.sup.drain("s1")
        self.assertEqual(self.states()[-1], "draining")
        self.clock.advance(29)
        self.assertEqual(self.ops.signals, [])
        self.clock.advance(1)
        self.assertEqual(self.ops.signals[0][1], signal.SIGTERM)
        self.spawner.processes[0].end(0)
        self.assertEqual(self.states(), ["starting", "ready", "draining", "stopping", "stopped"])

    def test_drain_then_stop(self) -> None:
        """
        A stop while draining stops at once, and the drain timer does not
        fire later.
        """
        self.start_ready(drain_timeout_s=30)
        self.sup.drain("s1")
        self.sup.stop("s1")
        self.assertEqual(len(self.ops.signals), 1)
        self.spawner.processes[0].end(0)
        self.clock.advance(60)
        self.assertEqual(len(self.ops.signals), 1)
        self.assertEqual(self.states()[-1], "stopped")

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

    def test_start_running_again(self) -> None:
        """
        A start for a shard that already runs starts nothing new and
        re-reports its state.
        """
        self.start_ready()
        self.sup.start(spec())
        self.assertEqual(len(self.spawner.calls), 1)
        self.assertEqual(self.states(), ["starting", "ready", "ready"])

    def test_restart_after_end(self) -> None:
        """
        A start for a shard that has ended runs it again.
        """
        self.start_ready()
        self.spawner.processes[0].end(3)
        self.sup.start(spec())
        self.assertEqual(len(self.spawner.calls), 2)
        self.assertEqual(self.states()[-1], "starting")

    def test_stop_unknown_shard(self) -> None:
        """
        A stop for a shard this agent never started is answered "stopped",
        so the control plane frees what it holds for it at once.
        """
        self.sup.stop("never-started")
        self.assertEqual(self.reports, [("never-started", "stopped", "", 0, 0)])
        self.assertEqual(self.spawner.calls, [])

    def test_clashes(self) -> None:
        """
        A start whose GPUs or port clash with a running shard, or whose GPUs
        the node does not have, fails with a message that says so and spawns
        nothing.
        """
        self.start_ready(gpus=(0, 1), port=8001)
        self.sup.start(spec("s2", gpus=(1, 2), port=8002))
        self.assertEqual(self.reports[-1][:3], ("s2", "failed", "GPU 1 is in use by shard s1"))
        self.sup.start(spec("s3", gpus=(2,), port=8001))
        self.assertEqual(self.reports[-1][:3], ("s3", "failed", "port 8001 is in use by shard s1"))
        self.sup.start(spec("s4", gpus=(7,), port=8004))
        self.assertEqual(self.reports[-1][2], "GPU 7 does not exist on this node (it has 0,1,2,3)")
        self.sup.start(spec("../etc", gpus=(3,), port=8005))
        self.assertIn("not usable", self.reports[-1][2])
        self.ops.busy_ports.add(8006)
        self.sup.start(spec("s6", gpus=(3,), port=8006))
        self.assertEqual(self.reports[-1][2],
                         "port 8006 is already in use by another process on this node")
        self.assertEqual(len(self.spawner.calls), 1)
        self.assertIsNone(self.sup.get("s2"))

    def test_refusal_classes(self) -> None:
        """
        A refused start carries a crash class saying whether a retry can
        help: a taken port is port_in_use, an empty command is config, a
        clash of GPUs is unknown.
        """
        self.start_ready(gpus=(0,), port=8001)
        classes = []
        for sid, kw in (("a", {"port": 8001, "gpus": (1,)}), ("b", {"argv": [], "port": 8002}),
                        ("c", {"gpus": (0,), "port": 8003})):
            classes.append(self.sup.start(spec(sid, **kw)).crash_class)
        self.ops.busy_ports.add(8004)
        classes.append(self.sup.start(spec("d", gpus=(2,), port=8004)).crash_class)
        self.assertEqual(classes, ["port_in_use", "config", "unknown", "port_in_use"])

    def test_unhealthy_while_ready(self) -> None:
        """
        Three failed health checks in a row while ready fail the shard (it is
        stopped, then reported failed with the health error).
        """
        self.start_ready()
        for _ in range(3):
            self.clock.advance(10)
            self.prober.answer(False)
        self.assertEqual(self.ops.signals[0][1], signal.SIGTERM)
        self.spawner.processes[0].end(0)
        self.assertEqual(self.reports[-1][1], "failed")
        self.assertIn("failed 3 health checks in a row", self.reports[-1][2])

    def test_spawn_error(self) -> None:
        """
        A spawn that raises is reported as failed with the reason.
        """
        self.spawner.fail = OSError("No such file or directory")
        self.sup.start(spec())
        self.assertEqual(self.reports[-1][1], "failed")
        self.assertIn("No such file", self.reports[-1][2])
        self.flushLoggedErrors(OSError)

    def test_record_written(self) -> None:
        """
        A live shard is recorded in the state directory with its pid, start
        time and state; the record follows its transitions.
        """
        shard = self.start_ready()
        data = json.loads(self.state.shards.joinpath("s1.json").read_bytes())
        self.assertEqual((data["pid"], data["start_time"], data["state"]),
                         (shard.pid, 4242 + shard.pid, "ready"))
        self.assertEqual(data["spec"]["gpu_indices"], [0])
        self.assertEqual([p.name for p in self.state.shards.iterdir()], ["s1.json"])

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
        self.assertEqual(self.reports[-1][3], sv.UNKNOWN_EXIT)
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


class ProcessGroupTests(SupervisorCase):
    """
    The shard is its whole process group (issue 11 item 1).
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
        for _ in range(int(sv.KILL_WAIT_S) + 1):
            self.clock.advance(1)
        self.assertLessEqual(self.ops.checks - checks, int(sv.KILL_WAIT_S) + 2)
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

    def test_marker_in_environment(self) -> None:
        """
        Every shard's environment names the shard, its replica, model and
        profile, and the agent (its state directory) that started it.
        """
        self.sup.start(spec())
        env = self.spawner.calls[0]["env"]
        self.assertEqual((env["LLMGW_SHARD_ID"], env["LLMGW_REPLICA_ID"], env["LLMGW_MODEL"],
                          env["LLMGW_PROFILE"]), ("s1", "r1", "m", "p"))
        self.assertEqual(env[sv.AGENT_MARKER], str(self.state.path.resolve()))


class RecoverGroupTests(SupervisorCase):
    """
    Re-adoption and the marker scan (issue 11 item 1).
    """

    def marked(self, pid: int, pgid: int, shard_id: str, **env: str) -> sv.MarkedProcess:
        full = {sv.AGENT_MARKER: str(self.state.path.resolve()), "LLMGW_SHARD_ID": shard_id,
                **env}
        proc = sv.MarkedProcess(pid=pid, pgid=pgid, start_time=1, env=full, command="engine")
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
        self.marked(700, 700, "someone-elses", **{sv.AGENT_MARKER: "/other/agent"})
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


class StateDirTests(SynchronousTestCase):
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
    def test_whole_id_checked(self) -> None:
        """
        A shard id names files in the state directory: all of it must be in
        the grammar, a trailing newline included.
        """
        from llmgw.agent.state import valid_shard_id

        self.assertTrue(valid_shard_id("demo-1-s0"))
        for bad in ("s1\n", "../etc", "", "a/b", "x" * 129):
            self.assertFalse(valid_shard_id(bad), bad)


class LogTailTests(SynchronousTestCase):
    def test_lines_and_partial(self) -> None:
        """
        The tail yields complete lines as they arrive and keeps a partial
        line until it is finished; the ring keeps the last lines only.
        """
        path = Path(self.mktemp())
        path.write_bytes(b"")
        tail = LogTail(path)
        with open(path, "ab") as f:
            f.write(b"one\ntw")
        self.assertEqual(tail.read(), ["one"])
        with open(path, "ab") as f:
            f.write(b"o\n" + b"".join(b"l%d\n" % i for i in range(200)))
        lines = tail.read()
        self.assertEqual(lines[0], "two")
        self.assertEqual(len(tail.lines), sv.RING_LINES)
        self.assertEqual(tail.lines[-1], "l199")

    def test_truncated_file(self) -> None:
        """
        A log that shrank (truncated) is read again from its start.
        """
        path = Path(self.mktemp())
        path.write_bytes(b"a long first line\n")
        tail = LogTail(path)
        tail.read()
        path.write_bytes(b"new\n")
        self.assertEqual(tail.read(), ["new"])


class ProcessOpsTests(SynchronousTestCase):
    def spawn(self, code: str, env: dict[str, str] | None = None) -> Any:
        import subprocess
        import sys

        # It says "up" once running, so the test reads its pipe, not a clock.
        proc = subprocess.Popen([sys.executable, "-c", "print('up', flush=True)\n" + code],
                                start_new_session=True, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE)
        self.assertEqual(proc.stdout.readline(), b"up\n")
        proc.stdout.close()

        def kill() -> None:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)

        self.addCleanup(kill)
        return proc

    def test_group_members_and_zombies(self) -> None:
        """
        A live process is a member of its group; once it has exited and is
        only a zombie (not reaped yet), the group counts as empty although
        killpg(pgid, 0) still finds it.
        """
        ops = ProcessOps()
        proc = self.spawn("import time; time.sleep(30)")
        self.assertEqual(ops.group_members(proc.pid), [proc.pid])
        proc.kill()
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
        os.killpg(proc.pid, 0)  # the zombie keeps the group
        self.assertEqual(ops.group_members(proc.pid), [])
        proc.wait(10)
        self.assertEqual(ops.group_members(proc.pid), [])

    def test_group_members_after_fork(self) -> None:
        """
        Members found once are checked first; when none of them lives, the
        whole of /proc is read again, which finds a process they forked
        since.
        """
        import subprocess
        import sys

        code = ("import subprocess, sys\n"
                "print('up', flush=True)\n"
                "sys.stdin.readline()\n"
                "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
                "print(c.pid, flush=True)\n")
        leader = subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.addCleanup(leader.wait, 10)
        self.addCleanup(os.killpg, leader.pid, signal.SIGKILL)
        assert leader.stdin is not None and leader.stdout is not None
        self.assertEqual(leader.stdout.readline(), b"up\n")
        ops = ProcessOps()
        self.assertEqual(ops.group_members(leader.pid), [leader.pid])
        leader.stdin.write(b"go\n")
        leader.stdin.close()
        child = int(leader.stdout.readline())
        leader.stdout.close()
        os.waitid(os.P_PID, leader.pid, os.WEXITED | os.WNOWAIT)
        self.assertEqual(ops.group_members(leader.pid), [child])

    def test_marked_processes(self) -> None:
        """
        The /proc scan finds a process by this agent's marker, with its
        group, start time and LLMGW_* variables, and skips one marked for
        another agent.
        """
        ops = ProcessOps()
        env = {"PATH": os.environ.get("PATH", ""), sv.AGENT_MARKER: "/state/a",
               "LLMGW_SHARD_ID": "s1", "LLMGW_PORT": "9001", "SECRET": "x"}
        mine = self.spawn("import time; time.sleep(30)", env)
        self.spawn("import time; time.sleep(30)", dict(env, **{sv.AGENT_MARKER: "/state/b"}))
        (p,) = ops.marked_processes("/state/a")
        self.assertEqual((p.pid, p.pgid, p.shard_id, p.env["LLMGW_PORT"]),
                         (mine.pid, mine.pid, "s1", "9001"))
        self.assertNotIn("SECRET", p.env)
        self.assertEqual(p.start_time, ops.start_time(mine.pid))

    def test_start_time(self) -> None:
        """
        The real start time reader gives a number for a live process and
        None for a pid that does not exist.
        """
        ops = ProcessOps()
        self.assertIsInstance(ops.start_time(os.getpid()), int)
        self.assertEqual(ops.start_time(os.getpid()), ops.start_time(os.getpid()))
        self.assertIsNone(ops.start_time(2**22 + 12345))

    def test_port_in_use(self) -> None:
        """
        A port another process listens on (on loopback) is in use; a free
        one is not.
        """
        import socket

        ops = ProcessOps()
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            port = listener.getsockname()[1]
            self.assertTrue(ops.port_in_use(port))
        self.assertFalse(ops.port_in_use(port))
