"""
The watch stream under load: N connected clients while the routing table
changes R times a second.

    python bench/watch.py                      # 1,000 clients, 100 changes/s, 20 s a phase
    python bench/watch.py --clients 200 --seconds 5

Two phases in one run, each against a fresh server process: the admin API
(L{llmgw.control.admin.site.admin_service}, its L{WatchHub} and all) on 127.0.0.1
over a fake fleet (L{llmgw.testing.fleet.sample_fleet}) whose real
L{RoutingTable} is republished R times a second; first with no watchers
(the baseline), then with N. Clients are raw WebSocket readers in
C{--procs} processes (the stream in full, as an ops tool reads it); each
notes when it first saw each route change's C{routes_revision}. Prints one
JSON document: the server's CPU (share of one core) and RSS in each phase
and their difference, and the delay from each change's publication to the
last client that received it (p50, p99, max).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import resource
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def serve(rate: float, seconds: float) -> None:
    """
    The server: prints its port, waits for "go", changes the routes
    C{rate} times a second for C{seconds}, prints the figures and exits.
    """
    from twisted.internet import epollreactor

    epollreactor.install()
    from twisted.internet import reactor, stdio
    from twisted.internet.task import LoopingCall
    from twisted.protocols.basic import LineReceiver

    from llmgw.control.admin.site import admin_service
    from llmgw.control.shell.metrics import make_registry
    from llmgw.routing import Route, RoutingTable
    from llmgw.testing.fleet import sample_fleet

    r: Any = reactor
    fleet: Any = sample_fleet()
    fleet.routing_table = RoutingTable(r)
    fleet.publish_routes()
    svc = admin_service(r, "127.0.0.1", 0, fleet, make_registry())
    svc.startService()
    published: dict[int, float] = {}
    count = [0]

    began = [0.0]

    def change() -> None:
        # As many changes as the rate owes by now: a late tick on a busy
        # machine catches up instead of lowering the rate.
        owed = int((time.time() - began[0]) * rate) - count[0]
        for _ in range(max(0, owed)):
            n = count[0] = count[0] + 1
            model = ("llama-8b", "qwen-7b")[n % 2]
            fleet.routing_table.publish_model(model, [Route(f"b{n}", model, f"10.0.{n % 250}.1:9000")])
            published[fleet.routing_table.revision] = time.time()

    class Control(LineReceiver):
        delimiter = b"\n"

        def connectionMade(self) -> None:
            self.sendLine(json.dumps({"port": svc.address()[1]}).encode())

        def lineReceived(self, line: bytes) -> None:
            if line.strip() != b"go":
                return
            start_cpu, start_wall, start_rss = _cpu(), time.time(), _rss_kb()
            began[0] = start_wall
            loop = LoopingCall(change)
            loop.clock = r
            loop.start(1.0 / rate)

            def done() -> None:
                loop.stop()
                change()
                cpu, wall = _cpu() - start_cpu, time.time() - start_wall
                self.sendLine(json.dumps({
                    "cpu_core_share": round(cpu / wall, 4), "wall_s": round(wall, 2),
                    "rss_kb_start": start_rss, "rss_kb_end": _rss_kb(),
                    "changes": len(published), "watch_clients": len(svc.watch.clients),
                    "dropped": svc.watch.dropped,
                    "published": published,
                }).encode())
                r.callLater(0.2, r.stop)

            r.callLater(seconds, done)

    stdio.StandardIO(Control())
    r.run()


def clients(port: int, n: int) -> None:
    """
    C{n} raw WebSocket clients of the stream: print "ready" once every one
    has its snapshot, then on "stop" print, per routes_revision, the latest
    first-sighting over these clients.
    """
    from twisted.internet import epollreactor

    epollreactor.install()
    from twisted.internet import reactor, stdio
    from twisted.internet.protocol import ClientFactory, Protocol
    from twisted.protocols.basic import LineReceiver

    r: Any = reactor
    pattern = re.compile(rb'"routes_revision":(\d+)')
    seen: dict[int, float] = {}
    state = {"open": 0, "closed": 0}

    class Reader(Protocol):
        upgraded = False
        last = 0
        tail = b""

        def connectionMade(self) -> None:
            key = base64.b64encode(os.urandom(16))
            self.transport.write(
                b"GET /api/v1/watch HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nUpgrade: websocket\r\n"
                b"Connection: Upgrade\r\nSec-WebSocket-Key: %s\r\nSec-WebSocket-Version: 13\r\n\r\n"
                % (port, key)
            )

        def dataReceived(self, data: bytes) -> None:
            now = time.time()
            if not self.upgraded:
                if b"snapshot" not in data:
                    self.tail += data
                    if b"snapshot" not in self.tail:
                        return
                self.upgraded = True
                state["open"] += 1
                data = b""
            text = self.tail[-40:] + data
            self.tail = data[-40:] if data else self.tail
            for m in pattern.finditer(text):
                rev = int(m.group(1))
                if rev > self.last:
                    self.last = rev
                    if seen.get(rev, 0.0) < now:
                        seen[rev] = now

        def connectionLost(self, reason: Any = None) -> None:
            state["closed"] += 1

    factory = ClientFactory()
    factory.protocol = Reader

    def dial(left: int) -> None:
        for _ in range(min(50, left)):
            r.connectTCP("127.0.0.1", port, factory)
        if left > 50:
            r.callLater(0.05, dial, left - 50)

    class Control(LineReceiver):
        delimiter = b"\n"

        def connectionMade(self) -> None:
            dial(n)
            self.check()

        def check(self) -> None:
            if state["open"] >= n:
                self.sendLine(b"ready")
            else:
                r.callLater(0.1, self.check)

        def lineReceived(self, line: bytes) -> None:
            if line.strip() == b"stop":
                self.sendLine(json.dumps({"seen": seen, "closed": state["closed"]}).encode())
                r.callLater(0.1, r.stop)

    stdio.StandardIO(Control())
    r.run()


def _percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def phase(n_clients: int, procs: int, rate: float, seconds: float) -> dict[str, Any]:
    me = [sys.executable, os.path.abspath(__file__)]
    server = subprocess.Popen(me + ["--serve", "--rate", str(rate), "--seconds", str(seconds)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert server.stdin is not None and server.stdout is not None
    port = json.loads(server.stdout.readline())["port"]
    readers = []
    if n_clients:
        share = [n_clients // procs + (1 if i < n_clients % procs else 0) for i in range(procs)]
        for k in share:
            p = subprocess.Popen(me + ["--client-proc", str(port), str(k)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            readers.append(p)
        for p in readers:
            assert p.stdout is not None
            line = p.stdout.readline()
            if line.strip() != b"ready":
                raise RuntimeError(f"a client process did not get ready: {line!r}")
    time.sleep(1.0)  # let the connection storm's garbage settle
    server.stdin.write(b"go\n")
    server.stdin.flush()
    result = json.loads(server.stdout.readline())
    server.wait()
    published = {int(k): v for k, v in result.pop("published").items()}
    delays: list[float] = []
    closed = 0
    if readers:
        time.sleep(0.5)
        last: dict[int, float] = {}
        missing = 0
        for p in readers:
            assert p.stdin is not None and p.stdout is not None
            try:
                p.stdin.write(b"stop\n")
                p.stdin.flush()
                got = json.loads(p.stdout.readline())
            except (BrokenPipeError, ValueError):
                got = {"seen": {}, "closed": -1}
            closed += got["closed"]
            for k, v in got["seen"].items():
                last[int(k)] = max(last.get(int(k), 0.0), v)
            p.wait()
        for rev, t in published.items():
            if rev in last:
                delays.append(last[rev] - t)
            else:
                missing += 1
        result["changes_not_seen_by_some_process"] = missing
    result["client_connections_closed"] = closed
    if delays:
        result["delay_ms"] = {
            "p50": round(_percentile(delays, 50) * 1000, 1),
            "p99": round(_percentile(delays, 99) * 1000, 1),
            "max": round(max(delays) * 1000, 1),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--procs", type=int, default=2, help="client processes")
    parser.add_argument("--rate", type=float, default=100.0, help="route changes a second")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--client-proc", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.rate, args.seconds)
        return
    if args.client_proc:
        clients(*args.client_proc)
        return
    baseline = phase(0, args.procs, args.rate, args.seconds)
    watched = phase(args.clients, args.procs, args.rate, args.seconds)
    out = {
        "config": {"clients": args.clients, "client_procs": args.procs, "rate": args.rate,
                   "seconds": args.seconds, "cpus": os.cpu_count(),
                   "load_before": os.getloadavg()},
        "no_watchers": baseline,
        "watchers": watched,
        "extra_cpu_core_share": round(watched["cpu_core_share"] - baseline["cpu_core_share"], 4),
        "extra_rss_mb": round((watched["rss_kb_end"] - baseline["rss_kb_end"]) / 1024, 1),
        "bars": {"extra_cpu_core_share": 0.10, "extra_rss_mb": 50, "delay_p99_ms": 200},
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
