"""
The published fleet views (ha4, L{llmgw.control.published.FleetPublisher}):
what the HA leader packs every 2 s and writes to etcd when its views
changed, and what each other member does with a new document, at fleet
sizes. Prints JSON.

    python bench/published_fleet.py [--nodes 1000,10000] [--rounds 10]

For each size, admin views as the leader's handlers build them: that many
nodes of 8 GPUs each, one replica of 2 shards per 2 nodes (with engine
signals), 1,500 events, a status; and:

- C{baseline}: C{json.dumps} of the C{GET /api/v1/nodes} and
  C{/api/v1/replicas} answers (what a leader's handler costs to encode),
  measured in the same run;
- C{publish}: L{FleetPublisher.pack} (coarsening, canonical JSON, zlib,
  fingerprint), milliseconds p50/p99, compressed bytes, bytes per node, and
  whether the nodes had to be cut (over L{MAX_PUBLISHED});
- C{follow}: what L{FleetFollower} does with a new value (inflate, parse,
  check), milliseconds p50/p99.

In-process, no etcd and no sockets: llmgw's own work, not etcd's.
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
from llmgw.control.published import MAX_PUBLISHED, FleetFollower, FleetPublisher, unpack_object  # noqa: E402


def views_of(n: int, now: float, seed: int = 1) -> dict[str, Any]:
    rng = random.Random(seed)
    nodes = []
    for i in range(n):
        nodes.append({
            "id": f"gpu-{i:05d}", "state": "ready", "connected": True, "cordoned": False, "draining": False,
            "last_seen": now - rng.random() * 5, "address": f"10.{rng.randrange(256)}.{rng.randrange(256)}.1",
            "agent_version": "0.9.0",
            "gpus": [{"index": g, "uuid": f"GPU-{rng.getrandbits(64):016x}", "name": "NVIDIA H100 80GB HBM3",
                      "memory_total_mb": 81559, "memory_used_mb": rng.randrange(81559), "problems": []}
                     for g in range(8)],
            "fabrics": {"nvlink": "nv0"}, "shards": [f"lq3x7k{i:06x}-s0"], "stray_processes": [],
        })
    replicas = []
    for i in range(n // 2):
        replicas.append({
            "id": f"lq3x7k{i:06x}", "model": f"org/model-{i % 50:02d}", "profile": "h100x8", "state": "ready",
            "draining": False, "evacuating": None, "adopted": False, "created": now - 3600, "ready_since": now - 3000,
            "shards": [{"id": f"lq3x7k{i:06x}-s{r}", "node": f"gpu-{2 * i + r:05d}", "rank": r, "state": "ready",
                        "address": f"10.0.{r}.1:20000", "gpus": list(range(8)),
                        "signals": {"waiting": rng.randrange(8), "running": rng.randrange(32)}}
                       for r in range(2)],
        })
    events = [{"seq": i, "time": now - 1500 + i, "kind": "replica_ready", "model": "org/model-01",
               "replica": f"lq3x7k{i:06x}", "node": None, "detail": "all shards ready"} for i in range(1500)]
    return {"leader": "cp1", "leader_admin_url": "https://10.0.0.1:7480", "nodes": nodes,
            "replicas": replicas, "events": events,
            "status": {"nodes": {"ready": n, "suspect": 0, "lost": 0}, "connected": n}}


def measure(n: int, rounds: int) -> dict[str, Any]:
    clock = Clock()
    clock.advance(1_700_000_000)
    views = views_of(n, clock.seconds())
    publisher = FleetPublisher(clock, None, "/llmgw", lambda: views)
    follower = FleetFollower(clock, None, "/llmgw")
    base_ns, pub_ns, follow_ns = [], [], []
    value = raw = b""
    for i in range(rounds):
        t0 = time.perf_counter_ns()
        raw = json.dumps({"nodes": views["nodes"]}).encode() + json.dumps({"replicas": views["replicas"]}).encode()
        t1 = time.perf_counter_ns()
        packed = publisher.pack()
        t2 = time.perf_counter_ns()
        assert packed is not None
        value = packed[0]
        follower.value = None
        follower._take(value, i + 1)
        t3 = time.perf_counter_ns()
        assert follower.document is not None
        base_ns.append(t1 - t0)
        pub_ns.append(t2 - t1)
        follow_ns.append(t3 - t2)
    published = unpack_object(value)["views"]
    return {
        "nodes": n,
        "replicas": len(views["replicas"]),
        "baseline_get_nodes_and_replicas": {"ms": summary_ms(base_ns), "bytes": len(raw)},
        "publish": {"ms": summary_ms(pub_ns), "bytes": len(value), "bytes_per_node": round(len(value) / n, 1),
                    "nodes_published": len(published["nodes"]), "truncated": "truncated" in published},
        "follow": {"ms": summary_ms(follow_ns)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="1000,10000")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    sizes = [int(x) for x in args.nodes.split(",") if x]
    out = {
        "bench": "published_fleet",
        "limit_bytes": MAX_PUBLISHED,
        "load": os.getloadavg(),
        "cpus": os.cpu_count(),
        "results": [measure(n, args.rounds) for n in sizes],
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
