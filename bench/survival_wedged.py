"""
A wedged replica under an open-loop client (the "wedged" part of the
survival bars): a local fleet (``llmgw local``: control plane, one agent,
the embedded gateway) serving two replicas of the engine simulator
(L{llmgw.testing.hangsim}), a client sending completions at a fixed rate
whatever the answers, one replica wedged with SIGUSR1 (its /health and
/metrics still answer). Printed as JSON:

* ``hang_to_out_s``: the hang to the control plane's C{replica_wedged}
  event, which takes the replica out of the routing table in the same
  decision (wall clock on one machine); bar: ``stall_after_s + 1``;
* ``evidence_flat_s``: the standstill the verdict was judged on;
* ``after_hang``: requests sent from the hang until the replacement is
  ready, by outcome; bar: no errors (none of them had started on the
  wedged replica before it hung).

    python -m bench.survival_wedged [--rate 10] [--stall-after-s 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from llmgw.agent.state import StateDir
from llmgw.testing.ports import free_port, wait_bound

ROOT = Path(__file__).resolve().parent.parent

CATALOG = """
[ports]
first = {first}
last = {last}

[profiles.sim]
gpus_per_shard = 1
gpu_memory_mb = 1000
stall_after_s = {stall}
command = [{python}, "-m", "llmgw.testing.hangsim", "--port", "{{port}}", "--model", "{{model}}",
           "--host", "{{host}}", "--engine-sim", "--step-ms", "20"]
env = {{ PYTHONPATH = {root} }}
metrics_path = "/metrics"
startup_timeout_s = 60
drain_timeout_s = 5
stop_grace_s = 5

[[deployments]]
model = "tiny"
profile = "sim"
replicas = 2
"""


def get(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return json.loads(r.read())


def complete(port: int, max_tokens: int) -> int:
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


def wait(what: str, check: Any, timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
        except OSError:
            value = None
        if value:
            return value
        time.sleep(0.1)
    raise SystemExit(f"timed out waiting for {what}")


def ready(admin: int) -> set[str]:
    return {r["id"] for r in get(admin, "/api/v1/replicas")["replicas"] if r["state"] == "ready"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=10.0, help="requests a second, open loop")
    p.add_argument("--stall-after-s", type=float, default=2.0)
    args = p.parse_args(argv)
    print(json.dumps(measure(args.rate, args.stall_after_s), indent=2))
    return 0


def measure(rate: float = 10.0, stall_after_s: float = 2.0) -> dict[str, Any]:
    """
    One fleet, one replica hung under an open-loop client of C{rate}
    requests a second: how soon it left routing, and what the client saw.
    """
    args = argparse.Namespace(rate=rate, stall_after_s=stall_after_s)
    work = Path(tempfile.mkdtemp(prefix="llmgw-wedged-"))
    first = 21000 + os.getpid() % 500 * 2
    (work / "catalog.toml").write_text(CATALOG.format(
        first=first, last=first + 1, stall=args.stall_after_s,
        python=json.dumps(sys.executable), root=json.dumps(str(ROOT))))
    gw, admin = free_port(), free_port()
    log = open(work / "fleet.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw.ctl.main", "local", "--agents", "1", "--catalog",
         str(work / "catalog.toml"), "--gateway", f"127.0.0.1:{gw}", "--admin", f"127.0.0.1:{admin}"],
        cwd=work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        wait_bound(proc, [admin, gw], lambda: "", 60)
        before = wait("two ready replicas", lambda: (r := ready(admin)) and len(r) == 2 and r)
        pids = {rec.spec.replica_id: rec.pid for d in (work / "local-state").glob("agent-*")
                for rec in StateDir(d).load_all()}
        victim = sorted(before)[0]
        outcomes: list[tuple[float, int]] = []
        lock = threading.Lock()
        stop = threading.Event()

        def one(sent: float) -> None:
            status = complete(gw, 200)
            with lock:
                outcomes.append((sent, status))

        def client() -> None:
            nxt = time.monotonic()
            while not stop.is_set():
                threading.Thread(target=one, args=(time.time(),), daemon=True).start()
                nxt += 1 / args.rate
                time.sleep(max(0.0, nxt - time.monotonic()))

        threading.Thread(target=client, daemon=True).start()
        time.sleep(3)  # warm: requests running on both replicas
        hung_at = time.time()
        os.kill(pids[victim], signal.SIGUSR1)

        def wedged() -> dict[str, Any] | None:
            evs = [e for e in get(admin, "/api/v1/events")["events"] if e["kind"] == "replica_wedged"]
            return evs[0] if evs else None

        event = wait("replica_wedged", wedged)
        wait("a replacement", lambda: (r := ready(admin)) and len(r) == 2 and victim not in r)
        stop.set()
        time.sleep(5)  # the last requests answered
        after = [s for t, s in outcomes if t >= hung_at]
        flat = re.search(r"flat for ([0-9.]+)s", event["reason"])
        out_s = round(event["time"] - hung_at, 3)
        errors = len(after) - after.count(200)
        return {
            "stall_after_s": args.stall_after_s,
            "hang_to_out_s": out_s,
            "bar_s": args.stall_after_s + 1,
            "evidence_flat_s": float(flat.group(1)) if flat else None,
            "after_hang": {"sent": len(after), "ok": after.count(200), "errors": errors},
            "bars": {"out_within_stall_plus_1s": out_s <= args.stall_after_s + 1,
                     "no_errors_for_requests_not_started": errors == 0},
        }
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


if __name__ == "__main__":
    sys.exit(main())
