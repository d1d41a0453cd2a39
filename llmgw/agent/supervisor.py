"""
The shard supervisor: runs each shard as a child process and reports its
state transitions (DESIGN §7, §15).

A shard's life::

    start -> fetching --(its weights are on the node)--> starting
    fetching --(the fetch failed)--> failed (disk_full, checksum, not_found, denied, fetch, config)
    fetching --(stop or drain)--> stopped
    start -> starting --(health GET answers 200)--> ready
    starting --(startup timeout)--> stopping --> failed
    ready --(3 failed probes in a row)--> stopping --> failed
    ready|starting --(drain)--> draining --(drain timeout or stop)--> stopping --> stopped
    any --(stop)--> stopping --> stopped
    any --(main process exits unasked)--> stopping --> failed (exit code or signal,
                                          crash class, last output)

A shard is its whole process group. It enters "stopping" when it is told to
stop or when its main process ends, asked or not, and leaves it (to stopped
or failed) only once the group is empty: only then are its GPUs and port
free for another shard.

The L{Supervisor} orchestrates; each concern is a collaborator or plain
functions beside it, testable alone:

  - L{llmgw.agent.launch}: whether a start may go ahead, and the command
    line and environment a shard is started with;
  - L{llmgw.agent.weights}: a shard's weights from the node's model cache
    before it starts (the C{fetching} state), and its pin there;
  - L{llmgw.agent.health}: health probes, readiness, the startup timeout;
  - L{llmgw.agent.stopping}: TERM, KILL after the grace, watching the group
    empty, and how a shard ended;
  - L{llmgw.agent.adoption}: taking over the shards already running after an
    agent restart (L{Supervisor.recover}), and strays;
  - L{llmgw.agent.records}: the shard's record and log in the state
    directory;
  - L{llmgw.agent.processes}, L{llmgw.agent.logtail},
    L{llmgw.agent.probe}: the operating system, a shard's log file, and
    the HTTP health probe.
"""

from __future__ import annotations

import collections
import os
import signal
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from llmgw.agent import adoption, launch
from llmgw.agent.adoption import Stray
from llmgw.agent.health import HealthWatch
from llmgw.agent.logtail import LogTail
from llmgw.agent.processes import SHARD_MARKER, MarkedProcess, ProcessOps
from llmgw.agent.records import Records
from llmgw.agent.shard import (
    DRAINING,
    FAILED,
    FETCHING,
    LIVE_STATES,
    STARTING,
    STOPPED,
    STOPPING,
    UNKNOWN_EXIT,
    Shard,
    ShardTimers,
)
from llmgw.agent.state import ShardSpec, StateDir, valid_shard_id
from llmgw.agent.stopping import Stopper, final_state, main_exit
from llmgw.agent.weights import WeightFetcher
from llmgw.crash import CrashClass
from llmgw.engines import stop_signal_number
from llmgw.models.cache import ModelCache

__all__ = ["FAILED", "STOPPED", "STOPPING", "Shard", "Stray", "Supervisor"]

#: Ended shards remembered (for re-reports), oldest forgotten first.
ENDED_KEPT = 256

Spawner = Callable[..., Any]


def _gpus(shard: Shard) -> str:
    return ",".join(map(str, shard.spec.gpu_indices)) or "none"


class Supervisor(Service):
    """
    Runs shards, keeps their records in a L{StateDir}, and tells its
    listeners (L{add_listener}) about every transition.

    @param spawn: C{reactor.spawnProcess} or a fake with its signature.
    @param gpu_indices: the node's GPU indices, or C{None} not to check.
    @param prober: health probes (L{llmgw.agent.probe.HttpProber}), or
        C{None}: then no shard ever becomes ready.
    @param base_env: the agent's variables a shard inherits; by default its
        C{PATH}, C{HOME} and C{LANG}.
    @param cache: the node's model cache, where shards with an C{hf://} or
        C{https://} source get their weights; C{None}: such shards are refused.
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
        cache: ModelCache | None = None,
    ):
        self.clock = clock
        self.spawn = spawn
        self.state_dir = state_dir
        self.records = Records(state_dir)
        self.gpu_indices = None if gpu_indices is None else set(gpu_indices)
        self.ops = ops or ProcessOps()
        self.python = python
        self.poll_interval = poll_interval
        if base_env is None:
            base_env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
        self.base_env = base_env
        self.shards: collections.OrderedDict[str, Shard] = collections.OrderedDict()
        #: Processes carrying this agent's marker that no shard accounts for.
        self.strays: list[Stray] = []
        #: Whether a held shard's GPUs may go to a new shard as well: its
        #: engine sleeps (L{llmgw.agent.sleep.Sleeper.lends}).
        self.lends: Callable[[Shard], bool] = lambda shard: False
        #: Asked of a start that passed its checks (L{llmgw.agent.sleep.Sleeper.confirm}).
        self.confirm: Callable[[ShardSpec, list[Shard]], bool] = lambda spec, held: False
        self._listeners: list[Callable[[Shard], None]] = []
        self._loop: LoopingCall | None = None
        #: Set by L{stopService}: shards that end after it are not watched.
        self.detached = False
        #: The address the agent advertises: health probes go there, and a
        #: command's {host} is filled with it.
        self.probe_host = "127.0.0.1"
        self.timers = ShardTimers(clock)
        self.health = HealthWatch(
            clock, prober, lambda: self.probe_host, changed=self._changed,
            unhealthy=self._terminate, interval_starting=probe_interval_starting,
            interval_ready=probe_interval_ready, unhealthy_after=unhealthy_after,
        )
        self.stopper = Stopper(clock, self.ops, emptied=self._finish,
                               poll_interval=poll_interval)
        self.weights = WeightFetcher(cache, self._fetched, self._fetch_failed)

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
            self.timers.cancel_all(shard)
            if shard.state == FETCHING:
                # Its fetch stops with the agent, what it got kept for the
                # next start; the control plane starts the shard again.
                self.weights.cancel(shard)
            if shard.tail is not None:
                self._tail(shard)
            if shard.state == STOPPING and shard.main_ended and not self.stopper.empty(shard):
                self.log.warn("the agent is stopping: KILLing what is left of shard {shard}'s "
                              "process group", shard=shard.shard_id)
                self.stopper.signal(shard, signal.SIGKILL)

    def add_listener(self, fn: Callable[[Shard], None]) -> None:
        """
        Call C{fn} with the shard at each of its transitions (and at each
        re-report); an exception it raises is logged.
        """
        self._listeners.append(fn)

    def live_shards(self) -> list[Shard]:
        """
        The shards in starting, ready or draining, oldest first.
        """
        return [s for s in self.shards.values() if s.live]

    def held_shards(self) -> list[Shard]:
        """
        The shards whose process groups may still have members (live or
        stopping) or that are fetching their weights, oldest first: what
        C{Register} lists, and what holds GPUs and ports.
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

    def fetch_progress(self) -> list[tuple[str, int, int, float]]:
        """
        (shard id, bytes done, total or 0 when unknown, bytes a second) of
        each shard fetching its weights, for heartbeats.
        """
        return self.weights.progress(list(self.shards.values()))

    @property
    def marker(self) -> str:
        """
        This agent's mark in its shards' environments: its state directory.
        """
        return self.records.marker

    def environment(self, spec: ShardSpec) -> dict[str, str]:
        """
        The shard's whole environment: a few of the agent's variables, the
        command's env, and ours, which win.
        """
        return launch.environment(spec, self.base_env, self.marker)

    # -- commands ------------------------------------------------------------

    def start(self, spec: ShardSpec, confirmed: bool = False) -> Shard | None:
        """
        Start a shard, or re-report it if it already runs. A start that
        cannot be honoured is reported as failed with the reason; C{None}
        while L{confirm} has it.
        """
        existing = self.shards.get(spec.shard_id)
        if existing is not None and existing.held:
            self.log.info("shard {shard} is already {state} (pid {pid}); starting nothing new",
                          shard=spec.shard_id, state=existing.state, pid=existing.pid)
            self._report(existing)
            return existing
        problem = launch.refusal(spec, self.gpu_indices, self.held_shards(),
                                 self.ops.port_in_use, self.lends)
        crash_class = launch.refusal_class(problem) if problem is not None else CrashClass.CONFIG
        if problem is None:
            problem = launch.weights_refusal(spec, self.environment(spec), self.python)
        if problem is None and launch.needs_fetch(spec):
            problem = self.weights.refusal()
        if problem is not None:
            return self.refuse(spec, problem, crash_class)
        if not confirmed and self.confirm(spec, self.held_shards()):
            return None
        if launch.needs_fetch(spec):
            # No process and no record yet: it holds its GPUs and port, and
            # its startup timeout starts once its weights are here.
            shard = Shard(spec, FETCHING)
            self._remember(shard)
            self.log.info("shard {shard} of replica {replica} ({model}) is fetching its weights "
                          "from {source}", shard=spec.shard_id, replica=spec.replica_id,
                          model=spec.model, source=spec.source.uri if spec.source else "")
            self._changed(shard)
            self.weights.start(shard)
            return shard
        shard = Shard(spec)
        self._remember(shard)
        return self._launch(shard, launch.local_weights(spec))

    def refuse(self, spec: ShardSpec, problem: str, crash_class: CrashClass = CrashClass.UNKNOWN) -> Shard:
        """Report C{spec}'s start refused: failed, for C{problem}."""
        shard = Shard(spec, FAILED)
        shard.error, shard.crash_class = problem, crash_class.value
        self.log.error("refusing to start shard {shard}: {error}", shard=spec.shard_id, error=problem)
        self._report(shard)
        return shard

    def _launch(self, shard: Shard, weights: str) -> Shard:
        """
        Spawn C{shard} (starting) with its weights at C{weights}, and watch
        it start.
        """
        spec = shard.spec
        try:
            self._spawn(shard, weights)
        except Exception as e:
            shard.state, shard.error = FAILED, f"could not start the process: {e}"
            self.log.failure("could not spawn shard {shard}", shard=spec.shard_id)
            self.weights.release(shard)
            self.records.remove(spec.shard_id)
            self._report(shard)
            return shard
        self.log.info(
            "shard {shard} of replica {replica} ({model}) started as pid {pid} on GPUs "
            "{gpus}, port {port}",
            shard=spec.shard_id, replica=spec.replica_id, model=spec.model, pid=shard.pid,
            gpus=_gpus(shard), port=spec.port,
        )
        self.health.watch_start(shard)
        self._changed(shard)
        return shard

    def _fetched(self, shard: Shard, weights: Path) -> None:
        if shard.state != FETCHING or self.detached:
            return
        self.log.info("shard {shard}'s weights are on this node at {path}", shard=shard.shard_id,
                      path=str(weights))
        shard.state, shard.progress = STARTING, None
        self._launch(shard, str(weights))

    def _fetch_failed(self, shard: Shard, error_: str, crash_class: str) -> None:
        if shard.state != FETCHING or self.detached:
            return
        self.weights.release(shard)
        self.records.remove(shard.shard_id)
        shard.state, shard.error, shard.crash_class = FAILED, error_, crash_class
        self.log.error("shard {shard} of replica {replica} failed ({crash_class}): {error}",
                       shard=shard.shard_id, replica=shard.spec.replica_id,
                       crash_class=crash_class, error=error_)
        self._report(shard)

    def _stop_fetching(self, shard: Shard) -> None:
        """
        A stop or drain of a shard still fetching: it gives up its interest
        in the fetch (which goes on if another shard waits on it) and is
        stopped at once; it never had a process.
        """
        self.weights.cancel(shard)
        self.records.remove(shard.shard_id)
        shard.state = STOPPED
        self.log.info("shard {shard} is stopped while fetching its weights; GPUs {gpus} and port "
                      "{port} are free", shard=shard.shard_id, gpus=_gpus(shard),
                      port=shard.spec.port)
        self._report(shard)

    def stop(self, shard_id: str) -> None:
        """
        Stop a shard: TERM to its group now, KILL after its grace; one
        fetching its weights is stopped at once.
        """
        shard = self.shards.get(shard_id)
        if shard is not None and shard.state == FETCHING:
            self._stop_fetching(shard)
            return
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
        stop comes first. One fetching its weights serves nothing yet: it
        is stopped at once.
        """
        shard = self.shards.get(shard_id)
        if shard is not None and shard.state == FETCHING:
            self._stop_fetching(shard)
            return
        if shard is None or not shard.live:
            self.log.info("drain for shard {shard}: it is not running", shard=shard_id)
            if shard is not None:
                self._report(shard)
            return
        if shard.state == DRAINING or shard.stopping:
            self._report(shard)
            return
        self.health.cancel_startup(shard)
        shard.state = DRAINING
        self._watch_drain(shard)
        self.log.info("shard {shard} is draining; it stops in {timeout}s at the latest",
                      shard=shard_id, timeout=shard.spec.drain_timeout_s)
        self._changed(shard)

    def _spawn(self, shard: Shard, weights: str) -> None:
        spec = shard.spec
        # A new run of this shard starts a new log.
        log_path = self.records.new_log(spec.shard_id)
        if log_path is not None:
            shard.tail = LogTail(log_path)
        argv = launch.fill_argv(spec, self.python, self.probe_host, weights) + self.weights.adapters.args(spec)
        args = launch.launcher_args(self.python, log_path or Path(os.devnull), argv)
        proto = launch.ShardProcess(shard, self._process_ended)
        shard.process = self.spawn(proto, self.python, args, env=self.environment(spec), path=None)
        shard.pid = shard.process.pid
        shard.start_time = self.ops.start_time(shard.pid) if shard.pid else None
        if shard.pid:
            # The launcher's setsid makes the pid its group's id.
            shard.pgids = {shard.pid}

    # -- transitions ----------------------------------------------------------

    def _watch_drain(self, shard: Shard) -> None:
        self.timers.set(shard, "drain", shard.spec.drain_timeout_s, self._drain_expired, shard)

    def _drain_expired(self, shard: Shard) -> None:
        self.timers.fired(shard, "drain")
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
        self._quiet(shard)
        self.log.info(
            "stopping shard {shard} (pid {pid}): TERM now, KILL in {grace}s{why}",
            shard=shard.shard_id, pid=shard.pid, grace=shard.spec.stop_grace_s,
            why=f" ({error_})" if error_ else "",
        )
        shard.state = STOPPING
        self.stopper.escalate(shard, stop_signal_number(shard.spec.stop_signal))
        self._changed(shard)

    def _quiet(self, shard: Shard) -> None:
        # A stopping shard has no startup or drain timeout and is not probed.
        self.health.forget(shard)
        self.timers.cancel(shard, "drain")

    def _process_ended(self, shard: Shard, exit_code: int, sig: int) -> None:
        if not self.detached:  # else the agent has stopped watching its shards
            self._ended(shard, exit_code, sig)

    def _ended(self, shard: Shard, exit_code: int, sig: int) -> None:
        """
        The main process ended. The shard is stopping until its group is
        empty; its group gets TERM now (unless a stop already sent it) and
        KILL after the grace.
        """
        if not shard.held or shard.main_ended:
            return
        shard.main_ended = True
        self._quiet(shard)
        self._tail(shard)
        if shard.tail is not None:
            shard.tail.flush_partial()
        shard.process = None
        how = main_exit(shard, exit_code, sig)
        if shard.final_state == STOPPED:
            self.log.info("shard {shard}'s main process ended ({how})", shard=shard.shard_id,
                          how=how)
        else:
            self.log.error(
                "shard {shard} of replica {replica} failed ({crash_class}): {error}; "
                "last output:\n{output}",
                shard=shard.shard_id, replica=shard.spec.replica_id, error=shard.error,
                crash_class=shard.crash_class, output=shard.last_output(),
            )
        if self.stopper.empty(shard):
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
            self.stopper.escalate(shard, signal.SIGTERM)
        else:
            if not shard.term_sent:
                # A stop that could not signal a re-adopted shard whose main
                # had just ended: its group gets the TERM now.
                self.stopper.signal(shard, signal.SIGTERM)
            self.stopper.watch(shard)
        shard.state = STOPPING
        self.records.save(shard)
        if news:
            self._report(shard)

    def _finish(self, shard: Shard) -> None:
        """
        The group is empty: the shard has ended, its GPUs and port are free.
        """
        self.timers.cancel_all(shard)
        shard.state, shard.error = final_state(shard)
        shard.process = None
        self.weights.release(shard)
        self.log.info("shard {shard} is {state}: its process group is empty, GPUs {gpus} and "
                      "port {port} are free", shard=shard.shard_id, state=shard.state,
                      gpus=_gpus(shard), port=shard.spec.port)
        if not shard.record_lost:
            self.records.remove(shard.shard_id)
        self._report(shard)

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
                elif shard.record_lost and shard.live and self.stopper.empty(shard):
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
        by_shard = adoption.by_shard(marked)
        adopted: list[Shard] = []
        probes = []
        for record in self.records.load_all():
            spec = record.spec
            if record.state == FETCHING:
                resumed = self._resume_fetch(record.spec)
                if resumed is not None:
                    adopted.append(resumed)
                continue
            procs = by_shard.pop(spec.shard_id, []) if valid_shard_id(spec.shard_id) else []
            start_time = self.ops.start_time(record.pid)
            shard = adoption.adopt(record, procs, start_time)
            if shard is None:
                self.log.warn(
                    "shard {shard} (pid {pid}) did not survive while the agent was away; "
                    "forgetting it, its GPUs {gpus} and port {port} are free",
                    shard=spec.shard_id, pid=record.pid,
                    gpus=",".join(map(str, spec.gpu_indices)) or "none", port=spec.port,
                )
                self.records.remove(spec.shard_id)
                continue
            shard.tail = LogTail(Path(record.log_path), from_end=True)
            outside = adoption.outside_group(record, procs)
            if outside:
                self.log.warn("shard {shard} has processes outside its process group (pids "
                              "{pids}); they are stopped with it", shard=spec.shard_id,
                              pids=",".join(map(str, outside)))
            self._remember(shard)
            adopted.append(shard)
            # Before any fetch: its model stays in the cache while it runs.
            self.weights.pin(shard)
            if shard.state in LIVE_STATES:
                self.log.info(
                    "re-adopted shard {shard} of replica {replica} (pid {pid}, {state})",
                    shard=spec.shard_id, replica=spec.replica_id, pid=record.pid,
                    state=shard.state,
                )
                if shard.state == DRAINING:
                    self._watch_drain(shard)
                probes.append(self.health.first_probe(shard))
                continue
            self._resume_stop(shard, adoption.main_alive(record, start_time))
        self._found_unrecorded(by_shard)
        d: defer.Deferred[Any] = defer.gatherResults(probes, consumeErrors=True)
        d.addCallback(lambda _: adopted)
        return d

    def _resume_fetch(self, spec: ShardSpec) -> Shard | None:
        """
        A shard that was fetching when the agent stopped fetches on (its
        model's cache entry resumes from what it had); without a cache, or
        with an unusable id, it is forgotten.
        """
        if not valid_shard_id(spec.shard_id) or not launch.needs_fetch(spec) \
                or self.weights.refusal() is not None:
            self.records.remove(spec.shard_id)
            return None
        # Not "adopted": the process it starts once fetched is this agent's child.
        shard = Shard(spec, FETCHING)
        self._remember(shard)
        self.log.info("shard {shard} of replica {replica} was fetching its weights when the agent "
                      "stopped: fetching on", shard=spec.shard_id, replica=spec.replica_id)
        self.weights.start(shard)
        return shard

    def _resume_stop(self, shard: Shard, main_alive: bool) -> None:
        """
        Go on stopping a re-adopted shard that was stopping, or whose main
        process ended while the agent was away: TERM its group again, KILL
        after the grace, and report it once its group is empty.
        """
        self.log.warn(
            "re-adopted shard {shard} of replica {replica} is stopping (main process {main}); "
            "TERM to its process groups {groups}, KILL in {grace}s",
            shard=shard.shard_id, replica=shard.spec.replica_id,
            main="alive" if main_alive else "gone",
            groups=",".join(map(str, sorted(shard.pgids))), grace=shard.spec.stop_grace_s,
        )
        self.stopper.escalate(shard, signal.SIGTERM)
        self.records.save(shard)

    def _found_unrecorded(self, by_shard: dict[str, list[MarkedProcess]]) -> None:
        """
        Processes with this agent's marker that no record accounts for: a
        shard whose record was lost is remembered (and reported, profile
        unknown, so the control plane stops it); the rest are strays.
        """
        for shard_id, procs in sorted(by_shard.items()):
            pids = ",".join(str(p.pid) for p in procs)
            if not valid_shard_id(shard_id):
                self.strays.extend(adoption.strays(shard_id, procs))
                self.log.critical(
                    "UNACCOUNTED PROCESSES {pids} carry this agent's marker but name no usable "
                    "shard ({var}={shard!r}); they are left running, and listed in Register",
                    pids=pids, var=SHARD_MARKER, shard=shard_id,
                )
                continue
            shard = adoption.lost_record(shard_id, procs)
            log_path = self.records.existing_log(shard_id)
            if log_path is not None:
                shard.tail = LogTail(log_path, from_end=True)
            self._remember(shard)
            spec = shard.spec
            self.log.critical(
                "FOUND SHARD {shard} RUNNING WITHOUT A RECORD (pids {pids}, process groups "
                "{groups}; replica {replica}, model {model}, profile {profile}, GPUs {gpus}, "
                "port {port}): its record was lost; it is reported to the control plane, "
                "which should stop it",
                shard=shard_id, pids=pids, groups=",".join(map(str, sorted(shard.pgids))),
                replica=spec.replica_id or "unknown", model=spec.model or "unknown",
                profile=adoption.group_leader(procs).env.get("LLMGW_PROFILE", "") or "unknown",
                gpus=_gpus(shard), port=spec.port,
            )

    # -- bookkeeping -----------------------------------------------------------------

    def _remember(self, shard: Shard) -> None:
        self.shards.pop(shard.shard_id, None)
        self.shards[shard.shard_id] = shard
        ended = [k for k, s in self.shards.items() if not s.held]
        for k in ended[: max(0, len(ended) - ENDED_KEPT)]:
            del self.shards[k]

    def _changed(self, shard: Shard) -> None:
        self.records.save(shard)
        self._report(shard)

    def _report(self, shard: Shard) -> None:
        for fn in list(self._listeners):
            try:
                fn(shard)
            except Exception:
                self.log.failure("reporting shard {shard} failed", shard=shard.shard_id)
