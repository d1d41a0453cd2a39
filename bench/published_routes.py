"""
The published routing table (L{llmgw.control.ha.published}): what the
HA leader writes to etcd per change and what each other member does with
it, at fleet sizes. Prints JSON.

    python bench/published_routes.py [--routes 1000,10000,50000] [--rounds 20]

For each size, a routing table of that many routes (replica ids as the
reconciler makes them, addresses spread over /16 of hosts, some draining,
engine signals on every route, 50 models) and:

- C{baseline}: what C{GET /api/v1/routes} costs for the same table
  (L{snapshot_to_json} and C{json.dumps}), its bytes, measured in the same
  run;
- C{publish}: L{routes_document} + L{pack} (what the leader does at most
  once a second): milliseconds p50/p99 over C{--rounds}, compressed bytes,
  bytes per route, and whether it is under L{MAX_PUBLISHED} (etcd takes it);
- C{follow}: L{unpack} + L{snapshot_from_json} + L{RoutingTable.replace}
  (what each follower does per new table): milliseconds p50/p99.

In-process, no etcd and no sockets: it measures llmgw's own work, not
etcd's (which is one put of that many bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from twisted.internet.task import Clock  # noqa: E402

from bench.common import summary_ms  # noqa: E402
from llmgw.control.ha.published import pack, routes_document, unpack  # noqa: E402
from llmgw.control.ha.publishing import MAX_PUBLISHED  # noqa: E402
from llmgw.routing import EngineSignals, Route, RoutingTable, snapshot_from_json, snapshot_to_json  # noqa: E402


def table_of(n: int, clock: Clock, seed: int = 1) -> RoutingTable:
    rng = random.Random(seed)
    models = [f"org/model-{i:02d}" for i in range(50)]
    routes = []
    for i in range(n):
        model = models[i % len(models)]
        signals = EngineSignals(sampled_at=clock.seconds() - rng.random(), waiting=rng.randrange(8),
                                running=rng.randrange(32), kv_cache_usage=round(rng.random(), 3))
        routes.append(Route(f"lq3x7k{i:06x}", model, f"10.{rng.randrange(256)}.{rng.randrange(256)}.1:"
                            f"{20000 + rng.randrange(1000)}", draining=rng.random() < 0.02, signals=signals))
    table = RoutingTable(clock)
    table.publish(routes, models)
    return table


def measure(n: int, rounds: int) -> dict[str, Any]:
    clock = Clock()
    clock.advance(1000)
    table = table_of(n, clock)
    base_ns, pub_ns, follow_ns = [], [], []
    raw = value = b""
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        raw = json.dumps(snapshot_to_json(table, clock.seconds())).encode()
        t1 = time.perf_counter_ns()
        value = pack(routes_document(table, clock.seconds()))
        t2 = time.perf_counter_ns()
        follower = RoutingTable(clock)
        t3 = time.perf_counter_ns()
        snapshot, problems = snapshot_from_json(unpack(value), clock.seconds())
        follower.replace(snapshot)
        t4 = time.perf_counter_ns()
        assert not problems and len(follower.snapshot()) == n
        base_ns.append(t1 - t0)
        pub_ns.append(t2 - t1)
        follow_ns.append(t4 - t3)
    return {
        "routes": n,
        "baseline_get_routes": {"ms": summary_ms(base_ns), "bytes": len(raw)},
        "publish": {"ms": summary_ms(pub_ns), "bytes": len(value), "bytes_per_route": round(len(value) / n, 1),
                    "under_limit": len(value) <= MAX_PUBLISHED},
        "follow": {"ms": summary_ms(follow_ns)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--routes", default="1000,10000,50000")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    sizes = [int(x) for x in args.routes.split(",") if x]
    out = {
        "bench": "published_routes",
        "limit_bytes": MAX_PUBLISHED,
        "load": os.getloadavg(),
        "cpus": os.cpu_count(),
        "results": [measure(n, args.rounds) for n in sizes],
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
