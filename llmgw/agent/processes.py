"""
What the supervisor asks of the operating system about processes, some of
which it did not spawn (a shard re-adopted after an agent restart is no
child of this agent): whether a pid is still the same process, which
processes a group still has, which processes carry this agent's marker,
and signals to a whole group. L{ProcessOps} reads C{/proc}; tests replace
it with a fake.

A process group counts as empty once its members are all zombies: an init
that does not reap would otherwise keep a dead group forever.
"""

from __future__ import annotations

import collections
import errno
import os
import socket
from dataclasses import dataclass, field

#: The variable in every shard's environment that names the agent (its
#: state directory) that started it.
AGENT_MARKER = "LLMGW_AGENT_STATE"
#: The variable that names the shard.
SHARD_MARKER = "LLMGW_SHARD_ID"
#: Process groups whose members L{ProcessOps} remembers between checks.
KNOWN_GROUPS = 1024


class ProcessOps:
    """
    What the supervisor asks of the operating system about processes it
    may not have spawned. Tests replace it.
    """

    def __init__(self) -> None:
        #: Members last found per process group (L{group_members}).
        self._known: collections.OrderedDict[int, list[int]] = collections.OrderedDict()

    def start_time(self, pid: int) -> int | None:
        """
        The start time (clock ticks since boot) of live process C{pid}, or
        C{None} if there is none (or only a zombie).
        """
        stat = _read_stat(pid)
        if stat is None or stat[0] in ("Z", "X"):
            return None
        return stat[2]

    def port_in_use(self, port: int) -> bool:
        """
        Whether another process on this machine already listens on C{port}
        (any address). A shard started there could not bind it, and a health
        check would reach the other process instead.
        """
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", port))
            except OSError as e:
                return e.errno == errno.EADDRINUSE
        return False

    def group_members(self, pgid: int) -> list[int]:
        """
        The live members of process group C{pgid}, zombies left out (an init
        that does not reap would keep them forever); C{[]} when it is empty.
        C{killpg(pgid, 0)} answers most calls. While the group exists, the
        members found last time are checked first (a few reads); C{/proc}
        is scanned whole only when none of them lives any more, which also
        finds what they forked since.
        """
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            self._known.pop(pgid, None)
            return []
        except PermissionError:
            pass
        known = self._known.get(pgid)
        if known:
            live = [pid for pid in known if _member(pid, pgid)]
            if live:
                self._known[pgid] = live
                return live
        live = [int(name) for name in os.listdir("/proc")
                if name.isdigit() and _member(int(name), pgid)]
        self._known.pop(pgid, None)
        if live:
            self._known[pgid] = live
            while len(self._known) > KNOWN_GROUPS:
                self._known.popitem(last=False)
        return live

    def marked_processes(self, marker: str) -> list[MarkedProcess]:
        """
        Every live process whose environment says C{LLMGW_AGENT_STATE=marker}:
        one pass over C{/proc/*/environ}, for the agent's start.
        """
        needle = f"{AGENT_MARKER}={marker}".encode()
        out = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            pid = int(name)
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    data = f.read()
            except OSError:
                continue
            entries = data.split(b"\0")
            if needle not in entries:
                continue
            stat = _read_stat(pid)
            if stat is None or stat[0] in ("Z", "X"):
                continue
            env = {}
            for entry in entries:
                key, eq, value = entry.partition(b"=")
                if eq and (key.startswith(b"LLMGW_") or key == b"CUDA_VISIBLE_DEVICES"):
                    env[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    command = f.read(400).replace(b"\0", b" ").decode("utf-8", "replace").strip()
            except OSError:
                command = ""
            out.append(MarkedProcess(pid=pid, pgid=stat[1], start_time=stat[2], env=env,
                                     command=command))
        return out

    def kill_group(self, pid: int, sig: int) -> None:
        """
        Send C{sig} to process group C{pid}, or to the process alone if its
        group is not set up yet.
        """
        try:
            os.killpg(pid, sig)
            return
        except ProcessLookupError:
            pass
        except PermissionError:
            pass
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _member(pid: int, pgid: int) -> bool:
    stat = _read_stat(pid)
    return stat is not None and stat[1] == pgid and stat[0] not in ("Z", "X")


def _read_stat(pid: int) -> tuple[str, int, int] | None:
    """
    (state, process group, start time) of C{pid} from C{/proc/PID/stat}.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: split after the last ')'.
    fields = data[data.rfind(b")") + 2 :].split()
    try:
        return fields[0].decode(), int(fields[2]), int(fields[19])
    except (IndexError, ValueError):
        return None


@dataclass
class MarkedProcess:
    """
    A process found carrying this agent's marker in its environment.
    """

    pid: int
    pgid: int
    start_time: int
    #: Its C{LLMGW_*} and C{CUDA_VISIBLE_DEVICES} variables.
    env: dict[str, str] = field(default_factory=dict)
    #: The start of its command line, for the log.
    command: str = ""

    @property
    def shard_id(self) -> str:
        return self.env.get(SHARD_MARKER, "")
