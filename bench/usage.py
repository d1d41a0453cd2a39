"""
CPU per request of usage accounting (llmgw.gateway.usage), in this
process: the gateway's whole handling of a request (its front parsing the
request, routing, the proxy call, the replica's answer parsed and passed
on) over memory transports, with the accounting as it ships (no keys:
counted under C{_anonymous}; and a key with request and token limits),
against the same gateway with the accounting switched off (the baselines,
without keys and with the key checked, measured in the same run, rounds
interleaved). Prints JSON.

    python bench/usage.py [--requests 20000] [--rounds 5]

Non-streamed answers (one JSON body with C{usage}) and streamed ones (40
events, the last with C{usage}, then C{[DONE]}).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from twisted.internet.testing import MemoryReactorClock, StringTransport  # noqa: E402

from llmgw.gateway.keys import KeyRing  # noqa: E402
from llmgw.gateway.proxy import Gateway, GatewayConfig  # noqa: E402
from llmgw.gateway.resource import GatewayResource, GatewaySite  # noqa: E402
from llmgw.gateway.usage import KeyLimits  # noqa: E402
from llmgw.routing import (
    Route,  # noqa: E402
    RoutingSnapshot,  # noqa: E402
)

MODEL = "bench"
KEY = "sk-bench-key-0001"
#: Each accounted mode, and the mode without accounting it is measured against.
BASELINES = {"anonymous": "off", "limits": "keys_off"}
USAGE = {"prompt_tokens": 9, "completion_tokens": 40, "total_tokens": 49}


class _Off:
    """
    Usage switched off: no counting, no meter.
    """

    def admit(self, key: str | None, model: str) -> None:
        return None


def _answer(stream: bool) -> bytes:
    if not stream:
        body = json.dumps({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "word " * 40},
                         "finish_reason": "stop"}],
            "usage": USAGE,
        }).encode()
        return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
            len(body), body)
    events = []
    for _ in range(40):
        doc = {"id": "c", "object": "chat.completion.chunk", "model": MODEL,
               "choices": [{"index": 0, "delta": {"content": "word "}, "finish_reason": None}], "usage": None}
        events.append(b"data: " + json.dumps(doc).encode() + b"\n\n")
    events.append(b"data: " + json.dumps({"id": "c", "choices": [], "usage": USAGE}).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            + chunks + b"0\r\n\r\n")


def _per_request(mode: str, stream: bool, requests: int) -> float:
    """
    Microseconds of CPU per request for C{mode}: C{off}, C{anonymous},
    C{keys_off} (an API key checked, no accounting) or C{limits}.
    """
    clock = MemoryReactorClock()
    keys = None
    if mode in ("limits", "keys_off"):
        keys = KeyRing({"team": KEY}, {"team": KeyLimits(requests_per_minute=10**9, tokens_per_minute=10**12)})
    table = RoutingSnapshot([Route("r1", MODEL, "10.0.0.9:8000")], [MODEL])
    gw = Gateway(clock, table, GatewayConfig(), keys=keys)
    if mode in ("off", "keys_off"):
        gw.usage = _Off()  # type: ignore[assignment]
    site = GatewaySite(GatewayResource(gw))
    client = StringTransport()
    front = site.buildProtocol(None)
    assert front is not None
    front.makeConnection(client)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}).encode()
    auth = b"Authorization: Bearer " + KEY.encode() + b"\r\n" if keys is not None else b""
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nContent-Type: application/json\r\n"
               + auth + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    answer = _answer(stream)
    front.dataReceived(request)
    _, _, factory, _, _ = clock.tcpClients[-1]
    upstream: Any = factory.buildProtocol(None)
    up_transport = StringTransport()
    upstream.makeConnection(up_transport)
    upstream.dataReceived(answer)
    assert client.value().startswith(b"HTTP/1.1 200"), client.value()[:200]
    start = time.process_time()
    for _ in range(requests):
        client.clear()
        up_transport.clear()
        front.dataReceived(request)
        upstream.dataReceived(answer)
    spent = time.process_time() - start
    assert client.value().startswith(b"HTTP/1.1 200"), client.value()[:200]
    assert len(clock.tcpClients) == 1, "the upstream connection was not kept"
    if mode not in ("off", "keys_off"):
        row = gw.usage.row("team" if keys else None, MODEL)
        assert row.completion_tokens == USAGE["completion_tokens"] * (requests + 1), row.as_dict()
    return spent / requests * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    load_before = [round(x, 2) for x in os.getloadavg()]
    results: dict[str, Any] = {}
    for stream in (False, True):
        kind = "streaming" if stream else "non_streaming"
        samples: dict[str, list[float]] = {"off": [], "anonymous": [], "keys_off": [], "limits": []}
        for _ in range(args.rounds):
            for mode in samples:
                samples[mode].append(_per_request(mode, stream, args.requests))
        med = {mode: statistics.median(v) for mode, v in samples.items()}
        results[kind] = {
            "us_per_request": {mode: round(v, 2) for mode, v in med.items()},
            "per_round": {mode: [round(x, 2) for x in v] for mode, v in samples.items()},
            # each against its baseline: no keys, or a key checked
            "usage_us_per_request": {m: round(med[m] - med[b], 2) for m, b in BASELINES.items()},
            "usage_share": {m: round((med[m] - med[b]) / med[b], 3) for m, b in BASELINES.items()},
        }
    print(json.dumps({
        "what": __doc__.split("\n\n")[0].replace("\n", " "),
        "requests_per_round": args.requests,
        "rounds": args.rounds,
        "load_average": {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()]},
        **results,
    }, indent=1))


if __name__ == "__main__":
    main()
