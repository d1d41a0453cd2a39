"""
What the HTTP surfaces' input checks cost, per call, in one process:
C{json.loads} against L{llmgw.untrusted.load_json} (a typical chat body, a
200-message one, and the adversarial 8 MiB bodies it must stay linear on),
the C{Host} check, and the replica head grammar of
L{llmgw.gateway.upstream}; each beside its baseline in the same run.

    python bench/surface.py [--rounds 5]

Prints one JSON document; times are microseconds per call (medians of the
rounds), measured with C{time.process_time}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmgw.gateway.upstream import _VALID_HEAD  # noqa: E402
from llmgw.hostcheck import HostCheck  # noqa: E402
from llmgw.untrusted import JSONInputError, load_json  # noqa: E402


def per_call_us(f: Callable[[], Any], n: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.process_time()
        for _ in range(n):
            f()
        times.append((time.process_time() - started) / n * 1e6)
    return round(statistics.median(times), 3)


def refused(f: Callable[[], Any]) -> Callable[[], Any]:
    def call() -> None:
        try:
            f()
        except (JSONInputError, RecursionError, ValueError):
            pass

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    small = json.dumps(
        {"model": "demo", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16}
    ).encode()
    chat200 = json.dumps(
        {"model": "demo", "messages": [{"role": "user", "content": "hello [x] {y} " * 20}] * 200}
    ).encode()
    brackets = b'{"model": "demo", "x": [' + b"[]," * 2_700_000 + b"[]]}"
    strings = json.dumps({"model": "demo", "x": ['ab\\"c[{' * 3] * 300_000}).encode()
    deep = b'{"model": "demo", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    bodies = {"small": (small, 20000), "chat200": (chat200, 500), "brackets_8mib": (brackets, 2),
              "strings_8mib": (strings, 2), "deep_100k": (deep, 20)}
    out: dict[str, Any] = {"uptime": os.getloadavg(), "rounds": args.rounds, "json": {}}
    for name, (body, n) in bodies.items():
        out["json"][name] = {
            "bytes": len(body),
            "json_loads_us": per_call_us(refused(lambda b=body: json.loads(b)), n, args.rounds),
            "load_json_us": per_call_us(refused(lambda b=body: load_json(b, unique=("model",))), n, args.rounds),
        }
    check = HostCheck(["gw.example.com"])
    out["host_check_us"] = {
        "baseline_set_lookup": per_call_us(lambda: b"127.0.0.1:8000" in {b"127.0.0.1:8000"}, 200_000, args.rounds),
        "allowed_again": per_call_us(lambda: check.allows(b"127.0.0.1:8000"), 200_000, args.rounds),
        "refused": per_call_us(lambda: check.allows(b"evil.example:8000"), 200_000, args.rounds),
    }
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ndate: Tue, 01 Dec 2026 11:00:00 GMT\r\n"
            b"server: uvicorn\r\ncontent-length: 300")
    out["response_head_us"] = {
        "baseline_split": per_call_us(lambda: head.split(b"\r\n"), 200_000, args.rounds),
        "grammar_check": per_call_us(lambda: _VALID_HEAD.fullmatch(head), 200_000, args.rounds),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
