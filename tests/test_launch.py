"""
Tests for L{llmgw.agent.launch}: whether a start may go ahead, and the
command line and environment a shard starts with, as plain functions.
"""

from __future__ import annotations

from pathlib import Path

from twisted.internet import error
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent import launch
from llmgw.agent.processes import AGENT_MARKER
from llmgw.agent.shard import STOPPING, Shard
from llmgw.crash import CrashClass
from tests.supervisor_harness import spec


def never(port: int) -> bool:
    return False


class RefusalTests(SynchronousTestCase):
    """
    L{launch.refusal} and L{launch.refusal_class}.
    """

    def test_acceptable(self) -> None:
        """
        A spec with a usable id, a command, a free port and GPUs the node
        has, clashing with no held shard, is not refused.
        """
        self.assertIsNone(launch.refusal(spec(), {0, 1}, [], never))

    def test_stopping_shard_holds(self) -> None:
        """
        A stopping shard still holds its GPUs and port.
        """
        other = Shard(spec("old", gpus=(1,), port=9000), STOPPING)
        self.assertEqual(launch.refusal(spec(gpus=(1,)), None, [other], never),
                         "GPU 1 is in use by shard old")
        self.assertEqual(launch.refusal(spec(gpus=(0,), port=9000), None, [other], never),
                         "port 9000 is in use by shard old")

    def test_port_asked_last(self) -> None:
        """
        The system is asked about the port only when every other check
        passed.
        """
        asked: list[int] = []

        def busy(port: int) -> bool:
            asked.append(port)
            return True

        self.assertIn("does not exist", launch.refusal(spec(gpus=(5,)), {0}, [], busy) or "")
        self.assertEqual(asked, [])
        self.assertEqual(launch.refusal(spec(port=8123), {0}, [], busy),
                         "port 8123 is already in use by another process on this node")
        self.assertEqual(asked, [8123])

    def test_bad_specs(self) -> None:
        """
        An unusable port, repeated GPUs and an empty command are refused.
        """
        self.assertEqual(launch.refusal(spec(port=0), None, [], never),
                         "port 0 is not a usable port")
        self.assertEqual(launch.refusal(spec(gpus=(1, 1)), None, [], never),
                         "GPU indices repeat: [1, 1]")
        self.assertEqual(launch.refusal(spec(argv=[""]), None, [], never), launch.NO_ARGV)

    def test_classes(self) -> None:
        """
        A taken port is a port_in_use refusal, an empty command a config
        one, and anything else unknown.
        """
        self.assertEqual(launch.refusal_class("port 1 is in use by shard x"),
                         CrashClass.PORT_IN_USE)
        self.assertEqual(launch.refusal_class(launch.NO_ARGV), CrashClass.CONFIG)
        self.assertEqual(launch.refusal_class("GPU 1 is in use by shard x"), CrashClass.UNKNOWN)


class CommandTests(SynchronousTestCase):
    """
    L{launch.fill_argv}, L{launch.launcher_args} and L{launch.environment}.
    """

    def test_placeholders(self) -> None:
        """
        Every placeholder is filled, several in one argument too; other
        arguments pass as they are.
        """
        s = spec("s9", gpus=(2, 3), port=8100, rank=1, world_size=2, leader_address="h:1",
                 argv=["{python}", "--on={host}:{port}", "{rank}/{world_size}", "{leader}",
                       "{model}", "{shard_id}", "{replica_id}", "{gpus}", "{other}"])
        self.assertEqual(launch.fill_argv(s, "/py", "10.0.0.5"),
                         ["/py", "--on=10.0.0.5:8100", "1/2", "h:1", "m", "s9", "r1", "2,3",
                          "{other}"])

    def test_launcher_args(self) -> None:
        """
        The launcher runs isolated, with the log path first and the shard's
        argv after it.
        """
        self.assertEqual(launch.launcher_args("/py", Path("/l/s.log"), ["a", "b"]),
                         ["/py", "-I", "-c", launch.LAUNCHER, "/l/s.log", "a", "b"])

    def test_environment(self) -> None:
        """
        The base environment and the command's env come first; the shard's
        own variables win; the agent marker is set only when there is one.
        """
        s = spec(env={"CUDA_VISIBLE_DEVICES": "9", "X": "1", "PATH": "/mine"})
        env = launch.environment(s, {"PATH": "/usr/bin", "HOME": "/root"}, "")
        self.assertEqual((env["PATH"], env["HOME"], env["X"], env["CUDA_VISIBLE_DEVICES"]),
                         ("/mine", "/root", "1", "0"))
        self.assertNotIn(AGENT_MARKER, env)
        self.assertEqual(launch.environment(s, {}, "/state")[AGENT_MARKER], "/state")


class ShardProcessTests(SynchronousTestCase):
    """
    L{launch.ShardProcess}.
    """

    def test_output_and_end(self) -> None:
        """
        What the launcher writes is kept as the shard's first output, and
        the end is passed on with its exit code or signal.
        """
        shard = Shard(spec())
        ends: list[tuple[int, int]] = []
        proto = launch.ShardProcess(shard, lambda s, code, sig: ends.append((code, sig)))
        proto.childDataReceived(2, b"llmgw: cannot run 'x'\n")
        proto.processEnded(Failure(error.ProcessTerminated(127)))
        proto.processEnded(Failure(error.ProcessTerminated(None, 9)))
        proto.processEnded(Failure(error.ProcessDone(0)))
        self.assertEqual(shard.last_output(), "llmgw: cannot run 'x'")
        self.assertEqual(ends, [(127, 0), (0, 9), (0, 0)])
