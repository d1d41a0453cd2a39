"""
Fakes for testing L{llmgw.agent.supervisor} and its collaborators without
processes, sockets or time: a spawner, the process operations, a health
prober, a shard spec, and a test case that wires them to a supervisor on a
C{Clock}.
"""

from __future__ import annotations

import signal
from typing import Any

from twisted.internet import defer, error
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.processes import AGENT_MARKER, MarkedProcess, ProcessOps
from llmgw.agent.shard import Shard
from llmgw.agent.state import ShardSpec, StateDir
from llmgw.agent.supervisor import Supervisor


class FakeProcess:
    """
    A spawned main process: the test ends it with L{end}, which takes it
    out of its group in the fake operations.
    """

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
    """
    C{spawnProcess} in memory: records each call, and gives each process a
    new pid that leads a group of its own (in C{ops}, if given). Raises
    C{fail} when that is set.
    """

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
        self.marked: list[MarkedProcess] = []
        self.mains: set[int] = set()
        self.checks = 0

    def group_members(self, pgid: int) -> list[int]:
        self.checks += 1
        return sorted(self.groups.get(pgid, {}))

    def marked_processes(self, marker: str) -> list[MarkedProcess]:
        return [p for p in self.marked if p.env.get(AGENT_MARKER) == marker]

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
    """
    Health probes the test answers in order, with L{answer}.
    """

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
    """
    A shard of replica C{r1} (model C{m}, profile C{p}) whose command runs a
    Python module on C{{port}}; C{kw} sets the other fields.
    """
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

    def start_ready(self, **kw: Any) -> Shard:
        shard = self.sup.start(spec(**kw))
        self.clock.advance(0)
        self.prober.answer(True)
        self.assertEqual(shard.state, "ready")
        return shard
