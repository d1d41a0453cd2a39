"""
Requests that outlive their replica: a real local fleet under an open-loop
client while replicas go away, one section per way they go.

    python bench/survival.py                          # every section
    python bench/survival.py --sections rollout --rollout-start-delay 5

Sections (C{--sections a,b}; each a function in L{SECTIONS}, sharing the
fleet and client helpers below):

* C{rollout}: C{--rollout-replicas} replicas of the fake model server (each
  C{--rollout-start-delay} seconds from launch to a healthy C{/health}) on
  as many agents of one simulated GPU each, a full fleet; an open-loop
  client at C{--rate} requests a second, half streamed; the catalog's
  profile is changed and reloaded, and the rollout replaces every replica
  one at a time (no spare GPU: drain one, start its replacement on the GPU
  it freed). Bars: zero non-2xx answers, zero broken streams, and the p99
  of the gateway's admission-queue wait at most one replica's start time.

* C{wedged}: two replicas of the engine simulator, one hung ("health ok,
  generation hangs") under an open-loop client at 10 requests a second,
  C{stall_after_s = 2}. Bars: out of routing within C{stall_after_s} + 1 s,
  and no error for a request that had not started (L{bench.survival_wedged}).

Streams broken by kills have their own script, L{bench.survival_kill}.

The fleet is one C{llmgw local} process (control plane, gateway and agents)
with a shard process per replica, on loopback ports picked free; it and
every shard are killed at the end of each section.

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from bench.common import summary_ms  # noqa: E402
from llmgw.local import demo_catalog  # noqa: E402
from llmgw.testing.openloop import Answer, OpenLoopClient, tally  # noqa: E402
from llmgw.testing.ports import free_port, port_block, wait_bound, with_ports  # noqa: E402
from llmgw.testing.procs import processes_marked  # noqa: E402

MODEL = "demo"

# -- a local fleet ---------------------------------------------------------------------------


class Cleanups:
    """
    Stands in for a test case's C{addCleanup} (L{port_block} holds its
    ports until cleanup).
    """

    def __init__(self) -> None:
        self.calls: list[Callable[..., Any]] = []

    def addCleanup(self, f: Callable[..., Any], *args: Any) -> None:
        self.calls.append(lambda: f(*args))

    def run(self) -> None:
        while self.calls:
            self.calls.pop()()


def fake_catalog(directory: Path, replicas: int, start_delay: float, tokens: int,
                 tokens_per_second: float) -> Path:
    """
    The demo catalog with C{replicas} replicas of the fake model server, each
    C{start_delay} seconds from launch to ready, replies of C{tokens} words
    streamed at C{tokens_per_second}.
    """
    path = demo_catalog(directory)
    text = path.read_text()
    marker = '"--metrics", "vllm"]'
    args = (f'"--metrics", "vllm", "--startup-delay", "{start_delay}", '
            f'"--tokens-per-second", "{tokens_per_second}", "--tokens", "{tokens}"]')
    if marker not in text or "replicas = 2" not in text:
        raise RuntimeError("the demo catalog changed shape: fix bench/survival.py's fake_catalog")
    path.write_text(text.replace(marker, args, 1).replace("replicas = 2", f"replicas = {replicas}", 1))
    return path


class LocalFleet:
    """
    One C{llmgw local} process with C{agents} agents of C{gpus} each, serving
    C{catalog}; L{close} kills it and every shard it started.
    """

    def __init__(self, directory: Path, catalog: Path, agents: int, gpus: str = "sim:1x24GiB"):
        self.dir, self.catalog = directory, catalog
        self.cleanups = Cleanups()
        catalog.write_text(with_ports(catalog.read_text(), *port_block(self.cleanups)))
        self.log = (directory / "fleet.log").open("w+b")
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        for _ in range(3):
            self.gateway_port, self.admin_port = free_port(), free_port()
            self.log.truncate(0)
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llmgw.ctl.main", "local", "--agents", str(agents), "--gpus", gpus,
                 "--catalog", str(catalog), "--gateway", f"127.0.0.1:{self.gateway_port}",
                 "--admin", f"127.0.0.1:{self.admin_port}", "--heartbeat", "1"],
                cwd=directory, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)
            if wait_bound(self.proc, [self.admin_port, self.gateway_port], self.output, 60):
                return
        raise RuntimeError(f"the fleet did not start:\n{self.output()[-3000:]}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")

    def admin(self, path: str, method: str = "GET") -> Any:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.admin_port}{path}", method=method,
            data=b"{}" if method == "POST" else None, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if path != "/metrics" else body.decode()

    def ready(self, model: str = MODEL) -> dict[str, str]:
        """Ready replicas of C{model} not draining: id -> address."""
        return {r["id"]: r["shards"][0]["address"] for r in self.admin("/api/v1/replicas")["replicas"]
                if r["model"] == model and r["state"] == "ready" and not r["draining"]}

    def deployment(self, model: str = MODEL) -> dict[str, Any]:
        [dep] = [d for d in self.admin("/api/v1/deployments")["deployments"] if d["model"] == model]
        return dep  # type: ignore[no-any-return]

    def wait(self, what: str, check: Callable[[], Any], timeout: float) -> Any:
        """
        Poll C{check} until it returns something true (returned), the fleet
        exits, or C{timeout} seconds pass (both raise).
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = check()
            except OSError:
                value = None
            if value:
                return value
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what}: not within {timeout} s (fleet exit status "
                                   f"{self.proc.poll()}):\n{self.output()[-3000:]}")
            time.sleep(0.2)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for pid in processes_marked(str(self.dir)):
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        self.log.close()
        self.cleanups.run()


# -- what the gateway measured ------------------------------------------------------------------


def queue_wait_buckets(metrics: str, model: str = MODEL) -> dict[float, float]:
    """
    The gateway's queue-wait histogram for C{model} (all outcomes summed):
    upper bound -> cumulative count.
    """
    out: dict[float, float] = {}
    for family in text_string_to_metric_families(metrics):
        if family.name != "llmgw_gateway_queue_wait_seconds":
            continue
        for s in family.samples:
            if s.name.endswith("_bucket") and s.labels.get("model") == model:
                le = float(s.labels["le"])
                out[le] = out.get(le, 0.0) + s.value
    return out


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> dict[str, Any]:
    """
    The queue waits between two reads of the histogram: how many, and the
    upper bound of the bucket holding the C{q} quantile (None: none waited).
    """
    diff = sorted((le, after.get(le, 0.0) - before.get(le, 0.0)) for le in after)
    total = diff[-1][1] if diff else 0.0
    bound = next((le for le, n in diff if n >= q * total), None) if total else None
    return {"queued": int(total), f"p{round(q * 100)}_at_most_s": bound}


def window(answers: list[Answer], start: float, end: float) -> dict[str, Any]:
    """Latency and time to first byte of the answers sent in [start, end)."""
    chosen = [a for a in answers if start <= a.sent < end]
    return {"sent": len(chosen),
            "latency": summary_ms([int(a.latency * 1e9) for a in chosen]),
            "first_byte": summary_ms([int(a.first_byte * 1e9) for a in chosen if a.first_byte is not None])}


def start_times(events: list[dict[str, Any]], replicas: set[str]) -> list[float]:
    """Seconds from placed to ready of each of C{replicas}, from the events."""
    placed = {e["replica"]: e["time"] for e in events if e["kind"] == "replica_placed"}
    ready = {e["replica"]: e["time"] for e in events if e["kind"] == "replica_ready"}
    return sorted(round(ready[r] - placed[r], 3) for r in replicas if r in placed and r in ready)


# -- sections -------------------------------------------------------------------------------------

Section = Callable[[argparse.Namespace, Path], dict[str, Any]]
SECTIONS: dict[str, Section] = {}


def section(name: str) -> Callable[[Section], Section]:
    def register(f: Section) -> Section:
        SECTIONS[name] = f
        return f
    return register


@section("rollout")
def rollout(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """
    A profile change rolled across a full fleet under the open-loop client.
    """
    n = args.rollout_replicas
    catalog = fake_catalog(work, n, args.rollout_start_delay, tokens=16, tokens_per_second=50)
    fleet = LocalFleet(work, catalog, agents=n)
    try:
        before_ids = fleet.wait(f"{n} ready replicas", lambda: (r := fleet.ready()) and len(r) == n and r,
                                timeout=120)
        client = OpenLoopClient("127.0.0.1", fleet.gateway_port, MODEL, rate=args.rate, max_tokens=16)
        client.start()
        try:
            fleet.wait("traffic before the change", lambda: len(client.answers) >= args.rate * args.settle,
                       timeout=args.settle * 10)
            buckets_before = queue_wait_buckets(fleet.admin("/metrics"))
            changed_at = time.monotonic() - client.started_at
            catalog.write_text(catalog.read_text().replace('"--tokens", "16"', '"--tokens", "12"'))
            fleet.admin("/api/v1/catalog/reload", "POST")
            done = fleet.wait("the rollout's end", lambda: (
                (ro := fleet.deployment()["rollout"]) is not None and ro["state"] != "progressing" and ro),
                timeout=args.rollout_deadline)
            done_at = time.monotonic() - client.started_at
            # Counted by when they were sent: the queue's backlog answers at
            # once when a replica comes back.
            fleet.wait("traffic after the rollout",
                       lambda: sum(a.sent >= done_at for a in list(client.answers)) >= args.rate * args.settle,
                       timeout=args.settle * 10 + 60)
        finally:
            answers = client.stop()
        buckets_after = queue_wait_buckets(fleet.admin("/metrics"))
        events = fleet.admin("/api/v1/events")["events"]
        after_ids = fleet.ready()
        starts = start_times(events, set(after_ids) - set(before_ids))
        wait = bucket_quantile(buckets_before, buckets_after, 0.99)
        counts = tally(answers)
        one_start = min(starts) if starts else None
        kinds = [e["kind"] for e in events]
        # The rollout's steps as they happened, in seconds from its start.
        began = next((e["time"] for e in events if e["kind"] == "rollout_started"), 0.0)
        timeline = [f'{e["time"] - began:7.2f} {e["kind"]} {e.get("replica", "")}'.rstrip()
                    for e in events if e["time"] >= began and e["kind"].startswith(("rollout_", "replica_"))]
        return {
            "config": {"replicas": n, "nodes": n, "gpus_per_node": 1, "rate_per_s": args.rate,
                       "streamed": "every second request", "engine_start_delay_s": args.rollout_start_delay,
                       "max_surge": 1, "max_unavailable": 1},
            "rollout": done,
            "rollout_s": round(done_at - changed_at, 3),
            "events": {k: kinds.count(k) for k in sorted(set(kinds)) if k.startswith(("rollout_", "replica_"))},
            "timeline": timeline,
            "replaced": len(set(before_ids) - set(after_ids)),
            "answers": counts,
            "pacer_worst_lag_s": round(client.worst_lag, 3),
            "replica_start_s": starts,
            "queue_wait": {**wait, "how": "the gateway's llmgw_gateway_queue_wait_seconds histogram "
                                          "(all outcomes), read before the change and after the "
                                          "rollout; the bound of the bucket holding the p99"},
            "client": {"before": window(answers, 0, changed_at),
                       "during": window(answers, changed_at, done_at),
                       "after": window(answers, done_at, float("inf"))},
            "bars": {
                "zero_non_2xx": counts["non_2xx"] == 0,
                "zero_broken_streams": counts["broken_streams"] == 0,
                "p99_queue_wait_within_one_start": (
                    one_start is not None and (wait["p99_at_most_s"] is None
                                               or wait["p99_at_most_s"] <= one_start)),
                "all_replaced": done["state"] == "done" and len(set(before_ids) & set(after_ids)) == 0,
            },
        }
    finally:
        fleet.close()


@section("wedged")
def wedged(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """
    A replica hung (the engine simulator's "health ok, generation hangs")
    under an open-loop client: out of routing within stall_after_s + 1 s,
    no error for a request not started (L{bench.survival_wedged}).
    """
    from bench.survival_wedged import measure

    return measure(rate=10.0, stall_after_s=2.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, of: {', '.join(SECTIONS)}")
    parser.add_argument("--rate", type=float, default=20.0, help="client requests a second")
    parser.add_argument("--settle", type=float, default=5.0,
                        help="seconds of traffic (counted in requests sent) before a change and after it")
    parser.add_argument("--rollout-replicas", type=int, default=4)
    parser.add_argument("--rollout-start-delay", type=float, default=5.0,
                        help="seconds each fake engine takes to become healthy")
    parser.add_argument("--rollout-deadline", type=float, default=300.0)
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = parser.parse_args()
    chosen = [s for s in args.sections.split(",") if s]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; known: {sorted(SECTIONS)}")
    work = Path(tempfile.mkdtemp(prefix="llmgw-survival-"))
    out: dict[str, Any] = {"cpus": os.cpu_count(), "work": str(work) if args.keep else None}
    for name in chosen:
        here = work / name
        here.mkdir()
        began = time.monotonic()
        out[name] = SECTIONS[name](args, here)
        out[name]["wall_s"] = round(time.monotonic() - began, 1)
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
