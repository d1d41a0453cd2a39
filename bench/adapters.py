"""
What routing a request for a LoRA adapter costs the gateway beyond one for
its base model: CPU microseconds per proxied request, in process, as
C{bench/gateway_path.py} measures them (the real front, resource, proxy,
router and upstream client on in-memory transports), in one run:

- C{base}: the base model, on two replicas that hold no adapters;
- C{adapter_by_name}: an adapter held by two of three vLLM-style
  replicas (routed to its holders, the body as sent);
- C{base_by_position}, C{adapter_by_position}: the base and an adapter on
  two llama.cpp-style replicas holding four adapters (the body gets the
  C{"lora"} field selecting them).

The cases run in turn, C{--repeats} times each, so a change of the
machine's load hits all alike; each case's best run counts. The bar:
C{adapter_by_name} and C{adapter_by_position} each under 5 µs more than
C{base}.

    python bench/adapters.py [--requests 30000] [--repeats 5] [--out bench/results/adapters-2cpu.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gateway_path import RESPONSE  # noqa: E402

BAR_US = 5.0


def request(model: str) -> bytes:
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "Say hello."}]}' % model.encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


def case(routes: list[Any], adapters: dict[str, str], model: str) -> Any:
    """
    A gateway over C{routes} and one client connection; returns the
    function that sends one request for C{model} through it and back.
    """
    from twisted.internet import reactor
    from twisted.internet.address import IPv4Address
    from twisted.internet.testing import StringTransport

    from llmgw.gateway.proxy import Gateway
    from llmgw.gateway.resource import GatewayResource, GatewaySite
    from llmgw.gateway.upstream import UpstreamConnection
    from llmgw.routing import RoutingSnapshot

    table = RoutingSnapshot(routes, sorted({r.model for r in routes}), adapters=adapters)
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
    raw = request(model)

    def one() -> None:
        front.dataReceived(raw)
        for conn in replicas:
            if conn.handler is not None:
                conn.dataReceived(RESPONSE)
                conn.transport.clear()
        client.clear()

    front.dataReceived(raw)
    sent = b""
    for conn in replicas:
        if conn.handler is not None:
            sent = conn.transport.value()
            conn.dataReceived(RESPONSE)
            conn.transport.clear()
    answer = client.value()
    if not answer.startswith(b"HTTP/1.1 200 "):
        raise SystemExit(f"{model}: the gateway did not answer 200: {answer[:200]!r}")
    client.clear()
    one.sent = sent  # type: ignore[attr-defined]
    return one


def measure(requests: int, repeats: int) -> dict[str, Any]:
    from twisted.internet import reactor

    from llmgw.routing import Route

    held = ("a1", "a2", "a3", "a4")
    plain = [Route("r1", "bench", "127.0.0.1:18101"), Route("r2", "bench", "127.0.0.1:18102")]
    by_name = [Route("r1", "bench", "127.0.0.1:18101", adapters=("a1",)),
               Route("r2", "bench", "127.0.0.1:18102", adapters=("a2", "a1")),
               Route("r3", "bench", "127.0.0.1:18103", adapters=("a2",))]
    by_position = [Route(r, "bench", f"127.0.0.1:1810{i}", adapters=held, lora_ids=True)
                   for i, r in ((1, "r1"), (2, "r2"))]
    adapters = {a: "bench" for a in held}
    cases = {
        "base": case(plain, {}, "bench"),
        "adapter_by_name": case(by_name, adapters, "a1"),
        "base_by_position": case(by_position, adapters, "bench"),
        "adapter_by_position": case(by_position, adapters, "a3"),
    }
    if b'"lora":[{"id":0,"scale":0},{"id":1,"scale":0},{"id":2,"scale":1}' not in cases["adapter_by_position"].sent:
        raise SystemExit("the adapter's request was not sent with its lora field")
    for one in cases.values():
        for _ in range(2000):
            one()
    runs: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, one in cases.items():
            started = time.process_time()
            for _ in range(requests):
                one()
            runs[name].append((time.process_time() - started) / requests * 1e6)
            # The reactor is not running: drop the cancelled timers it would.
            reactor._pendingTimedCalls = [c for c in reactor._pendingTimedCalls  # type: ignore[attr-defined]
                                          if not c.cancelled]
            reactor._cancellations = 0  # type: ignore[attr-defined]
    best = {name: round(min(r), 2) for name, r in runs.items()}
    extra = {name: round(best[name] - best["base"], 2) for name in ("adapter_by_name", "adapter_by_position")}
    return {
        "us_per_request": best,
        "runs": {name: [round(x, 2) for x in r] for name, r in runs.items()},
        "adapter_extra_us": extra,
        "bar_us": BAR_US,
        "bar_met": all(v < BAR_US for v in extra.values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=30_000, help="requests per run and case")
    ap.add_argument("--repeats", type=int, default=5, help="runs per case (the best counts)")
    ap.add_argument("--out", type=Path, help="also write the result here")
    a = ap.parse_args()
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    result: dict[str, Any] = {"what": "gateway CPU per routed request, adapter vs base (bench/adapters.py)",
                              "python": sys.version.split()[0], "uptime_before": uptime}
    import llmgw.gateway.resource as resource

    result["compiled"] = not resource.__file__.endswith(".py") if resource.__file__ else False
    result.update(measure(a.requests, a.repeats))
    result["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    text = json.dumps(result, indent=2)
    print(text)
    if a.out is not None:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
