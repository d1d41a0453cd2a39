"""
Streams that survive their replica: C{--streams} streamed requests kept in
flight through the gateway of a local fleet (C{llmgw local}, a real
process) across C{--replicas} replicas, while one replica's engine is
SIGKILLed every C{--kill-every} seconds (the agent sees it exit, the
control plane replaces it).

The engines are L{bench.survival_engine} processes (fake, on purpose:
llama.cpp on two shared cores cannot keep 200 streams going), whose next
word is a function of the whole context, so a continuation on another
replica must give exactly the unbroken answer's words; every reference
answer is computed here with the same function, and a few are checked
against an unbroken run through the gateway before the kills start. Half
the requests are chats, half text completions.

Bars (from the issue): zero broken streams (not 200, no C{[DONE]}, a
connection error), zero lost or repeated words (the text equals the
reference), and the p99 added delay at a break under twice one replica's
time to first token (the median TTFT of the streams no kill touched).
A stream counts as broken by a kill when its first replica (the engine's
answer header C{x-survival-engine}, passed on by the gateway) was killed
while it was in flight; the delay added is the gap between its chunks
around the kill less one word's interval.

    python bench/survival_kill.py [--seconds 60] [--streams 200] [--replicas 4]
        [--kill-every 10] [--tps 10] [--words 60] [--out bench/results/survival-kill-2cpu.json]

Prints one JSON document (and writes it to C{--out}).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from bench.common import percentile, raise_nofile  # noqa: E402
from bench.survival_engine import render, reply  # noqa: E402
from llmgw.agent.state import StateDir  # noqa: E402
from llmgw.gateway.resume import OUTCOMES  # noqa: E402
from llmgw.testing.ports import free_port  # noqa: E402

CATALOG = """
[ports]
first = {first}
last = {last}

[profiles.survival]
shards = 1
gpus_per_shard = 1
command = [{python}, {engine}, "--port", "{{port}}", "--model", "{{model}}", "--tps", "{tps}",
           "--prefill-ms", "{prefill_ms}"]
startup_timeout_s = 60
stop_grace_s = 2

[[deployments]]
model = "tiny"
profile = "survival"
replicas = {replicas}
"""


class Fleet:
    def __init__(self, args: argparse.Namespace, directory: Path):
        self.dir = directory
        first = 31000 + random.randrange(0, 2000)
        (directory / "catalog.toml").write_text(CATALOG.format(
            first=first, last=first + 200, python=json.dumps(sys.executable),
            engine=json.dumps(str(HERE / "survival_engine.py")), tps=args.tps,
            prefill_ms=args.prefill_ms, replicas=args.replicas))
        self.gateway_port, self.admin_port = free_port(), free_port()
        agents = (args.replicas + 1) // 2
        self.log = open(directory / "fleet.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw.ctl.main", "local", "--agents", str(agents), "--gpus", "sim:2x24GiB",
             "--catalog", str(directory / "catalog.toml"), "--gateway", f"127.0.0.1:{self.gateway_port}",
             "--admin", f"127.0.0.1:{self.admin_port}", "--heartbeat", "1"],
            cwd=directory, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=self.log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def ready(self) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/api/v1/replicas", timeout=5) as r:
                replicas = json.loads(r.read())["replicas"]
        except OSError:
            return {}
        return {r["id"]: r for r in replicas if r["state"] == "ready"}

    def pids(self) -> dict[str, int]:
        out = {}
        for state in (self.dir / "local-state").glob("agent-*"):
            for record in StateDir(state).load_all():
                out[record.spec.replica_id] = record.pid
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


def request_for(i: int, words: int) -> tuple[str, dict[str, Any], list[str]]:
    """
    The path, body and reference words of request C{i}.
    """
    if i % 2:
        messages = [{"role": "user", "content": f"question {i}"}]
        body = {"model": "tiny", "messages": messages, "max_tokens": words, "stream": True,
                "stream_options": {"include_usage": True}}
        return "/v1/chat/completions", body, reply(render(messages, False), words)
    prompt = f"prompt number {i}:"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": words, "stream": True,
            "stream_options": {"include_usage": True}}
    return "/v1/completions", body, reply(prompt, words)


async def stream(port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """
    One streamed request: status, the first engine, the words, the
    arrival time of each text chunk, the [DONE]s, the usage, an error.
    """
    out: dict[str, Any] = {"start": time.monotonic(), "status": 0, "engine": None, "text": [], "at": [],
                           "dones": 0, "usage": None, "error": None}
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        data = json.dumps(body).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(data)}\r\nconnection: close\r\n\r\n".encode() + data)
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        out["status"] = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:] if h)}
        out["engine"] = headers.get("x-survival-engine")
        chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        buf = b""
        while True:
            if chunked:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    break
                piece = await reader.readexactly(size + 2)
                buf += piece[:-2]
            else:
                piece = await reader.read(65536)
                if not piece:
                    break
                buf += piece
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if not event.startswith(b"data: "):
                    continue
                payload = event[6:]
                if payload == b"[DONE]":
                    out["dones"] += 1
                    continue
                doc = json.loads(payload)
                if doc.get("usage"):
                    out["usage"] = doc["usage"]
                for c in doc.get("choices", []):
                    text = (c.get("delta") or {}).get("content") if "delta" in c else c.get("text")
                    if text:
                        out["text"].append(text)
                        out["at"].append(time.monotonic())
        writer.close()
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        out["error"] = repr(e)
    out["end"] = time.monotonic()
    return out


async def run(args: argparse.Namespace, fleet: Fleet) -> dict[str, Any]:
    results: list[tuple[list[str], dict[str, Any]]] = []
    kills: list[tuple[float, str, int]] = []
    stop_at = time.monotonic() + args.seconds
    counter = iter(range(10**9))
    # A stream that hangs (held in the queue with no replica left) counts as broken.
    limit = 3 * args.words / args.tps + 30

    async def client() -> None:
        while time.monotonic() < stop_at:
            i = next(counter)
            path, body, ref = request_for(i, args.words)
            try:
                got = await asyncio.wait_for(stream(fleet.gateway_port, path, body), limit)
            except TimeoutError:
                got = {"start": 0.0, "end": 0.0, "status": 0, "engine": None, "text": [], "at": [], "dones": 0,
                       "usage": None, "error": f"no end within {limit:.0f} s"}
            results.append((ref, got))

    async def killer() -> None:
        while True:
            await asyncio.sleep(args.kill_every)
            if time.monotonic() > stop_at - args.kill_every / 2:
                return
            ready = await asyncio.to_thread(fleet.ready)
            pids = fleet.pids()
            victims = [rid for rid in sorted(ready) if rid in pids]
            if not victims:
                continue
            rid = random.choice(victims)
            kills.append((time.monotonic(), rid, pids[rid]))
            try:
                os.kill(pids[rid], signal.SIGKILL)
            except OSError:
                pass

    await asyncio.gather(killer(), *(client() for _ in range(args.streams)))
    return summarise(args, results, kills)


def summarise(args: argparse.Namespace, results: list[tuple[list[str], dict[str, Any]]],
              kills: list[tuple[float, str, int]]) -> dict[str, Any]:
    broken = lost = repeated = 0
    ttft, added = [], []
    touched = 0
    examples = []
    for ref, r in results:
        ok = r["status"] == 200 and r["dones"] == 1 and r["error"] is None
        text = "".join(r["text"])
        if not ok:
            broken += 1
        elif text != "".join(ref):
            got = len(r["text"])
            lost += max(0, len(ref) - got)
            repeated += max(0, got - len(ref))
            if got == len(ref):
                lost += 1  # same count, other words
        if (not ok or text != "".join(ref)) and len(examples) < 5:
            examples.append({"status": r["status"], "error": r["error"], "dones": r["dones"],
                             "got": text[-120:], "want": "".join(ref)[-120:]})
        hit = [t for t, _, pid in kills if r["engine"] == str(pid) and r["start"] < t < r["end"]]
        if hit and r["at"]:
            touched += 1
            t = hit[0]
            before = [a for a in r["at"] if a <= t]
            after = [a for a in r["at"] if a > t]
            if after:
                gap = after[0] - (before[-1] if before else r["start"])
                added.append(max(0.0, gap - 1 / args.tps))
        elif r["at"] and ok:
            ttft.append(r["at"][0] - r["start"])
    ttft.sort()
    added.sort()
    ttft_p50 = percentile(ttft, 50)
    p99 = percentile(added, 99) if added else 0.0
    return {
        "bench": "survival-kill",
        "engine": "bench/survival_engine.py (fake; next word a hash of the whole context)",
        "config": {k: getattr(args, k) for k in ("seconds", "streams", "replicas", "kill_every", "tps", "words",
                                                  "prefill_ms")},
        "requests": len(results),
        "kills": len(kills),
        "streams_broken_by_a_kill": touched,
        "broken_streams": broken,
        "lost_words": lost,
        "repeated_words": repeated,
        "ttft_unbroken_p50_ms": round(ttft_p50 * 1000, 1),
        "added_delay_at_break_ms": {"n": len(added), "p50": round(percentile(added, 50) * 1000, 1) if added else None,
                                    "p99": round(p99 * 1000, 1), "max": round(added[-1] * 1000, 1) if added else None},
        "bars": {"zero_broken": broken == 0, "zero_lost_or_repeated": lost == 0 and repeated == 0,
                 "p99_added_delay_under_2x_ttft": p99 < 2 * ttft_p50},
        "examples": examples,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--kill-every", type=float, default=10)
    p.add_argument("--tps", type=float, default=10)
    p.add_argument("--words", type=int, default=60)
    p.add_argument("--prefill-ms", type=float, default=100)
    p.add_argument("--keep-log", help="copy the fleet's log here")
    p.add_argument("--out", default=str(HERE / "results" / "survival-kill-2cpu.json"))
    args = p.parse_args()
    raise_nofile()
    # SIGTERM (a timeout) still stops the fleet, through the finally below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="survival-kill-") as tmp:
        fleet = Fleet(args, Path(tmp))
        try:
            deadline = time.monotonic() + 60
            while len(fleet.ready()) < args.replicas:
                if time.monotonic() > deadline or fleet.proc.poll() is not None:
                    raise SystemExit("the fleet did not get ready:\n"
                                     + (Path(tmp) / "fleet.log").read_text(errors="replace")[-3000:])
                time.sleep(0.5)
            # The references are right: a few unbroken runs, before any kill.
            async def check() -> list[bool]:
                out = []
                for i in range(4):
                    path, body, ref = request_for(i, args.words)
                    r = await stream(fleet.gateway_port, path, body)
                    out.append("".join(r["text"]) == "".join(ref))
                return out
            checked = asyncio.run(check())
            result = asyncio.run(run(args, fleet))
            result["references_checked"] = checked
            log = (Path(tmp) / "fleet.log").read_text(errors="replace")
            result["gateway_log"] = {o: log.count(f": {o}") for o in OUTCOMES}
            # The control plane's crash backoff per deployment (each kill is a failure to it).
            result["gateway_log"]["placement_backoffs"] = log.count("backoff: replica=")
            if args.keep_log:
                Path(args.keep_log).write_text(log)
        finally:
            fleet.stop()
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
