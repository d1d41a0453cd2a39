"""
Tests for L{llmgw.agent.processes}: the real process operations, on small
real processes that each test KILLs in its cleanup.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.processes import AGENT_MARKER, ProcessOps


class ProcessOpsTests(SynchronousTestCase):
    """
    L{ProcessOps} on this machine's C{/proc}.
    """

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
        env = {"PATH": os.environ.get("PATH", ""), AGENT_MARKER: "/state/a",
               "LLMGW_SHARD_ID": "s1", "LLMGW_PORT": "9001", "SECRET": "x"}
        mine = self.spawn("import time; time.sleep(30)", env)
        self.spawn("import time; time.sleep(30)", dict(env, **{AGENT_MARKER: "/state/b"}))
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

        from llmgw.testing.ports import free_port

        ops = ProcessOps()
        with socket.socket() as listener:
            # Not an ephemeral port: once closed, no outbound connection takes it.
            listener.bind(("127.0.0.1", free_port()))
            listener.listen(1)
            port = listener.getsockname()[1]
            self.assertTrue(ops.port_in_use(port))
        self.assertFalse(ops.port_in_use(port))
