"""
Benchmark of the agent stream: simulated agents against one control plane,
and the same agents against a bare Twisted TLS server, in one run. Prints
one JSON document.

    python bench/agent_stream.py             # 10,000 agents, a few minutes
    python bench/agent_stream.py --quick     # 500 agents, about half a minute
    python bench/agent_stream.py --agents 2000

See bench/README.md for what each figure means.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    machine_busy_seconds,
    proc_cpu_seconds,
    proc_rss_kb,
    raise_nofile,
    summary_ms,
)
from llmgw.tlsconf.ca import CertificateAuthority  # noqa: E402
from llmgw.tlsconf.options import AGENT_GROUPS, SERVER_GROUPS  # noqa: E402

PREFIX = "sim-"


class ChildError(RuntimeError):
    pass


class Child:
    """
    A child process driven over stdin/stdout with one JSON document a line.
    """

    def __init__(self, name: str, argv: list[str], workdir: Path) -> None:
        self.name = name
        self.stderr_path = workdir / f"{name}.stderr"
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, *argv],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.stderr_path, "wb"),  # noqa: SIM115
        )
        self.pid = self.proc.pid
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.decode())
        self._lines.put(None)

    def send(self, op: str, **kw: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}).encode() + b"\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise ChildError(f"{self.name}: no answer within {timeout}s") from None
        if line is None:
            raise ChildError(f"{self.name} exited ({self.proc.wait()}): {self.stderr_tail()}")
        doc = json.loads(line)
        if "error" in doc:
            raise ChildError(f"{self.name}: {doc['error']}")
        return doc

    def call(self, op: str, wait: float, **kw: Any) -> dict[str, Any]:
        """
        Send one request and wait up to C{wait} seconds for its answer.
        """
        self.send(op, **kw)
        return self.recv(wait)

    def stderr_tail(self) -> str:
        try:
            return self.stderr_path.read_text()[-2000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(3)
            except (subprocess.TimeoutExpired, OSError):
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait()


# -- certificates -------------------------------------------------------------

_ca: CertificateAuthority | None = None


def _load_ca(directory: str) -> None:
    global _ca
    _ca = CertificateAuthority.load(directory)


def _issue(node_ids: list[str]) -> int:
    assert _ca is not None
    for node_id in node_ids:
        _ca.issue_agent(node_id, days=2)
    return len(node_ids)


def make_certs(directory: Path, n: int, workers: int, prefix: str = PREFIX) -> dict[str, Any]:
    t = time.monotonic()
    CertificateAuthority.init(directory, days=2).issue_server(["127.0.0.1"], days=2)
    ca_s = time.monotonic() - t
    ids = [f"{prefix}{i:05d}" for i in range(n)]
    chunks = [ids[i : i + 250] for i in range(0, n, 250)]
    t = time.monotonic()
    with multiprocessing.get_context("fork").Pool(
        workers, initializer=_load_ca, initargs=(str(directory),)
    ) as pool:
        issued = sum(pool.map(_issue, chunks))
    agents_s = time.monotonic() - t
    return {
        "ca_and_server_s": round(ca_s, 3),
        "agent_certs": issued,
        "agent_certs_s": round(agents_s, 2),
        "agent_certs_per_s": round(issued / agents_s, 1),
        "issuing_workers": workers,
    }


# -- one target ---------------------------------------------------------------


def rate_peak(times_ns: list[int], window_ns: int = 1_000_000_000) -> int:
    """
    The most events in any window of C{window_ns}.
    """
    t = sorted(times_ns)
    best, j = 0, 0
    for i in range(len(t)):
        while t[i] - t[j] >= window_ns:
            j += 1
        best = max(best, i - j + 1)
    return best


class Background:
    """
    How much CPU the rest of the machine used over a phase: everything busy
    on the machine minus this benchmark's own processes. The machine may be
    shared; a phase measured while others were busy says so.
    """

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.t = time.monotonic()
        self.busy = machine_busy_seconds()
        self.ours = self._ours()

    def _ours(self) -> float:
        own = os.times()
        return own.user + own.system + sum(proc_cpu_seconds(p) for p in self.pids)

    def cores(self) -> float:
        """
        Other processes' CPU use since construction, in cores.
        """
        wall = time.monotonic() - self.t
        others = (machine_busy_seconds() - self.busy) - (self._ours() - self.ours)
        return round(max(0.0, others) / wall, 3) if wall > 0 else 0.0


def run_target(
    kind: str, args: argparse.Namespace, certs: Path, workdir: Path,
    sims: list[Child], server_cpus: list[int], sim_cpus: list[int],
) -> dict[str, Any]:
    n = args.agents
    argv = ["-m", "bench.target", "--kind", kind, "--certs", str(certs),
            "--log", str(workdir / f"{kind}.log"),
            "--heartbeat-interval", str(args.heartbeat_interval)]
    for c in server_cpus:
        argv += ["--cpu", str(c)]
    server = Child(f"target-{kind}", argv, workdir)
    out: dict[str, Any] = {}
    try:
        hello = server.recv(30)
        out["server"] = {"pid": server.pid, "nofile": hello["nofile"], "cpus": hello["cpus"],
                         "reactor": hello["reactor"]}
        time.sleep(1.0)
        rss_idle = proc_rss_kb(server.pid)

        # Registration storm.
        t0 = time.monotonic_ns() + 300_000_000
        cpu0 = proc_cpu_seconds(server.pid)
        sim_cpu0 = sum(proc_cpu_seconds(s.pid) for s in sims)
        pids = [server.pid] + [s.pid for s in sims]
        bg = Background(pids)
        server.call("gc", 10)
        if args.profile:
            server.call("profile", 10, action="start")
            sims[0].call("profile", 10, action="start")
        for sim in sims:
            sim.send("storm", host="127.0.0.1", port=hello["port"], kind=kind, t0_ns=t0,
                     jitter_s=args.jitter, timeout=args.storm_timeout, cpu=sim_cpus)
        reg = server.call("await", args.storm_timeout + 5, count=n, timeout=args.storm_timeout)
        cpu1 = proc_cpu_seconds(server.pid)
        sim_cpu1 = sum(proc_cpu_seconds(s.pid) for s in sims)
        storm_gc = server.call("gc", 10)
        if args.profile:
            out["storm_profile_top"] = server.call(
                "profile", 60, action="stop", path=str(workdir / f"{kind}-storm.prof"))["top"]
        storm_wall = (reg["t_ns"] - t0) / 1e9 if reg["t_ns"] else float("nan")
        dial, hs, up = [], [], []
        storm_sims: dict[str, Any] = {"reconnects": 0, "lost_reasons": {}, "refusals": {}}
        for sim in sims:
            r = sim.recv(args.storm_timeout + 10)
            if args.profile and sim is sims[0]:
                out["agents_storm_profile_top"] = sim.call(
                    "profile", 60, action="stop", path=str(workdir / f"{kind}-sim-storm.prof")
                )["top"]
            dial += r["dial_ns"]
            hs += r["hs_ns"]
            up += r["up_ns"]
            storm_sims["reconnects"] += r["reconnects"]
            for k in ("lost_reasons", "refusals"):
                for why, c in r[k].items():
                    storm_sims[k][why] = storm_sims[k].get(why, 0) + c
        done_hs = [h for h in hs if h]
        out["storm"] = {
            "agents": n,
            "registered": reg["registered"],
            "timed_out": bool(reg.get("timed_out")),
            "all_registered_s": round(storm_wall, 3),
            "dial_spread_s": args.jitter,
            "handshakes": len(done_hs),
            "handshakes_per_s": round(len(done_hs) / ((max(done_hs) - t0) / 1e9), 1)
            if done_hs else 0,
            "peak_handshakes_per_s_1s": rate_peak(done_hs),
            "handshake": summary_ms([h - d for d, h in zip(dial, hs, strict=True) if h and d]),
            "dial_to_up": summary_ms([u - d for d, u in zip(dial, up, strict=True) if u and d]),
            "server_cpu_s": round(cpu1 - cpu0, 2),
            "agents_cpu_s": round(sim_cpu1 - sim_cpu0, 2),
            "other_processes_cpu_cores": bg.cores(),
            "server_gc": storm_gc,
            **storm_sims,
        }

        # Steady state: every agent heartbeats once per interval.
        time.sleep(args.settle)
        stats0 = [s.call("stats", 30) for s in sims]
        c0, w0 = proc_cpu_seconds(server.pid), time.monotonic()
        bg = Background(pids)
        server.call("gc", 10)
        if args.profile:
            server.call("profile", 10, action="start")
        time.sleep(args.steady_window)
        if args.profile:
            prof = server.call("profile", 60, action="stop",
                               path=str(workdir / f"{kind}-steady.prof"))
            out["steady_profile_top"] = prof["top"]
        c1, w1 = proc_cpu_seconds(server.pid), time.monotonic()
        others = bg.cores()
        steady_gc = server.call("gc", 10)
        stats1 = [s.call("stats", 30) for s in sims]
        rss = proc_rss_kb(server.pid)
        sstats = server.call("stats", 30)
        hb = sum(b["heartbeats_sent"] for b in stats1) - sum(a["heartbeats_sent"] for a in stats0)
        out["steady"] = {
            "window_s": round(w1 - w0, 2),
            "connected": sstats["connected"],
            "heartbeats_per_s": round(hb / (w1 - w0), 1),
            "cpu_share_of_one_core": round((c1 - c0) / (w1 - w0), 4),
            "rss_idle_kb": rss_idle,
            "rss_kb": rss,
            "rss_per_connection_kb": round((rss - rss_idle) / max(1, sstats["connected"]), 2),
            "lost_after_up": sum(b["lost_after_up"] for b in stats1),
            "other_processes_cpu_cores": others,
            "server_gc": steady_gc,
            "server": sstats,
        }

        # Dispatch: one command to each of K idle agents.
        k = min(args.dispatch, n)
        out["dispatch"] = {}
        for mode, interval in (("paced", args.dispatch_interval_ms), ("burst", 0.0)):
            bg = Background(pids)
            sent = server.call("dispatch", 120, count=k, interval_ms=interval)
            time.sleep(1.0)
            lat: list[int] = []
            for sim in sims:
                lat += sim.call("latencies", 30)["latencies_ns"]
            out["dispatch"][mode] = {
                "commands": k,
                "interval_ms": interval,
                "sent": sent["sent"],
                "errors": sent["errors"],
                "send_loop_ms": round(sent["send_loop_ms"], 2),
                "read": len(lat),
                **summary_ms(lat),
                "other_processes_cpu_cores": bg.cores(),
            }
        final = [s.call("stats", 30) for s in sims]
        out["end"] = {
            "connected": server.call("stats", 30)["connected"],
            "lost_after_up": sum(b["lost_after_up"] for b in final),
            "bad_frames": sum(b["bad_frames"] for b in final),
            "stray_commands": sum(b["stray_commands"] for b in final),
        }
        for sim in sims:
            sim.call("disconnect", 60)
    finally:
        server.stop()
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b:
        return None
    return round(a / b, 3)


def compare(res: dict[str, Any]) -> dict[str, Any]:
    c, b = res.get("control"), res.get("bare")
    if not c or not b:
        return {}
    return {
        "storm_all_registered_s": ratio(c["storm"]["all_registered_s"], b["storm"]["all_registered_s"]),
        "storm_handshakes_per_s": ratio(c["storm"]["handshakes_per_s"], b["storm"]["handshakes_per_s"]),
        "storm_server_cpu_s": ratio(c["storm"]["server_cpu_s"], b["storm"]["server_cpu_s"]),
        "steady_cpu_share": ratio(c["steady"]["cpu_share_of_one_core"],
                                  b["steady"]["cpu_share_of_one_core"]),
        "steady_rss_per_connection": ratio(c["steady"]["rss_per_connection_kb"],
                                           b["steady"]["rss_per_connection_kb"]),
        "dispatch_paced_p50": ratio(c["dispatch"]["paced"].get("p50_ms"),
                                    b["dispatch"]["paced"].get("p50_ms")),
        "dispatch_paced_p99": ratio(c["dispatch"]["paced"].get("p99_ms"),
                                    b["dispatch"]["paced"].get("p99_ms")),
        "dispatch_burst_p50": ratio(c["dispatch"]["burst"].get("p50_ms"),
                                    b["dispatch"]["burst"].get("p50_ms")),
        "dispatch_burst_p99": ratio(c["dispatch"]["burst"].get("p99_ms"),
                                    b["dispatch"]["burst"].get("p99_ms")),
    }


def bars(res: dict[str, Any], ratios: dict[str, Any]) -> dict[str, Any]:
    c = res.get("control")
    if not c:
        return {}
    out = {
        "connected_agents": {"want": ">= 10000", "got": c["steady"]["connected"],
                             "ok": c["steady"]["connected"] >= 10000},
        "storm_all_registered_s": {"want": "< 20", "got": c["storm"]["all_registered_s"],
                                   "ok": c["storm"]["registered"] == c["storm"]["agents"]
                                   and c["storm"]["all_registered_s"] < 20},
        "steady_cpu_share_of_one_core": {"want": "< 0.25",
                                         "got": c["steady"]["cpu_share_of_one_core"],
                                         "ok": c["steady"]["cpu_share_of_one_core"] < 0.25},
        "dispatch_p99_ms": {"want": "< 10", "got": c["dispatch"]["paced"].get("p99_ms"),
                            "ok": (c["dispatch"]["paced"].get("p99_ms") or 1e9) < 10},
    }
    if c["storm"]["agents"] < 10000:
        out["connected_agents"]["note"] = "a scaled-down run; the bars are for 10,000 agents"
    r = ratios.get("steady_rss_per_connection")
    if r is not None:
        out["rss_per_connection_vs_bare"] = {"want": "<= 1.5", "got": r, "ok": r <= 1.5}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Agent-stream benchmark; prints one JSON document.")
    p.add_argument("--agents", type=int, default=None, help="simulated agents (default 10000)")
    p.add_argument("--quick", action="store_true",
                   help="500 agents, short windows: a smoke run well under a minute")
    p.add_argument("--jitter", type=float, default=None, help="storm dial spread, s (default 5)")
    p.add_argument("--heartbeat-interval", type=float, default=5.0)
    p.add_argument("--settle", type=float, default=None,
                   help="wait after the storm before the steady window, s (default 5)")
    p.add_argument("--steady-window", type=float, default=None, help="s (default 30)")
    p.add_argument("--dispatch", type=int, default=1000, help="agents sent one command each")
    p.add_argument("--dispatch-interval-ms", type=float, default=2.0,
                   help="spacing of the paced dispatch (the burst sends all in one turn)")
    p.add_argument("--sims", type=int, default=2, help="simulated-agent processes")
    p.add_argument("--pin", action="store_true",
                   help="pin the server to the first CPU and the agents to the others "
                   "(default: the kernel schedules all of them on all CPUs)")
    p.add_argument("--targets", default="bare,control",
                   help="comma-separated, in order: bare, control")
    p.add_argument("--storm-timeout", type=float, default=90.0)
    p.add_argument("--profile", action="store_true",
                   help="cProfile the server during the steady window; top functions in the JSON")
    p.add_argument("--keep", action="store_true", help="keep the work directory (certs, logs)")
    args = p.parse_args(argv)
    if args.quick:
        defaults = {"agents": 500, "jitter": 2.0, "settle": 1.0, "steady_window": 5.0}
    else:
        defaults = {"agents": 10000, "jitter": 5.0, "settle": 5.0, "steady_window": 30.0}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if not set(targets) <= {"bare", "control"}:
        p.error("--targets takes bare and/or control")

    t_start = time.monotonic()
    nofile = raise_nofile()
    if args.agents + 100 > nofile[0]:
        p.error(f"{args.agents} agents need more file descriptors than RLIMIT_NOFILE {nofile}")
    cpus = sorted(os.sched_getaffinity(0))
    pinning = args.pin and len(cpus) >= 2
    server_cpus = cpus[:1] if pinning else []
    sim_cpus = cpus[1:] if pinning else []

    workdir = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
    certs = workdir / "certs"
    children: list[Child] = []
    result: dict[str, Any] = {}
    try:
        setup = make_certs(certs, args.agents, max(1, len(cpus)))
        per = -(-args.agents // args.sims)
        t = time.monotonic()
        for i in range(args.sims):
            first = i * per
            count = min(per, args.agents - first)
            if count <= 0:
                break
            children.append(Child(f"sim{i}", [
                "-m", "bench.simagents", "--certs", str(certs), "--prefix", PREFIX,
                "--first", str(first), "--count", str(count),
                "--heartbeat-interval", str(args.heartbeat_interval)], workdir))
        hellos = [c.recv(600) for c in children]
        setup["sim_load_s"] = round(time.monotonic() - t, 2)
        setup["sim_processes"] = len(children)

        import OpenSSL

        import twisted
        result["config"] = {
            "agents": args.agents,
            "quick": args.quick,
            "dial_jitter_s": args.jitter,
            "heartbeat_interval_s": args.heartbeat_interval,
            "settle_s": args.settle,
            "steady_window_s": args.steady_window,
            "dispatch_commands": min(args.dispatch, args.agents),
            "dispatch_interval_ms": args.dispatch_interval_ms,
            "sim_processes": len(children),
            "cpus": cpus,
            "pinning": {"server": server_cpus, "agents": sim_cpus} if pinning else "none",
            "rlimit_nofile": {"orchestrator": nofile, "server": None,
                              "agents": hellos[0]["nofile"] if hellos else None},
            "reactor": "epoll",
            "python": platform.python_version(),
            "twisted": twisted.__version__,
            "openssl": OpenSSL.SSL.SSLeay_version(OpenSSL.SSL.SSLEAY_VERSION).decode(),
            "tls": "mutual, ECDSA P-256 certificates from llmgw.tlsconf.ca, TLS >= 1.2",
            "key_exchange": {"agents": AGENT_GROUPS, "servers": SERVER_GROUPS},
        }
        result["setup"] = setup
        for kind in targets:
            result[kind] = run_target(kind, args, certs, workdir, children, server_cpus, sim_cpus)
            result["config"]["rlimit_nofile"]["server"] = result[kind]["server"]["nofile"]
        result["ratios_control_to_bare"] = compare(result)
        result["bars"] = bars(result, result["ratios_control_to_bare"])
        result["total_s"] = round(time.monotonic() - t_start, 1)
    except ChildError as e:
        result["error"] = str(e)
        print(json.dumps(result, indent=2))
        return 1
    finally:
        for c in children:
            c.stop()
        if args.keep:
            print(f"work directory kept: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
