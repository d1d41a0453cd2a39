"""
The shard supervisor: runs each shard as a child process and reports its
state transitions (DESIGN §7, issue 3 item 4).

A shard's life::

    start -> starting --(health GET answers 200)--> ready
    starting --(startup timeout)--> TERM, KILL after grace --> failed
    ready --(3 failed probes in a row)--> TERM, KILL after grace --> failed
    ready|starting --(drain)--> draining --(drain timeout or stop)--> stopped
    any --(stop)--> TERM to the group, KILL after the grace --> stopped
    any --(exit nobody asked for)--> failed (exit code or signal, last output)

Each shard runs in its own session (so its process group is its own and
C{killpg} reaches everything it forked), with stdout and stderr appended to
a log file in the state directory rather than a pipe to the agent: a shard
must outlive the agent, and a pipe whose reader died would kill it with
SIGPIPE on its next line. The supervisor tails that file into the agent's
log and a bounded ring buffer, the "last output" of a failure.

After an agent restart, L{Supervisor.recover} re-adopts the shards recorded
in the state directory whose processes are still alive (same pid and same
start time in C{/proc/PID/stat}), probes their health, and from then on
detects their exit by polling, since they are no longer its children.
"""

from __future__ import annotations

import collections
import errno
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterable
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
from llmgw.engines import health_url, stop_signal_number

STARTING = "starting"
READY = "ready"
DRAINING = "draining"
STOPPED = "stopped"
FAILED = "failed"
LIVE_STATES = (STARTING, READY, DRAINING)

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

    def start_time(self, pid: int) -> int | None:
        """
        The start time (clock ticks since boot) of live process C{pid}, or
        C{None} if there is none (or only a zombie).
        """
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                data = f.read()
        except OSError:
            return None
        # The command name may hold spaces and parentheses: split after the last ')'.
        fields = data[data.rfind(b")") + 2 :].split()
        if not fields or fields[0] in (b"Z", b"X"):
            return None
        try:
            return int(fields[19])
        except (IndexError, ValueError):
            return None

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
        self.stopping = False
        #: Set when a stop is the supervisor's own doing (a timeout): the
        #: shard ends failed with this error instead of stopped.
        self.stop_error = ""
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
        return self.state in LIVE_STATES

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
        self._listeners: list[Callable[[Shard], None]] = []
        self._loop: LoopingCall | None = None
        #: engines (issue 11): the address the agent advertises; probes and
        #: {host} use it.
        self.probe_host = "127.0.0.1"

    # -- service -----------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._loop = LoopingCall(self.tick)
        self._loop.clock = self.clock
        self._loop.start(self.poll_interval, now=False)

    def stopService(self) -> Any:
        # Shards outlive the agent: stop watching them, never stop them.
        super().stopService()
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        for shard in self.shards.values():
            self._cancel_timers(shard)
            if shard.tail is not None:
                self._tail(shard)

    def add_listener(self, fn: Callable[[Shard], None]) -> None:
        self._listeners.append(fn)

    def live_shards(self) -> list[Shard]:
        """
        The shards in starting, ready or draining, oldest first.
        """
        return [s for s in self.shards.values() if s.live]

    def get(self, shard_id: str) -> Shard | None:
        return self.shards.get(shard_id)

    # -- commands ------------------------------------------------------------

    def start(self, spec: ShardSpec) -> Shard:
        """
        Start a shard, or re-report it if it already runs. A start that
        cannot be honoured is reported as failed with the reason.
        """
        existing = self.shards.get(spec.shard_id)
        if existing is not None and existing.live:
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
        for other in self.live_shards():
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
            "LLMGW_SHARD_ID": spec.shard_id,
            "LLMGW_REPLICA_ID": spec.replica_id,
            "LLMGW_MODEL": spec.model,
        })
        return env

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
        TERM the shard's group, KILL after the grace. It ends C{stopped}, or
        C{failed} with C{error_} when that is set.
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
        self._signal(shard, stop_signal_number(shard.spec.stop_signal))  # engines (issue 11)
        self._set_timer(shard, "kill", grace, self._kill, shard)

    def _kill(self, shard: Shard) -> None:
        shard.timers.pop("kill", None)
        self.log.warn("shard {shard} (pid {pid}) outlived its {grace}s grace; sending KILL",
                      shard=shard.shard_id, pid=shard.pid, grace=shard.spec.stop_grace_s)
        self._signal(shard, signal.SIGKILL)

    def _signal(self, shard: Shard, sig: int) -> None:
        if shard.pid is None:
            return
        if shard.adopted and self.ops.start_time(shard.pid) != shard.start_time:
            # Not ours any more (it ended, and the pid may be someone else's).
            return
        self.ops.kill_group(shard.pid, sig)

    def _ended(self, shard: Shard, exit_code: int, sig: int) -> None:
        if not shard.live:
            return
        self._cancel_timers(shard)
        self._tail(shard)
        if shard.tail is not None:
            shard.tail.flush_partial()
        shard.exit_code, shard.signal = exit_code, sig
        how = (f"killed by signal {sig}" if sig else
               "exit status unknown (not this agent's child)" if exit_code == UNKNOWN_EXIT else
               f"exit code {exit_code}")
        if shard.stopping and not shard.stop_error:
            shard.state = STOPPED
            self.log.info("shard {shard} stopped ({how})", shard=shard.shard_id, how=how)
        else:
            shard.state = FAILED
            if shard.stop_error:
                shard.error = f"{shard.stop_error}; {how}"
            else:
                shard.error = f"exited without being asked to ({how})"
            self.log.error(
                "shard {shard} of replica {replica} failed: {error}; last output:\n{output}",
                shard=shard.shard_id, replica=shard.spec.replica_id, error=shard.error,
                output=shard.last_output(),
            )
        shard.process = None
        if self.state_dir is not None:
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
        Tail every live shard's output and notice re-adopted shards that
        exited.
        """
        for shard in list(self.shards.values()):
            if not shard.live:
                continue
            try:
                self._tail(shard)
                if shard.adopted and shard.pid is not None:
                    if self.ops.start_time(shard.pid) != shard.start_time:
                        self._ended(shard, UNKNOWN_EXIT, 0)
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
        still run; forget the others (their GPUs and ports are free again).
        Fires with the adopted shards once each has had one health probe.
        """
        if self.state_dir is None:
            return defer.succeed([])
        adopted: list[Shard] = []
        probes = []
        for record in self.state_dir.load_all():
            spec = record.spec
            alive = self.ops.start_time(record.pid)
            if alive is None or alive != record.start_time or not valid_shard_id(spec.shard_id):
                self.log.warn(
                    "shard {shard} (pid {pid}) did not survive while the agent was away; "
                    "forgetting it, its GPUs {gpus} and port {port} are free",
                    shard=spec.shard_id, pid=record.pid,
                    gpus=",".join(map(str, spec.gpu_indices)) or "none", port=spec.port,
                )
                self.state_dir.remove(spec.shard_id)
                continue
            state = record.state if record.state in LIVE_STATES else STARTING
            shard = Shard(spec, state)
            shard.adopted = True
            shard.pid, shard.start_time = record.pid, record.start_time
            shard.tail = LogTail(Path(record.log_path), from_end=True)
            self._remember(shard)
            adopted.append(shard)
            self.log.info(
                "re-adopted shard {shard} of replica {replica} (pid {pid}, {state})",
                shard=spec.shard_id, replica=spec.replica_id, pid=record.pid, state=state,
            )
            probes.append(self._first_probe(shard))
        d: defer.Deferred[Any] = defer.gatherResults(probes, consumeErrors=True)
        d.addCallback(lambda _: adopted)
        return d

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
        ended = [k for k, s in self.shards.items() if not s.live]
        for k in ended[: max(0, len(ended) - ENDED_KEPT)]:
            del self.shards[k]

    def _persist(self, shard: Shard) -> None:
        if self.state_dir is None or shard.pid is None or not shard.live:
            return
        try:
            self.state_dir.save(ShardRecord(
                spec=shard.spec, pid=shard.pid, start_time=shard.start_time or 0,
                state=shard.state,
                log_path=str(shard.tail.path) if shard.tail is not None else os.devnull,
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
