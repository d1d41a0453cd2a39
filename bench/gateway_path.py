"""
The gateway's own CPU per proxied request, in process: no sockets, no model
server, no load tool, so the figure hardly moves with the machine's load.

One gateway (its real front, resource, proxy, router, metrics and upstream
client, on the real reactor's timers, not running) with two replicas of
one model; each client connection and replica connection is an in-memory
transport. A request is a chat completion as C{wrk} sends it in
C{bench/gateway.py}; each replica answers what the fake model server
answers. Per request: the client's bytes into the front, the replica's
answer into its connection, the client's answer read off. It reports CPU
microseconds per request (the best of C{--repeats} runs) and checks that
the answers are 200s.

C{--baseline DIR} runs the same in another checkout of llmgw (say
C{git archive OLD | tar -x -C DIR}), in a process of its own, one run
each in turn: before and after, in one invocation.

    python bench/gateway_path.py [--requests 50000] [--repeats 5] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BODY = b'{"model": "bench", "messages": [{"role": "user", "content": "Say hello."}]}'
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
)
ANSWER = (
    b'{"id": "chatcmpl-d0fe65148d5b4430a31641afc266c43d", "object": "chat.completion", "created": 1796131648, '
    b'"model": "bench", "choices": [{"index": 0, "message": {"role": "assistant", "content": "This is a reply '
    b'from the fake model. This is a reply from the fake"}, "logprobs": null, "finish_reason": "stop"}], '
    b'"usage": {"prompt_tokens": 2, "completion_tokens": 16, "total_tokens": 18}}'
)
RESPONSE = (
    b"HTTP/1.1 200 OK\r\nServer: TwistedWeb/26.10.0\r\nDate: Tue, 01 Dec 2026 13:27:28 GMT\r\n"
    b"X-Fakemodel-Instance: 127.0.0.1:18111\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
    % (len(ANSWER), ANSWER)
)


def measure(requests: int, repeats: int, policy: str = "") -> dict[str, Any]:
    """
    CPU microseconds per proxied request through the llmgw importable here,
    routed by C{policy} (empty: the gateway's default).
    """
    from twisted.internet import reactor
    from twisted.internet.address import IPv4Address
    from twisted.internet.testing import StringTransport

    from llmgw.gateway.proxy import Gateway
    from llmgw.gateway.resource import GatewayResource, GatewaySite
    from llmgw.gateway.upstream import UpstreamConnection
    from llmgw.routing import Route, RoutingSnapshot

    routes = [Route("r1", "bench", "127.0.0.1:18101"), Route("r2", "bench", "127.0.0.1:18102")]
    # Without a policy, as an older llmgw (a baseline) builds it.
    table = RoutingSnapshot(routes, ["bench"], policies={"bench": policy}) if policy else RoutingSnapshot(
        routes, ["bench"])
    gateway = Gateway(reactor, table)
    site = GatewaySite(GatewayResource(gateway), reactor)
    replicas = []
    for route in routes:
        conn = UpstreamConnection(gateway.pool, route.address)
        conn.makeConnection(StringTransport())
        gateway.pool.release(conn)
        replicas.append(conn)
    front = site.buildProtocol(None)
    assert front is not None
    client = StringTransport(peerAddress=IPv4Address("TCP", "127.0.0.1", 40000))
    front.makeConnection(client)

    def one() -> None:
        front.dataReceived(REQUEST)
        for conn in replicas:
            if conn.handler is not None:
                conn.dataReceived(RESPONSE)
                conn.transport.clear()
        client.clear()

    front.dataReceived(REQUEST)
    for conn in replicas:
        if conn.handler is not None:
            conn.dataReceived(RESPONSE)
    answer = client.value()
    if not answer.startswith(b"HTTP/1.1 200 ") or not answer.endswith(ANSWER):
        raise SystemExit(f"the gateway did not answer 200 with the replica's body: {answer[:200]!r}")
    client.clear()
    for _ in range(2000):
        one()
    runs = []
    for _ in range(repeats):
        started = time.process_time()
        for _ in range(requests):
            one()
        runs.append((time.process_time() - started) / requests * 1e6)
        # The reactor is not running: drop the cancelled timers it would.
        reactor._pendingTimedCalls = [c for c in reactor._pendingTimedCalls if not c.cancelled]  # type: ignore[attr-defined]
        reactor._cancellations = 0  # type: ignore[attr-defined]
    return {"us_per_request": round(min(runs), 2), "runs": [round(r, 2) for r in runs]}


def in_checkout(root: Path, requests: int, repeats: int, policy: str = "") -> dict[str, Any]:
    """
    L{measure} (this file's) in a process of its own, importing llmgw from
    C{root}.
    """
    env = dict(os.environ, PYTHONPATH=str(root))
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--one", "--requests", str(requests),
         "--repeats", str(repeats), "--policy", policy],
        env=env, cwd=str(root), capture_output=True, text=True, check=True,
    ).stdout
    return json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=50_000, help="requests per run")
    ap.add_argument("--repeats", type=int, default=5, help="runs (the best counts)")
    ap.add_argument("--baseline", type=Path, help="another llmgw checkout to measure beside")
    ap.add_argument("--policy", default="", help="the routing policy (default: the gateway's default)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(measure(a.requests, a.repeats, a.policy)))
        return
    here = Path(__file__).resolve().parent.parent
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    result: dict[str, Any] = {"what": "gateway CPU per proxied request in process (bench/gateway_path.py)",
                              "python": sys.version.split()[0], "uptime_before": uptime,
                              "policy": a.policy or "the default"}
    if a.baseline is None:
        result["this"] = in_checkout(here, a.requests, a.repeats, a.policy)
    else:
        # In turn, twice each, so that a change of load hits both alike.
        this, base = [], []
        for _ in range(2):
            this.append(in_checkout(here, a.requests, a.repeats, a.policy))
            base.append(in_checkout(a.baseline.resolve(), a.requests, a.repeats, a.policy))
        result["this"] = min(this, key=lambda r: r["us_per_request"])
        result["baseline"] = min(base, key=lambda r: r["us_per_request"])
        result["baseline_at"] = str(a.baseline)
        result["ratio"] = round(result["this"]["us_per_request"] / result["baseline"]["us_per_request"], 3)
    result["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
