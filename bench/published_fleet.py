"""
The published fleet views (L{llmgw.control.ha.published_fleet.FleetPublisher}):
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
- C{ha4_publish_one_turn} / C{ha4_follow_one_turn}: the earlier pack (the
  whole document in one call) and the earlier follower's apply (inflate and
  parse it all), kept here as the baseline, in the same run;
- C{publish}: L{FleetPack}, a step per reactor turn: the longest
  turn and the sum of the turns (ms p50/p99), the turns, compressed bytes,
  bytes per node, whether the nodes had to be cut (over L{MAX_PUBLISHED});
  and the longest turn in which no full collection of Python's cyclic GC
  ran (one is a pause over every live object, whatever code runs then:
  C{full_gc} counts them and their time over the run);
- C{follow}: a follower's apply of a new value (L{FleetDocument}: the
  header only), and the first answer of each part (inflating it; later
  answers are the bytes kept).

- C{leader_views}: the leader's nodes view from a real reconciler and
  inventory: built whole in one turn against a slice per turn.

In-process, no etcd and no sockets: llmgw's own work, not etcd's.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import sys
import time
import zlib
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from twisted.internet.task import Clock  # noqa: E402

from bench.common import summary_ms  # noqa: E402
from llmgw.control.admin.fleet import nodes_view  # noqa: E402
from llmgw.control.core.catalog import EMPTY  # noqa: E402
from llmgw.control.ha.member import SlicedNodes  # noqa: E402
from llmgw.control.ha.published_fleet import (  # noqa: E402
    FLEET_EVENTS,
    FLEET_SLICE,
    FleetDocument,
    FleetPack,
    _coarse_node,
    _coarse_replica,
)
from llmgw.control.ha.publishing import MAX_PUBLISHED, PACK_LEVEL, unpack_object  # noqa: E402
from llmgw.control.shell.reconciler import Reconciler  # noqa: E402
from llmgw.control.state.inventory import GPUInfo, Inventory, Node  # noqa: E402


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


def ha4_pack(views: dict[str, Any], now: float) -> bytes:
    """The earlier pack, kept here as the baseline: the whole document in one call."""
    nodes = [_coarse_node(n) for n in views["nodes"]]
    replicas = [_coarse_replica(r) for r in views["replicas"]]
    doc = {**views, "nodes": nodes, "replicas": replicas, "events": list(views["events"])[-FLEET_EVENTS:]}
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    value = zlib.compress(b'{"published_at":' + json.dumps(now).encode() + b',"views":' + raw + b"}", PACK_LEVEL)
    hashlib.sha256(raw).digest()
    return value


def ha4_follow(value: bytes) -> dict[str, Any]:
    """The earlier follower's apply, the baseline: inflate and parse the whole document."""
    doc = unpack_object(value)
    assert isinstance(doc.get("views"), dict)
    return doc


#: Full (generation 2) collections of Python's cyclic GC seen: each is a
#: pause over every live object (the views' hundreds of thousands of dicts),
#: not the pack's own work, and falls in whichever turn allocates then.
GC_FULL = {"count": 0, "ns": 0, "began": 0}


def _gc_seen(phase: str, info: dict[str, Any]) -> None:
    if info.get("generation") != 2:
        return
    if phase == "start":
        GC_FULL["began"] = time.perf_counter_ns()
    else:
        GC_FULL["count"] += 1
        GC_FULL["ns"] += time.perf_counter_ns() - GC_FULL["began"]


def measure(n: int, rounds: int) -> dict[str, Any]:
    clock = Clock()
    clock.advance(1_700_000_000)
    views = views_of(n, clock.seconds())
    base_ns, ha4_pack_ns, ha4_follow_ns = [], [], []
    turn_max_ns, pack_total_ns, turns, turn_max_no_gc_ns = [], [], [], []
    gc_full = 0
    apply_ns, nodes_ns, replicas_ns, events_ns = [], [], [], []
    value = raw = b""
    job: FleetPack | None = None
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        raw = json.dumps({"nodes": views["nodes"]}).encode() + json.dumps({"replicas": views["replicas"]}).encode()
        t1 = time.perf_counter_ns()
        old = ha4_pack(views, clock.seconds())
        t2 = time.perf_counter_ns()
        ha4_follow(old)
        t3 = time.perf_counter_ns()
        base_ns.append(t1 - t0)
        ha4_pack_ns.append(t2 - t1)
        ha4_follow_ns.append(t3 - t2)
        # Each step is one reactor turn of the leader's.
        job = FleetPack(views, clock.seconds())
        longest = total = longest_no_gc = 0
        steps = 0
        it = job.steps_iter()
        while True:
            s0, c0 = time.perf_counter_ns(), GC_FULL["count"]
            try:
                next(it)
                done = False
            except StopIteration:
                done = True
            took = time.perf_counter_ns() - s0
            longest, total, steps = max(longest, took), total + took, steps + 1
            if GC_FULL["count"] == c0:
                longest_no_gc = max(longest_no_gc, took)
            else:
                gc_full += GC_FULL["count"] - c0
            if done:
                break
        assert job.value is not None
        value = job.value
        turn_max_ns.append(longest)
        turn_max_no_gc_ns.append(longest_no_gc)
        pack_total_ns.append(total)
        turns.append(steps)
        # The follower: apply (header), then the first answer of each part.
        f0 = time.perf_counter_ns()
        doc = FleetDocument(value)
        f1 = time.perf_counter_ns()
        doc.part("nodes")
        f2 = time.perf_counter_ns()
        doc.part("replicas")
        f3 = time.perf_counter_ns()
        doc.events()
        doc.status()
        f4 = time.perf_counter_ns()
        apply_ns.append(f1 - f0)
        nodes_ns.append(f2 - f1)
        replicas_ns.append(f3 - f2)
        events_ns.append(f4 - f3)
    assert job is not None
    return {
        "nodes": n,
        "replicas": len(views["replicas"]),
        "baseline_get_nodes_and_replicas": {"ms": summary_ms(base_ns), "bytes": len(raw)},
        "ha4_publish_one_turn": {"ms": summary_ms(ha4_pack_ns), "bytes": len(old)},
        "ha4_follow_one_turn": {"ms": summary_ms(ha4_follow_ns)},
        "publish": {"max_turn_ms": summary_ms(turn_max_ns),
                    "max_turn_without_full_gc_ms": summary_ms(turn_max_no_gc_ns),
                    "full_gc_in_turns": gc_full, "total_ms": summary_ms(pack_total_ns),
                    "turns": max(turns), "bytes": len(value), "bytes_per_node": round(len(value) / n, 1),
                    "nodes_published": job.nodes_published, "truncated": job.nodes_published < n},
        "follow": {"apply_ms": summary_ms(apply_ns), "first_nodes_answer_ms": summary_ms(nodes_ns),
                   "first_replicas_answer_ms": summary_ms(replicas_ns),
                   "first_events_and_status_ms": summary_ms(events_ns)},
    }


def measure_leader_views(n: int, rounds: int) -> dict[str, Any]:
    """
    The leader's nodes view at C{n} nodes of 8 GPUs from a real
    L{Reconciler} and L{Inventory}: the earlier pack built it whole in its first
    turn (C{admin.nodes_view}); now it is built a slice of L{FLEET_SLICE} per
    turn (L{SlicedNodes}), measured here per slice (the pack's own work for
    the slice comes on top: C{publish.max_turn_without_full_gc_ms}).
    """
    clock = Clock()
    inventory = Inventory()
    rec = Reconciler(EMPTY, inventory, clock=clock)
    rng = random.Random(3)
    for i in range(n):
        inventory.upsert(Node(f"gpu-{i:05d}", address=f"10.{rng.randrange(256)}.{rng.randrange(256)}.1",
                              gpus=[GPUInfo(g, f"GPU-{rng.getrandbits(64):016x}", "NVIDIA H100 80GB HBM3", 81559,
                                            rng.randrange(81559)) for g in range(8)]))
    whole_ns, slice_max_ns, slice_no_gc_ns = [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        nodes_view(rec, None)
        whole_ns.append(time.perf_counter_ns() - t0)
        sliced = SlicedNodes(rec, None)
        longest = longest_no_gc = 0
        for i in range(0, len(sliced), FLEET_SLICE):
            s0, c0 = time.perf_counter_ns(), GC_FULL["count"]
            sliced[i:i + FLEET_SLICE]
            took = time.perf_counter_ns() - s0
            longest = max(longest, took)
            if GC_FULL["count"] == c0:
                longest_no_gc = max(longest_no_gc, took)
        slice_max_ns.append(longest)
        slice_no_gc_ns.append(longest_no_gc)
    return {"nodes": n, "ha4_nodes_view_one_turn": {"ms": summary_ms(whole_ns)},
            "ha5_slice": {"nodes": FLEET_SLICE, "max_ms": summary_ms(slice_max_ns),
                          "max_without_full_gc_ms": summary_ms(slice_no_gc_ns)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="1000,10000")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    sizes = [int(x) for x in args.nodes.split(",") if x]
    gc.callbacks.append(_gc_seen)
    out = {
        "bench": "published_fleet",
        "limit_bytes": MAX_PUBLISHED,
        "load": os.getloadavg(),
        "cpus": os.cpu_count(),
        "results": [measure(n, args.rounds) for n in sizes],
        "leader_views": [measure_leader_views(n, args.rounds) for n in sizes],
        "full_gc": {"count": GC_FULL["count"], "ms": round(GC_FULL["ns"] / 1e6, 3)},
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
