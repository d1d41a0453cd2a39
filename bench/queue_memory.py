"""
Does a gateway's memory come back after a burst of large queued bodies?

Runs a gateway in a child process whose one model has no replica, so that
every request waits in the admission queue with its body; sends C{--count}
bodies of C{--size} MiB on as many connections; reads the child's resident
memory (RSS) before, while they wait, and after the clients have gone (their
waiters leave the queue and release their bodies); then asks the child for
glibc's C{malloc_trim(0)} (timed) and reads it again, to show what the
allocator still kept. Twice, to show whether a second burst reuses what the
first left. C{--no-trim} turns off the gateway's own trim after a burst
(L{llmgw.memtrim}), to see what glibc keeps without it.

    python -m bench.queue_memory [--count 30] [--size 7.5] [--queue-bytes-per-model MiB]

Prints one JSON object (figures in MiB, and the answers' statuses).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from llmgw.memtrim import TRIM_INTERVAL

MIB = 1024 * 1024


def serve(per_model: int, total: int, trim: int) -> None:
    """
    The child: a gateway on loopback whose model "demo" has no replica; its
    port on stdout; SIGUSR1 runs malloc_trim(0) and prints its milliseconds.
    """
    from twisted.internet import reactor

    from llmgw.gateway.proxy import Gateway, GatewayConfig
    from llmgw.gateway.resource import GatewayResource, GatewaySite
    from llmgw.routing import RoutingTable

    libc = ctypes.CDLL("libc.so.6")

    def timed_trim() -> None:
        t = time.perf_counter()
        libc.malloc_trim(0)
        print(round((time.perf_counter() - t) * 1000, 2), flush=True)

    signal.signal(signal.SIGUSR1, lambda *a: reactor.callFromThread(timed_trim))  # type: ignore[attr-defined]
    table = RoutingTable(reactor)
    table.set_known(["demo"])
    config = GatewayConfig(queue_timeout_s=600, queue_bytes_per_model=per_model, queue_bytes=total,
                           max_body=64 * MIB)
    gateway = Gateway(reactor, table, config)
    if not trim:
        gateway.admission.trimmer = None
    port = reactor.listenTCP(0, GatewaySite(GatewayResource(gateway)), interface="127.0.0.1")  # type: ignore[attr-defined]
    print(port.getHost().port, flush=True)
    reactor.run()  # type: ignore[attr-defined]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/statm", "rb") as f:
        return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB, 1)


def settle(pid: int, seconds: float = 1.0) -> float:
    """
    The child's RSS once it has stopped moving (or after 15 s).
    """
    last = rss_mib(pid)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        time.sleep(seconds)
        now = rss_mib(pid)
        if abs(now - last) < 1:
            return now
        last = now
    return last


def burst(port: int, count: int, size: int) -> tuple[list[socket.socket], dict[str, int]]:
    """
    Send C{count} requests of C{size} bytes; the connections (their
    requests waiting) and the statuses of those answered at once.
    """
    pad = size - len(b'{"model":"demo","messages":[{"role":"user","content":""}]}')
    body = b'{"model":"demo","messages":[{"role":"user","content":"' + b"x" * pad + b'"}]}'
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    conns = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(head + body)
        conns.append(s)
    time.sleep(1.0)
    statuses: dict[str, int] = {}
    for s in conns:
        s.setblocking(False)
        try:
            data = s.recv(65536)
        except BlockingIOError:
            data = b""
        status = data.split(b" ", 2)[1].decode() if data else "waiting"
        statuses[status] = statuses.get(status, 0) + 1
    return conns, statuses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=30)
    parser.add_argument("--size", type=float, default=7.5, help="MiB per body")
    parser.add_argument("--queue-bytes-per-model", type=float, default=64, help="MiB")
    parser.add_argument("--queue-bytes", type=float, default=256, help="MiB")
    parser.add_argument("--no-trim", action="store_true", help="no trim by the gateway itself")
    parser.add_argument("--serve", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(*args.serve)
        return
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.queue_memory", "--serve",
         str(int(args.queue_bytes_per_model * MIB)), str(int(args.queue_bytes * MIB)), str(int(not args.no_trim))],
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        out: dict[str, Any] = {"count": args.count, "size_mib": args.size,
                               "queue_bytes_per_model_mib": args.queue_bytes_per_model,
                               "queue_bytes_mib": args.queue_bytes, "gateway_trims": not args.no_trim,
                               "rss_mib": {"start": settle(child.pid)}}
        for n in (1, 2):
            conns, statuses = burst(port, args.count, int(args.size * MIB))
            out[f"statuses_{n}"] = statuses
            out["rss_mib"][f"waiting_{n}"] = settle(child.pid)
            for s in conns:
                s.close()
            if not args.no_trim:
                # The gateway trims at most once every TRIM_INTERVAL seconds.
                time.sleep(TRIM_INTERVAL)
            out["rss_mib"][f"after_{n}"] = settle(child.pid)
        child.send_signal(signal.SIGUSR1)
        out["malloc_trim_ms"] = float(child.stdout.readline())
        out["rss_mib"]["after_malloc_trim"] = settle(child.pid)
        print(json.dumps(out, indent=1))
    finally:
        child.terminate()
        child.wait(10)


if __name__ == "__main__":
    main()
