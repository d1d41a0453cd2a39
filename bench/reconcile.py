"""
Reconcile pass time against fleet size (DESIGN §14), printed as JSON.

For 100, 1,000 and 10,000 nodes of 8 simulated GPUs, with ready replicas on
half the GPUs:

  - steady: a pass with nothing to do, while a fifth of the nodes heartbeat
    each simulated second (as 5 s heartbeats would); median and max;
  - place: one pass that places 1,000 new single-GPU replicas (fewer where
    the free half of the fleet holds fewer);
  - baseline: a bare Python loop over the same nodes and GPUs (reading each
    GPU's free memory once), measured in the same run, so the pass can be
    read against what merely touching the data costs.

The bar: steady under 50 ms at 10,000 nodes, placing 1,000 under 500 ms,
growth no worse than linear.

Run: PYTHONPATH=. python bench/reconcile.py [--sizes 100,1000,10000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import tomllib

from twisted.internet.task import Clock

from llmgw.control.catalog import FleetState, parse_catalog
from llmgw.control.interfaces import ShardReport
from llmgw.control.inventory import Inventory
from llmgw.control.reconciler import Reconciler
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


def catalog_text(per_deployment: int, extra: int) -> str:
    text = PROFILE
    for i in range(DEPLOYMENTS):
        text += f'\n[[deployments]]\nmodel = "m{i}"\nprofile = "one"\nreplicas = {per_deployment}\n'
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


def make_ready(rec: Reconciler, dispatcher: FakeDispatcher) -> None:
    for cmd in dispatcher.starts:
        rec.on_shard_status(ShardReport(cmd.node_id, cmd.replica_id, cmd.shard_id, "starting"))
        rec.on_shard_status(ShardReport(cmd.node_id, cmd.replica_id, cmd.shard_id, "ready"))
    dispatcher.clear()


def run(nodes: int, steady_passes: int) -> dict[str, object]:
    clock = Clock()
    inv = Inventory()
    ids = sim_fleet(inv, nodes, gpus=8)
    half = nodes * 4
    per_dep = half // DEPLOYMENTS
    to_place = min(1000, nodes * 8 - per_dep * DEPLOYMENTS)
    cat = parse_catalog(tomllib.loads(catalog_text(per_dep, 0)))
    dispatcher = FakeDispatcher(connected=set(ids))
    rec = Reconciler(
        cat, inv, clock, dispatcher, adoption_grace=0, pending_timeout=1e9, fleet_state=FleetState(None)
    )
    for node_id in ids:
        rec.adopt(node_id, [])
        rec.node_registered(node_id)

    # Fill half the GPUs.
    clock.advance(1)
    started = time.perf_counter()
    rec.run_pass()
    fill_s = time.perf_counter() - started
    placed_fill = len(dispatcher.starts)
    make_ready(rec, dispatcher)

    # Steady passes: nothing to do; a fifth of the nodes heartbeat per second.
    durations = []
    for i in range(steady_passes):
        clock.advance(1)
        now = clock.seconds()
        for node_id in ids[i % 5 :: 5]:
            inv.touch(node_id, now)
        rec.run_pass()
        durations.append(rec.last_pass_duration)
    assert not dispatcher.starts and not dispatcher.stops, "a steady pass changed something"
    assert rec.metrics_snapshot()["nodes"]["suspect"] == 0

    # One pass that places `to_place` new replicas.
    rec.scale("new", to_place)
    clock.advance(1)
    for node_id in ids:
        inv.touch(node_id, clock.seconds())
    rec.run_pass()
    place_s = rec.last_pass_duration
    placed = len(dispatcher.starts)

    base = statistics.median(baseline(inv) for _ in range(5))
    steady = statistics.median(durations)
    return {
        "nodes": nodes,
        "gpus": nodes * 8,
        "replicas_ready": placed_fill,
        "fill_pass_ms": round(fill_s * 1000, 2),
        "steady_pass_ms_median": round(steady * 1000, 3),
        "steady_pass_ms_max": round(max(durations) * 1000, 3),
        "place_replicas": placed,
        "place_pass_ms": round(place_s * 1000, 2),
        "baseline_loop_ms": round(base * 1000, 3),
        "steady_over_baseline": round(steady / base, 2) if base else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--sizes", default="100,1000,10000")
    parser.add_argument("--steady-passes", type=int, default=30)
    args = parser.parse_args(argv)
    results = [run(int(n), args.steady_passes) for n in args.sizes.split(",")]
    big = results[-1]
    out: dict[str, object] = {
        "benchmark": "reconcile",
        "python": sys.version.split()[0],
        "results": results,
        "bar": {
            "steady_10k_under_50ms": big["nodes"] != 10000 or big["steady_pass_ms_max"] < 50,  # type: ignore[operator]
            "place_1000_under_500ms": all(r["place_pass_ms"] < 500 for r in results),  # type: ignore[operator]
        },
    }
    if len(results) > 1:
        small = results[0]
        scale = big["nodes"] / small["nodes"]  # type: ignore[operator]
        out["growth"] = {
            "nodes_factor": scale,
            "steady_factor": round(big["steady_pass_ms_median"] / max(small["steady_pass_ms_median"], 1e-3), 1),  # type: ignore[operator]
            "fill_pass_factor": round(big["fill_pass_ms"] / max(small["fill_pass_ms"], 1e-3), 1),  # type: ignore[operator]
            "baseline_factor": round(big["baseline_loop_ms"] / max(small["baseline_loop_ms"], 1e-3), 1),  # type: ignore[operator]
        }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
