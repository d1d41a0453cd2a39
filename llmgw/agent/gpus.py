"""
GPU discovery and health for the agent (DESIGN §7).

Three sources, tried in this order for C{--gpus auto}:

  - NVML through C{nvidia-ml-py} (C{import pynvml}) when the library loads;
    it also reports health problems: critical Xid events, uncorrectable ECC
    errors, and a GPU that fell off the bus;
  - C{nvidia-smi} CSV output, when the program is on the path;
  - nothing, with a log line saying so.

C{--gpus sim:COUNTxSIZE} (C{sim:2x80GiB}) gives simulated GPUs on machines
without any; groups of them may have a model name and differ
(C{sim:2x24GiB:L4,1x80GiB:H100}), which placement matches against
profiles' GPU types (L{llmgw.gputypes}). A L{GPUMonitor} polls the source, keeps memory used per GPU
for every heartbeat and hands out each problem once, as new, for the next
heartbeat.
"""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
import subprocess
import uuid as uuidlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from twisted.application.service import Service
from twisted.internet import defer, utils
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

log = Logger()

#: The columns asked of nvidia-smi, in order.
SMI_QUERY = "index,uuid,name,memory.total,memory.used,ecc.errors.uncorrected.volatile.total"
SMI_ARGS = [f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits"]
SMI_TIMEOUT = 10.0

_SIM_GROUP = re.compile(r"^(\d+)x(\d+)(GiB|MiB|TiB|G|M|T)(?::([A-Za-z0-9][A-Za-z0-9 ._/\-]{0,63}))?$",
                        re.IGNORECASE)
#: Most simulated GPUs one node may have, all groups together.
MAX_SIM_GPUS = 64
_UNIT_MB = {"m": 1, "mib": 1, "g": 1024, "gib": 1024, "t": 1024 * 1024, "tib": 1024 * 1024}


class SmiPollError(RuntimeError):
    """
    An C{nvidia-smi} poll failed as a whole; the GPUs keep their last state.
    """


class GPUSpecError(ValueError):
    """
    A C{--gpus} value is not understood; the message says what is accepted.
    """


@dataclass
class GPU:
    """
    One device as the agent reports it in C{Register}.
    """

    index: int
    uuid: str
    name: str
    memory_total_mb: int
    memory_used_mb: int = 0
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Problem:
    """
    A health problem on one GPU.
    """

    gpu_index: int
    problem: str


@dataclass(frozen=True)
class Sample:
    """
    One poll of a source: memory used per GPU index, and the problems
    observed now (repeats of old ones are fine; the monitor keeps them once).
    """

    memory_used_mb: dict[int, int]
    problems: list[Problem]


@dataclass(frozen=True)
class SimGroup:
    """
    C{count} simulated GPUs of C{size_mb} each, called C{name} ("": the
    default name).
    """

    count: int
    size_mb: int
    name: str = ""


@dataclass(frozen=True)
class GPUSpec:
    """
    A parsed C{--gpus}: C{kind} is C{auto}, C{nvml}, C{nvidia-smi}, C{none} or
    C{sim}; C{count} and C{size_mb} are for C{sim} (the first group's size),
    and C{groups} too where there is more than one group or a name.
    """

    kind: str
    count: int = 0
    size_mb: int = 0
    groups: tuple[SimGroup, ...] = ()

    def sim_groups(self) -> tuple[SimGroup, ...]:
        """
        The simulated GPUs' groups, in index order.
        """
        return self.groups or (SimGroup(self.count, self.size_mb),)


def parse_gpu_spec(spec: str) -> GPUSpec:
    """
    Parse C{--gpus}: C{auto}, C{nvml}, C{nvidia-smi}, C{none}, or
    C{sim:} and comma-separated groups C{COUNTxSIZE[:NAME]}, SIZE like
    C{80GiB}, C{24GiB}, C{512MiB} and NAME a GPU model name such as C{H100}
    (C{sim:2x80GiB}, C{sim:2x24GiB:L4,1x80GiB:H100}).

    @raise GPUSpecError: saying what is accepted.
    """
    text = spec.strip()
    if text.lower() in ("auto", "nvml", "nvidia-smi", "none"):
        return GPUSpec(text.lower())
    usage = ("use auto, nvml, nvidia-smi, none, or sim:COUNTxSIZE[:NAME],... such as "
             "sim:2x80GiB or sim:2x24GiB:L4,1x80GiB:H100")
    if not text.lower().startswith("sim:"):
        raise GPUSpecError(f"--gpus {spec!r} is not understood: {usage}")
    groups: list[SimGroup] = []
    for part in text[4:].split(","):
        m = _SIM_GROUP.fullmatch(part.strip())
        if not m:
            raise GPUSpecError(f"--gpus {spec!r}: {part.strip()!r} is not COUNTxSIZE[:NAME]; {usage}")
        count, size = int(m.group(1)), int(m.group(2)) * _UNIT_MB[m.group(3).lower()]
        if count < 1:
            raise GPUSpecError(f"--gpus {spec!r}: the count must be 1..{MAX_SIM_GPUS}")
        if size <= 0:
            raise GPUSpecError(f"--gpus {spec!r}: the size must be positive")
        groups.append(SimGroup(count, size, (m.group(4) or "").strip()))
    total = sum(g.count for g in groups)
    if total > MAX_SIM_GPUS:
        raise GPUSpecError(f"--gpus {spec!r}: the count must be 1..{MAX_SIM_GPUS} (all groups together)")
    if len(groups) == 1 and not groups[0].name:
        return GPUSpec("sim", total, groups[0].size_mb)
    return GPUSpec("sim", total, groups[0].size_mb, tuple(groups))


class GPUSource:
    """
    Where GPUs come from. L{gpus} is the discovery at start; L{poll} samples.
    """

    kind = "none"
    #: Whether shards on these GPUs are simulated (they just run their argv).
    simulated = False

    def gpus(self) -> list[GPU]:
        return []

    def poll(self) -> defer.Deferred[Sample]:
        return defer.succeed(Sample({}, []))

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return "no GPUs"


class NoGPUs(GPUSource):
    pass


class SimulatedGPUs(GPUSource):
    """
    C{count} GPUs of C{size_mb} each that exist only in reports, or the
    C{groups} given (in index order; a group's name is its GPUs' model
    name). Their uuids are stable for a given C{salt} (the node id).
    """

    kind = "sim"
    simulated = True

    def __init__(self, count: int, size_mb: int, salt: str = "",
                 groups: Sequence[SimGroup] = ()):
        self._gpus: list[GPU] = []
        for group in groups or (SimGroup(count, size_mb),):
            for _ in range(group.count):
                i = len(self._gpus)
                self._gpus.append(GPU(
                    index=i,
                    uuid="GPU-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"llmgw-sim/{salt}/{i}")),
                    name=group.name or f"Simulated GPU ({group.size_mb} MiB)",
                    memory_total_mb=group.size_mb,
                ))

    def gpus(self) -> list[GPU]:
        return [GPU(g.index, g.uuid, g.name, g.memory_total_mb) for g in self._gpus]

    def poll(self) -> defer.Deferred[Sample]:
        return defer.succeed(Sample({g.index: 0 for g in self._gpus}, []))

    def describe(self) -> str:
        kinds = sorted({(g.memory_total_mb, g.name) for g in self._gpus})
        if len(kinds) == 1:
            return f"{len(self._gpus)} simulated GPUs of {self._gpus[0].memory_total_mb} MiB"
        return f"{len(self._gpus)} simulated GPUs: " + ", ".join(
            f"{sum(1 for g in self._gpus if (g.memory_total_mb, g.name) == k)} x {k[1]} ({k[0]} MiB)"
            for k in kinds)


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class NVMLSource(GPUSource):
    """
    GPUs through NVML. C{nvml} is the C{pynvml} module (or a fake with the
    same names); it must already be initialised.
    """

    kind = "nvml"

    def __init__(self, nvml: Any):
        self.nvml = nvml
        self.handles: dict[int, Any] = {}
        self.events: Any = None
        count = nvml.nvmlDeviceGetCount()
        for i in range(count):
            self.handles[i] = nvml.nvmlDeviceGetHandleByIndex(i)
        try:
            self.events = nvml.nvmlEventSetCreate()
            for handle in self.handles.values():
                nvml.nvmlDeviceRegisterEvents(
                    handle, nvml.nvmlEventTypeXidCriticalError, self.events
                )
        except nvml.NVMLError as e:
            # Xid events need a supported driver and device; the rest works without.
            log.warn("NVML cannot deliver Xid events ({error}); watching ECC and lost GPUs only",
                     error=str(e))
        self._lost: set[int] = set()

    def gpus(self) -> list[GPU]:
        out = []
        for i, handle in self.handles.items():
            mem = self.nvml.nvmlDeviceGetMemoryInfo(handle)
            out.append(
                GPU(
                    index=i,
                    uuid=_text(self.nvml.nvmlDeviceGetUUID(handle)),
                    name=_text(self.nvml.nvmlDeviceGetName(handle)),
                    memory_total_mb=int(mem.total) // (1024 * 1024),
                    memory_used_mb=int(mem.used) // (1024 * 1024),
                )
            )
        return out

    def poll(self) -> defer.Deferred[Sample]:
        # NVML calls answer in microseconds; the event wait uses a zero timeout.
        return defer.execute(self.sample)

    def sample(self) -> Sample:
        nvml = self.nvml
        used: dict[int, int] = {}
        problems: list[Problem] = []
        for i, handle in self.handles.items():
            try:
                used[i] = int(nvml.nvmlDeviceGetMemoryInfo(handle).used) // (1024 * 1024)
                try:
                    ecc = nvml.nvmlDeviceGetTotalEccErrors(
                        handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
                    )
                except nvml.NVMLError_NotSupported:
                    ecc = 0
                if ecc:
                    problems.append(Problem(i, "uncorrectable ECC errors"))
            except nvml.NVMLError_GpuIsLost:
                problems.append(Problem(i, "GPU fell off the bus (NVML: GPU is lost)"))
        if self.events is not None:
            problems += self._xid_events()
        return Sample(used, problems)

    def _xid_events(self) -> list[Problem]:
        nvml = self.nvml
        out: list[Problem] = []
        # Bounded: a storm of events is drained a batch per poll.
        for _ in range(64):
            try:
                data = nvml.nvmlEventSetWait_v2(self.events, 0)
            except nvml.NVMLError_Timeout:
                break
            except nvml.NVMLError as e:
                log.warn("reading NVML events failed: {error}", error=str(e))
                break
            try:
                index = int(nvml.nvmlDeviceGetIndex(data.device))
            except nvml.NVMLError:
                index = -1
            out.append(Problem(index, f"critical Xid {int(data.eventData)} error"))
        return out

    def close(self) -> None:
        try:
            if self.events is not None:
                self.nvml.nvmlEventSetFree(self.events)
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass

    def describe(self) -> str:
        return f"{len(self.handles)} GPUs through NVML"


def _int_field(value: str) -> int | None:
    value = value.strip()
    if not value or value.startswith("["):  # [N/A], [Not Supported], [Unknown Error]
        return None
    try:
        return int(float(value))
    except ValueError:
        return None


def parse_smi_csv(text: str) -> tuple[list[GPU], list[str]]:
    """
    Parse C{nvidia-smi --query-gpu=SMI_QUERY --format=csv,noheader,nounits}.

    Returns the GPUs (an uncorrectable ECC count above zero is a problem) and
    the lines that were not GPU rows (nvidia-smi prints "GPU is lost" and
    similar complaints there).
    """
    gpus: list[GPU] = []
    other: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        row = next(csv.reader(io.StringIO(line), skipinitialspace=True))
        index = _int_field(row[0]) if row else None
        if len(row) < 5 or index is None:
            other.append(line.strip())
            continue
        total = _int_field(row[3]) or 0
        used = _int_field(row[4]) or 0
        ecc = _int_field(row[5]) if len(row) > 5 else None
        problems = [f"uncorrectable ECC errors: {ecc}"] if ecc else []
        gpus.append(GPU(index, row[1].strip(), row[2].strip(), total, used, problems))
    return gpus, other


class SmiSource(GPUSource):
    """
    GPUs through the C{nvidia-smi} program. Discovery runs it once at start
    (before the reactor runs); polls run it as a child process of the
    reactor. A GPU that was there at start and is missing from a later poll
    fell off the bus.
    """

    kind = "nvidia-smi"

    def __init__(self, path: str, first_output: str, reactor: Any,
                 run: Callable[[str, Sequence[str]], defer.Deferred[tuple[bytes, bytes, int]]] | None = None):
        self.path = path
        self.reactor = reactor
        self._run = run or self._spawn
        self._gpus, other = parse_smi_csv(first_output)
        if other:
            log.warn("nvidia-smi said: {lines}", lines=" | ".join(other))

    def _spawn(self, path: str, args: Sequence[str]) -> defer.Deferred[tuple[bytes, bytes, int]]:
        d = utils.getProcessOutputAndValue(path, list(args), env=dict(os.environ),
                                           reactor=self.reactor)
        d.addTimeout(SMI_TIMEOUT, self.reactor)
        return d  # type: ignore[no-any-return]

    def gpus(self) -> list[GPU]:
        return [GPU(g.index, g.uuid, g.name, g.memory_total_mb, g.memory_used_mb, list(g.problems))
                for g in self._gpus]

    @defer.inlineCallbacks
    def poll(self) -> Any:
        out, err, code = yield self._run(self.path, SMI_ARGS)
        text = out.decode("utf-8", "replace")
        gpus, other = parse_smi_csv(text)
        problems = [Problem(g.index, p) for g in gpus for p in g.problems]
        seen = {g.index for g in gpus}
        complaint = "; ".join(other + [err.decode("utf-8", "replace").strip()]).strip("; ")
        if code != 0 and not gpus:
            # nvidia-smi itself failed (driver busy, killed): that says
            # nothing about any one GPU, and problems are never cleared.
            raise SmiPollError(f"nvidia-smi exited with {code} and listed no GPU: {complaint[:200]}")
        for g in self._gpus:
            if g.index not in seen:
                problems.append(Problem(
                    g.index,
                    "GPU fell off the bus (missing from nvidia-smi"
                    + (f": {complaint[:200]}" if complaint else "") + ")",
                ))
        return Sample({g.index: g.memory_used_mb for g in gpus}, problems)

    def describe(self) -> str:
        return f"{len(self._gpus)} GPUs through nvidia-smi"


def load_nvml() -> Any:
    """
    Import and initialise C{pynvml}; raises whatever stops it.
    """
    import pynvml

    pynvml.nvmlInit()
    return pynvml


def run_smi_once(path: str) -> str:
    """
    Run nvidia-smi synchronously (start-up only) and return its output.

    @raise OSError: it could not run or failed.
    """
    proc = subprocess.run([path, *SMI_ARGS], capture_output=True, timeout=SMI_TIMEOUT, text=True)
    if proc.returncode != 0:
        raise OSError(f"{path} exited with {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def discover(
    spec: GPUSpec,
    reactor: Any,
    salt: str = "",
    nvml_loader: Callable[[], Any] = load_nvml,
    smi_path: str | None | Callable[[], str | None] = lambda: shutil.which("nvidia-smi"),
    smi_once: Callable[[str], str] = run_smi_once,
) -> GPUSource:
    """
    The GPU source for C{spec}. C{auto} tries NVML, then nvidia-smi, then
    settles for none, logging what it found and why the others failed.

    @raise GPUSpecError: an explicitly asked source (C{nvml},
        C{nvidia-smi}) is not available.
    """
    if spec.kind == "sim":
        return SimulatedGPUs(spec.count, spec.size_mb, salt, spec.groups)
    if spec.kind == "none":
        return NoGPUs()
    why: list[str] = []
    if spec.kind in ("auto", "nvml"):
        try:
            return NVMLSource(nvml_loader())
        except Exception as e:  # ImportError, NVMLError_LibraryNotFound, driver errors
            why.append(f"NVML: {type(e).__name__}: {e}")
            if spec.kind == "nvml":
                raise GPUSpecError(f"--gpus nvml: NVML is not available ({why[-1]})") from e
    path = smi_path() if callable(smi_path) else smi_path
    if path:
        try:
            return SmiSource(path, smi_once(path), reactor)
        except (OSError, subprocess.SubprocessError) as e:
            why.append(f"nvidia-smi: {e}")
    else:
        why.append("nvidia-smi: not on PATH")
    if spec.kind == "nvidia-smi":
        raise GPUSpecError(f"--gpus nvidia-smi: {why[-1]}")
    log.warn(
        "no GPUs found ({why}); this node offers none. Use --gpus sim:COUNTxSIZE for "
        "simulated GPUs",
        why="; ".join(why),
    )
    return NoGPUs()


class GPUMonitor(Service):
    """
    Polls a L{GPUSource} every C{interval} seconds and keeps what heartbeats
    and registers need: the GPU list with memory used and problems, and the
    problems not yet reported.
    """

    log = Logger()

    def __init__(self, source: GPUSource, clock: Any, interval: float = 5.0):
        self.source = source
        self.clock = clock
        self.interval = interval
        self._gpus = {g.index: g for g in source.gpus()}
        self._seen: set[tuple[int, str]] = {
            (g.index, p) for g in self._gpus.values() for p in g.problems
        }
        self._new: list[Problem] = [
            Problem(g.index, p) for g in self._gpus.values() for p in g.problems
        ]
        self._loop: LoopingCall | None = None
        self._polling = False

    def startService(self) -> None:
        super().startService()
        self._loop = LoopingCall(self.refresh)
        self._loop.clock = self.clock
        self._loop.start(self.interval, now=False)

    def stopService(self) -> Any:
        super().stopService()
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self.source.close()

    def gpus(self) -> list[GPU]:
        """
        The GPUs, in index order, with the latest memory used and every
        problem seen.
        """
        return [self._gpus[i] for i in sorted(self._gpus)]

    def memory_used(self) -> list[int]:
        """
        Memory used per GPU in MiB, indexed like L{gpus}.
        """
        return [g.memory_used_mb for g in self.gpus()]

    def take_new_problems(self) -> list[Problem]:
        """
        The problems seen since the last call, each once.
        """
        new, self._new = self._new, []
        return new

    def forget_new_problems(self) -> None:
        """
        A Register (which carries every problem) went out: nothing is new.
        """
        self._new = []

    def refresh(self) -> defer.Deferred[Any]:
        """
        Poll the source once. A failed poll is logged; the loop goes on. A
        poll still running when the next is due is not overlapped.
        """
        if self._polling:
            return defer.succeed(None)
        self._polling = True
        d: defer.Deferred[Any] = defer.maybeDeferred(self.source.poll)
        d.addCallback(self.apply)
        d.addErrback(lambda f: self.log.failure("polling {source} failed", f,
                                                source=self.source.describe()))

        def done(_: Any) -> None:
            self._polling = False

        d.addBoth(done)
        return d

    def apply(self, sample: Sample) -> None:
        """
        Fold a sample in: memory used, and problems new since any before.
        """
        for index, used in sample.memory_used_mb.items():
            if index in self._gpus:
                self._gpus[index].memory_used_mb = used
        for p in sample.problems:
            key = (p.gpu_index, p.problem)
            if key in self._seen:
                continue
            self._seen.add(key)
            self._new.append(p)
            if p.gpu_index in self._gpus:
                self._gpus[p.gpu_index].problems.append(p.problem)
            self.log.warn("GPU {gpu} has a health problem: {problem}",
                          gpu=p.gpu_index if p.gpu_index >= 0 else "?", problem=p.problem)
