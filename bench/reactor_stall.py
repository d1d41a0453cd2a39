"""
The reactor's longest stall while a gateway reads adversarial JSON bodies.

A gateway process (the real front, resource and sliced parse of
C{llmgw.gateway}, on the epoll reactor, on loopback) with a heartbeat: a
C{LoopingCall} every millisecond that records the gap since its last call.
For each shape of body (many small keys, many small messages, deep nesting,
one long string, many escapes, surrogate pairs, many small array items, a
huge number, a run of blanks, a long key), at the gateway's largest body
(8 MiB, and 16 MiB for margin) the orchestrator posts one body and reads
the answer (404: no such model; the body is parsed in full first), while a
well-behaved client asks for C{/health} every 5 ms on a connection of its
own. Per shape it reports the reactor's longest gap (wall clock, and the
reactor thread's CPU time in that gap, which leaves out the time other
processes of a shared machine took), the well-behaved client's latencies
and the time to the answer.

The baseline is the same gateway with every body parsed at once by
C{json.loads} (C{load_json}), in the same run. The bar: no gap of the
sliced gateway over 20 ms. Also reported, in this process: the CPU time
of what follows the parse of a body on the reactor (the prefix policy's
key on the kept sample, and freeing it).

    python bench/reactor_stall.py [--sizes 8,16] [--shapes a,b] > bench/results/reactor-stall-2cpu.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 1024 * 1024
#: Heartbeat interval of the gateway process's reactor, seconds.
BEAT = 0.001
#: How often the well-behaved client asks, seconds.
PROBE_EVERY = 0.005


def bodies(size: int) -> dict[str, bytes]:
    """
    One body of about C{size} bytes per adversarial shape.
    """

    def fill(head: bytes, unit: bytes, tail: bytes) -> bytes:
        n = max(1, (size - len(head) - len(tail)) // (len(unit) + 1))
        return head + b",".join([unit] * n) + tail

    pad = size - 64
    return {
        "small_keys": b'{"model":"nope",' + b",".join(b'"%07x":1' % i for i in range((size - 20) // 12)) + b"}",
        "small_messages": fill(b'{"model":"nope","messages":[', b'{"role":"user","content":"x"}', b"]}"),
        "deep_nesting": fill(b'{"model":"nope","messages":[', b"[" * 62 + b"]" * 62, b"]}"),
        "long_string": b'{"model":"nope","prompt":"' + b"a" * pad + b'"}',
        "many_escapes": b'{"model":"nope","prompt":"' + b'\\n\\"\\u00e9' * (pad // 10) + b'"}',
        "surrogate_pairs": b'{"model":"nope","prompt":"' + b"\\ud83d\\ude00" * (pad // 12) + b'"}',
        "small_items": fill(b'{"model":"nope","prompt":[', b"7", b"]}"),
        "empty_objects": fill(b'{"model":"nope","messages":[', b"{}", b"]}"),
        "huge_number": b'{"model":"nope","x":0.' + b"1" * pad + b"}",
        "blanks": b'{"model":"nope","x":1' + b" " * pad + b"}",
        "long_key": b'{"model":"nope","' + b"k" * pad + b'":1}',
    }


# -- the gateway process -----------------------------------------------------------------


def child(mode: str, max_body: int, freeze: bool) -> None:
    from twisted.internet import epollreactor

    epollreactor.install()
    from twisted.internet import reactor, stdio
    from twisted.internet.task import LoopingCall

    import llmgw.gateway.resource as resource_module
    from bench.common import ControlChannel
    from llmgw.gateway.proxy import Gateway, GatewayConfig
    from llmgw.gateway.resource import GatewayResource, GatewaySite
    from llmgw.routing import RoutingSnapshot

    if mode == "json.loads":
        # Every body parsed at once, as before the sliced parse.
        resource_module.sliced = lambda body: False  # type: ignore[assignment]
    gateway = Gateway(reactor, RoutingSnapshot([], ["bench"]), GatewayConfig(max_body=max_body))
    site = GatewaySite(GatewayResource(gateway), reactor)
    port = reactor.listenTCP(0, site, interface="127.0.0.1")  # type: ignore[attr-defined]
    gaps: list[tuple[float, float]] = []
    last = [time.perf_counter(), time.thread_time()]

    def beat() -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        gaps.append((now - last[0], cpu - last[1]))
        last[0], last[1] = now, cpu

    LoopingCall(beat).start(BEAT)
    if freeze:
        # What a process can do once it is built: its objects then cost the
        # collector's full passes nothing.
        gc.freeze()
    # The cyclic collector's passes, by generation: (count, longest CPU s).
    collections: dict[int, list[float]] = {}
    collecting = [0.0]

    def timed(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collecting[0] = time.thread_time()
            return
        seen = collections.setdefault(info["generation"], [0, 0.0])
        seen[0] += 1
        seen[1] = max(seen[1], time.thread_time() - collecting[0])

    gc.callbacks.append(timed)

    def reset(req: dict[str, Any]) -> dict[str, Any]:
        del gaps[:]
        collections.clear()
        return {"ok": True}

    def stats(req: dict[str, Any]) -> dict[str, Any]:
        wall = sorted(g for g, _ in gaps)
        worst = max(gaps, default=(0.0, 0.0))
        return {
            "beats": len(gaps),
            "max_gap_ms": round(worst[0] * 1e3, 2),
            "cpu_in_max_gap_ms": round(worst[1] * 1e3, 2),
            "max_cpu_gap_ms": round(max((c for _, c in gaps), default=0.0) * 1e3, 2),
            "p99_gap_ms": round(wall[int(len(wall) * 0.99)] * 1e3, 2) if wall else None,
            "gaps_over_20ms": sum(1 for g in wall if g > 0.020),
            "gaps_over_10ms": sum(1 for g in wall if g > 0.010),
            "gc": {f"gen{g}": {"n": int(n), "max_ms": round(d * 1e3, 2)} for g, (n, d) in sorted(collections.items())},
            "tracked_objects": len(gc.get_objects()),
        }

    channel = ControlChannel({"reset": reset, "stats": stats}, {"port": port.getHost().port},
                             lambda: reactor.stop())  # type: ignore[attr-defined]
    stdio.StandardIO(channel)
    reactor.run()  # type: ignore[attr-defined]


# -- the orchestrator ----------------------------------------------------------------------


class Child:
    def __init__(self, mode: str, max_body: int, freeze: bool = False):
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", mode, "--max-body", str(max_body)] + (["--gc-freeze"] if freeze else []),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        self.port = self.read()["port"]

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the gateway process ended")
        return json.loads(line)

    def ask(self, op: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op}).encode() + b"\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def read_response(sock: socket.socket) -> int:
    """
    Read one HTTP response (framed by Content-Length) off C{sock}; its status.
    """
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise RuntimeError("the gateway closed the connection")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise RuntimeError("the gateway closed the connection")
        rest += chunk
    return int(head.split(b" ")[1])


def post(port: int, body: bytes) -> tuple[int, float]:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        started = time.perf_counter()
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        status = read_response(sock)
        return status, time.perf_counter() - started


class Probe(threading.Thread):
    """
    A well-behaved client: C{GET /health} every L{PROBE_EVERY} seconds on
    one kept-alive connection, recording each answer's latency.
    """

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port = port
        self.latencies: list[float] = []
        self.errors = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        sock = socket.create_connection(("127.0.0.1", self.port))
        try:
            while not self.stopping.is_set():
                started = time.perf_counter()
                try:
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                    if read_response(sock) != 200:
                        self.errors += 1
                except (OSError, RuntimeError):
                    # Counted, and asked again on a new connection.
                    self.errors += 1
                    sock.close()
                    sock = socket.create_connection(("127.0.0.1", self.port))
                    continue
                self.latencies.append(time.perf_counter() - started)
                self.stopping.wait(PROBE_EVERY)
        finally:
            sock.close()


def run_mode(mode: str, sizes: list[int], shapes: list[str] | None, freeze: bool = False) -> dict[str, Any]:
    from bench.common import percentile

    child = Child(mode, max(sizes), freeze)
    out: dict[str, Any] = {}
    try:
        for size in sizes:
            for shape, body in bodies(size).items():
                if shapes and shape not in shapes:
                    continue
                child.ask("reset")
                probe = Probe(child.port)
                probe.start()
                time.sleep(0.05)
                status, took = post(child.port, body)
                time.sleep(0.05)
                probe.stopping.set()
                probe.join()
                lat = sorted(probe.latencies)
                out[f"{shape}@{size // MIB}MiB"] = {
                    "bytes": len(body),
                    "status": status,
                    "answer_s": round(took, 3),
                    **child.ask("stats"),
                    "probe": {
                        "n": len(lat),
                        "p99_ms": round(percentile(lat, 99) * 1e3, 2),
                        "max_ms": round(lat[-1] * 1e3, 2) if lat else None,
                        "errors": probe.errors,
                    },
                }
                print(f"{mode} {shape}@{size // MIB}MiB {out[f'{shape}@{size // MIB}MiB']}", file=sys.stderr)
    finally:
        child.close()
    return out


def after_parse(size: int, shapes: list[str] | None) -> dict[str, Any]:
    """
    CPU ms, in this process, of the prefix policy's key on the sample kept
    of each body, and of freeing it: what runs on the reactor after the
    last slice.
    """

    from llmgw.gateway.bigbody import KEPT_CHARS, KEPT_ITEMS
    from llmgw.gateway.policy import PolicyConfig, affinity_key
    from llmgw.gateway.resource import KEPT_KEYS
    from llmgw.jsonslices import load_json_sliced, run_sliced
    from llmgw.untrusted import JSONInputError

    out: dict[str, Any] = {}
    for shape, body in bodies(size).items():
        if shapes and shape not in shapes:
            continue
        try:
            value = run_sliced(load_json_sliced(body, unique=("model",), keep=KEPT_KEYS,
                                                kept_items=KEPT_ITEMS, kept_chars=KEPT_CHARS))
        except JSONInputError:
            continue
        gc.collect()
        started = time.thread_time()
        affinity_key(value, None, PolicyConfig())
        del value
        out[shape] = round((time.thread_time() - started) * 1e3, 2)
    return out


def bars(runs: dict[str, Any], sizes: list[int]) -> dict[str, Any]:
    """
    The bar, per body size (the largest the default limits allow, 8 MiB,
    and twice that for margin): the longest gap of C{runs}, on the wall
    clock and in the reactor thread's CPU time.
    """
    out = {}
    for size in sizes:
        these = [r for k, r in runs.items() if k.endswith(f"@{size // MIB}MiB")]
        worst = max((r["max_gap_ms"] for r in these), default=0.0)
        worst_cpu = max((r["max_cpu_gap_ms"] for r in these), default=0.0)
        out[f"{size // MIB}MiB"] = {
            "max_stall_ms": worst,
            "max_stall_cpu_ms": worst_cpu,
            "under_20ms": worst < 20.0,
            # The reactor thread's own work in its longest gap: what the
            # gateway did, less the time other processes of a shared
            # machine held the CPU.
            "cpu_under_20ms": worst_cpu < 20.0,
            "gaps_over_20ms": sum(r["gaps_over_20ms"] for r in these),
            "gaps_over_10ms": sum(r["gaps_over_10ms"] for r in these),
            "beats": sum(r["beats"] for r in these),
            "full_collector_passes": sum(r["gc"].get("gen2", {}).get("n", 0) for r in these),
            "longest_full_pass_ms": max((r["gc"].get("gen2", {}).get("max_ms", 0.0) for r in these), default=0.0),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8,16", help="body sizes in MiB, comma-separated (the first is the baseline's)")
    ap.add_argument("--shapes", default="", help="only these shapes, comma-separated")
    ap.add_argument("--no-baseline", action="store_true", help="skip the json.loads baseline")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="also run the sliced gateway with gc.freeze() once built (its objects out of full passes)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--max-body", type=int, default=17 * MIB, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.max_body, a.gc_freeze)
        return
    sizes = [int(s) * MIB for s in a.sizes.split(",")]
    shapes = [s for s in a.shapes.split(",") if s] or None
    result: dict[str, Any] = {
        "config": {
            "sizes_mib": [s // MIB for s in sizes],
            "heartbeat_ms": BEAT * 1e3,
            "probe_every_ms": PROBE_EVERY * 1e3,
            "cpus": os.cpu_count(),
            "load_before": list(os.getloadavg()),
            "python": sys.version.split()[0],
        },
        "sliced": run_mode("sliced", sizes, shapes),
    }
    if a.gc_freeze:
        result["sliced+gc.freeze"] = run_mode("sliced", sizes, shapes, freeze=True)
    if not a.no_baseline:
        result["json.loads"] = run_mode("json.loads", sizes[:1], shapes)
    result["after_parse_cpu_ms"] = after_parse(sizes[-1], shapes)
    result["bar"] = {mode: bars(result[mode], sizes) for mode in ("sliced", "sliced+gc.freeze") if mode in result}
    result["config"]["load_after"] = list(os.getloadavg())
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
