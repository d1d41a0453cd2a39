"""
The console's costs (issue bars, DESIGN §21), printed as JSON.

Section C{curves}: what keeping the curves costs the control plane at
10,000 nodes (bar: under 1% of a core and under 20 MiB). In one process, a
reconciler holds 10,000 simulated nodes of 8 GPUs with half of them
running single-GPU replicas of 10 deployments (40,000 shards), each node's
heartbeat carrying its GPU memory and its shards' engine signals, and an
embedded gateway counting requests, first bytes and tokens for 10 models
and 50 API keys. Each
simulated 10-second step does the control plane's work (every node's
heartbeat, ten reconcile passes, the gateway's requests) and then one
sample of the L{SeriesKeeper}, as its 10 s loop would.

  - CPU: the keeper's sample, timed alone (process CPU time): median, p99,
    max, and its share of a core (mean sample / step). Also the steps'
    CPU with and without the keeper, the same work otherwise (noisy on a
    shared machine; the timed sample is the figure).
  - memory: what the keeper holds once its rings are full (an hour of
    samples, 361), by tracemalloc from its creation on; and the rings'
    own bytes. Also the process's RSS growth over that hour.
  - the answer: C{GET /api/v1/series}'s view, first (since=0) and a
    poll's (since the newest), its time and JSON size.

The collector runs as in a control-plane process (C{--gc-threshold},
default 50,000, the heap frozen after the fleet is built); C{0} leaves
Python's defaults.

Run: PYTHONPATH=. python bench/page.py [--section curves] [--nodes 10000] [--steps 30] [--gc-threshold N]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import tomllib
import tracemalloc
from typing import Any

from twisted.internet.task import Clock

from bench.reconcile import DEPLOYMENTS, catalog_text, make_ready, passes_until_done
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.core.catalog import parse_catalog
from llmgw.control.core.kept import KeptState
from llmgw.control.shell.reconciler import Reconciler
from llmgw.control.shell.series import ControlSources, SeriesKeeper
from llmgw.control.state.inventory import Inventory
from llmgw.control.state.series import KEEP_S, STEP_S, points_for
from llmgw.gateway.keys import KeyRing
from llmgw.gateway.service import GatewayService
from llmgw.routing import Route, RoutingSnapshot
from llmgw.testing.simfleet import FakeDispatcher, sim_fleet

KEYS = 50
REQUESTS_PER_MODEL = 40


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Fleet:
    """The simulated control plane: reconciler, inventory, embedded gateway."""

    def __init__(self, nodes: int):
        self.clock = Clock()
        self.clock.advance(1_700_000_000)
        self.inv = Inventory()
        self.ids = sim_fleet(self.inv, nodes, gpus=8)
        per_dep = nodes * 4 // DEPLOYMENTS
        cat = parse_catalog(tomllib.loads(catalog_text(per_dep, 0)))
        self.dispatcher = FakeDispatcher(connected=set(self.ids))
        self.rec = Reconciler(cat, self.inv, self.clock, self.dispatcher, adoption_grace=0,
                              pending_timeout=1e9, fleet_state=KeptState(None))
        for node_id in self.ids:
            self.rec.adopt(node_id, [])
            self.rec.node_registered(node_id)
        self.clock.advance(1)
        passes_until_done(self.rec)
        self.shards: dict[str, list[str]] = {}
        for cmd in self.dispatcher.starts:
            self.shards.setdefault(cmd.node_id, []).append(cmd.shard_id)
        make_ready(self.rec, self.clock, self.dispatcher)
        keys = {f"key-{i:02}": f"sk-bench-key-{i:04}" for i in range(KEYS)}
        self.gateway = GatewayService(self.clock, RoutingSnapshot([Route("r1", "m0", "10.0.0.9:8000")]),
                                      port=0, keys=KeyRing(keys)).gateway
        self.key_names = sorted(keys)
        self.tokens = 0.0
        self.step_no = 0

    def heartbeats(self) -> None:
        now_tokens = self.tokens
        for i, node_id in enumerate(self.ids):
            shards = self.shards.get(node_id, [])
            used = [1000 + (self.step_no * 37 + i + g) % 50_000 for g in range(8)]
            self.inv.apply_heartbeat(node_id, used, [])
            self.inv.touch(node_id, self.clock.seconds())
            self.rec.record_engine_signals(node_id, [
                pb.ShardSignals(shard_id=s, age_s=0.5, waiting=1, running=2, generated_tokens=now_tokens + i)
                for s in shards])

    def traffic(self) -> None:
        metrics, usage = self.gateway.metrics, self.gateway.usage
        for m in range(DEPLOYMENTS):
            model = f"m{m}"
            for r in range(REQUESTS_PER_MODEL):
                metrics.count(model, "/v1/chat/completions", 200)
                metrics.first_byte(model, 0.05 + 0.01 * (r % 20))
                meter = usage.admit(self.key_names[(m * REQUESTS_PER_MODEL + r) % KEYS], model)
                meter.feed(b'{"usage": {"prompt_tokens": 30, "completion_tokens": 70, "total_tokens": 100}}')
                meter.finish(200)

    def step(self) -> None:
        """The control plane's work over one 10 s step, the keeper aside."""
        self.step_no += 1
        self.tokens += 500.0
        self.heartbeats()
        self.traffic()
        for _ in range(10):
            self.clock.advance(1)
            passes_until_done(self.rec)

    def keeper(self) -> SeriesKeeper:
        return SeriesKeeper(self.clock, ControlSources(self.rec, self.inv, lambda: self.gateway))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def curves(nodes: int, steps: int, gc_threshold: int) -> dict[str, Any]:
    started = time.monotonic()
    fleet = Fleet(nodes)
    setup_s = time.monotonic() - started
    if gc_threshold:
        # As a control-plane process runs (--gc-threshold, CollectorTuning):
        # the fleet's records frozen out of the collector's scans.
        gc.collect()
        gc.freeze()
        gc.set_threshold(gc_threshold)
    fleet.step()
    keeper = fleet.keeper()
    keeper.sample()
    # CPU: steps with and without the keeper, alternating, so that drift
    # on a shared machine falls on both.
    with_keeper, without, samples = [], [], []
    for i in range(2 * steps):
        t0 = time.process_time()
        fleet.step()
        if i % 2 == 0:
            s0 = time.process_time()
            keeper.sample()
            samples.append(time.process_time() - s0)
            with_keeper.append(time.process_time() - t0)
        else:
            without.append(time.process_time() - t0)
    mean_sample = statistics.fmean(samples)
    # The answer, with an hour of curves or what there is.
    t0 = time.perf_counter()
    first = json.dumps(keeper.view(0.0))
    view_ms = (time.perf_counter() - t0) * 1000
    newest = keeper.models.times[keeper.models.slot]
    fleet.step()
    keeper.sample()
    t0 = time.perf_counter()
    poll = json.dumps(keeper.view(newest))
    poll_ms = (time.perf_counter() - t0) * 1000

    # Memory: a new keeper, filled for an hour, traced from its creation.
    points = points_for(KEEP_S, STEP_S)
    del keeper
    gc.collect()
    rss0 = rss_bytes()
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    keeper = fleet.keeper()
    # No heartbeats meanwhile: what they replace in the fleet's records
    # would be traced as new, and the rings' size does not depend on the
    # values they hold.
    for _ in range(points + 5):
        fleet.clock.advance(STEP_S)
        keeper.sample()
    gc.collect()
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss1 = rss_bytes()
    full_view = json.dumps(keeper.view(0.0))
    return {
        "nodes": nodes,
        "gpus": nodes * 8,
        "shards": sum(len(s) for s in fleet.shards.values()),
        "models": DEPLOYMENTS,
        "api_keys": KEYS,
        "setup_s": round(setup_s, 1),
        "step_s": STEP_S,
        "steps_timed": steps,
        "sample_cpu_ms_median": round(statistics.median(samples) * 1000, 2),
        "sample_cpu_ms_p99": round(pct(samples, 0.99) * 1000, 2),
        "sample_cpu_ms_max": round(max(samples) * 1000, 2),
        "core_share_pct": round(100 * mean_sample / STEP_S, 3),
        "step_cpu_ms_with_keeper_median": round(statistics.median(with_keeper) * 1000, 1),
        "step_cpu_ms_without_median": round(statistics.median(without) * 1000, 1),
        "points_per_curve": points,
        "curves": {"models": len(keeper.models), "nodes": len(keeper.nodes), "keys": len(keeper.keys)},
        "memory_held_mib": round((held - base) / 2**20, 2),
        "memory_peak_mib": round((peak - base) / 2**20, 2),
        "rings_mib": round(keeper.nbytes() / 2**20, 2),
        "rss_growth_mib": round((rss1 - rss0) / 2**20, 1),
        "answer_first_kib": round(len(first) / 1024, 1),
        "answer_first_ms": round(view_ms, 2),
        "answer_poll_kib": round(len(poll) / 1024, 1),
        "answer_poll_ms": round(poll_ms, 2),
        "answer_full_hour_kib": round(len(full_view) / 1024, 1),
        "bar": {"core_share_pct_under": 1.0, "memory_mib_under": 20.0},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--section", choices=["curves"], default="curves")
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=30, help="10 s steps timed with the keeper (as many without)")
    parser.add_argument("--gc-threshold", type=int, default=50_000,
                        help="the collector's young threshold, as the control plane sets it (0: Python's, no freeze)")
    args = parser.parse_args(argv)
    out: dict[str, Any] = {"benchmark": "page", "python": sys.version.split()[0], "gc_threshold": args.gc_threshold}
    out["curves"] = curves(args.nodes, args.steps, args.gc_threshold)
    c = out["curves"]
    out["curves"]["passed"] = c["core_share_pct"] < 1.0 and c["memory_held_mib"] < 20.0
    out["load"] = os.getloadavg()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
