"""
Shared-system-prompt benchmark: applications that each send one long
system prompt with a different short question every time, on two real
llama.cpp replicas (C{llama-server}, the tiny model of
L{llmgw.testing.tinygguf}), routed by llmgw's gateway, by sglang-router's
cache-aware policy, and served by one replica alone. Prints JSON.

    python bench/prefix.py [--apps 8] [--system-words 50] [--clients 8]
        [--requests 96] [--cache-ram 256] [--runs 1]
        [--out bench/results/prefix-2cpu.json]
    python bench/prefix.py --pick-cost BASELINE_CHECKOUT [--system-words 50]

Routers, each against freshly started engines (empty caches), the same
request schedule for each:

- C{single}: one replica alone, all of the load sent to it directly: the
  cache share to reach;
- C{cache_aware}: llmgw's gateway, its C{cache_aware} policy (the prefix
  index; C{prefix_match} as configured by default);
- C{prefix}: llmgw's gateway, its default C{prefix} policy: no prefix
  index, every request a first turn dealt out by load;
- C{least_loaded}: llmgw's gateway, least in flight;
- C{sglang-router cache_aware}: from the bench's own environment
  (C{.venv-bench}, C{pip install sglang-router}), when it is there.

Per router: the share of prompt tokens the engines served from their
caches (C{llamacpp:prompt_tokens_cached_total} over it plus
C{llamacpp:prompt_tokens_total}, from their C{/metrics}), requests per
replica (prompt tokens, busiest over mean), wall time; through llmgw's
gateway (which names the replica that answered) the requests of each
application per replica. The bars: C{cache_aware}'s share at least 0.9 of
C{single}'s, its busiest replica at most 1.25 times the mean, and its share
over the peer's in the same run. With C{--runs N}, N runs one after
another and a summary (per router, each run's figures and their medians).
The tiny model's tokenizer makes about six tokens of a word.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Final

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.routing import (  # noqa: E402
    MODEL,
    free_ports,
    interleaved_pick_costs,
    llama_health,
    llama_text,
    median_of,
    wait_port,
)

VENV = ROOT / ".venv-bench"


def metrics(port: int) -> dict[str, float]:
    """
    llama-server's C{llamacpp:} counters and gauges, by name.
    """
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(llamacpp:[a-z_]+)(?:\{[^}]*\})?\s+([-0-9.e+]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def post(port: int, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as response:
        out = dict(json.loads(response.read()))
        # llmgw's gateway names the replica that answered: which
        # application went where (the other routers say nothing).
        replica = response.headers.get("x-llmgw-replica")
        if replica:
            out["_replica"] = replica
        return out


def schedule(args: argparse.Namespace) -> tuple[list[str], list[list[tuple[int, str]]]]:
    """
    The applications' system prompts, and per client its requests
    (application, question), drawn from a fixed seed.
    """
    rng = random.Random(11)
    systems = [f"You are application {i}. " + llama_text(rng, args.system_words) for i in range(args.apps)]
    per_client = args.requests // args.clients
    plans = [[(rng.randrange(args.apps), llama_text(rng, rng.randint(3, 8))) for _ in range(per_client)]
             for _ in range(args.clients)]
    return systems, plans


def drive(port: int, systems: list[str], plans: list[list[tuple[int, str]]], engine_ports: list[int]) -> dict[str, Any]:
    """
    Every client's requests, one after another, the clients at once; the
    engines' counters, before and after, tell what each replica served.
    """
    lock = threading.Lock()
    errors: list[str] = []
    answered = 0
    where: dict[str, dict[int, int]] = {}

    def one(plan: list[tuple[int, str]]) -> None:
        nonlocal answered
        for app, question in plan:
            body = {"model": MODEL, "max_tokens": 4, "temperature": 0,
                    "messages": [{"role": "system", "content": systems[app]}, {"role": "user", "content": question}]}
            try:
                replica = post(port, body).get("_replica")
            except Exception as e:  # noqa: BLE001 (counted and reported)
                with lock:
                    errors.append(repr(e)[:200])
                continue
            with lock:
                answered += 1
                if replica:
                    per = where.setdefault(replica, {})
                    per[app] = per.get(app, 0) + 1

    before = [metrics(p) for p in engine_ports]
    threads = [threading.Thread(target=one, args=(p,)) for p in plans]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    after = [metrics(p) for p in engine_ports]

    def delta(name: str) -> list[float]:
        return [a.get(name, 0.0) - b.get(name, 0.0) for a, b in zip(after, before, strict=True)]

    computed, cached = delta("llamacpp:prompt_tokens_total"), delta("llamacpp:prompt_tokens_cached_total")
    requests = delta("llamacpp:requests_processed_total") if "llamacpp:requests_processed_total" in after[0] else []
    total = sum(computed) + sum(cached)
    per_replica_tokens = [c + k for c, k in zip(computed, cached, strict=True)]
    mean_tokens = sum(per_replica_tokens) / len(per_replica_tokens)
    return {
        "answered": answered,
        "errors": errors[:5],
        "prompt_tokens": int(total),
        "prompt_tokens_cached": int(sum(cached)),
        "cache_share": round(sum(cached) / total, 3) if total else None,
        "prompt_tokens_per_replica": [int(x) for x in per_replica_tokens],
        "computed_per_replica": [int(x) for x in computed],
        "requests_per_replica": [int(x) for x in requests],
        "busiest_over_mean": round(max(per_replica_tokens) / mean_tokens, 3) if mean_tokens else None,
        "wall_s": round(wall, 2),
        # Per replica (when the router names it), requests per application.
        "apps_per_replica": {r: dict(sorted(a.items())) for r, a in sorted(where.items())},
        "applications_on_two_replicas": sum(
            1 for app in range(len(systems)) if sum(1 for a in where.values() if app in a) > 1
        ) if where else None,
    }


def sglang_router() -> Path | None:
    """
    The bench environment's Python with sglang-router, made and filled
    from PyPI on first use; C{None} if it cannot be had.
    """
    py = VENV / "bin" / "python"
    check = [str(py), "-c", "import sglang_router.launch_router"]
    if py.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return py
    try:
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", "sglang-router"], check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return py if subprocess.run(check, capture_output=True).returncode == 0 else None


def stop(procs: list[subprocess.Popen[str]]) -> None:
    for pr in procs:
        pr.terminate()
        try:
            pr.wait(10)
        except subprocess.TimeoutExpired:
            pr.kill()
            pr.wait()


def run_router(name: str, binary: Path, model: Path, engine_args: list[str], systems: list[str],
               plans: list[list[tuple[int, str]]], log_dir: Path) -> dict[str, Any]:
    replicas = 1 if name == "single" else 2
    ports = free_ports(replicas + 1)
    procs: list[subprocess.Popen[str]] = []
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        for p in ports[:replicas]:
            procs.append(subprocess.Popen(
                [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(p), "--alias", MODEL,
                 "--metrics", *engine_args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True))
        deadline = time.monotonic() + 60
        while not all(llama_health(p) for p in ports[:replicas]):
            if time.monotonic() > deadline or any(pr.poll() is not None for pr in procs):
                raise RuntimeError("llama-server did not become healthy")
            time.sleep(0.2)
        front = ports[0]
        if name != "single":
            ups = [f"127.0.0.1:{p}" for p in ports[:2]]
            if name.startswith("sglang"):
                py = sglang_router()
                if py is None:
                    return {"skipped": "sglang-router could not be installed into .venv-bench"}
                cmd = [str(py), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(ports[2]),
                       "--policy", "cache_aware", "--log-level", "warn", "--worker-urls",
                       *[f"http://{u}" for u in ups]]
            else:
                cmd = [sys.executable, str(ROOT / "bench" / "routing.py"), "gateway", "--port", str(ports[2]),
                       "--upstreams", ",".join(ups), "--policy", name]
            log = open(log_dir / f"{name.split()[0]}.log", "w")  # noqa: SIM115 (closed with the process)
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env))
            log.close()
            try:
                wait_port(ports[2], procs[-1], 60)
            except Exception as e:  # noqa: BLE001 (reported)
                tail = (log_dir / f"{name.split()[0]}.log").read_text()[-600:]
                return {"error": f"{e!r}: {tail}"}
            front = ports[2]
        # One warm-up request with a prompt no application shares: loads
        # the model's pages, caches nothing the workload reuses.
        try:
            post(front, {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "warm"}]})
        except Exception as e:  # noqa: BLE001 (reported)
            tail = ""
            if name != "single":
                tail = (log_dir / f"{name.split()[0]}.log").read_text()[-600:]
            return {"error": f"the router answers no request: {e!r} {tail}"}
        return drive(front, systems, plans, ports[:replicas])
    finally:
        stop(procs)


#: One C{cache_aware} decision after another (the affinity key, then
#: L{Router.pick}), four requests kept in flight, on the router's clock:
#: CPU microseconds per decision.
PICK_COST_CHILD = """
import json, random, sys, time
from collections import deque
from twisted.internet.task import Clock
from llmgw.gateway.policy import PolicyConfig, affinity_key
from llmgw.gateway.router import Router
from llmgw.routing import Route
n, replicas, words = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(1)
vocab = ["the", "a", "model", "reply", "tiny", "llmgw", "is"]
text = lambda k: " ".join(rng.choice(vocab) for _ in range(k))
routes = [Route(f"r{i}", "m", f"127.0.0.1:{i + 1}") for i in range(replicas)]
config = PolicyConfig()
clock = Clock()
router = Router(clock, policy=config)
systems = [f"You are application {i}. " + text(words) for i in range(8)]
bodies = [{"model": "m", "messages": [{"role": "system", "content": systems[rng.randrange(8)]},
          {"role": "user", "content": text(rng.randint(3, 8))}]} for _ in range(1000)]
held = deque()
t0 = time.process_time()
for i in range(n):
    clock.rightNow += 0.001
    r = router.pick(routes, (), "cache_aware", affinity_key(bodies[i % 1000], None, config, True))
    router.begin(r.replica_id)
    held.append(r.replica_id)
    if len(held) > 4:
        router.end(held.popleft())
print(json.dumps((time.process_time() - t0) / n * 1e6))
"""


def pick_cost(baseline: str, rounds: int, picks: int, words: int) -> dict[str, Any]:
    """
    CPU microseconds per C{cache_aware} decision (L{PICK_COST_CHILD}: this
    workload's requests, 8 applications with C{words}-word system
    prompts, over 2 and 4 replicas), this tree against C{baseline} (another
    checkout), in interleaved rounds; medians.
    """
    per = interleaved_pick_costs(PICK_COST_CHILD, picks, rounds, baseline, str(words))
    med = median_of

    return {
        "bench": "prefix-pick-cost", "policy": "cache_aware", "system_prompt_words": words,
        "picks_per_run": picks, "rounds": rounds, "baseline": baseline,
        "us_per_pick_median": {t: {f"{k}_replicas": med(v) for k, v in d.items()} for t, d in per.items()},
        "branch_minus_baseline_us": {f"{k}_replicas": round(med(per["branch"][k]) - med(per["baseline"][k]), 2)
                                     for k in (2, 4)},
        "per_round_us": {t: {f"{k}_replicas": [round(x, 2) for x in v] for k, v in d.items()} for t, d in per.items()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--apps", type=int, default=8, help="applications, each its own system prompt")
    p.add_argument("--system-words", type=int, default=50, help="system prompt words (about 6 tokens each)")
    p.add_argument("--clients", type=int, default=8, help="clients at once, each one request after another")
    p.add_argument("--requests", type=int, default=480, help="requests in all")
    p.add_argument("--ctx", type=int, default=4096, help="each engine's -c")
    p.add_argument("--slots", type=int, default=4, help="each engine's -np")
    p.add_argument("--cache-ram", type=int, default=256, help="each engine's --cache-ram (MiB): its prompt cache")
    p.add_argument("--routers", default="single,cache_aware,prefix,least_loaded,sglang-router cache_aware")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--runs", type=int, default=1, help="runs, one after another, and a summary of them")
    p.add_argument("--pick-cost", metavar="BASELINE", default=None,
                   help="instead, CPU per cache_aware decision here and in the checkout BASELINE")
    p.add_argument("--rounds", type=int, default=7, help="(--pick-cost) interleaved rounds")
    p.add_argument("--picks", type=int, default=20000, help="(--pick-cost) decisions per run")
    args = p.parse_args(argv)
    if args.pick_cost:
        text = json.dumps(pick_cost(args.pick_cost, args.rounds, args.picks, args.system_words), indent=2)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return 0

    from llmgw.testing import tinygguf
    from llmgw.testing.engines import find_llama_server, llama_server_missing_reason

    binary = find_llama_server()
    if binary is None:
        print(json.dumps({"skipped": llama_server_missing_reason()}))
        return 0
    runs = [one_run(args, binary, tinygguf) for _ in range(args.runs)]
    out: dict[str, Any] = runs[0] if args.runs == 1 else {"bench": "prefix", "runs": runs, "summary": summary(runs)}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def one_run(args: argparse.Namespace, binary: Path, tinygguf: Any) -> dict[str, Any]:
    """
    Every router of C{args.routers} in turn, each on fresh engines, the
    same schedule for each; their figures and the bars.
    """
    engine_args = ["-c", str(args.ctx), "-np", str(args.slots), "-t", "1", "--no-warmup",
                   "--cache-ram", str(args.cache_ram)]
    systems, plans = schedule(args)
    load_before = os.getloadavg()
    doc: dict[str, Any] = {
        "bench": "prefix",
        "engine": str(binary), "engine_args": engine_args,
        "workload": {"apps": args.apps, "system_prompt_words": args.system_words, "question_words": "3-8",
                     "clients": args.clients, "requests": args.requests, "max_tokens": 4},
        "routers": {},
    }
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-prefix-") as tmp:
        # The model's trained context: each slot's share of -c.
        model = tinygguf.write(Path(tmp) / "tiny.gguf", context=args.ctx // args.slots)
        for name in args.routers.split(","):
            doc["routers"][name] = run_router(name, binary, model, engine_args, systems, plans, Path(tmp))
    doc["machine"] = {"cpus": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg()}
    r = doc["routers"]
    single = (r.get("single") or {}).get("cache_share")
    bars: dict[str, Any] = {}
    for name in r:
        share = r[name].get("cache_share")
        if name != "single" and share is not None and single:
            r[name]["cache_share_over_single"] = round(share / single, 3)
    aware = r.get("cache_aware") or {}
    if "cache_share_over_single" in aware:
        bars["cache_aware_cache_share_at_least_0_9_of_single"] = aware["cache_share_over_single"] >= 0.9
        bars["cache_aware_busiest_at_most_1_25_mean"] = (aware.get("busiest_over_mean") or 99) <= 1.25
    peer = (r.get(PEER) or {}).get("cache_share")
    if aware.get("cache_share") is not None and peer:
        bars["cache_aware_cache_share_over_sglang_router"] = round(aware["cache_share"] / peer, 3)
        bars["cache_aware_beats_sglang_router"] = aware["cache_share"] > peer
    doc["bars"] = bars
    return doc


#: The peer router the bars compare with.
PEER: Final = "sglang-router cache_aware"


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """
    Per router, its cache share and busiest over mean in each run, their
    medians; and in how many runs llmgw's C{cache_aware} beat the peer.
    """
    def med(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    out: dict[str, Any] = {}
    for name in runs[0]["routers"]:
        shares = [d["routers"][name].get("cache_share") for d in runs]
        busiest = [d["routers"][name].get("busiest_over_mean") for d in runs]
        if None in shares:
            continue
        out[name] = {"cache_share": shares, "cache_share_median": med(shares),
                     "busiest_over_mean": busiest, "busiest_over_mean_median": med(busiest)}
    beats = [d["bars"].get("cache_aware_beats_sglang_router") for d in runs]
    if None not in beats:
        out["cache_aware_beat_sglang_router_in_runs"] = f"{sum(beats)} of {len(runs)}"
    return out


if __name__ == "__main__":
    sys.exit(main())
