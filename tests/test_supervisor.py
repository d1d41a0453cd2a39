"""
Tests for L{llmgw.agent.supervisor}: the commands (start, stop, drain), what
a start is refused for, and what it spawns and records, driven by a
C{Clock}, a fake spawner, fake process operations and a fake prober.
"""

from __future__ import annotations

import json
import signal

from llmgw.agent.launch import LAUNCHER
from llmgw.agent.processes import AGENT_MARKER
from tests.supervisor_harness import SupervisorCase, spec


class SupervisorTests(SupervisorCase):
    """
    Starting, stopping and draining shards through the supervisor.
    """

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

    def test_marker_in_environment(self) -> None:
        """
        Every shard's environment names the shard, its replica, model and
        profile, and the agent (its state directory) that started it.
        """
        self.sup.start(spec())
        env = self.spawner.calls[0]["env"]
        self.assertEqual((env["LLMGW_SHARD_ID"], env["LLMGW_REPLICA_ID"], env["LLMGW_MODEL"],
                          env["LLMGW_PROFILE"]), ("s1", "r1", "m", "p"))
        self.assertEqual(env[AGENT_MARKER], str(self.state.path.resolve()))

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
