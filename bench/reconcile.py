"""
Reconcile pass time against fleet size (DESIGN §14), printed as JSON.

For 100, 1,000 and 10,000 nodes of 8 simulated GPUs:

  - cold fill: from an empty fleet, placing replicas on half the GPUs, as
    passes run back to back (a pass that stops at its budget is continued
    at once); wall time and the longest single pass;
  - steady: passes with nothing to do, while a fifth of the nodes
    heartbeat each simulated second (as 5 s heartbeats would); a pass that
    leaves node checks for the next is followed at once, as the reactor
    does, and each counts; median, p99 and max;
  - place: 1,000 new single-GPU replicas (fewer where the free half holds
    fewer), wall time over the passes it takes and the longest pass;
  - reactor hold: the longest any single pass held the reactor, over all
    of the above (the pass includes sending its commands);
  - baseline: a bare Python loop over the same nodes and GPUs, measured in
    the same run.

The bar: steady p99 under 5 ms at 10,000 nodes; no pass over
the 20 ms budget; 1,000 replicas placed within 1 s of wall time; a cold
fill of 10,000 nodes under 3 s; growth no worse than linear. The collector
runs as in a control-plane process (C{--gc-threshold}, default 50,000, with
the heap frozen first, and the reconciler's growth hook freezing what the
fleet's records added, where the code under test has the hook); each size
also reports its collections and the longest one.

With C{--before DIR}, the same benchmark also runs against the llmgw
package in DIR (an export of main, say) in a subprocess, and both are
reported. With C{--rounds N} as well, before and after each run N times,
interleaved (before, after, before, ...), each in a fresh subprocess, and
the median and the least of each figure over the rounds are reported
beside the rounds.

With C{--autoscaled}, the ten deployments autoscale (bounds pinned at the
same count, so nothing changes) and the autoscaling decision runs on every
pass: what it costs. It applies to this tree only, not to
C{--before}.

Run: PYTHONPATH=. python bench/reconcile.py [--sizes 100,1000,10000] [--before DIR [--rounds N]] [--autoscaled]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

from twisted.internet.task import Clock

from llmgw.control.core.catalog import parse_catalog
from llmgw.control.core.kept import KeptState
from llmgw.control.shell.reconciler import Reconciler
from llmgw.control.state.interfaces import ShardReport
from llmgw.control.state.inventory import Inventory
from llmgw.testing.simfleet import FakeDispatcher, sim_fleet

PROFILE = """
[ports]
first = 20000
last = 29999

[profiles.one]
gpus_per_shard = 1
gpu_memory_mb = 1000
command = ["{python}", "-m", "llmgw.testing.fakemodel", "--port", "{port}", "--model", "{model}"]
"""
DEPLOYMENTS = 10


def catalog_text(per_deployment: int, extra: int, autoscaled: bool = False) -> str:
    text = PROFILE
    for i in range(DEPLOYMENTS):
        if autoscaled:
            # Autoscaled at a fixed count: the decision runs every pass, changes nothing.
            count = (f"min_replicas = {per_deployment}\nmax_replicas = {per_deployment}\n"
                     f"target_in_flight = 4\n")
        else:
            count = f"replicas = {per_deployment}\n"
        text += f'\n[[deployments]]\nmodel = "m{i}"\nprofile = "one"\n{count}'
    text += f'\n[[deployments]]\nmodel = "new"\nprofile = "one"\nreplicas = {extra}\n'
    return text


def baseline(inv: Inventory) -> float:
    started = time.perf_counter()
    total = 0
    for node_id in inv.ids():
        node = inv.peek(node_id)
        assert node is not None
        for g in node.gpus:
            if not g.problems:
                total += g.memory_total_mb - g.memory_used_mb
    return time.perf_counter() - started


def make_ready(rec: Reconciler, clock: Clock, dispatcher: FakeDispatcher) -> None:
    for cmd in dispatcher.starts:
        rec.on_shard_status(ShardReport(cmd.node_id, cmd.replica_id, cmd.shard_id, "starting"))
        rec.on_shard_status(ShardReport(cmd.node_id, cmd.replica_id, cmd.shard_id, "ready"))
    clock.advance(0)
    dispatcher.clear()


def passes_until_done(rec: Reconciler, cpu: list[float] | None = None) -> tuple[float, list[float]]:
    """
    Run passes back to back until one finishes its work; returns the wall
    time and each pass's duration, and appends the CPU time to C{cpu}.
    """
    started, started_cpu = time.perf_counter(), time.process_time()
    durations = []
    while True:
        rec.run_pass()
        durations.append(rec.last_pass_duration)
        if not getattr(rec, "pass_unfinished", False):
            if cpu is not None:
                cpu.append(time.process_time() - started_cpu)
            return time.perf_counter() - started, durations


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


def run(nodes: int, steady_passes: int, autoscaled: bool = False) -> dict[str, object]:
    clock = Clock()
    inv = Inventory()
    ids = sim_fleet(inv, nodes, gpus=8)
    half = nodes * 4
    per_dep = half // DEPLOYMENTS
    to_place = min(1000, nodes * 8 - per_dep * DEPLOYMENTS)
    cat = parse_catalog(tomllib.loads(catalog_text(per_dep, 0, autoscaled)))
    dispatcher = FakeDispatcher(connected=set(ids))
    rec = Reconciler(
        cat, inv, clock, dispatcher, adoption_grace=0, pending_timeout=1e9, fleet_state=KeptState(None)
    )
    if TUNED and hasattr(rec, "after_growth"):
        # As the control plane's CollectorTuning.freeze_grown does.
        rec.after_growth = gc.freeze
    collections.clear()
    for node_id in ids:
        rec.adopt(node_id, [])
        rec.node_registered(node_id)
    clock.advance(0)

    # Cold fill: half the GPUs.
    clock.advance(1)
    cpu: list[float] = []
    fill_s, fill_passes = passes_until_done(rec, cpu)
    placed_fill = len(dispatcher.starts)
    make_ready(rec, clock, dispatcher)

    # Steady passes: nothing to do; a fifth of the nodes heartbeat per second.
    durations = []
    for i in range(steady_passes):
        clock.advance(1)
        now = clock.seconds()
        for node_id in ids[i % 5 :: 5]:
            inv.touch(node_id, now)
        # A pass that left work (node checks) is followed at once, as the
        # reactor does (callLater(0)); each counts as a pass.
        durations.extend(passes_until_done(rec)[1])
    assert not dispatcher.starts and not dispatcher.stops, "a steady pass changed something"
    assert rec.metrics_snapshot()["nodes"]["suspect"] == 0

    # Place `to_place` new replicas.
    rec.scale("new", to_place)
    clock.advance(1)
    for node_id in ids:
        inv.touch(node_id, clock.seconds())
    place_s, place_passes = passes_until_done(rec, cpu)
    placed = len(dispatcher.starts)

    base = statistics.median(baseline(inv) for _ in range(5))
    steady = statistics.median(durations)
    return {
        "nodes": nodes,
        "gpus": nodes * 8,
        "replicas_ready": placed_fill,
        "fill_wall_s": round(fill_s, 3),
        "fill_cpu_s": round(cpu[0], 3),
        "fill_passes": len(fill_passes),
        "fill_pass_ms_max": round(max(fill_passes) * 1000, 2),
        "steady_pass_ms_median": round(steady * 1000, 3),
        "steady_pass_ms_p99": round(p99(durations) * 1000, 3),
        "steady_pass_ms_max": round(max(durations) * 1000, 3),
        "place_replicas": placed,
        "place_wall_ms": round(place_s * 1000, 2),
        "place_cpu_ms": round(cpu[1] * 1000, 2),
        "place_passes": len(place_passes),
        "place_pass_ms_max": round(max(place_passes) * 1000, 2),
        "reactor_hold_ms_max": round(max(fill_passes + durations + place_passes) * 1000, 2),
        "baseline_loop_ms": round(base * 1000, 3),
        "gc_collections": len(collections),
        "gc_ms_max": round(max(collections, default=0.0) * 1000, 2),
        "steady_over_baseline": round(steady / base, 2) if base else None,
    }


TUNED = False
#: How long each cyclic collection in the current run took, in seconds.
collections: list[float] = []
_gc_started = [0.0]


def _timed(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc_started[0] = time.perf_counter()
    else:
        collections.append(time.perf_counter() - _gc_started[0])


def measure(sizes: list[int], steady_passes: int, gc_threshold: int, autoscaled: bool = False) -> dict[str, object]:
    global TUNED
    gc.callbacks.append(_timed)
    TUNED = gc_threshold > 0
    if gc_threshold > 0:
        # As a control-plane process runs (CollectorTuning, --gc-threshold).
        gc.collect()
        gc.freeze()
        gc.set_threshold(gc_threshold, *gc.get_threshold()[1:])
    results = [run(n, steady_passes, autoscaled) for n in sizes]
    big = results[-1]
    out: dict[str, object] = {"results": results}
    if big["nodes"] == 10000:
        out["bar"] = {
            "steady_10k_p99_under_5ms": big["steady_pass_ms_p99"] < 5,  # type: ignore[operator]
            "no_pass_over_20ms": all(r["reactor_hold_ms_max"] <= 20 for r in results),  # type: ignore[operator]
            "place_1000_within_1s": all(r["place_wall_ms"] < 1000 for r in results),  # type: ignore[operator]
            "cold_fill_10k_under_3s": big["fill_wall_s"] < 3,  # type: ignore[operator]
        }
    if len(results) > 1:
        small = results[0]
        out["growth"] = {
            "nodes_factor": big["nodes"] / small["nodes"],  # type: ignore[operator]
            "steady_factor": round(big["steady_pass_ms_median"] / max(small["steady_pass_ms_median"], 1e-3), 1),  # type: ignore[operator]
            "fill_factor": round(big["fill_wall_s"] / max(small["fill_wall_s"], 1e-6), 1),  # type: ignore[operator]
            "baseline_factor": round(big["baseline_loop_ms"] / max(small["baseline_loop_ms"], 1e-3), 1),  # type: ignore[operator]
        }
    return out


def raw_run(llmgw_dir: str, args: argparse.Namespace) -> dict[str, object]:
    """
    One run of this script in a subprocess against the llmgw package in
    C{llmgw_dir}.
    """
    env = dict(os.environ, PYTHONPATH=llmgw_dir)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--raw", "--sizes", args.sizes,
         "--steady-passes", str(args.steady_passes), "--gc-threshold", str(args.gc_threshold)],
        env=env, capture_output=True, text=True, check=True,
    )
    result: dict[str, object] = json.loads(proc.stdout)
    return result


def over_rounds(runs: list[dict[str, object]], pick: Callable[[list[float]], float]) -> list[dict[str, float]]:
    """
    Each size's figures, C{pick} (the median, the least) of each over C{runs}.
    """
    per_size = zip(*(run["results"] for run in runs), strict=True)  # type: ignore[call-overload]
    return [{k: round(pick([r[k] for r in rows]), 3) for k in rows[0] if rows[0][k] is not None}
            for rows in per_size]


def interleaved(args: argparse.Namespace) -> dict[str, object]:
    """
    C{args.rounds} rounds of before then after, each a fresh subprocess.
    """
    here = str(Path(__file__).resolve().parent.parent)
    before: list[dict[str, object]] = []
    after: list[dict[str, object]] = []
    for _ in range(args.rounds):
        before.append(raw_run(args.before, args))
        after.append(raw_run(here, args))
    return {"median": {"before": over_rounds(before, statistics.median), "after": over_rounds(after, statistics.median)},
            "best": {"before": over_rounds(before, min), "after": over_rounds(after, min)},
            "rounds": {"before": [r["results"] for r in before], "after": [r["results"] for r in after]}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--sizes", default="100,1000,10000")
    parser.add_argument("--steady-passes", type=int, default=100)
    parser.add_argument("--gc-threshold", type=int, default=50_000,
                        help="the collector's young threshold, as the control plane sets it (0: Python's)")
    parser.add_argument("--before", default="", help="run against the llmgw package in this directory too")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --before: this many rounds of before and after, interleaved, each a subprocess")
    parser.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--autoscaled", action="store_true",
                        help="the ten deployments autoscale (at a fixed count), after only: what the decision costs")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.sizes.split(",")]
    if args.raw:
        print(json.dumps(measure(sizes, args.steady_passes, args.gc_threshold)))
        return 0
    out: dict[str, object] = {"benchmark": "reconcile", "python": sys.version.split()[0]}
    out["gc_threshold"] = args.gc_threshold
    if args.before and args.rounds > 1:
        out.update(interleaved(args))
        out["load"] = os.getloadavg()
        print(json.dumps(out, indent=2))
        return 0
    if args.before:
        # This script, with the other llmgw first on the path.
        out["before"] = raw_run(args.before, args)
    out["autoscaled"] = args.autoscaled
    out["after"] = measure(sizes, args.steady_passes, args.gc_threshold, args.autoscaled)
    out["load"] = os.getloadavg()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
