"""
Many models on few GPUs (DESIGN §22): eight models on two simulated GPUs
under Zipf-distributed demand, served three ways by a real local fleet,
and the cost of a wake through llmgw beside the engine's own.

    python bench/multiplex.py                    # the whole run (10 minutes a mode)
    python bench/multiplex.py --quick            # compressed for CI (see below)

Each engine is the engine simulator (C{python -m llmgw.testing.sleepsim
--engine-sim}: vLLM-shaped metrics and timing, vLLM's sleep endpoints),
each replica one GPU. Defaults are a 7-8B model's orders of magnitude:
C{--load-s} 30 from launch to ready (weights and warm-up), C{--wake-ms}
1500 from level-1 sleep, C{--sleep-ms} 500. C{--quick} divides every time
(load, wake, sleep, idleness, residence, the run) by C{--compress}.

Modes (a fresh fleet each, the same seeded arrivals):

* C{static}: the two most asked-for models have one replica each, the
  others none (their requests wait in the queue until its timeout);
* C{scale_to_zero}: every model autoscales 0..1 and scales to zero after
  C{--idle-s}; nothing else frees a GPU;
* C{multiplex}: as C{scale_to_zero}, plus C{sleep_after_s} (before the
  scale to zero) and C{evictable = true} with C{min_resident_s}: a request
  for a model that fits nowhere swaps out the least recently used.

Per mode: p99 (and p50) time to first token of requests sent while their
model had no replica at all ("no_replica", the bar's figure), while it had
no ready awake one ("cold": none, starting or asleep), and of all; requests refused (any
non-200); swaps per minute (C{swap} events); GPU-held share (GPU-seconds
held by a replica) and GPU-busy share (GPU-seconds whose replica had
requests running), both from the replicas view polled each second, a GPU
counted once however many replicas hold it (a sleeper's lent GPU is held
by it and its borrower both); the
records of the refused requests and of the five slowest.

Wake bar: one replica that sleeps after 2 s idle; its engine's own wake
(C{POST /wake_up} straight to the engine) beside a request through the
gateway while it sleeps less the same request while awake; the bar is
the difference at most 100 ms. The same with llama.cpp's server (it
sleeps by itself and a request wakes it) when the binary is there: the
request straight to the engine while asleep less awake, beside the same
through the gateway.

Prints one JSON document (and writes it with C{--out}).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from bench.common import percentile  # noqa: E402
from bench.survival import LocalFleet  # noqa: E402

MODELS = [f"m{i}" for i in range(1, 9)]
#: The body of the latest refusal, for the report.
LAST_ERROR: list[str] = []


def catalog(mode: str, args: argparse.Namespace, models: list[str] | None = None) -> str:
    c = args.compress
    models = models or MODELS
    command = [
        "{python}", "-m", "llmgw.testing.sleepsim", "--sleep-mode", "vllm",
        "--sleep-ms", f"{args.sleep_ms / c:g}", "--wake-ms", f"{args.wake_ms / c:g}",
        "--port", "{port}", "--model", "{model}", "--host", "{host}", "--engine-sim",
        "--startup-delay", f"{args.load_s / c:g}", "--tokens", str(args.tokens),
    ]
    text = (
        f'[profiles.sim]\nengine = "vllm"\ngpus_per_shard = 1\ngpu_memory_mb = 1000\n'
        f"command = {json.dumps(command)}\nenv = {{ PYTHONPATH = {json.dumps(str(ROOT))} }}\n"
        f"startup_timeout_s = 600\ndrain_timeout_s = 30\nstop_grace_s = 2\n"
        f"sleep_level = {1 if mode in ('multiplex', 'wake') else 0}\n"
    )
    for i, model in enumerate(models):
        text += f'\n[[deployments]]\nmodel = "{model}"\nprofile = "sim"\nqueue_timeout_s = {args.queue_timeout_s / c:g}\n'
        if mode == "static":
            text += f"replicas = {1 if i < 2 else 0}\n"
        elif mode == "wake":
            text += "replicas = 1\nsleep_after_s = 2\n"
        else:
            text += (f"min_replicas = 0\nmax_replicas = 1\nscale_to_zero_after_s = {args.idle_s / c:g}\n"
                     "stabilization_s = 0\n")
            if mode == "multiplex":
                text += (f"sleep_after_s = {args.sleep_after_s / c:g}\nevictable = true\n"
                         f"min_resident_s = {args.resident_s / c:g}\n")
    return text


def gpus_held(replicas: list[dict[str, Any]]) -> tuple[set[tuple[str, int]], set[tuple[str, int]]]:
    """
    The GPUs (node, index) the replicas view shows held by a replica
    (awake or asleep), and those of them whose replica has requests
    running or waiting: each GPU once, lent or not.
    """
    held: set[tuple[str, int]] = set()
    busy: set[tuple[str, int]] = set()
    for r in replicas:
        gpus = {(s["node"], g) for s in r["shards"] for g in s.get("gpus") or ()}
        held |= gpus
        sig = r["shards"][0].get("signals") if r["shards"] else None
        if sig and ((sig.get("running") or 0) > 0 or (sig.get("waiting") or 0) > 0):
            busy |= gpus
    return held, busy


class Poller(threading.Thread):
    """
    The replicas view once a second: per model whether it has a ready,
    awake replica; GPU-seconds held and busy.
    """

    def __init__(self, fleet: LocalFleet):
        super().__init__(daemon=True)
        self.fleet = fleet
        self.ready: dict[str, bool] = {}
        #: Models with any replica (placed, starting, ready, asleep).
        self.placed: set[str] = set()
        self.held = self.busy = 0.0
        self.samples = 0
        self.halt = threading.Event()

    def run(self) -> None:
        last = time.monotonic()
        while not self.halt.is_set():
            try:
                replicas = self.fleet.admin("/api/v1/replicas")["replicas"]
            except OSError:
                replicas = None
            now = time.monotonic()
            if replicas is not None:
                ready: dict[str, bool] = {}
                placed: set[str] = set()
                held, busy = gpus_held(replicas)
                for r in replicas:
                    if r["state"] not in ("stopping", "stopped", "failed") and not r["draining"]:
                        placed.add(r["model"])
                    if r["state"] == "ready" and not r["draining"] and not r.get("sleeping"):
                        ready[r["model"]] = True
                self.ready, self.placed = ready, placed
                dt = now - last
                self.held += len(held) * dt
                self.busy += len(busy) * dt
                self.samples += 1
            last = now
            self.halt.wait(1.0)


def chat(port: int, model: str, timeout: float, max_tokens: int = 8) -> tuple[int, float | None, float]:
    """
    One streamed chat through the gateway: its status, seconds to the first
    content event (None: none), seconds to its end.
    """
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    first: float | None = None
    try:
        body = json.dumps({"model": model, "stream": True, "max_tokens": max_tokens,
                           "messages": [{"role": "user", "content": f"hello {model}"}]})
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            LAST_ERROR[:] = [response.read()[:500].decode("utf-8", "replace")]
            return response.status, None, time.monotonic() - started
        for line in response:
            if first is None and line.startswith(b"data:") and b'"content"' in line:
                first = time.monotonic() - started
        return 200, first, time.monotonic() - started
    except OSError:
        return 0, None, time.monotonic() - started
    finally:
        conn.close()


def arrivals(seed: int, duration: float, rate: float, s: float) -> list[tuple[float, str]]:
    """
    Poisson arrivals at C{rate} a second over C{duration}, each for a model
    drawn from a Zipf law of exponent C{s} over L{MODELS} (m1 the most asked).
    """
    rng = random.Random(seed)
    weights = [1 / (k ** s) for k in range(1, len(MODELS) + 1)]
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append((t, rng.choices(MODELS, weights)[0]))


def run_mode(mode: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    c = args.compress
    directory = work / mode
    directory.mkdir()
    path = directory / "catalog.toml"
    path.write_text(catalog(mode, args))
    fleet = LocalFleet(directory, path, agents=1, gpus="sim:2x24GiB")
    try:
        if mode == "static":
            fleet.wait("the static replicas", lambda: len(fleet.ready("m1")) + len(fleet.ready("m2")) == 2,
                       args.load_s / c + 60)
        duration = args.duration_s / c
        plan = arrivals(args.seed, duration, args.rate * c, args.zipf)
        poller = Poller(fleet)
        poller.start()
        results: list[dict[str, Any]] = []
        lock = threading.Lock()

        def one(model: str, at: float) -> None:
            cold = not poller.ready.get(model, False)
            none = model not in poller.placed
            status, first, total = chat(fleet.gateway_port, model, args.queue_timeout_s / c + 30)
            with lock:
                results.append({"model": model, "at": round(at, 1), "cold": cold, "none": none,
                                "status": status, "ttft": first, "total": round(total, 1),
                                **({"error": LAST_ERROR[0][:200]} if status != 200 and LAST_ERROR else {})})

        threads = []
        start = time.monotonic()
        for at, model in plan:
            delay = start + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            th = threading.Thread(target=one, args=(model, at), daemon=True)
            th.start()
            threads.append(th)
        for th in threads:
            th.join(args.queue_timeout_s / c + 60)
        elapsed = time.monotonic() - start
        poller.halt.set()
        poller.join(5)
        events = fleet.admin("/api/v1/events?since=0")["events"]
    finally:
        fleet.close()
    swaps = sum(1 for e in events if e["kind"] == "swap")
    asleep = sum(1 for e in events if e["kind"] == "replica_asleep")
    cold = sorted(r["ttft"] for r in results if r["cold"] and r["ttft"] is not None)
    none = sorted(r["ttft"] for r in results if r["none"] and r["ttft"] is not None)
    every = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    refused = [r for r in results if r["status"] != 200]
    gpu_seconds = 2 * elapsed

    def ms(values: list[float], p: float, scale: float = 1.0) -> float | None:
        return round(percentile(values, p) * 1000 * scale, 1) if values else None

    return {
        "requests": len(results),
        "refused": len(refused),
        "refused_by_status": {str(s): sum(1 for r in refused if r["status"] == s)
                              for s in sorted({r["status"] for r in refused})},
        # Sent while the model had no replica at all: the bar's figure.
        "no_replica_requests": sum(1 for r in results if r["none"]),
        "ttft_no_replica_ms": {"p50": ms(none, 50), "p99": ms(none, 99), "n": len(none)},
        "ttft_no_replica_uncompressed_ms": {"p50": ms(none, 50, c), "p99": ms(none, 99, c)},
        # Sent while it had no ready replica that was awake (none, starting, or asleep).
        "cold_requests": sum(1 for r in results if r["cold"]),
        "ttft_cold_ms": {"p50": ms(cold, 50), "p99": ms(cold, 99), "n": len(cold)},
        # A cold request's wait is load, wake, drain and idleness times, all
        # divided by --compress: multiplied back, the uncompressed estimate.
        "ttft_cold_uncompressed_ms": {"p50": ms(cold, 50, c), "p99": ms(cold, 99, c)},
        "ttft_all_ms": {"p50": ms(every, 50), "p99": ms(every, 99), "n": len(every)},
        "swaps": swaps,
        "swaps_per_minute": round(swaps / (elapsed * c / 60), 2),
        "sleeps": asleep,
        "gpu_held_share": round(poller.held / gpu_seconds, 3),
        "gpu_busy_share": round(poller.busy / gpu_seconds, 3),
        "served_per_model": {m: sum(1 for r in results if r["model"] == m and r["status"] == 200) for m in MODELS},
        "asked_per_model": {m: sum(1 for r in results if r["model"] == m) for m in MODELS},
        "refused_per_model": {m: n for m in MODELS if (n := sum(1 for r in refused if r["model"] == m))},
        # Each refused request, and the five that waited longest: when each
        # was sent (seconds into the run), its model, and its wait.
        "refused_records": sorted(refused, key=lambda r: r["at"]),
        "longest_records": sorted(results, key=lambda r: -r["total"])[:5],
    }


def post(url: str) -> float:
    started = time.monotonic()
    request = urllib.request.Request(url, data=b"{}", method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()
    return time.monotonic() - started


def direct_chat(address: str, model: str) -> float:
    started = time.monotonic()
    body = json.dumps({"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    request = urllib.request.Request(f"http://{address}/v1/chat/completions", data=body.encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()
    return time.monotonic() - started


def gateway_chat(fleet: LocalFleet, model: str) -> float:
    status, _, total = chat(fleet.gateway_port, model, 60, max_tokens=1)
    if status != 200:
        raise RuntimeError(f"a chat through the gateway answered {status}: {LAST_ERROR}")
    return total


def engine_sleeping(address: str, path: str) -> bool:
    with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as response:
        return json.loads(response.read()).get("is_sleeping") is True


def wait_asleep(fleet: LocalFleet, model: str, status_path: str) -> dict[str, Any]:
    """
    Wait until C{model}'s replica is shown awake (a wake just made has
    reached the control plane), then until both the view and the engine
    itself say it sleeps; returns the replica.
    """
    def view() -> dict[str, Any] | None:
        for r in fleet.admin("/api/v1/replicas")["replicas"]:
            if r["model"] == model and r["state"] == "ready":
                return r  # type: ignore[no-any-return]
        return None

    fleet.wait(f"{model} shown awake", lambda: (r := view()) is not None and r.get("sleeping") is False, 60)

    def asleep() -> dict[str, Any] | None:
        r = view()
        if r is None or not r.get("sleeping"):
            return None
        return r if engine_sleeping(r["shards"][0]["address"], status_path) else None

    return fleet.wait(f"{model} asleep", asleep, 60)  # type: ignore[no-any-return]


def wake_sim(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    directory = work / "wake-sim"
    directory.mkdir()
    path = directory / "catalog.toml"
    path.write_text(catalog("wake", argparse.Namespace(**{**vars(args), "compress": 1.0, "load_s": 1.0}),
                            models=["w"]))
    fleet = LocalFleet(directory, path, agents=1, gpus="sim:1x24GiB")
    engine, through, awake = [], [], []
    try:
        fleet.wait("a ready replica", lambda: fleet.ready("w"), 60)
        gateway_chat(fleet, "w")
        for _ in range(args.wake_rounds):
            r = wait_asleep(fleet, "w", "/is_sleeping")
            engine.append(post(f"http://{r['shards'][0]['address']}/wake_up"))
            wait_asleep(fleet, "w", "/is_sleeping")
            through.append(gateway_chat(fleet, "w"))
            awake.append(gateway_chat(fleet, "w"))
    finally:
        fleet.close()
    return wake_summary("engine simulator, vLLM sleep level 1", engine, through, awake)


def wake_summary(what: str, engine: list[float], through: list[float], awake: list[float],
                 engine_awake: list[float] | None = None) -> dict[str, Any]:
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    own = med(engine) - (med(engine_awake) if engine_awake else 0.0)
    via = med(through) - med(awake)
    return {
        "engine": what,
        "rounds": len(engine),
        "engine_wake_ms": round(own * 1000, 1),
        "through_llmgw_asleep_minus_awake_ms": round(via * 1000, 1),
        "added_by_llmgw_ms": round((via - own) * 1000, 1),
        "bar_ms": 100,
        "met": via - own <= 0.100,
        "samples_ms": {"engine": [round(x * 1000, 1) for x in engine],
                       "through_asleep": [round(x * 1000, 1) for x in through],
                       "through_awake": [round(x * 1000, 1) for x in awake],
                       **({"engine_awake": [round(x * 1000, 1) for x in engine_awake]} if engine_awake else {})},
    }


def wake_llama(args: argparse.Namespace, work: Path) -> dict[str, Any] | str:
    from llmgw.testing.engines import find_llama_server
    from llmgw.testing.tinygguf import write

    binary = find_llama_server()
    if binary is None:
        return "skipped: no llama-server binary"
    directory = work / "wake-llama"
    directory.mkdir()
    model = write(directory / "tiny.gguf")
    path = directory / "catalog.toml"
    path.write_text(
        f'[profiles.llama]\nengine = "llamacpp"\ngpus_per_shard = 1\nprogram = {json.dumps(str(binary))}\n'
        f'sleep_level = 1\n\n[[deployments]]\nmodel = "w"\nprofile = "llama"\nreplicas = 1\n'
        f"source = {json.dumps(model.as_uri())}\nsleep_after_s = 2\n"
        'args = ["-c", "512", "-np", "2", "-t", "1", "--no-warmup", "-ngl", "0"]\n')
    fleet = LocalFleet(directory, path, agents=1, gpus="sim:1x24GiB")
    engine, engine_awake, through, awake = [], [], [], []
    try:
        fleet.wait("a ready replica", lambda: fleet.ready("w"), 120)
        gateway_chat(fleet, "w")
        for _ in range(args.wake_rounds):
            r = wait_asleep(fleet, "w", "/props")
            address = r["shards"][0]["address"]
            engine.append(direct_chat(address, "w"))
            engine_awake.append(direct_chat(address, "w"))
            wait_asleep(fleet, "w", "/props")
            through.append(gateway_chat(fleet, "w"))
            awake.append(gateway_chat(fleet, "w"))
    finally:
        fleet.close()
    return wake_summary("llama.cpp's server (a request wakes it)", engine, through, awake, engine_awake)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="compressed for CI: every time divided by --compress")
    p.add_argument("--compress", type=float, default=5.0)
    p.add_argument("--modes", default="static,scale_to_zero,multiplex")
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--rate", type=float, default=0.1, help="requests a second, all models (uncompressed)")
    p.add_argument("--zipf", type=float, default=1.2)
    p.add_argument("--seed", type=int, default=27)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--load-s", type=float, default=30.0)
    p.add_argument("--wake-ms", type=float, default=1500.0)
    p.add_argument("--sleep-ms", type=float, default=500.0)
    p.add_argument("--idle-s", type=float, default=300.0, help="scale_to_zero_after_s")
    p.add_argument("--sleep-after-s", type=float, default=30.0)
    p.add_argument("--resident-s", type=float, default=60.0, help="min_resident_s")
    p.add_argument("--queue-timeout-s", type=float, default=300.0)
    p.add_argument("--wake-rounds", type=int, default=5)
    p.add_argument("--no-wake", action="store_true")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if not args.quick:
        args.compress = 1.0
    doc: dict[str, Any] = {"bench": "multiplex", "args": vars(args),
                           "note": ("times in ms are as measured (compressed with --quick), except "
                                    "ttft_cold_uncompressed_ms and swaps_per_minute, scaled back by "
                                    "--compress")}
    with tempfile.TemporaryDirectory(prefix="llmgw-multiplex-") as tmp:
        work = Path(tmp)
        doc["modes"] = {}
        for mode in filter(None, args.modes.split(",")):
            doc["modes"][mode] = run_mode(mode, args, work)
            print(json.dumps({mode: doc["modes"][mode]}), file=sys.stderr, flush=True)
        if not args.no_wake:
            doc["wake"] = {"sim": wake_sim(args, work), "llamacpp": wake_llama(args, work)}
    text = json.dumps(doc, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
