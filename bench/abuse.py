"""
llmgw under abuse, with a well-behaved client in the same run: does that
client keep its latency and its answers, and does the process under attack
keep its memory, while an attacker does its worst?

    python bench/abuse.py                                # every scenario, 20 s attacks
    python bench/abuse.py --scenarios pipeline-gateway,ws-flood --attack-s 10

For each scenario, a fresh target (L{bench.abuse_fleet}: C{twistd llmgw
control} with its admin API on mutual TLS and its embedded gateway, a
C{twistd llmgw agent} running two fake model replicas, and for the gateway
scenarios a standalone C{twistd llmgw gateway} following it, which is then
the process under attack). Then three phases, the well-behaved client
(L{bench.abuse_client}, its own process) running throughout:

1. C{alone} (C{--alone-s}): the client by itself; the baseline.
2. C{attack} (C{--attack-s}): the attack (L{bench.abuse_attacks}, its own
   process, dialling from 127.0.0.2) beside the client. It ends early when
   the target's RSS passes its baseline + C{--rss-abort-mib}, to spare the
   machine.
3. C{after} (C{--after-s}): the attack stopped; does memory come back?

Measured: the client's latency per stream (p50, p99, max) and refusals in
each phase; the target's RSS (C{VmRSS}, every 0.1 s) before, at its peak
during and at the end; its open descriptors (every 0.5 s); the reactor's
longest stall, seen from outside as the slowest answer of the requests the
target answers itself (C{GET /v1/models}, and C{GET /api/v1/whoami} on the
admin API), due every 50 ms (20 a second) and 100 ms: a stall of S ms shows
as one of those waiting at least S minus that interval. Then the bars
(L{bench.abuse_summary.judge}). Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from bench.abuse_fleet import API_KEY, MODEL, Fleet, make_certs  # noqa: E402
from bench.abuse_summary import judge, latency_summary, resource_summary  # noqa: E402
from bench.common import machine_busy_seconds, proc_cpu_seconds, raise_nofile  # noqa: E402

#: scenario -> (a standalone gateway is the target, the attack's config
#: from the fleet and the options).
Scenario = tuple[bool, Callable[[Fleet, argparse.Namespace], dict[str, Any]]]

SCENARIOS: dict[str, Scenario] = {
    "pipeline-gateway": (True, lambda f, a: {"kind": "pipeline", "port": f.front_port}),
    "pipeline-embedded": (False, lambda f, a: {"kind": "pipeline", "port": f.gateway_port}),
    "pipeline-admin": (False, lambda f, a: {"kind": "pipeline", "port": f.admin_port,
                                            "tls": f.admin_files()}),
    "slow-bodies": (True, lambda f, a: {"kind": "slow_bodies", "port": f.front_port,
                                        "connections": a.slow_connections, "trickle_s": a.trickle_s}),
    "tls-flood": (False, lambda f, a: {"kind": "tls_flood", "port": f.admin_port,
                                       "connections": a.flood_connections}),
    "big-json": (True, lambda f, a: {"kind": "big_json", "port": f.front_port, "key": API_KEY,
                                     "model": MODEL, "max_body": a.max_body}),
    "ws-flood": (False, lambda f, a: {"kind": "ws_flood", "port": f.admin_port, "tls": f.admin_files(),
                                      "requests": a.ws_requests}),
}


def fd_count(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class Sampler(threading.Thread):
    """
    The target's RSS every 0.1 s and its descriptors every 0.5 s, as
    C{(t, rss_kb, fds)}; sets C{over} once RSS passes C{limit_kb} (when
    set).
    """

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.samples: list[tuple[float, int | None, int | None]] = []
        self.done = threading.Event()
        self.over = threading.Event()
        self.limit_kb: int | None = None

    def run(self) -> None:
        n = 0
        while not self.done.is_set():
            rss = rss_kb(self.pid)
            fds = fd_count(self.pid) if n % 5 == 0 else None
            self.samples.append((time.monotonic(), rss, fds))
            if rss is not None and self.limit_kb is not None and rss > self.limit_kb:
                self.over.set()
            n += 1
            self.done.wait(0.1)


def child(module: str, config: dict[str, Any]) -> subprocess.Popen[str]:
    """
    Start C{bench.MODULE} with C{config}, and wait for its C{ready}.
    """
    p = subprocess.Popen([sys.executable, "-m", module, json.dumps(config)], cwd=ROOT, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    if line.strip() != "ready":
        p.kill()
        p.wait()
        raise RuntimeError(f"{module} did not start: {line!r}")
    return p


def finish(p: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    """
    Tell a child to stop and read its report; kill it if it does not come.
    """
    assert p.stdin is not None and p.stdout is not None
    try:
        p.stdin.write("stop\n")
        p.stdin.flush()
    except BrokenPipeError:
        pass
    result: dict[str, Any] = {}
    reader = threading.Thread(target=lambda: result.update(json.loads(p.stdout.readline() or "{}")))  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout)
    if reader.is_alive() or p.poll() is None:
        try:
            p.wait(2)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return result


def run_scenario(name: str, args: argparse.Namespace, certs: Path, work: Path) -> dict[str, Any]:
    standalone, attack_config = SCENARIOS[name]
    fleet = Fleet(work / name, certs, replicas=2, standalone=standalone)
    client = attacker = None
    sampler: Sampler | None = None
    try:
        started = fleet.start()
        pid = fleet.target_pid
        admin = None if standalone else {**fleet.admin_files(), "port": fleet.admin_port}
        client = child("bench.abuse_client", {
            "gateway_port": fleet.front_port, "key": API_KEY, "model": MODEL, "chat_rate": args.chat_rate,
            "models_rate": 20, "admin": admin, "admin_rate": 10, "timeout": args.request_timeout,
        })
        sampler = Sampler(pid)
        sampler.start()
        t0 = time.monotonic()
        time.sleep(args.alone_s)
        t1 = time.monotonic()
        base = rss_kb(pid) or 0
        sampler.limit_kb = base + args.rss_abort_mib * 1024
        cpu0, busy0 = proc_cpu_seconds(pid), machine_busy_seconds()
        config = attack_config(fleet, args)
        attacker = child("bench.abuse_attacks", {**config, "source": args.source})
        cut_short = sampler.over.wait(args.attack_s)
        t2 = time.monotonic()
        cpu1, busy1 = proc_cpu_seconds(pid), machine_busy_seconds()
        attack_report = finish(attacker, 20)
        attacker = None
        t3 = time.monotonic()
        time.sleep(args.after_s)
        t4 = time.monotonic()
        samples = finish(client, args.request_timeout + 10).get("samples", [])
        client = None
        sampler.done.set()
        sampler.join()
        alive = fleet.procs["gateway" if standalone else "control"].poll() is None
        phases = {
            "alone": latency_summary(samples, t0, t1),
            "attack": latency_summary(samples, t1, t2),
            "after": latency_summary(samples, t3, t4),
        }
        resources = resource_summary(sampler.samples, (t0, t1), (t1, t3), (t3, t4 + 1))
        stall = {
            phase: max((s["max_ms"] for k, s in phases[phase].items() if k in ("models", "admin")),
                       default=None)
            for phase in phases
        }
        return {
            "target": "standalone gateway" if standalone else "control plane (embedded gateway, admin API)",
            "attack_config": {k: v for k, v in config.items() if k not in ("tls", "key")},
            **started,
            "attack_s": round(t2 - t1, 1),
            "attack_cut_short_by_rss": cut_short,
            "target_alive_after": alive,
            "target_cpu_share_during_attack": round((cpu1 - cpu0) / (t2 - t1), 2),
            "machine_busy_cores_during_attack": round((busy1 - busy0) / (t2 - t1), 2),
            "latency": phases,
            **resources,
            "longest_stall_ms_probe": stall,
            "attack": attack_report,
            "bars": judge(phases["attack"], resources),
        }
    finally:
        if sampler is not None:
            sampler.done.set()
        for p in (attacker, client):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        fleet.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, of: " + ", ".join(SCENARIOS))
    ap.add_argument("--alone-s", type=float, default=10.0, help="seconds of the client alone (baseline)")
    ap.add_argument("--attack-s", type=float, default=20.0, help="seconds of attack")
    ap.add_argument("--after-s", type=float, default=10.0, help="seconds after the attack")
    ap.add_argument("--chat-rate", type=float, default=20.0, help="well-behaved chat completions a second")
    ap.add_argument("--request-timeout", type=float, default=10.0, help="a well-behaved request's timeout")
    ap.add_argument("--rss-abort-mib", type=float, default=1536.0,
                    help="end an attack early once the target's RSS is this far above its baseline")
    ap.add_argument("--source", default="127.0.0.2", help="the attacker's source address")
    ap.add_argument("--slow-connections", type=int, default=1000)
    ap.add_argument("--trickle-s", type=float, default=5.0, help="seconds between a slow body's bytes")
    ap.add_argument("--flood-connections", type=int, default=1000,
                    help="half-done TLS handshakes, and as many silent connections")
    ap.add_argument("--max-body", type=int, default=8 * 1024 * 1024, help="the gateway's --max-body")
    ap.add_argument("--ws-requests", type=int, default=20000)
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s): {', '.join(unknown)}")
    raise_nofile()
    work = Path(tempfile.mkdtemp(prefix="llmgw-abuse-"))
    certs = make_certs(work / "certs")
    results: dict[str, Any] = {}
    try:
        for name in names:
            print(f"abuse: {name}", file=sys.stderr, flush=True)
            try:
                results[name] = run_scenario(name, args, certs, work)
            except Exception as e:  # a scenario that cannot run is reported, the others still run
                results[name] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        if args.keep:
            print(f"abuse: work directory kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    out = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "load_before": os.getloadavg()},
        "commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                 capture_output=True, text=True).stdout.strip(),
        "scenarios": results,
        "bars_passed": {n: r.get("bars", {}).get("passed", False) for n, r in results.items()},
    }
    text = json.dumps(out, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
