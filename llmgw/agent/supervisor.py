"""
The shard supervisor: runs each shard as a child process and reports its
state transitions (DESIGN §7, §15; issue 3 item 4, issue 11 item 1).

A shard's life::

    start -> starting --(health GET answers 200)--> ready
    starting --(startup timeout)--> stopping --> failed
    ready --(3 failed probes in a row)--> stopping --> failed
    ready|starting --(drain)--> draining --(drain timeout or stop)--> stopping --> stopped
    any --(stop)--> stopping --> stopped
    any --(main process exits unasked)--> stopping --> failed (exit code or signal,
                                          crash class, last output)

A shard is its whole process group. It enters "stopping" when it is told to
stop or when its main process ends, asked or not: TERM goes to the group,
KILL after the shard's C{stop_grace_s}, and that KILL stands after the main
process has exited, so children that ignore TERM die too. It leaves
"stopping" (to stopped or failed) only once the group is empty, and only then
are its GPUs and port free for another shard. Emptiness is polled on the
injected clock (L{ProcessOps.group_members}: C{killpg(pgid, 0)}, then the
group's members in C{/proc}, zombies not counted, since an init that does not
reap would otherwise keep a dead group forever).

Each shard runs in its own session (so its process group is its own and
C{killpg} reaches everything it forked), with stdout and stderr appended to
a log file in the state directory rather than a pipe to the agent: a shard
must outlive the agent, and a pipe whose reader died would kill it with
SIGPIPE on its next line. The supervisor tails that file into the agent's
log and a bounded ring buffer, the "last output" of a failure.

Every shard's environment carries C{LLMGW_SHARD_ID}, C{LLMGW_REPLICA_ID},
C{LLMGW_MODEL} and C{LLMGW_AGENT_STATE} (this agent's state directory), which
its children inherit. After an agent restart, L{Supervisor.recover} re-adopts
the shards recorded in the state directory whose processes are still alive
(same pid and same start time in C{/proc/PID/stat}), or whose group still has
members (they are stopping), and from then on detects their exit by polling,
since they are no longer its children. It also scans C{/proc/*/environ} once
for processes carrying this agent's marker: those of a shard whose record is
damaged or missing become a "record lost" shard (reported in C{Register} so
the control plane stops it; its profile is unknown), and those that cannot
be tied to a shard at all are strays, logged loudly and listed in
C{Register}.
"""

from __future__ import annotations

import collections
import errno
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twisted.application.service import Service
from twisted.internet import defer, error
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmgw.agent.state import ShardRecord, ShardSpec, StateDir, valid_shard_id
from llmgw.crash import CrashClass, classify
from llmgw.engines import health_url, stop_signal_number
from llmgw.states import ShardState

STARTING = ShardState.STARTING
READY = ShardState.READY
DRAINING = ShardState.DRAINING
STOPPING = ShardState.STOPPING
STOPPED = ShardState.STOPPED
FAILED = ShardState.FAILED
LIVE_STATES = (STARTING, READY, DRAINING)
#: States in which a shard holds its GPUs and port: its group may have members.
HELD_STATES = (*LIVE_STATES, STOPPING)

#: The variable in every shard's environment that names the agent (its
#: state directory) that started it.
AGENT_MARKER = "LLMGW_AGENT_STATE"
#: The variable that names the shard.
SHARD_MARKER = "LLMGW_SHARD_ID"
#: The first checks of a stopping group come quickly (most groups empty at
#: once), then back off to the supervisor's poll interval.
GROUP_POLL_FIRST = 0.05
#: Process groups whose members L{ProcessOps} remembers between checks.
KNOWN_GROUPS = 1024
#: After the KILL, how long a group may take to empty before the agent says,
#: loudly, that it survives (a process in uninterruptible sleep, say).
KILL_WAIT_S = 10.0

#: Lines of output kept per shard for its "last output".
RING_LINES = 100
#: Longest line kept; longer ones are cut.
LINE_MAX = 2000
#: Most bytes read from one shard's log per tail pass.
TAIL_CHUNK = 256 * 1024
#: A shard log over this size is truncated once read (its lines are already
#: in the agent's log); the shard appends, so it carries on at the new end.
LOG_MAX = 32 * 1024 * 1024
#: Ended shards remembered (for re-reports), oldest forgotten first.
ENDED_KEPT = 256
#: The exit code reported when a re-adopted shard ended and its status is
#: unknowable (it was not this process's child).
UNKNOWN_EXIT = -1

# Runs in the child before the shard's own program: output to the log file,
# stdin from /dev/null, a session (and process group) of its own, then exec,
# which keeps the pid.
LAUNCHER = """\
import os, sys
log, argv = sys.argv[1], sys.argv[2:]
fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0); os.dup2(fd, 1); os.dup2(fd, 2)
os.close(fd); os.close(null)
os.setsid()
try:
    os.execvp(argv[0], argv)
except OSError as e:
    os.write(2, ("llmgw: cannot run %r: %s\\n" % (argv[0], e.strerror)).encode())
    os._exit(127)
"""

Spawner = Callable[..., Any]


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


@dataclass
class Stray:
    """
    A process this agent started (it carries the marker) that belongs to no
    shard it can name: logged loudly and listed in C{Register}, never
    signalled.
    """

    pid: int
    pgid: int
    shard_id: str
    reason: str
    command: str
    start_time: int | None = None


def _int(text: str) -> int:
    try:
        return max(0, int(text))
    except ValueError:
        return 0


def _int_list(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if part.isdigit():
            out.append(int(part))
    return out


class HttpProber:
    """
    Health probes over HTTP: a GET that must answer 200 within C{timeout}.
    """

    def __init__(self, reactor: Any, timeout: float = 5.0):
        from twisted.web.client import Agent, HTTPConnectionPool

        self.reactor = reactor
        self.timeout = timeout
        class QuietPool(HTTPConnectionPool):
            # Not a "Starting factory" log line per probe.
            class _factory(HTTPConnectionPool._factory):  # type: ignore[valid-type,misc]
                noisy = False

        self.agent = Agent(reactor, connectTimeout=timeout,
                           pool=QuietPool(reactor, persistent=False))

    def probe(self, url: str) -> defer.Deferred[Any]:
        from twisted.web.client import readBody

        d: defer.Deferred[Any] = self.agent.request(b"GET", url.encode())

        def check(response: Any) -> Any:
            body = readBody(response)

            def code(_: Any) -> None:
                if response.code != 200:
                    raise ValueError(f"HTTP {response.code}")

            return body.addCallback(code)

        d.addCallback(check)
        d.addTimeout(self.timeout, self.reactor)
        return d


class LogTail:
    """
    Reads a shard's log file as it grows, keeping the last lines.
    """

    def __init__(self, path: Path, from_end: bool = False):
        self.path = path
        self.lines: collections.deque[str] = collections.deque(maxlen=RING_LINES)
        self.offset = 0
        self._partial = b""
        if from_end:
            try:
                size = path.stat().st_size
            except OSError:
                size = 0
            # Keep the tail of what the shard wrote while no agent watched.
            self.offset = max(0, size - 16 * 1024)
            self.read()

    def read(self) -> list[str]:
        """
        New complete lines since the last call (at most L{TAIL_CHUNK} bytes).
        """
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self.offset:
                    self.offset, self._partial = 0, b""
                f.seek(self.offset)
                data = f.read(TAIL_CHUNK)
        except OSError:
            return []
        self.offset += len(data)
        data = self._partial + data
        parts = data.split(b"\n")
        self._partial = parts.pop()
        if len(self._partial) > LINE_MAX:
            parts.append(self._partial)
            self._partial = b""
        lines = [p.decode("utf-8", "replace").rstrip("\r")[:LINE_MAX] for p in parts]
        self.lines.extend(lines)
        if self.offset > LOG_MAX and not self._partial and len(data) < TAIL_CHUNK:
            try:
                os.truncate(self.path, 0)
                self.offset = 0
            except OSError:
                pass
        return lines

    def flush_partial(self) -> None:
        if self._partial:
            self.lines.append(self._partial.decode("utf-8", "replace")[:LINE_MAX])
            self._partial = b""

    def last_output(self) -> str:
        return "\n".join(self.lines)


class Shard:
    """
    One shard the supervisor runs or ran. Read-only to everything but the
    supervisor.
    """

    def __init__(self, spec: ShardSpec, state: str = STARTING):
        self.spec = spec
        self.state = state
        self.error = ""
        self.exit_code = 0
        self.signal = 0
        self.pid: int | None = None
        self.start_time: int | None = None
        self.process: Any = None
        self.adopted = False
        #: Found by its environment marker, its record lost: its profile and
        #: command are unknown, so it is only ever stopped.
        self.record_lost = False
        #: Set once TERM has gone to its group (asked, or its main process ended).
        self.stopping = False
        #: Set when a stop is the supervisor's own doing (a timeout): the
        #: shard ends failed with this error instead of stopped.
        self.stop_error = ""
        #: The process groups that make up the shard (its main process's, and
        #: any other found carrying its marker at the agent's start).
        self.pgids: set[int] = set()
        #: Whether the main process has ended (the group may live on).
        self.main_ended = False
        #: The state it takes once its group is empty: stopped or failed.
        self.final_state = ""
        #: The class of its failure (L{llmgw.crash.CrashClass}), "" if none.
        self.crash_class = ""
        #: When the KILL went out (clock seconds), for "survives KILL".
        self.killed_at: float | None = None
        self.survivors_logged = False
        self.term_sent = False
        self.tail: LogTail | None = None
        self.probe_failures = 0
        self.last_probe_error = ""
        self.timers: dict[str, IDelayedCall] = {}
        self._startup_output: collections.deque[str] = collections.deque(maxlen=20)

    @property
    def shard_id(self) -> str:
        return self.spec.shard_id

    @property
    def live(self) -> bool:
        """
        Starting, ready or draining: its main process runs.
        """
        return self.state in LIVE_STATES

    @property
    def held(self) -> bool:
        """
        Live or stopping: its group may have members, and its GPUs and port
        are not free.
        """
        return self.state in HELD_STATES

    def last_output(self) -> str:
        lines = list(self._startup_output)
        if self.tail is not None:
            lines += list(self.tail.lines)
        return "\n".join(lines[-RING_LINES:])


class _ShardProcess(ProcessProtocol):
    def __init__(self, supervisor: Supervisor, shard: Shard):
        self.supervisor = supervisor
        self.shard = shard

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        # Only the launcher writes here, before it redirects to the log file.
        for line in data.decode("utf-8", "replace").splitlines():
            self.shard._startup_output.append(line[:LINE_MAX])

    def processEnded(self, reason: Failure) -> None:
        if self.supervisor.detached:
            return  # the agent stopped watching its shards
        value = reason.value
        code = getattr(value, "exitCode", None)
        sig = getattr(value, "signal", None)
        self.supervisor._ended(self.shard, code if code is not None else 0, sig or 0)


class Supervisor(Service):
    """
    Runs shards, keeps their records in a L{StateDir}, and tells its
    listeners (L{add_listener}) about every transition.

    @param spawn: C{reactor.spawnProcess} or a fake with its signature.
    @param gpu_indices: the node's GPU indices, or C{None} not to check.
    """

    log = Logger()

    def __init__(
        self,
        clock: Any,
        spawn: Spawner,
        state_dir: StateDir | None = None,
        gpu_indices: Iterable[int] | None = None,
        ops: ProcessOps | None = None,
        prober: Any = None,
        python: str = sys.executable,
        probe_interval_starting: float = 1.0,
        probe_interval_ready: float = 10.0,
        unhealthy_after: int = 3,
        poll_interval: float = 1.0,
        base_env: dict[str, str] | None = None,
    ):
        self.clock = clock
        self.spawn = spawn
        self.state_dir = state_dir
        self.gpu_indices = None if gpu_indices is None else set(gpu_indices)
        self.ops = ops or ProcessOps()
        self.prober = prober
        self.python = python
        self.probe_interval_starting = probe_interval_starting
        self.probe_interval_ready = probe_interval_ready
        self.unhealthy_after = unhealthy_after
        self.poll_interval = poll_interval
        if base_env is None:
            base_env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
        self.base_env = base_env
        self.shards: collections.OrderedDict[str, Shard] = collections.OrderedDict()
        #: Processes carrying this agent's marker that no shard accounts for.
        self.strays: list[Stray] = []
        self._listeners: list[Callable[[Shard], None]] = []
        self._loop: LoopingCall | None = None
        #: Set by L{stopService}: shards that end after it are not watched.
        self.detached = False
        #: engines (issue 11): the address the agent advertises; probes and
        #: {host} use it.
        self.probe_host = "127.0.0.1"

    # -- service -----------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self.detached = False
        self._loop = LoopingCall(self.tick)
        self._loop.clock = self.clock
        self._loop.start(self.poll_interval, now=False)

    def stopService(self) -> Any:
        # Shards outlive the agent: stop watching them, never stop them. A
        # shard whose main process has ended is already dead: what is left of
        # its group gets its KILL now, since no timer of ours will send it.
        super().stopService()
        self.detached = True
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        for shard in self.shards.values():
            self._cancel_timers(shard)
            if shard.tail is not None:
                self._tail(shard)
            if shard.state == STOPPING and shard.main_ended and not self._group_empty(shard):
                self.log.warn("the agent is stopping: KILLing what is left of shard {shard}'s "
                              "process group", shard=shard.shard_id)
                self._signal(shard, signal.SIGKILL)

    def add_listener(self, fn: Callable[[Shard], None]) -> None:
        self._listeners.append(fn)

    def live_shards(self) -> list[Shard]:
        """
        The shards in starting, ready or draining, oldest first.
        """
        return [s for s in self.shards.values() if s.live]

    def held_shards(self) -> list[Shard]:
        """
        The shards whose process groups may still have members (live or
        stopping), oldest first: what C{Register} lists, and what holds GPUs
        and ports.
        """
        return [s for s in self.shards.values() if s.held]

    def live_strays(self) -> list[Stray]:
        """
        The strays found at start that still run (the list drops the others).
        """
        self.strays = [p for p in self.strays if self.ops.start_time(p.pid) == p.start_time]
        return list(self.strays)

    def get(self, shard_id: str) -> Shard | None:
        return self.shards.get(shard_id)

    # -- commands ------------------------------------------------------------

    def start(self, spec: ShardSpec) -> Shard:
        """
        Start a shard, or re-report it if it already runs. A start that
        cannot be honoured is reported as failed with the reason.
        """
        existing = self.shards.get(spec.shard_id)
        if existing is not None and existing.held:
            self.log.info(
                "shard {shard} is already {state} (pid {pid}); starting nothing new",
                shard=spec.shard_id, state=existing.state, pid=existing.pid,
            )
            self._report(existing)
            return existing
        problem = self._refusal(spec)
        if problem is not None:
            shard = Shard(spec, FAILED)
            shard.error = problem
            # A refused start is no crash, but the control plane still needs
            # to know whether a retry can help: a taken port, an empty command.
            shard.crash_class = (
                CrashClass.PORT_IN_USE if problem.startswith("port ") and "in use" in problem
                else CrashClass.CONFIG if problem == "the command has no argv"
                else CrashClass.UNKNOWN
            ).value
            self.log.error("refusing to start shard {shard}: {error}",
                           shard=spec.shard_id, error=problem)
            self._report(shard)
            return shard
        shard = Shard(spec)
        self._remember(shard)
        try:
            self._spawn(shard)
        except Exception as e:
            shard.state, shard.error = FAILED, f"could not start the process: {e}"
            self.log.failure("could not spawn shard {shard}", shard=spec.shard_id)
            self._report(shard)
            return shard
        self.log.info(
            "shard {shard} of replica {replica} ({model}) started as pid {pid} on GPUs "
            "{gpus}, port {port}",
            shard=spec.shard_id, replica=spec.replica_id, model=spec.model, pid=shard.pid,
            gpus=",".join(map(str, spec.gpu_indices)) or "none", port=spec.port,
        )
        self._set_timer(shard, "startup", spec.startup_timeout_s, self._startup_expired, shard)
        self._schedule_probe(shard, 0)
        self._persist(shard)
        self._report(shard)
        return shard

    def stop(self, shard_id: str) -> None:
        """
        Stop a shard: TERM to its group now, KILL after its grace.
        """
        shard = self.shards.get(shard_id)
        if shard is None or not shard.live:
            self.log.info("stop for shard {shard}: it is not running ({state})",
                          shard=shard_id, state=shard.state if shard else "unknown")
            if shard is None:
                # A start that never arrived, say: answer "stopped" so the
                # control plane frees what it holds for it now, not after
                # the stop's grace.
                if not valid_shard_id(shard_id):
                    return
                shard = Shard(ShardSpec(shard_id=shard_id, replica_id="", model="", profile="",
                                        argv=[], gpu_indices=[], port=0), STOPPED)
            self._report(shard)
            return
        self._terminate(shard, "")

    def drain(self, shard_id: str) -> None:
        """
        Report the shard draining; stop it at its drain timeout unless a
        stop comes first.
        """
        shard = self.shards.get(shard_id)
        if shard is None or not shard.live:
            self.log.info("drain for shard {shard}: it is not running", shard=shard_id)
            if shard is not None:
                self._report(shard)
            return
        if shard.state == DRAINING or shard.stopping:
            self._report(shard)
            return
        self._cancel_timer(shard, "startup")
        shard.state = DRAINING
        self._set_timer(shard, "drain", shard.spec.drain_timeout_s, self._drain_expired, shard)
        self.log.info("shard {shard} is draining; it stops in {timeout}s at the latest",
                      shard=shard_id, timeout=shard.spec.drain_timeout_s)
        self._persist(shard)
        self._report(shard)

    # -- start ---------------------------------------------------------------

    def _refusal(self, spec: ShardSpec) -> str | None:
        if not valid_shard_id(spec.shard_id):
            return f"shard id {spec.shard_id!r} is not usable (letters, digits, '.', '_', '-')"
        if not spec.argv or not spec.argv[0]:
            return "the command has no argv"
        if not 0 < spec.port < 65536:
            return f"port {spec.port} is not a usable port"
        if len(set(spec.gpu_indices)) != len(spec.gpu_indices):
            return f"GPU indices repeat: {spec.gpu_indices}"
        if self.gpu_indices is not None:
            missing = sorted(set(spec.gpu_indices) - self.gpu_indices)
            if missing:
                have = ",".join(map(str, sorted(self.gpu_indices))) or "none"
                return f"GPU {','.join(map(str, missing))} does not exist on this node (it has {have})"
        # A stopping shard's GPUs and port are free only once its group is empty.
        for other in self.held_shards():
            if other.spec.port == spec.port:
                return f"port {spec.port} is in use by shard {other.shard_id}"
            shared = sorted(set(other.spec.gpu_indices) & set(spec.gpu_indices))
            if shared:
                return (f"GPU {','.join(map(str, shared))} is in use by shard "
                        f"{other.shard_id}")
        if self.ops.port_in_use(spec.port):
            return f"port {spec.port} is already in use by another process on this node"
        return None

    def _argv(self, spec: ShardSpec) -> list[str]:
        values = {
            "{python}": self.python,
            "{port}": str(spec.port),
            "{rank}": str(spec.rank),
            "{world_size}": str(spec.world_size),
            "{leader}": spec.leader_address,
            "{model}": spec.model,
            "{shard_id}": spec.shard_id,
            "{replica_id}": spec.replica_id,
            "{gpus}": ",".join(map(str, spec.gpu_indices)),
            "{host}": self.probe_host,  # engines (issue 11): if the control plane left it
        }
        out = []
        for arg in spec.argv:
            for key, value in values.items():
                if key in arg:
                    arg = arg.replace(key, value)
            out.append(arg)
        return out

    def environment(self, spec: ShardSpec) -> dict[str, str]:
        """
        The shard's whole environment: a few of the agent's variables, the
        command's env, and ours, which win.
        """
        env = dict(self.base_env)
        env.update(spec.env)
        env.update({
            "CUDA_VISIBLE_DEVICES": ",".join(map(str, spec.gpu_indices)),
            "LLMGW_PORT": str(spec.port),
            "LLMGW_RANK": str(spec.rank),
            "LLMGW_WORLD_SIZE": str(spec.world_size),
            "LLMGW_LEADER": spec.leader_address,
            SHARD_MARKER: spec.shard_id,
            "LLMGW_REPLICA_ID": spec.replica_id,
            "LLMGW_MODEL": spec.model,
            "LLMGW_PROFILE": spec.profile,
        })
        if self.state_dir is not None:
            env[AGENT_MARKER] = self.marker
        return env

    @property
    def marker(self) -> str:
        """
        This agent's mark in its shards' environments: its state directory.
        """
        return str(self.state_dir.path.resolve()) if self.state_dir is not None else ""

    def _log_path(self, spec: ShardSpec) -> Path:
        if self.state_dir is not None:
            return self.state_dir.log_path(spec.shard_id)
        return Path(os.devnull)

    def _spawn(self, shard: Shard) -> None:
        spec = shard.spec
        log_path = self._log_path(spec)
        if self.state_dir is not None:
            # A new run of this shard starts a new log.
            log_path.write_bytes(b"")
            shard.tail = LogTail(log_path)
        args = [self.python, "-I", "-c", LAUNCHER, str(log_path), *self._argv(spec)]
        proto = _ShardProcess(self, shard)
        shard.process = self.spawn(proto, self.python, args, env=self.environment(spec), path=None)
        shard.pid = shard.process.pid
        shard.start_time = self.ops.start_time(shard.pid) if shard.pid else None
        if shard.pid:
            # The launcher's setsid makes the pid its group's id.
            shard.pgids = {shard.pid}

    # -- transitions ----------------------------------------------------------

    def _startup_expired(self, shard: Shard) -> None:
        shard.timers.pop("startup", None)
        why = f"not healthy within its startup timeout of {shard.spec.startup_timeout_s}s"
        if shard.last_probe_error:
            why += f" (last health check: {shard.last_probe_error})"
        self._terminate(shard, why)

    def _drain_expired(self, shard: Shard) -> None:
        shard.timers.pop("drain", None)
        self.log.info("shard {shard} reached its drain timeout; stopping it", shard=shard.shard_id)
        self._terminate(shard, "")

    def _terminate(self, shard: Shard, error_: str) -> None:
        """
        TERM the shard's group, KILL after the grace: it is stopping, and it
        ends C{stopped}, or C{failed} with C{error_} when that is set, once
        its group is empty.
        """
        if shard.stopping:
            return
        shard.stopping = True
        shard.stop_error = error_
        for name in ("startup", "drain", "probe"):
            self._cancel_timer(shard, name)
        grace = shard.spec.stop_grace_s
        self.log.info(
            "stopping shard {shard} (pid {pid}): TERM now, KILL in {grace}s{why}",
            shard=shard.shard_id, pid=shard.pid, grace=grace,
            why=f" ({error_})" if error_ else "",
        )
        shard.state = STOPPING
        self._signal(shard, stop_signal_number(shard.spec.stop_signal))  # engines (issue 11)
        self._set_timer(shard, "kill", grace, self._kill, shard)
        if shard.main_ended:
            self._watch_group(shard, GROUP_POLL_FIRST)
        self._persist(shard)
        self._report(shard)

    def _kill(self, shard: Shard) -> None:
        shard.timers.pop("kill", None)
        if shard.main_ended and self._group_empty(shard):
            self._finish(shard)
            return
        self.log.warn("shard {shard} (pid {pid}) outlived its {grace}s grace; sending KILL "
                      "to its process group", shard=shard.shard_id, pid=shard.pid,
                      grace=shard.spec.stop_grace_s)
        shard.killed_at = self.clock.seconds()
        self._signal(shard, signal.SIGKILL)

    def _signal(self, shard: Shard, sig: int) -> bool:
        """
        Send C{sig} to each of the shard's process groups; whether it went.
        """
        if shard.adopted and not shard.main_ended and shard.pid is not None:
            if self.ops.start_time(shard.pid) != shard.start_time:
                # The main process ended unseen: its pid may be someone
                # else's now; its group is still ours while it has members,
                # and _ended takes it from here.
                return False
        for pgid in sorted(shard.pgids):
            self.ops.kill_group(pgid, sig)
        if sig == signal.SIGTERM:
            shard.term_sent = True
        return True

    def _group_empty(self, shard: Shard) -> bool:
        return all(not self.ops.group_members(pgid) for pgid in shard.pgids)

    def _ended(self, shard: Shard, exit_code: int, sig: int) -> None:
        """
        The main process ended. The shard is stopping until its group is
        empty; its group gets TERM now (unless a stop already sent it) and
        KILL after the grace.
        """
        if not shard.held or shard.main_ended:
            return
        shard.main_ended = True
        for name in ("startup", "drain", "probe"):
            self._cancel_timer(shard, name)
        self._tail(shard)
        if shard.tail is not None:
            shard.tail.flush_partial()
        shard.exit_code, shard.signal = exit_code, sig
        shard.process = None
        how = (f"killed by signal {sig}" if sig else
               "exit status unknown (not this agent's child)" if exit_code == UNKNOWN_EXIT else
               f"exit code {exit_code}")
        if shard.stopping and not shard.stop_error:
            shard.final_state = STOPPED
            self.log.info("shard {shard}'s main process ended ({how})", shard=shard.shard_id,
                          how=how)
        else:
            shard.final_state = FAILED
            if shard.stop_error:
                shard.error = f"{shard.stop_error}; {how}"
            else:
                shard.error = f"exited without being asked to ({how})"
            shard.crash_class = classify(
                exit_code if exit_code != UNKNOWN_EXIT else 0, sig, shard.last_output(),
                asked=shard.stopping,
            ).value
            self.log.error(
                "shard {shard} of replica {replica} failed ({crash_class}): {error}; "
                "last output:\n{output}",
                shard=shard.shard_id, replica=shard.spec.replica_id, error=shard.error,
                crash_class=shard.crash_class, output=shard.last_output(),
            )
        if self._group_empty(shard):
            self._finish(shard)
            return
        # Reported when it is news: a shard that was not stopping yet, or one
        # whose stop is now a failure (its error, exit and class are new).
        news = not shard.stopping or shard.final_state == FAILED
        if not shard.stopping:
            self.log.warn("shard {shard}'s main process ended but its process group lives on: "
                          "TERM to the group now, KILL in {grace}s", shard=shard.shard_id,
                          grace=shard.spec.stop_grace_s)
            shard.stopping = True
            shard.state = STOPPING
            self._signal(shard, signal.SIGTERM)
            self._set_timer(shard, "kill", shard.spec.stop_grace_s, self._kill, shard)
        elif not shard.term_sent:
            # A stop that could not signal a re-adopted shard whose main had
            # just ended: its group gets the TERM now.
            self._signal(shard, signal.SIGTERM)
        shard.state = STOPPING
        self._persist(shard)
        if news:
            self._report(shard)
        self._watch_group(shard, GROUP_POLL_FIRST)

    def _watch_group(self, shard: Shard, delay: float) -> None:
        self._set_timer(shard, "group", delay, self._check_group, shard, delay)

    def _check_group(self, shard: Shard, delay: float) -> None:
        """
        One look at a stopping shard's group: finish it when empty, else look
        again later (backing off to the poll interval), re-sending KILL and
        saying so loudly when the group outlives it.
        """
        shard.timers.pop("group", None)
        if not shard.held:
            return
        try:
            if self._group_empty(shard):
                self._finish(shard)
                return
            if shard.killed_at is not None:
                if self.clock.seconds() - shard.killed_at >= KILL_WAIT_S:
                    if not shard.survivors_logged:
                        shard.survivors_logged = True
                        left = sorted(p for g in shard.pgids for p in self.ops.group_members(g))
                        self.log.critical(
                            "shard {shard}'s process group survives SIGKILL for {wait}s "
                            "(pids {pids}: uninterruptible sleep?); its GPUs {gpus} stay held",
                            shard=shard.shard_id, wait=KILL_WAIT_S,
                            pids=",".join(map(str, left)),
                            gpus=",".join(map(str, shard.spec.gpu_indices)) or "none",
                        )
                    self._signal(shard, signal.SIGKILL)
        except Exception:
            self.log.failure("watching shard {shard}'s process group failed",
                             shard=shard.shard_id)
        self._watch_group(shard, min(delay * 2, self.poll_interval))

    def _finish(self, shard: Shard) -> None:
        """
        The group is empty: the shard has ended, its GPUs and port are free.
        """
        self._cancel_timers(shard)
        # No final state yet: a group that emptied on its own (a shard found
        # by its marker) failed; one we stopped is stopped.
        shard.state = shard.final_state or (
            FAILED if shard.stop_error or not shard.stopping else STOPPED)
        if shard.state == FAILED and not shard.error:
            shard.error = shard.stop_error or "its processes ended"
        shard.process = None
        self.log.info("shard {shard} is {state}: its process group is empty, GPUs {gpus} and "
                      "port {port} are free", shard=shard.shard_id, state=shard.state,
                      gpus=",".join(map(str, shard.spec.gpu_indices)) or "none",
                      port=shard.spec.port)
        if self.state_dir is not None and not shard.record_lost:
            self.state_dir.remove(shard.shard_id)
        self._report(shard)

    # -- health ----------------------------------------------------------------

    def _schedule_probe(self, shard: Shard, delay: float) -> None:
        if self.prober is None:
            return
        self._set_timer(shard, "probe", delay, self._probe, shard)

    def _probe(self, shard: Shard) -> None:
        shard.timers.pop("probe", None)
        if not shard.live or shard.stopping:
            return
        url = health_url(self.probe_host, shard.spec)  # engines (issue 11)
        d = defer.maybeDeferred(self.prober.probe, url) if url else defer.succeed(None)
        d.addCallbacks(lambda _: self._probed(shard, None),
                       lambda f: self._probed(shard, f))

    def _probed(self, shard: Shard, failure: Failure | None) -> None:
        if not shard.live or shard.stopping:
            return
        if failure is None:
            shard.probe_failures = 0
            shard.last_probe_error = ""
            if shard.state == STARTING:
                self._cancel_timer(shard, "startup")
                shard.state = READY
                self.log.info("shard {shard} is ready (health check on port {port} answered)",
                              shard=shard.shard_id, port=shard.spec.port)
                self._persist(shard)
                self._report(shard)
        else:
            e = failure.value
            shard.last_probe_error = (
                "no answer in time" if isinstance(e, defer.TimeoutError | error.TimeoutError)
                else str(e) or type(e).__name__
            )
            if shard.state in (READY, DRAINING):
                shard.probe_failures += 1
                self.log.warn(
                    "shard {shard} failed a health check ({n} of {limit}): {error}",
                    shard=shard.shard_id, n=shard.probe_failures, limit=self.unhealthy_after,
                    error=shard.last_probe_error,
                )
                if shard.probe_failures >= self.unhealthy_after:
                    self._terminate(
                        shard,
                        f"failed {shard.probe_failures} health checks in a row "
                        f"(last: {shard.last_probe_error})",
                    )
                    return
        delay = self.probe_interval_starting if shard.state == STARTING else self.probe_interval_ready
        self._schedule_probe(shard, delay)

    # -- periodic ----------------------------------------------------------------

    def tick(self) -> None:
        """
        Tail every shard's output; notice re-adopted shards whose main
        process exited, and shards found by their marker whose processes
        all ended.
        """
        for shard in list(self.shards.values()):
            if not shard.held:
                continue
            try:
                self._tail(shard)
                if shard.adopted and not shard.main_ended and shard.pid is not None:
                    if self.ops.start_time(shard.pid) != shard.start_time:
                        self._ended(shard, UNKNOWN_EXIT, 0)
                elif shard.record_lost and shard.live and self._group_empty(shard):
                    self._finish(shard)
            except Exception:
                self.log.failure("watching shard {shard} failed", shard=shard.shard_id)

    def _tail(self, shard: Shard) -> None:
        if shard.tail is None:
            return
        for line in shard.tail.read():
            self.log.info("[{shard}] {line}", shard=shard.shard_id, line=line)

    # -- re-adoption --------------------------------------------------------------

    def recover(self) -> defer.Deferred[list[Shard]]:
        """
        Re-adopt the shards recorded in the state directory whose processes
        still run (live ones are probed; stopping ones, and those whose main
        process ended while the agent was away but whose group lives on, go
        on stopping); forget the others (their GPUs and ports are free
        again). Processes carrying this agent's marker whose record is lost
        become "record lost" shards, and those that name no usable shard
        become L{strays}. Fires with the adopted shards once each live one
        has had one health probe.
        """
        if self.state_dir is None:
            return defer.succeed([])
        try:
            marked = self.ops.marked_processes(self.marker)
        except Exception:
            self.log.failure("could not scan /proc for this agent's shard processes")
            marked = []
        by_shard: dict[str, list[MarkedProcess]] = {}
        for proc in marked:
            by_shard.setdefault(proc.shard_id, []).append(proc)
        adopted: list[Shard] = []
        probes = []
        for record in self.state_dir.load_all():
            spec = record.spec
            procs = by_shard.pop(spec.shard_id, []) if valid_shard_id(spec.shard_id) else []
            alive = self.ops.start_time(record.pid)
            main_alive = alive is not None and alive == record.start_time
            if not valid_shard_id(spec.shard_id) or (not main_alive and not procs):
                self.log.warn(
                    "shard {shard} (pid {pid}) did not survive while the agent was away; "
                    "forgetting it, its GPUs {gpus} and port {port} are free",
                    shard=spec.shard_id, pid=record.pid,
                    gpus=",".join(map(str, spec.gpu_indices)) or "none", port=spec.port,
                )
                self.state_dir.remove(spec.shard_id)
                continue
            shard = Shard(spec, record.state if record.state in HELD_STATES else STARTING)
            shard.adopted = True
            shard.pid, shard.start_time = record.pid, record.start_time
            shard.tail = LogTail(Path(record.log_path), from_end=True)
            # Groups are trusted while the main process lives (its pid is its
            # group) or when members carry the shard's marker.
            shard.pgids = {p.pgid for p in procs}
            if main_alive:
                shard.pgids |= set(record.pgids or [record.pid])
            outside = sorted(p.pid for p in procs if p.pgid != record.pid)
            if outside:
                self.log.warn("shard {shard} has processes outside its process group (pids "
                              "{pids}); they are stopped with it", shard=spec.shard_id,
                              pids=",".join(map(str, outside)))
            self._remember(shard)
            adopted.append(shard)
            if main_alive and record.state in LIVE_STATES:
                self.log.info(
                    "re-adopted shard {shard} of replica {replica} (pid {pid}, {state})",
                    shard=spec.shard_id, replica=spec.replica_id, pid=record.pid,
                    state=shard.state,
                )
                probes.append(self._first_probe(shard))
                continue
            self._resume_stop(shard, record, main_alive)
        self._found_unrecorded(by_shard)
        d: defer.Deferred[Any] = defer.gatherResults(probes, consumeErrors=True)
        d.addCallback(lambda _: adopted)
        return d

    def _resume_stop(self, shard: Shard, record: ShardRecord, main_alive: bool) -> None:
        """
        Go on stopping a re-adopted shard that was stopping, or whose main
        process ended while the agent was away: TERM its group again, KILL
        after the grace, and report it once its group is empty.
        """
        shard.stopping = True
        shard.state = STOPPING
        shard.stop_error = record.stop_error
        if record.main_ended or not main_alive:
            shard.main_ended = True
            if record.main_ended:
                shard.error, shard.exit_code, shard.signal = (
                    record.error, record.exit_code, record.signal)
                shard.crash_class = record.crash_class
                shard.final_state = FAILED if record.error or record.stop_error else STOPPED
            elif record.state == STOPPING and not record.stop_error:
                shard.exit_code, shard.final_state = UNKNOWN_EXIT, STOPPED
            else:
                shard.exit_code, shard.final_state = UNKNOWN_EXIT, FAILED
                shard.error = "exited while the agent was away (exit status unknown)"
                if record.stop_error:
                    shard.error = f"{record.stop_error}; {shard.error}"
                shard.crash_class = CrashClass.UNKNOWN.value
        self.log.warn(
            "re-adopted shard {shard} of replica {replica} is stopping (main process {main}); "
            "TERM to its process groups {groups}, KILL in {grace}s",
            shard=shard.shard_id, replica=shard.spec.replica_id,
            main="alive" if main_alive else "gone",
            groups=",".join(map(str, sorted(shard.pgids))), grace=shard.spec.stop_grace_s,
        )
        self._signal(shard, signal.SIGTERM)
        self._set_timer(shard, "kill", shard.spec.stop_grace_s, self._kill, shard)
        if shard.main_ended:
            self._watch_group(shard, GROUP_POLL_FIRST)
        self._persist(shard)

    def _found_unrecorded(self, by_shard: dict[str, list[MarkedProcess]]) -> None:
        """
        Processes with this agent's marker that no record accounts for: a
        shard whose record was lost is remembered (and reported, profile
        unknown, so the control plane stops it); the rest are strays.
        """
        for shard_id, procs in sorted(by_shard.items()):
            pids = ",".join(str(p.pid) for p in procs)
            if not valid_shard_id(shard_id):
                for p in procs:
                    self.strays.append(Stray(
                        pid=p.pid, pgid=p.pgid, shard_id=shard_id, command=p.command,
                        reason=f"its {SHARD_MARKER} {shard_id!r} is not a shard id",
                        start_time=p.start_time,
                    ))
                self.log.critical(
                    "UNACCOUNTED PROCESSES {pids} carry this agent's marker but name no usable "
                    "shard ({var}={shard!r}); they are left running, and listed in Register",
                    pids=pids, var=SHARD_MARKER, shard=shard_id,
                )
                continue
            leader = next((p for p in procs if p.pid == p.pgid), procs[0])
            env = leader.env
            spec = ShardSpec(
                shard_id=shard_id,
                replica_id=env.get("LLMGW_REPLICA_ID", ""),
                model=env.get("LLMGW_MODEL", ""),
                # Its command, health path and timeouts went with the record:
                # the profile is reported unknown, so the control plane stops it.
                profile="",
                argv=[],
                gpu_indices=_int_list(env.get("CUDA_VISIBLE_DEVICES", "")),
                port=_int(env.get("LLMGW_PORT", "")),
                rank=_int(env.get("LLMGW_RANK", "")),
                world_size=_int(env.get("LLMGW_WORLD_SIZE", "")) or 1,
                leader_address=env.get("LLMGW_LEADER", ""),
            )
            shard = Shard(spec, STARTING)
            shard.adopted = shard.record_lost = shard.main_ended = True
            shard.pid, shard.start_time = leader.pid, leader.start_time
            shard.pgids = {p.pgid for p in procs}
            log_path = self.state_dir.log_path(shard_id) if self.state_dir is not None else None
            if log_path is not None and log_path.exists():
                shard.tail = LogTail(log_path, from_end=True)
            self._remember(shard)
            self.log.critical(
                "FOUND SHARD {shard} RUNNING WITHOUT A RECORD (pids {pids}, process groups "
                "{groups}; replica {replica}, model {model}, profile {profile}, GPUs {gpus}, "
                "port {port}): its record was lost; it is reported to the control plane, "
                "which should stop it",
                shard=shard_id, pids=pids, groups=",".join(map(str, sorted(shard.pgids))),
                replica=spec.replica_id or "unknown", model=spec.model or "unknown",
                profile=env.get("LLMGW_PROFILE", "") or "unknown",
                gpus=",".join(map(str, spec.gpu_indices)) or "none", port=spec.port,
            )

    def _first_probe(self, shard: Shard) -> defer.Deferred[None]:
        if shard.state == DRAINING:
            self._set_timer(shard, "drain", shard.spec.drain_timeout_s, self._drain_expired, shard)
        if self.prober is None:
            return defer.succeed(None)
        url = health_url(self.probe_host, shard.spec)  # engines (issue 11)
        d = defer.maybeDeferred(self.prober.probe, url) if url else defer.succeed(None)

        def healthy(_: Any) -> None:
            if shard.live and shard.state == STARTING:
                shard.state = READY
                self._persist(shard)
                self._report(shard)
            self._schedule_probe(shard, self.probe_interval_ready)

        def unhealthy(f: Failure) -> None:
            shard.last_probe_error = str(f.value) or type(f.value).__name__
            if shard.live and shard.state != STARTING:
                self.log.warn("re-adopted shard {shard} does not answer its health check "
                              "({error}); it is starting again", shard=shard.shard_id,
                              error=shard.last_probe_error)
                shard.state = STARTING
                self._persist(shard)
                self._report(shard)
            if shard.live:
                self._set_timer(shard, "startup", shard.spec.startup_timeout_s,
                                self._startup_expired, shard)
                self._schedule_probe(shard, self.probe_interval_starting)

        d.addCallbacks(healthy, unhealthy)
        return d

    # -- bookkeeping -----------------------------------------------------------------

    def _remember(self, shard: Shard) -> None:
        self.shards.pop(shard.shard_id, None)
        self.shards[shard.shard_id] = shard
        ended = [k for k, s in self.shards.items() if not s.held]
        for k in ended[: max(0, len(ended) - ENDED_KEPT)]:
            del self.shards[k]

    def _persist(self, shard: Shard) -> None:
        if self.state_dir is None or shard.pid is None or not shard.held or shard.record_lost:
            return
        try:
            self.state_dir.save(ShardRecord(
                spec=shard.spec, pid=shard.pid, start_time=shard.start_time or 0,
                state=shard.state,
                log_path=str(shard.tail.path) if shard.tail is not None else os.devnull,
                pgids=sorted(shard.pgids), main_ended=shard.main_ended,
                error=shard.error, exit_code=shard.exit_code, signal=shard.signal,
                crash_class=shard.crash_class, stop_error=shard.stop_error,
            ))
        except OSError:
            self.log.failure("could not record shard {shard} in {dir}; it will not be "
                             "re-adopted after a restart", shard=shard.shard_id,
                             dir=str(self.state_dir.path))

    def _report(self, shard: Shard) -> None:
        for fn in list(self._listeners):
            try:
                fn(shard)
            except Exception:
                self.log.failure("reporting shard {shard} failed", shard=shard.shard_id)

    def _set_timer(self, shard: Shard, name: str, seconds: float, fn: Any, *args: Any) -> None:
        self._cancel_timer(shard, name)
        shard.timers[name] = self.clock.callLater(seconds, fn, *args)

    def _cancel_timer(self, shard: Shard, name: str) -> None:
        call = shard.timers.pop(name, None)
        if call is not None and call.active():
            call.cancel()

    def _cancel_timers(self, shard: Shard) -> None:
        for name in list(shard.timers):
            self._cancel_timer(shard, name)
