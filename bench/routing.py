"""
Routing benchmark: four simulated engine replicas (the fake model server's
engine simulator, L{llmgw.testing.enginesim}) behind one router, three
workloads, every routing policy in one run. Prints JSON.

    python bench/routing.py [--peers /path/to/venv/bin] [--quick]
        [--conversations 96] [--turns 6] [--arrival-s 16] [--think-s 1]
        [--independent 240] [--burst 600]
    python bench/routing.py offline [--seeds 1,2,3]
    python bench/routing.py llama [--llama-conversations 8] [--llama-turns 6]

C{offline} runs workload (a) through llmgw's own router and four engine
simulators on one simulated clock (no sockets, no processes): exact,
repeatable TTFT figures for llmgw's policies, free of the machine's load.
C{llama} runs two real C{llama-server} replicas (C{.ci/build-llama-server},
the tiny model of L{llmgw.testing.tinygguf}) behind the gateway with a long
shared system prompt and reports the share of prompt tokens they served
from their caches (C{timings.cache_n}), least-in-flight against prefix.

Routers compared, each against freshly started replicas (empty caches):

- C{least_in_flight}: llmgw's gateway as it was (least_loaded with no engine
  signals, which is exactly the old least-in-flight rule);
- C{round_robin}, C{least_loaded} and C{prefix}: llmgw's policies as
  configured by default, the gateway fed the replicas' engine signals every
  0.25 s (what the control plane's scrapes give it);
- C{prefix_engine_load}: C{prefix} with engine counts added to the load
  (C{PolicyConfig.engine_load}, off by default);
- C{vllm-router cache_aware} and C{sglang-router cache_aware}, when their
  executables are in C{--peers} (C{pip install vllm-router sglang-router}
  into a separate venv).

Workloads, one after the other on the same replicas:

(a) C{conversations}: multi-turn chats, C{--conversations} of them
    arriving as a Poisson process over C{--arrival-s} seconds, each of 2 to
    C{2 * --turns - 2} user turns (50 to 350 words) after think times of
    mean C{--think-s}, every turn resending the earlier ones; eight system
    prompts (300 words) shared between them. The schedule is drawn up front
    from a fixed seed, so every router gets the same one. The conversations
    active at once hold more history than one replica's KV cache and less
    than four hold.
(b) C{independent}: prompts (about 300 tokens) that share nothing, from 32
    concurrent clients.
(c) C{burst}: C{--burst} requests at once, well over the replicas' batch
    capacity; each must be answered or refused with 503 and Retry-After.
    llmgw's gateways hold what the replicas cannot take in their admission
    queue (C{--queue-depth}, default the gateway's 1,000; a smaller one
    makes the burst overflow it, to see the refusals).

Per workload: time to first token (first byte of the streamed body)
p50/p99, requests per second, the requests each replica served (busiest /
mean), the share of prompt tokens served from the replicas' prefix caches,
and how many requests were answered, refused (503 + Retry-After) or lost.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import percentile  # noqa: E402
from llmgw.gateway.policy import PolicyConfig  # noqa: E402

MODEL = "sim"
MAX_TOKENS = 16
SYSTEM_WORDS = 300
SYSTEM_PROMPTS = 8
TURN_WORDS = 200
SIM_ARGS = {
    "kv_blocks": 2048,
    "block_tokens": 16,
    "max_running": 48,
    "step_s": 0.012,
    "step_per_seq_s": 0.0004,
    "prefill_s_per_token": 0.0001,
}


# -- processes served by this file --------------------------------------------------------


def serve_sims(ports: list[int]) -> None:
    from twisted.internet import reactor

    from llmgw.testing.enginesim import EngineSimConfig
    from llmgw.testing.fakemodel import FakeModelConfig, listen

    for i, port in enumerate(ports):
        config = FakeModelConfig(
            model=MODEL,
            tokens=MAX_TOKENS,
            metrics="vllm",
            instance=f"r{i}",
            engine_sim=EngineSimConfig(**SIM_ARGS),  # type: ignore[arg-type]
        )
        listen(reactor, config, port)
    print("ready", flush=True)
    reactor.run()  # type: ignore[attr-defined]


def serve_gateway(
    port: int, upstreams: list[str], policy: str, signals: bool, epsilon: float, engine_load: bool,
    slack: int | None = None,
    queue_depth: int | None = None,
    scrape_s: float = 0.25,
    spread_s: float | None = None,
    prefix_match: float | None = None,
) -> None:
    import treq
    from twisted.internet import reactor
    from twisted.internet.defer import DeferredList
    from twisted.internet.task import LoopingCall
    from twisted.web.client import Agent, HTTPConnectionPool

    from llmgw import engines
    from llmgw.gateway.policy import PolicyConfig
    from llmgw.gateway.proxy import GatewayConfig
    from llmgw.gateway.service import GatewayService
    from llmgw.routing import Route, RoutingTable

    table = RoutingTable(reactor)
    ids = [f"r{i}" for i in range(len(upstreams))]
    current: dict[str, Any] = {rid: None for rid in ids}

    def publish() -> None:
        table.publish([Route(rid, MODEL, up, signals=current[rid]) for rid, up in zip(ids, upstreams, strict=True)], [MODEL])

    publish()
    table.set_policies({MODEL: policy})
    knobs: dict[str, Any] = {} if slack is None else {"slack": slack}
    if spread_s is not None:
        knobs["spread_s"] = spread_s
    if prefix_match is not None:
        knobs["prefix_match"] = prefix_match
    config = GatewayConfig(first_byte_timeout=600, policy=PolicyConfig(epsilon=epsilon, engine_load=engine_load, **knobs))
    if queue_depth is not None:
        config.queue_depth = queue_depth
    GatewayService(reactor, table, "127.0.0.1", port, config).startService()
    if signals:
        names = engines.metric_names_for("vllm")
        http = treq.client.HTTPClient(
            Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=True))
        )

        def scrape_one(rid: str, up: str) -> Any:
            d = http.get(f"http://{up}/metrics", timeout=1.0)
            d.addCallback(lambda r: r.text())

            def got(text: str) -> None:
                current[rid] = engines.normalise(text, names, reactor.seconds())  # type: ignore[attr-defined]

            d.addCallbacks(got, lambda f: None)
            return d

        def scrape() -> Any:
            d = DeferredList([scrape_one(rid, up) for rid, up in zip(ids, upstreams, strict=True)])
            d.addCallback(lambda _: publish())
            return d

        LoopingCall(scrape).start(scrape_s)
    print("ready", flush=True)
    reactor.run()  # type: ignore[attr-defined]


# -- the load generator -------------------------------------------------------------------


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Result:
    __slots__ = ("status", "ttft", "total", "instance", "retry_after", "error")

    def __init__(self) -> None:
        self.status = 0
        self.ttft: float | None = None
        self.total = 0.0
        self.instance = ""
        self.retry_after = False
        self.error = ""


def make_call(reactor: Any, port: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    """
    One streamed request on its own connection (Connection: close); fires
    with a L{Result}.
    """
    from twisted.internet.defer import Deferred
    from twisted.internet.protocol import ClientFactory, Protocol

    data = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n{extra}Connection: close\r\n\r\n"
    ).encode()
    done: Deferred[Result] = Deferred()
    result = Result()
    started = time.monotonic()

    class Call(Protocol):
        buf = b""
        head_done = False

        def connectionMade(self) -> None:
            self.transport.write(head + data)  # type: ignore[union-attr]

        def dataReceived(self, chunk: bytes) -> None:
            if self.head_done:
                if result.ttft is None and chunk:
                    result.ttft = time.monotonic() - started
                return
            self.buf += chunk
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            self.head_done = True
            lines = self.buf[:end].split(b"\r\n")
            result.status = int(lines[0].split()[1])
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"x-fakemodel-instance":
                    result.instance = value.strip().decode()
                elif name == b"retry-after":
                    result.retry_after = True
            if len(self.buf) > end + 4:
                result.ttft = time.monotonic() - started
            self.buf = b""

        def connectionLost(self, reason: Any) -> None:
            result.total = time.monotonic() - started
            if not self.head_done:
                result.error = reason.getErrorMessage()
            done.callback(result)

    class Factory(ClientFactory):
        def buildProtocol(self, addr: Any) -> Protocol:
            return Call()

        def clientConnectionFailed(self, connector: Any, reason: Any) -> None:
            result.error = reason.getErrorMessage()
            result.total = time.monotonic() - started
            done.callback(result)

    reactor.connectTCP("127.0.0.1", port, Factory(), timeout=30)
    return done


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(100000)}" for _ in range(n))


def reply_text() -> str:
    from llmgw.testing.fakemodel import reply_words

    return "".join(reply_words(MAX_TOKENS))


def chat_body(messages: list[dict[str, str]]) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "stream": True}


def conversation_plan(n: int, turns: int, seed: int, arrival_s: float, think_s: float) -> list[dict[str, Any]]:
    """
    The schedule of workload (a), drawn up front from C{seed} so that every
    router gets exactly the same one: conversation i starts at C{start}
    (arrivals a Poisson process over C{arrival_s} seconds), uses one of the
    eight system prompts, and has between 2 and C{2 * turns - 2} user turns
    (mean C{turns}) of 50 to 350 words, each after a think time drawn from
    an exponential distribution of mean C{think_s} once the previous answer
    is in.
    """
    rng = random.Random(seed)
    systems = [words(rng, SYSTEM_WORDS) for _ in range(SYSTEM_PROMPTS)]
    plan = []
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(n / arrival_s) if arrival_s > 0 else 0.0
        k = rng.randint(2, max(2, 2 * turns - 2))
        plan.append({
            "start": t,
            "system": systems[rng.randrange(SYSTEM_PROMPTS)],
            "turns": [
                (words(rng, rng.randint(TURN_WORDS - 150, TURN_WORDS + 150)),
                 rng.expovariate(1 / think_s) if think_s > 0 else 0.0)
                for _ in range(k)
            ],
        })
    return plan


async def conversations(
    reactor: Any, port: int, n: int, turns: int, seed: int, arrival_s: float, think_s: float
) -> list[Result]:
    from twisted.internet.defer import Deferred, gatherResults
    from twisted.internet.task import deferLater

    plan = conversation_plan(n, turns, seed, arrival_s, think_s)
    answer = reply_text()
    results: list[Result] = []

    async def one(c: dict[str, Any]) -> None:
        await deferLater(reactor, c["start"], lambda: None)
        messages = [{"role": "system", "content": c["system"]}]
        for i, (text, think) in enumerate(c["turns"]):
            if i:
                await deferLater(reactor, think, lambda: None)
            messages.append({"role": "user", "content": text})
            r = await make_call(reactor, port, chat_body(messages))
            results.append(r)
            messages.append({"role": "assistant", "content": answer})

    await gatherResults([Deferred.fromCoroutine(one(c)) for c in plan])
    return results


async def independent(reactor: Any, port: int, n: int, clients: int, seed: int) -> list[Result]:
    from twisted.internet.defer import Deferred, gatherResults

    rng = random.Random(seed)
    prompts = [words(rng, 300) for _ in range(n)]
    results: list[Result] = []

    async def client() -> None:
        while prompts:
            p = prompts.pop()
            results.append(await make_call(reactor, port, chat_body([{"role": "user", "content": p}])))

    await gatherResults([Deferred.fromCoroutine(client()) for _ in range(clients)])
    return results


async def burst(reactor: Any, port: int, n: int, seed: int) -> list[Result]:
    from twisted.internet.defer import gatherResults

    rng = random.Random(seed)
    return list(
        await gatherResults(
            [make_call(reactor, port, chat_body([{"role": "user", "content": words(rng, 200)}])) for _ in range(n)]
        )
    )


def summarise(results: list[Result], wall: float, replicas: int) -> dict[str, Any]:
    ok = [r for r in results if r.status == 200 and r.ttft is not None]
    ttft = sorted(r.ttft for r in ok if r.ttft is not None)
    per: dict[str, int] = {f"r{i}": 0 for i in range(replicas)}
    for r in ok:
        if r.instance in per:
            per[r.instance] += 1
    mean = sum(per.values()) / replicas if replicas else 0
    refused = [r for r in results if r.status == 503 and r.retry_after]
    lost = len(results) - len(ok) - len(refused)
    errors: dict[str, int] = {}
    for r in results:
        if r not in ok and r not in refused:
            key = r.error or f"status {r.status}"
            errors[key] = errors.get(key, 0) + 1
    return {
        "requests": len(results),
        "answered": len(ok),
        "refused_503_retry_after": len(refused),
        "lost": lost,
        "errors": errors,
        "ttft_p50_ms": round(percentile(ttft, 50) * 1000, 1) if ttft else None,
        "ttft_p99_ms": round(percentile(ttft, 99) * 1000, 1) if ttft else None,
        "ttft_mean_ms": round(sum(ttft) / len(ttft) * 1000, 1) if ttft else None,
        "throughput_rps": round(len(ok) / wall, 2) if wall else None,
        "per_replica": per,
        "busiest_over_mean": round(max(per.values()) / mean, 3) if mean else None,
    }


# -- the orchestrator ---------------------------------------------------------------------


def wait_ready(proc: subprocess.Popen[str], what: str) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        raise RuntimeError(f"{what} did not start: {line!r}")


def wait_port(port: int, proc: subprocess.Popen[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited with status {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port} after {timeout} s")


def sim_metrics(ports: list[int]) -> tuple[float, float]:
    """
    Prefix-cache queries and hits summed over the replicas.
    """
    import urllib.request

    q = h = 0.0
    for p in ports:
        text = urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics", timeout=5).read().decode()
        for line in text.splitlines():
            if line.startswith("vllm:prefix_cache_queries_total"):
                q += float(line.split()[-1])
            elif line.startswith("vllm:prefix_cache_hits_total"):
                h += float(line.split()[-1])
    return q, h


def router_command(name: str, port: int, sim_ports: list[int], args: argparse.Namespace) -> list[str] | None:
    peers = args.peers
    urls = [f"http://127.0.0.1:{p}" for p in sim_ports]
    ups = ",".join(f"127.0.0.1:{p}" for p in sim_ports)
    me = [sys.executable, str(Path(__file__).resolve()), "gateway", "--port", str(port), "--upstreams", ups]
    slack = [] if args.slack is None else ["--slack", str(args.slack)]
    if args.spread_s is not None:
        slack += ["--spread-s", str(args.spread_s)]
    if args.queue_depth is not None:
        me += ["--queue-depth", str(args.queue_depth)]
    me += ["--scrape-s", str(args.scrape_s)]
    if name == "least_in_flight":
        return me + ["--policy", "least_loaded"]
    if name == "prefix_no_signals":
        return me + ["--policy", "prefix", "--epsilon", str(args.epsilon)] + slack
    if name == "prefix_no_spread":
        return me + ["--policy", "prefix", "--signals", "--epsilon", str(args.epsilon), "--spread-s", "0"] + slack
    if name == "prefix_engine_load":
        return me + ["--policy", "prefix", "--signals", "--engine-load", "--epsilon", str(args.epsilon)] + slack
    if name in ("round_robin", "least_loaded", "prefix"):
        return me + ["--policy", name, "--signals", "--epsilon", str(args.epsilon)] + slack
    if peers is None:
        return None
    if name == "vllm-router cache_aware":
        exe = Path(peers) / "vllm-router"
        if not exe.exists():
            return None
        return [str(exe), "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
                "--log-level", "error", "--worker-urls", *urls]
    if name == "sglang-router cache_aware":
        py = Path(peers) / "python"
        if not (Path(peers) / "sglang-router").exists():
            return None
        return [str(py), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                "--policy", "cache_aware", "--log-level", "error", "--worker-urls", *urls]
    return None


WORKLOADS = ["conversations", "independent", "burst"]

ROUTERS = ["least_in_flight", "round_robin", "least_loaded", "prefix", "vllm-router cache_aware",
           "sglang-router cache_aware", "prefix_engine_load"]
#: Routers run only when named in --routers.
EXTRA_ROUTERS = ["prefix_no_signals", "prefix_no_spread"]


def run_router(name: str, args: argparse.Namespace) -> dict[str, Any] | None:
    sim_ports = free_ports(4)
    (port,) = free_ports(1)
    cmd = router_command(name, port, sim_ports, args)
    if cmd is None:
        return None
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    sims = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "sims", "--ports", ",".join(map(str, sim_ports))],
        stdout=subprocess.PIPE, text=True, env=env,
    )
    router = None
    try:
        wait_ready(sims, "the simulated replicas")
        router = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, env=env)
        wait_port(port, router, 60)
        out: dict[str, Any] = {"command": " ".join(cmd[:1] + cmd[1:3]) if name.startswith(("vllm", "sglang")) else name}
        out.update(load(port, sim_ports, args))
        return out
    finally:
        for p in (router, sims):
            if p is not None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def load(port: int, sim_ports: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """
    Run the three workloads against the router on C{port}.
    """
    from twisted.internet import reactor
    from twisted.internet.defer import Deferred, ensureDeferred
    from twisted.internet.task import deferLater

    out: dict[str, Any] = {}

    async def warm() -> None:
        # The router may take a moment to see its workers: wait until one
        # request is answered.
        for _ in range(300):
            r = await make_call(reactor, port, chat_body([{"role": "user", "content": "warm up"}]))
            if r.status == 200:
                return
            await deferLater(reactor, 0.2, lambda: None)
        raise RuntimeError("the router never answered")

    async def workload(name: str, run: Any) -> None:
        q0, h0 = sim_metrics(sim_ports)
        t0 = time.monotonic()
        results = await run
        wall = time.monotonic() - t0
        q1, h1 = sim_metrics(sim_ports)
        s = summarise(results, wall, len(sim_ports))
        s["prefix_cache_hit_share"] = round((h1 - h0) / (q1 - q0), 3) if q1 > q0 else None
        out[name] = s

    async def main() -> None:
        await warm()
        chosen = args.workloads.split(",")
        if "conversations" in chosen:
            await workload("conversations", Deferred.fromCoroutine(
                conversations(reactor, port, args.conversations, args.turns, 1, args.arrival_s, args.think_s)))
        if "independent" in chosen:
            await workload("independent", Deferred.fromCoroutine(independent(reactor, port, args.independent, 32, 2)))
        if "burst" in chosen:
            await deferLater(reactor, 1.0, lambda: None)
            await workload("burst", Deferred.fromCoroutine(burst(reactor, port, args.burst, 3)))

    failure: list[Any] = []

    def stop(result: Any) -> None:
        if hasattr(result, "getTraceback"):
            failure.append(result)
        reactor.stop()  # type: ignore[attr-defined]

    reactor.callWhenRunning(lambda: ensureDeferred(main()).addBoth(stop))  # type: ignore[attr-defined]
    reactor.run(installSignalHandlers=False)  # type: ignore[attr-defined]
    if failure:
        raise RuntimeError(failure[0].getTraceback())
    return out


# -- simulated time: llmgw's own policies without the machine's noise --------------------


def offline_run(
    policy: str, args: argparse.Namespace, slack: int | None, seed: int, spread_s: float | None = None
) -> dict[str, Any]:
    """
    Workload (a) with four engine simulators and llmgw's L{Router} on one
    L{Clock}, no sockets and no processes: the same schedule, the same
    engine model, in simulated time, so that TTFT figures are exact and
    repeat (what the real run adds is HTTP and the machine's load).
    C{least_in_flight} routes with no engine signals; the others get them
    every 0.25 s, as the gateway mode does.
    """
    from twisted.internet.task import Clock

    from llmgw.gateway.policy import affinity_key
    from llmgw.gateway.router import Router
    from llmgw.routing import EngineSignals, Route
    from llmgw.testing.enginesim import EngineSim, EngineSimConfig, chat_tokens

    clock = Clock()
    sims = [EngineSim(clock, EngineSimConfig(**SIM_ARGS)) for _ in range(4)]  # type: ignore[arg-type]
    ids = [f"r{i}" for i in range(4)]
    knobs: dict[str, Any] = {} if slack is None else {"slack": slack}
    if spread_s is not None:
        knobs["spread_s"] = spread_s
    config = PolicyConfig(epsilon=args.epsilon, **knobs)
    router = Router(clock, policy=config)
    routes = [Route(rid, MODEL, "-") for rid in ids]
    signals = policy != "least_in_flight"
    name = "least_loaded" if policy == "least_in_flight" else policy
    plan = conversation_plan(args.conversations, args.turns, seed, args.arrival_s, args.think_s)
    answer = reply_text()
    ttft: list[float] = []
    per = dict.fromkeys(ids, 0)

    def scrape() -> None:
        nonlocal routes
        if signals:
            routes = [Route(rid, MODEL, "-", signals=EngineSignals(
                clock.seconds(), float(len(s.waiting)), float(len(s.running)), s.kv_usage()))
                for rid, s in zip(ids, sims, strict=True)]
        clock.callLater(0.25, scrape)

    def turn(c: dict[str, Any], i: int, messages: list[dict[str, str]]) -> None:
        messages = [*messages, {"role": "user", "content": c["turns"][i][0]}]
        body = chat_body(messages)
        route = router.pick(routes, (), name, affinity_key(body, None, config, chain=name == "cache_aware"))
        assert route is not None
        rid = route.replica_id
        router.begin(rid)
        per[rid] += 1
        t0 = clock.seconds()

        def on_token(k: int) -> None:
            if k == 1:
                ttft.append(clock.seconds() - t0)

        def on_done() -> None:
            router.end(rid)
            if i + 1 < len(c["turns"]):
                clock.callLater(c["turns"][i + 1][1], turn, c, i + 1,
                                [*messages, {"role": "assistant", "content": answer}])

        sims[ids.index(rid)].submit(chat_tokens(messages), MAX_TOKENS, on_token, on_done)

    scrape()
    for c in plan:
        clock.callLater(c["start"], turn, c, 0, [{"role": "system", "content": c["system"]}])
    total = sum(len(c["turns"]) for c in plan)
    while len(ttft) < total and clock.seconds() < 3600:
        clock.advance(0.001)
    ttft.sort()
    queries = sum(s.queries for s in sims)
    mean = sum(per.values()) / len(per)
    return {
        "requests": len(ttft),
        "ttft_p50_ms": round(percentile(ttft, 50) * 1000, 1),
        "ttft_p99_ms": round(percentile(ttft, 99) * 1000, 1),
        "ttft_mean_ms": round(sum(ttft) / len(ttft) * 1000, 1),
        "prefix_cache_hit_share": round(sum(s.hits for s in sims) / queries, 3) if queries else None,
        "per_replica": per,
        "busiest_over_mean": round(max(per.values()) / mean, 3),
        "simulated_s": round(clock.seconds(), 1),
    }


def offline_independent(policy: str, spread_s: float | None, ramp_s: float, n: int = 240,
                        clients: int = 32, seed: int = 2) -> dict[str, Any]:
    """
    Workload (b) in simulated time: C{clients} closed-loop clients sending
    C{n} independent 300-word prompts to four engine simulators through
    llmgw's L{Router} on one L{Clock}, the clients starting over
    C{ramp_s} seconds (0: all at once, as the real run's do), 1 ms from the
    router to an engine and back. C{prefix} with C{spread_s} 0 places first
    turns as C{least_loaded} does.
    """
    from twisted.internet.task import Clock

    from llmgw.gateway.policy import affinity_key
    from llmgw.gateway.router import Router
    from llmgw.routing import EngineSignals, Route
    from llmgw.testing.enginesim import EngineSim, EngineSimConfig, chat_tokens

    clock = Clock()
    sims = [EngineSim(clock, EngineSimConfig(**SIM_ARGS)) for _ in range(4)]  # type: ignore[arg-type]
    ids = [f"r{i}" for i in range(4)]
    config = PolicyConfig(**({} if spread_s is None else {"spread_s": spread_s}))
    router = Router(clock, policy=config)
    routes = [Route(rid, MODEL, "-") for rid in ids]
    signals = policy != "least_in_flight"
    name = "least_loaded" if policy == "least_in_flight" else policy
    rng = random.Random(seed)
    prompts = [words(rng, 300) for _ in range(n)]
    ttft: list[float] = []
    per = dict.fromkeys(ids, 0)
    done = [0]

    def scrape() -> None:
        nonlocal routes
        if signals:
            routes = [Route(rid, MODEL, "-", signals=EngineSignals(
                clock.seconds(), float(len(s.waiting)), float(len(s.running)), s.kv_usage()))
                for rid, s in zip(ids, sims, strict=True)]
        clock.callLater(0.25, scrape)

    def client() -> None:
        if not prompts:
            return
        body = chat_body([{"role": "user", "content": prompts.pop()}])
        route = router.pick(routes, (), name, affinity_key(body, None, config, chain=name == "cache_aware"))
        assert route is not None
        rid = route.replica_id
        router.begin(rid)
        per[rid] += 1
        t0 = clock.seconds()

        def on_token(k: int) -> None:
            if k == 1:
                ttft.append(clock.seconds() - t0)

        def on_done() -> None:
            router.end(rid)
            done[0] += 1
            clock.callLater(0.001, client)

        sim = sims[ids.index(rid)]
        clock.callLater(0.001, sim.submit, chat_tokens(body["messages"]), MAX_TOKENS, on_token, on_done)

    scrape()
    for i in range(clients):
        clock.callLater(ramp_s * i / clients, client)
    while done[0] < n and clock.seconds() < 3600:
        clock.advance(0.0005)
    ttft.sort()
    mean = sum(per.values()) / len(per)
    return {
        "ttft_p50_ms": round(percentile(ttft, 50) * 1000, 1),
        "ttft_p99_ms": round(percentile(ttft, 99) * 1000, 1),
        "ttft_mean_ms": round(sum(ttft) / len(ttft) * 1000, 1),
        "throughput_rps": round(n / clock.seconds(), 2),
        "busiest_over_mean": round(max(per.values()) / mean, 3),
    }


def offline(args: argparse.Namespace) -> dict[str, Any]:
    runs = [("least_in_flight", None), ("round_robin", None), ("least_loaded", None),
            ("prefix slack 0", 0), ("prefix spread 0", None), ("prefix", None), ("cache_aware", None)]
    out: dict[str, Any] = {}
    for seed in args.seeds:
        out[f"seed {seed}"] = {
            label: offline_run(label.split()[0], args, slack, seed, 0.0 if "spread 0" in label else None)
            for label, slack in runs
        }
    ratio = [r["prefix"]["ttft_p99_ms"] / r["least_in_flight"]["ttft_p99_ms"] for r in out.values()]
    independent = {
        f"clients start over {ramp} s": {
            "least_in_flight": offline_independent("least_in_flight", None, ramp),
            "prefix spread 0": offline_independent("prefix", 0.0, ramp),
            "prefix": offline_independent("prefix", None, ramp),
        }
        for ramp in (0.0, 0.25, 0.5)
    }
    return {"bench": "routing-offline", "simulator": SIM_ARGS, "epsilon": args.epsilon,
            "slack": PolicyConfig().slack, "spread_s": PolicyConfig().spread_s,
            "workload": {"conversations": args.conversations, "turns": args.turns,
                         "arrival_s": args.arrival_s, "think_s": args.think_s},
            "runs": out, "prefix_p99_over_least_in_flight": [round(x, 3) for x in ratio],
            "independent": {"requests": 240, "clients": 32, "prompt_words": 300, "runs": independent}}


# -- the cost of a routing decision ----------------------------------------------------------

PICK_COST_CHILD = """
import json, sys, time
from twisted.internet.task import Clock
from llmgw.gateway.policy import PolicyConfig, affinity_key
from llmgw.gateway.router import Router
from llmgw.routing import Route
n, replicas, kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
routes = [Route(f"r{i}", "m", f"127.0.0.1:{i + 1}") for i in range(replicas)]
config = PolicyConfig()
clock = Clock()
router = Router(clock, policy=config)
later = [{"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}] if kind == "later" else []
bodies = [{"model": "m", "messages": [{"role": "system", "content": "s" * 2000},
          {"role": "user", "content": f"question {i}"}, *later]} for i in range(1000)]
t0 = time.process_time()
for i in range(n):
    # A thousand decisions a second, on the router's clock.
    clock.rightNow += 0.001
    r = router.pick(routes, (), "prefix", affinity_key(bodies[i % 1000], None, config))
    router.begin(r.replica_id)
    router.end(r.replica_id)
print(json.dumps((time.process_time() - t0) / n * 1e6))
"""


def interleaved_pick_costs(child: str, picks: int, rounds: int, baseline: str | Path,
                           last: str) -> dict[str, dict[int, list[float]]]:
    """
    Run C{child} (a script that prints CPU microseconds a pick, given
    C{picks}, a replica count and C{last}) over 2 and 4 replicas with this
    tree and with C{baseline} on C{PYTHONPATH}, in interleaved rounds: each
    tree's runs, by replica count.
    """
    trees = {"branch": ROOT, "baseline": Path(baseline)}
    per: dict[str, dict[int, list[float]]] = {t: {2: [], 4: []} for t in trees}
    for _ in range(rounds):
        for replicas in (2, 4):
            for name, tree in trees.items():
                proc = subprocess.run([sys.executable, "-c", child, str(picks), str(replicas), last],
                                      capture_output=True, text=True, check=True,
                                      env=dict(os.environ, PYTHONPATH=str(tree)))
                per[name][replicas].append(float(proc.stdout.strip()))
    return per


def median_of(xs: list[float]) -> float:
    return round(sorted(xs)[len(xs) // 2], 2)


def pick_cost(args: argparse.Namespace) -> dict[str, Any]:
    """
    CPU microseconds per C{prefix} routing decision (affinity key of a chat
    with a 2,000-character system prompt, then L{Router.pick} over 2 and 4
    replicas; a later turn, or with C{--pick-kind first} a first turn), this
    tree against C{--baseline} (another checkout), in interleaved rounds;
    medians.
    """
    per = interleaved_pick_costs(PICK_COST_CHILD, args.picks, args.rounds, args.baseline, args.pick_kind)
    med = median_of
    return {
        "bench": "routing-pick-cost", "picks_per_run": args.picks, "rounds": args.rounds,
        "turn": args.pick_kind,
        "baseline": str(args.baseline),
        "us_per_pick_median": {t: {f"{k}_replicas": med(v) for k, v in d.items()} for t, d in per.items()},
        "branch_over_baseline": {f"{k}_replicas": round(med(per["branch"][k]) / med(per["baseline"][k]), 3)
                                 for k in (2, 4)},
        "per_round_us": {t: {f"{k}_replicas": [round(x, 2) for x in v] for k, v in d.items()} for t, d in per.items()},
    }


# -- real engines: two llama-server replicas ----------------------------------------------

#: Words the tiny model's vocabulary holds whole (one token each).
LLAMA_WORDS = ["the", "a", "model", "reply", "tiny", "llmgw", "is"]


def llama_text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(LLAMA_WORDS) for _ in range(n))


def llama_post(port: int, body: dict[str, Any]) -> dict[str, Any]:
    import urllib.request

    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as response:
        return dict(json.loads(response.read()))


def llama_conversations(port: int, args: argparse.Namespace) -> dict[str, Any]:
    """
    Workload (a) in small, against real engines: C{--llama-conversations}
    chats at once, C{--llama-turns} turns each, all starting with the same
    long system prompt; non-streamed, so that each answer carries
    llama-server's C{timings} (C{cache_n}: prompt tokens taken from its
    cache; C{prompt_n}: prompt tokens it computed).
    """
    import threading

    rng = random.Random(5)
    system = llama_text(rng, args.llama_system_words)
    plans = [
        [(llama_text(rng, rng.randint(20, 50)), rng.uniform(0.0, 0.3)) for _ in range(args.llama_turns)]
        for _ in range(args.llama_conversations)
    ]
    cached = computed = answered = 0
    errors: list[str] = []
    lock = threading.Lock()

    def one(plan: list[tuple[str, float]]) -> None:
        nonlocal cached, computed, answered
        messages = [{"role": "system", "content": system}]
        for text, think in plan:
            time.sleep(think)
            messages.append({"role": "user", "content": text})
            body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0,
                    "ignore_eos": True}
            try:
                doc = llama_post(port, body)
            except Exception as e:  # noqa: BLE001 (counted and reported)
                with lock:
                    errors.append(repr(e)[:200])
                return
            timings = doc.get("timings") or {}
            with lock:
                answered += 1
                cached += int(timings.get("cache_n", 0))
                computed += int(timings.get("prompt_n", 0))
            messages.append({"role": "assistant", "content": doc["choices"][0]["message"]["content"]})

    threads = [threading.Thread(target=one, args=(p,)) for p in plans]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    return {
        "requests": args.llama_conversations * args.llama_turns,
        "answered": answered,
        "errors": errors[:5],
        "prompt_tokens_cached": cached,
        "prompt_tokens_computed": computed,
        "cache_share": round(cached / (cached + computed), 3) if cached + computed else None,
        "wall_s": round(wall, 2),
    }


def llama_health(port: int) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return bool(r.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def llama_run(args: argparse.Namespace) -> dict[str, Any]:
    """
    Two real llama-server replicas (the tiny model of
    L{llmgw.testing.tinygguf}) behind the gateway, least-in-flight against
    prefix, each on freshly started replicas.
    """
    import tempfile

    from llmgw.testing import tinygguf
    from llmgw.testing.engines import find_llama_server, llama_server_missing_reason

    binary = find_llama_server()
    if binary is None:
        return {"skipped": llama_server_missing_reason()}
    engine_args = ["-c", str(args.llama_ctx), "-np", str(args.llama_slots), "-t", "1", "--no-warmup",
                   "--cache-ram", str(args.llama_cache_ram)]
    out: dict[str, Any] = {
        "engine": str(binary), "engine_args": engine_args, "replicas": 2,
        "workload": {"conversations": args.llama_conversations, "turns": args.llama_turns,
                     "system_prompt_words": args.llama_system_words, "user_turn_words": "20-50",
                     "max_tokens": 8},
        "routers": {},
    }
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-llama-") as tmp:
        # The tiny model, with a training context long enough for the
        # system prompt and the turns (llama-server caps a slot's context
        # at it); its weights are random either way.
        tinygguf.CONTEXT = args.llama_ctx // args.llama_slots
        model = tinygguf.write(Path(tmp) / "tiny.gguf")
        for name, policy in (("least_in_flight", "least_loaded"), ("prefix", "prefix")):
            ports = free_ports(3)
            procs: list[subprocess.Popen[str]] = []
            try:
                for p in ports[:2]:
                    procs.append(subprocess.Popen(
                        [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(p),
                         "--alias", MODEL, *engine_args],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True))
                deadline = time.monotonic() + 60
                while not all(llama_health(p) for p in ports[:2]):
                    if time.monotonic() > deadline or any(pr.poll() is not None for pr in procs):
                        raise RuntimeError("llama-server did not become healthy")
                    time.sleep(0.2)
                ups = ",".join(f"127.0.0.1:{p}" for p in ports[:2])
                gw = subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "gateway", "--port", str(ports[2]),
                     "--upstreams", ups, "--policy", policy],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, env=env)
                procs.append(gw)
                wait_port(ports[2], gw, 60)
                out["routers"][name] = llama_conversations(ports[2], args)
            finally:
                for pr in procs:
                    pr.terminate()
                    try:
                        pr.wait(10)
                    except subprocess.TimeoutExpired:
                        pr.kill()
                        pr.wait()
    r = out["routers"]
    if r.get("prefix", {}).get("cache_share") is not None and r.get("least_in_flight", {}).get("cache_share"):
        out["prefix_over_least_in_flight"] = round(r["prefix"]["cache_share"] / r["least_in_flight"]["cache_share"], 3)
    return out


def verdict(results: dict[str, Any]) -> dict[str, Any]:
    """
    The issue's bars, checked against the figures (those of the workloads
    that ran).
    """
    base = results.get("least_in_flight")
    new = results.get("prefix")
    if not base or not new or "error" in base or "error" in new:
        return {}
    out: dict[str, Any] = {}
    if "conversations" in new and "conversations" in base:
        peers = [results[p] for p in ROUTERS[4:6] if results.get(p) and "conversations" in results[p]]
        a_new, a_base = new["conversations"]["ttft_p99_ms"], base["conversations"]["ttft_p99_ms"]
        best_peer = min((p["conversations"]["ttft_p99_ms"] for p in peers), default=None)
        out["a_p99_at_most_half_of_least_in_flight"] = a_new <= a_base / 2
        out["a_p99_no_worse_than_best_peer"] = None if best_peer is None else a_new <= best_peer
    if "independent" in new and "independent" in base:
        b_new, b_base = new["independent"], base["independent"]
        out["b_throughput_within_5pct"] = b_new["throughput_rps"] >= 0.95 * b_base["throughput_rps"]
        for figure in ("p50", "mean", "p99"):
            name = f"ttft_{figure}_ms"
            out[f"b_ttft_{figure}_within_5pct"] = b_new[name] <= 1.05 * b_base[name]
    ran = [w for w in WORKLOADS if w in new]
    out["busiest_at_most_1_25_mean"] = all(
        new[w]["busiest_over_mean"] is not None and new[w]["busiest_over_mean"] <= 1.25 for w in ran
    )
    if "burst" in new:
        out["c_none_lost"] = new["burst"]["lost"] == 0
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", nargs="?", default="run", choices=["run", "sims", "gateway", "one", "llama", "offline", "pick-cost"])
    p.add_argument("--ports", default="")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--upstreams", default="")
    p.add_argument("--policy", default="prefix")
    p.add_argument("--signals", action="store_true")
    p.add_argument("--engine-load", action="store_true", help="(gateway) engine counts add to the load")
    p.add_argument("--epsilon", type=float, default=0.25, help="prefix's load bound (gateway mode)")
    p.add_argument("--slack", type=int, default=None, help="prefix's slack over the bound (default: PolicyConfig's)")
    p.add_argument("--peers", default=None, help="a bin directory holding vllm-router and sglang-router")
    p.add_argument("--routers", default=",".join(ROUTERS),
                   help="comma-separated, from: " + ", ".join(ROUTERS + EXTRA_ROUTERS))
    p.add_argument("--scrape-s", type=float, default=0.25,
                   help="seconds between the gateway's scrapes of the replicas' engine signals")
    p.add_argument("--prefix-match", type=float, default=None,
                   help="(gateway) cache_aware's prefix_match (default: PolicyConfig's; above 1: no prefix index)")
    p.add_argument("--spread-s", type=float, default=None,
                   help="prefix's spread window for first turns (default: PolicyConfig's)")
    p.add_argument("--conversations", type=int, default=96)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--arrival-s", type=float, default=16.0, help="(a) conversations arrive over this long")
    p.add_argument("--think-s", type=float, default=1.0, help="(a) mean think time between turns")
    p.add_argument("--independent", type=int, default=240)
    p.add_argument("--burst", type=int, default=600)
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help="comma-separated, from: " + ", ".join(WORKLOADS))
    p.add_argument("--queue-depth", type=int, default=None,
                   help="llmgw's admission queue bound per model (default: the gateway's)")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of every router, interleaved; figures are the rounds' medians")
    p.add_argument("--quick", action="store_true", help="a small run, to check the bench works")
    p.add_argument("--router", default="", help="(one) the router to run")
    p.add_argument("--baseline", default="", help="(pick-cost) another checkout to compare with")
    p.add_argument("--picks", type=int, default=20000, help="(pick-cost) decisions per run")
    p.add_argument("--rounds", type=int, default=5, help="(pick-cost) interleaved rounds")
    p.add_argument("--pick-kind", choices=["later", "first"], default="later",
                   help="(pick-cost) a conversation's later turn or its first")
    p.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2, 3],
                   help="(offline) workload (a) schedules to run, comma-separated")
    p.add_argument("--llama-conversations", type=int, default=8, help="(llama) chats at once")
    p.add_argument("--llama-turns", type=int, default=6, help="(llama) turns per chat")
    p.add_argument("--llama-system-words", type=int, default=150,
                   help="(llama) system prompt words (the tiny model's tokenizer makes about 6 tokens of each)")
    p.add_argument("--llama-ctx", type=int, default=16384, help="(llama) each engine's -c")
    p.add_argument("--llama-slots", type=int, default=4, help="(llama) each engine's -np")
    p.add_argument("--llama-cache-ram", type=int, default=0,
                   help="(llama) each engine's --cache-ram in MiB (0: its KV slots are its only cache)")
    args = p.parse_args(argv)
    if args.mode == "sims":
        serve_sims([int(x) for x in args.ports.split(",")])
        return 0
    if args.mode == "gateway":
        serve_gateway(args.port, args.upstreams.split(","), args.policy, args.signals, args.epsilon, args.engine_load, args.slack,
                      args.queue_depth, args.scrape_s, args.spread_s, args.prefix_match)
        return 0
    if args.mode == "pick-cost":
        load_before = os.getloadavg()
        doc = pick_cost(args)
        doc["machine"] = {"cpus": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg()}
        print(json.dumps(doc, indent=2))
        return 0
    if args.mode == "offline":
        print(json.dumps(offline(args), indent=2))
        return 0
    if args.mode == "llama":
        load_before = os.getloadavg()
        doc = llama_run(args)
        doc = {"bench": "routing-llama", "machine": {"cpus": os.cpu_count(), "load_before": load_before,
                                                    "load_after": os.getloadavg()}, **doc}
        print(json.dumps(doc, indent=2))
        return 0
    if args.quick:
        args.conversations, args.turns, args.independent, args.burst = 12, 3, 40, 100
        args.arrival_s, args.think_s = 2.0, 0.3
    if args.mode == "one":
        # One router per process: each load generator gets a fresh reactor.
        print(json.dumps(run_router(args.router, args)))
        return 0
    load_before = os.getloadavg()
    per_round: dict[str, list[dict[str, Any]]] = {}
    skipped: list[str] = []
    for _ in range(args.repeat):
        # Rounds interleaved: each router's figures span the same stretch of
        # the machine's load.
        for name in args.routers.split(","):
            if name in skipped:
                continue
            got = run_one(name, args)
            if got is None:
                skipped.append(name)
            else:
                per_round.setdefault(name, []).append(got)
    results = {name: merge_rounds(docs) for name, docs in per_round.items()}
    report = {
        "bench": "routing",
        "machine": {"cpus": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg()},
        "simulator": SIM_ARGS,
        "prefix_policy": {"epsilon": args.epsilon,
                          "slack": PolicyConfig().slack if args.slack is None else args.slack,
                          "spread_s": PolicyConfig().spread_s if args.spread_s is None else args.spread_s},
        "scrape_s": args.scrape_s,
        "rounds": args.repeat,
        "max_tokens": MAX_TOKENS,
        "workloads": {
            "conversations": {"conversations": args.conversations, "turns": args.turns,
                              "arrival_s": args.arrival_s, "think_s": args.think_s, "system_prompts": SYSTEM_PROMPTS,
                              "system_words": SYSTEM_WORDS, "turn_words": f"{TURN_WORDS - 150}-{TURN_WORDS + 150}",
                              "turns_per_conversation": f"2-{max(2, 2 * args.turns - 2)}"},
            "independent": {"requests": args.independent, "clients": 32, "prompt_words": 300},
            "burst": {"requests": args.burst, "prompt_words": 200, "queue_depth": args.queue_depth},
        },
        "routers": results,
        "skipped": skipped,
        "bars": verdict(results),
        "peers_found": bool(args.peers and shutil.which("vllm-router", path=args.peers)),
    }
    print(json.dumps(report, indent=2))
    return 0


#: Figures of a workload that several rounds sum (the rest: medians).
_SUMMED = ("requests", "answered", "refused_503_retry_after", "lost")


def merge_rounds(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """
    One router's figures over several rounds: per workload, the median of
    each figure (TTFT, throughput, busiest / mean, hit share), the sums of
    the counts (requests, answered, refused, lost, per replica), and each
    round's TTFT p50 / mean / p99 and throughput. One round: as it came.
    """
    if len(docs) == 1 or any("error" in d for d in docs):
        return docs[0] if len(docs) == 1 else {"error": [d["error"] for d in docs if "error" in d]}
    out: dict[str, Any] = {"command": docs[0].get("command")}
    for w in WORKLOADS:
        runs = [d[w] for d in docs if w in d]
        if not runs:
            continue
        merged: dict[str, Any] = {}
        for k, v in runs[0].items():
            if k in _SUMMED:
                merged[k] = sum(r[k] for r in runs)
            elif k == "per_replica":
                merged[k] = {rid: sum(r[k].get(rid, 0) for r in runs) for rid in v}
            elif k == "errors":
                errors: dict[str, int] = {}
                for r in runs:
                    for e, n in r[k].items():
                        errors[e] = errors.get(e, 0) + n
                merged[k] = errors
            elif isinstance(v, (int, float)) or v is None:
                xs = [r[k] for r in runs if r[k] is not None]
                merged[k] = round(statistics.median(xs), 3) if xs else None
        merged["per_round"] = [
            {k: r[k] for k in ("ttft_p50_ms", "ttft_mean_ms", "ttft_p99_ms", "throughput_rps", "busiest_over_mean")}
            for r in runs
        ]
        out[w] = merged
    return out


def run_one(name: str, args: argparse.Namespace) -> dict[str, Any] | None:
    """
    One router's run, in a process of its own (a fresh reactor for each
    load generator): its figures, C{None} when it is not installed, or
    C{{"error": ...}}.
    """
    cmd = [sys.executable, str(Path(__file__).resolve()), "one", "--router", name,
           "--conversations", str(args.conversations), "--turns", str(args.turns),
           "--arrival-s", str(args.arrival_s), "--think-s", str(args.think_s),
           "--independent", str(args.independent), "--burst", str(args.burst),
           "--epsilon", str(args.epsilon), "--workloads", args.workloads, "--scrape-s", str(args.scrape_s)]
    if args.slack is not None:
        cmd += ["--slack", str(args.slack)]
    if args.spread_s is not None:
        cmd += ["--spread-s", str(args.spread_s)]
    if args.peers:
        cmd += ["--peers", args.peers]
    if args.queue_depth is not None:
        cmd += ["--queue-depth", str(args.queue_depth)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    doc: dict[str, Any] | None = json.loads(proc.stdout.strip().splitlines()[-1])
    return doc


if __name__ == "__main__":
    sys.exit(main())
