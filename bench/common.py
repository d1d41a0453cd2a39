"""
Helpers shared by the benchmark's processes: resource limits, CPU pinning,
reading another process's CPU time and RSS from C{/proc}, percentiles, and
the one-JSON-document-per-line control channel between the orchestrator and
its child processes.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import resource
import time
from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.logger import Logger
from twisted.protocols.basic import LineReceiver
from twisted.python.failure import Failure

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def raise_nofile() -> tuple[int, int]:
    """
    Raise this process's soft C{RLIMIT_NOFILE} to its hard limit (the most an
    unprivileged process may) and return the new C{(soft, hard)}.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def pin(cpus: Sequence[int] | None) -> list[int]:
    """
    Pin this process to C{cpus} (no change for C{None} or an empty list);
    returns the CPUs it may now run on.
    """
    if cpus:
        os.sched_setaffinity(0, set(cpus))
    return sorted(os.sched_getaffinity(0))


def proc_cpu_seconds(pid: int) -> float:
    """
    User plus system CPU seconds used so far by process C{pid}.
    """
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    # The command name (field 2) may hold spaces; fields resume after its ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / _CLK_TCK


def machine_busy_seconds() -> float:
    """
    CPU seconds all CPUs of the machine have spent busy (not idle or
    waiting for I/O) since boot, from C{/proc/stat}.
    """
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / _CLK_TCK


def proc_rss_kb(pid: int) -> int:
    """
    Resident set size of process C{pid}, in KiB.
    """
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """
    The C{p}th percentile (0..100) of already sorted values, nearest rank.
    """
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), int(-(-p * len(sorted_values) // 100))))
    return sorted_values[rank - 1]


def summary_ms(values_ns: Sequence[int]) -> dict[str, Any]:
    """
    Count, p50, p90, p99, max and mean of nanosecond durations, in ms.
    """
    v = sorted(values_ns)
    if not v:
        return {"n": 0}
    ms = 1e6
    return {
        "n": len(v),
        "p50_ms": round(percentile(v, 50) / ms, 3),
        "p90_ms": round(percentile(v, 90) / ms, 3),
        "p99_ms": round(percentile(v, 99) / ms, 3),
        "max_ms": round(v[-1] / ms, 3),
        "mean_ms": round(sum(v) / len(v) / ms, 3),
    }


Handler = Callable[[dict[str, Any]], "dict[str, Any] | Deferred[dict[str, Any]]"]


class ControlChannel(LineReceiver):
    """
    The child's end of the orchestrator's channel on stdin/stdout: one JSON
    request a line (C{{"op": NAME, ...}}), one JSON reply a line.
    """

    delimiter = b"\n"
    MAX_LENGTH = 1 << 20
    log = Logger()

    def __init__(
        self, handlers: dict[str, Handler], hello: dict[str, Any], on_close: Callable[[], None]
    ):
        self.handlers = handlers
        self.hello = hello
        self.on_close = on_close

    def connectionMade(self) -> None:
        self.reply(self.hello)

    def reply(self, doc: dict[str, Any]) -> None:
        self.transport.write(json.dumps(doc).encode() + b"\n")

    def lineReceived(self, line: bytes) -> None:
        try:
            req = json.loads(line)
            handler = self.handlers[req["op"]]
        except (ValueError, KeyError) as e:
            self.reply({"error": f"bad request {line[:200]!r}: {e!r}"})
            return

        def failed(f: Failure) -> dict[str, Any]:
            self.log.failure("request {op} failed", f, op=req["op"])
            return {"error": f"{req['op']}: {f.getErrorMessage()}"}

        maybeDeferred(handler, req).addErrback(failed).addCallback(self.reply)

    def connectionLost(self, reason: Failure | None = None) -> None:
        # The orchestrator went away (or closed our stdin): nothing is left
        # to report to, so stop.
        self.on_close()


class Profiler:
    """
    The C{profile} request: C{{"action": "start"}}, then
    C{{"action": "stop", "path": P, "top": N}} dumps cProfile stats to P and
    answers with the top N functions by own time. With C{"clock": "cpu"} at
    the start, times are the process's CPU time, not wall time (which counts
    the waits of a crowded machine as the function's own).
    """

    def __init__(self) -> None:
        self._prof: cProfile.Profile | None = None

    def __call__(self, req: dict[str, Any]) -> dict[str, Any]:
        if req["action"] == "start":
            self._prof = cProfile.Profile(time.process_time) if req.get("clock") == "cpu" else cProfile.Profile()
            self._prof.enable()
            return {"profiling": True}
        prof, self._prof = self._prof, None
        if prof is None:
            return {"profiling": False}
        prof.disable()
        prof.dump_stats(req["path"])
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(int(req.get("top", 25)))
        return {"profiling": False, "path": req["path"], "top": text.getvalue()}
