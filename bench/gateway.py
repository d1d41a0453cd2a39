"""
Gateway overhead benchmark: the fake model server called directly, through
the gateway, and through a bare twisted.web reverse proxy (the baseline),
in one run. Prints JSON.

    python bench/gateway.py [--duration 5] [--rate 500] [--quick] [--no-pin]

Every party is its own process on this machine: the fake model server
(C{python -m llmgw.testing.fakemodel}), the gateway (one process, a static
routing table to the fake), the bare proxy, and the load generators: C{wrk}
for closed-loop throughput at 1, 50 and 200 connections, and an open-loop
generator (this file, C{openloop} mode) that sends at a fixed rate and
measures each request from the moment it was due, so that queueing in the
generator cannot hide latency. The gateway's added latency is its p50/p99
minus the direct call's.

A second, smaller section repeats the throughput runs against a minimal
upstream (a canned answer to every request, read no further than its
framing) to show the gateway's own ceiling when the model server is not
the bottleneck.

CPU pinning (the default; C{--no-pin} leaves placement to the scheduler):
for the closed-loop runs the proxy under test (gateway or bare proxy) runs
alone on CPU 0; the model server and the load generators share CPU 1, in
the direct runs as in the proxied ones, so that what differs between them
is the proxy and its hop, and the load generator does not steal the
proxy's core. The open-loop runs (the latency bar) leave placement to the
scheduler, and are repeated pinned for reference (C{open_loop_pinned}). Each closed-loop
run also reports the CPU time per request of the proxy and of the model
server (from /proc), which is the gateway's own cost whatever the placement.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}]}
STREAM = dict(CHAT, stream=True)


# -- processes served by this file -------------------------------------------


def serve_gateway(port: int, upstream: str, front: str = "lean", policy: str = "", forwarded: str = "") -> None:
    """
    The gateway on C{port}, routing to C{upstream} (addresses separated by
    commas: one replica each), on the C{front} named: C{lean} (llmgw's
    own), C{httptools} or C{twisted_web} (see L{bench.fronts}), with the
    routing C{policy} named (empty: the gateway's default) and the
    C{forwarded} headers setting (C{--forwarded-headers}; empty: the
    gateway's default).
    """
    # On the reactor twistd's standalone gateway runs on by default (where
    # the llmgw measured has one: an older one, as a baseline, may not).
    # install(), not a newer name: a baseline runs this file on its llmgw.
    try:
        from llmgw.reactor import install
    except ImportError:
        pass
    else:
        install()
    from twisted.internet import reactor

    from llmgw.gateway.resource import GatewayResource
    from llmgw.gateway.service import GatewayService
    from llmgw.routing import Route, RoutingSnapshot

    routes = [Route(f"r{i}", MODEL, address) for i, address in enumerate(upstream.split(","), 1)]
    # Without a policy, as an older llmgw (a baseline) builds it.
    table = RoutingSnapshot(routes, [MODEL], policies={MODEL: policy}) if policy else RoutingSnapshot(routes, [MODEL])
    config = None
    if forwarded:
        from llmgw.gateway.proxy import GatewayConfig

        try:
            config = GatewayConfig(forwarded_headers=forwarded)
        except TypeError:
            # An older llmgw (a baseline) without the setting.
            print(f"this llmgw has no forwarded-headers setting; {forwarded!r} ignored", file=sys.stderr)
    svc = GatewayService(reactor, table, "127.0.0.1", port, config=config)
    if front != "lean":
        from bench.fronts import HttptoolsSite, twisted_web_site

        handler = GatewayResource(svc.gateway)
        site = HttptoolsSite(handler, reactor) if front == "httptools" else twisted_web_site(handler)
        svc.listener.factory = site
    # As twistd's standalone gateway does in its own process (where the
    # llmgw measured has it: an older one, as a baseline, may not).
    try:
        from llmgw.collector import CollectorTuning
    except ImportError:
        pass
    else:
        CollectorTuning(threshold=None).startService()
    svc.startService()
    reactor.run()


def serve_bare(port: int, upstream: str) -> None:
    # The baseline: a reverse proxy in a few lines of twisted.web.
    from twisted.internet import reactor
    from twisted.web import proxy, server

    host, up_port = upstream.rsplit(":", 1)
    site = server.Site(proxy.ReverseProxyResource(host, int(up_port), b""))
    site.log = lambda request: None  # type: ignore[method-assign]
    reactor.listenTCP(port, site, interface="127.0.0.1", backlog=1024)
    reactor.run()


def serve_fast(port: int) -> None:
    # A minimal upstream: the same JSON for every request, which is read no
    # further than its framing (Content-Length), so that it costs far less
    # per request than the gateway and shows the gateway's own ceiling.
    from twisted.internet import reactor
    from twisted.internet.protocol import Factory, Protocol

    body = json.dumps(
        {"id": "x", "object": "chat.completion", "model": MODEL,
         "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"},
                      "finish_reason": "stop"}]}
    ).encode()
    response = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    ) + body

    class Fast(Protocol):
        buf = b""

        def dataReceived(self, data: bytes) -> None:
            buf = self.buf + data
            answers = 0
            while True:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    break
                head = buf[:end].lower()
                i = head.find(b"content-length:")
                n = int(head[i + 15 :].split(b"\r\n", 1)[0]) if i >= 0 else 0
                if len(buf) < end + 4 + n:
                    break
                buf = buf[end + 4 + n :]
                answers += 1
            self.buf = buf
            if answers:
                self.transport.write(response * answers)

    reactor.listenTCP(port, Factory.forProtocol(Fast), interface="127.0.0.1", backlog=1024)
    reactor.run()


#: Between two slices of an open-loop run nothing is due for this long, so
#: that what the last slice left in flight is answered before the next
#: address is called.
SLICE_GAP = 0.05


def openloop(addresses: list[str], path: str, body: bytes, rate: float, duration: float, warmup: float,
             slice_s: float = 0.0) -> None:
    """
    Send C{rate} requests a second over kept-alive connections (opened as
    needed) to each of C{addresses}, one address at a time: first a warm-up
    of C{warmup} seconds each, then C{duration} seconds each. With
    C{slice_s}, each address's C{duration} is cut into slices of about
    C{slice_s} seconds and the addresses take turns, one slice each, the
    order rotated from one turn to the next; a change in the machine's
    load during the run then falls on every address alike instead of on
    whichever was running. Print, per address, latency and time to first
    byte of the requests due after its warm-up, each timed from when it
    was due (so that queueing in the generator cannot hide latency).
    """
    from twisted.internet import reactor

    from llmgw.gateway.upstream import UpstreamPool

    pool = UpstreamPool(reactor, connect_timeout=5, max_idle=1024)
    heads = [
        (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: " + address.encode()
         + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
        for address in addresses
    ]
    # The whole run as one schedule: (due, address index, measured), due
    # in seconds from the start.
    schedule: list[tuple[float, int, bool]] = []
    at = 0.0

    def burst(index: int, seconds: float, measured: bool) -> None:
        nonlocal at
        n = int(rate * seconds)
        schedule.extend((at + i / rate, index, measured) for i in range(n))
        at += n / rate + SLICE_GAP

    for index in range(len(addresses)):
        burst(index, warmup, False)
    slices = max(1, round(duration / slice_s)) if slice_s > 0 else 1
    for turn in range(slices):
        for k in range(len(addresses)):
            burst((turn + k) % len(addresses), duration / slices, True)

    clock = time.perf_counter
    total = len(schedule)
    t0 = clock() + 0.2
    results: list[list[tuple[float, float]]] = [[] for _ in addresses]
    errors = [0] * len(addresses)
    state = {"sent": 0, "done": 0}

    class Call:
        def __init__(self, due: float, index: int, measured: bool):
            self.due = due
            self.index = index
            self.measured = measured
            self.ttfb = 0.0

        def response_started(self, status: int, reason: bytes, headers: Any) -> None:
            self.ttfb = clock() - self.due
            if status != 200:
                errors[self.index] += 1

        def response_data(self, data: bytes) -> None:
            pass

        def response_finished(self) -> None:
            if self.measured:
                results[self.index].append((self.ttfb, clock() - self.due))
            self._end()

        def response_failed(self, reason: Any, started: bool) -> None:
            errors[self.index] += 1
            self._end()

        def _end(self) -> None:
            state["done"] += 1
            if state["done"] == total:
                reactor.stop()

    def launch(call: Call) -> None:
        address, head = addresses[call.index], heads[call.index]
        conn = pool.take(address)
        if conn is not None:
            conn.send(head, call)
            return
        d = pool.connect(address)
        d.addCallbacks(lambda c: c.send(head, call), lambda f: call.response_failed(f, False))

    def tick() -> None:
        now = clock()
        while state["sent"] < total:
            offset, index, measured = schedule[state["sent"]]
            due = t0 + offset
            if due > now:
                reactor.callLater(max(0.0, due - clock()), tick)
                return
            launch(Call(due, index, measured))
            state["sent"] += 1

    reactor.callLater(0.2, tick)
    reactor.callLater(at + 30, reactor.stop)
    reactor.run()
    out = {}
    for index, address in enumerate(addresses):
        ttfb = sorted(r[0] for r in results[index])
        lat = sorted(r[1] for r in results[index])
        out[address] = {
            "requests": len(lat), "errors": errors[index],
            "p50_ms": _pct(lat, 50), "p90_ms": _pct(lat, 90), "p99_ms": _pct(lat, 99),
            "ttfb_p50_ms": _pct(ttfb, 50), "ttfb_p99_ms": _pct(ttfb, 99),
        }
    print(json.dumps({"by_address": out, "slices": slices}))


def _median(values: list[Any]) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    n = len(values)
    mid = values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2
    return round(mid, 3)


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    i = min(len(values) - 1, max(0, int(round(p / 100 * len(values))) - 1))
    return round(values[i] * 1000, 3)


# -- the orchestrator ----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 15.0) -> None:
    end = time.time() + timeout
    while time.time() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {timeout} s")


#: CPUs per role when pinning: the proxy under test alone on one, the
#: model server and the load generators on the other.
PIN = {"proxy": {0}, "upstream": {1}, "load": {1}}


def placement(pin: bool) -> dict[str, set[int] | None]:
    if not pin or (os.cpu_count() or 1) < 2:
        return {role: None for role in PIN}
    return dict(PIN)  # type: ignore[arg-type]


def _affinity(cpus: set[int] | None) -> Any:
    if cpus is None:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def cpu_seconds(pid: int) -> float:
    """
    User and system CPU time of process C{pid} so far.
    """
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """
    CPU time spent by the whole machine so far, every process and interrupt.
    """
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(x) for x in fields]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class Procs:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = dict(os.environ, PYTHONPATH=str(ROOT))

    def start(self, *args: str, cpus: set[int] | None = None, root: Path = ROOT) -> subprocess.Popen[bytes]:
        env = self.env if root == ROOT else dict(self.env, PYTHONPATH=str(root))
        p = subprocess.Popen([sys.executable, *args], env=env, cwd=root,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             preexec_fn=_affinity(cpus))
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()


def wrk(url: str, body: dict[str, Any], connections: int, duration: float,
        cpus: set[int] | None = None, watch: dict[str, int] | None = None) -> dict[str, Any]:
    """
    A closed-loop C{wrk} run; C{watch} names processes (by pid) whose CPU
    time per request is reported.
    """
    fd, name = tempfile.mkstemp(prefix="llmgw-bench-", suffix=".lua")
    os.close(fd)
    script = Path(name)
    script.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = {json.dumps(json.dumps(body))}\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
    )
    before = {name: cpu_seconds(pid) for name, pid in (watch or {}).items()}
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration))}s", "--latency", "-s", str(script), url],
        capture_output=True, text=True, timeout=duration + 60, preexec_fn=_affinity(cpus),
    ).stdout
    used = {name: cpu_seconds(pid) - before[name] for name, pid in (watch or {}).items()}
    script.unlink()
    total = re.search(r"(\d+) requests in", out)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    p50 = re.search(r"\s50%\s+([\d.]+)(us|ms|s)", out)
    p99 = re.search(r"\s99%\s+([\d.]+)(us|ms|s)", out)

    def ms(m: Any) -> float | None:
        if not m:
            return None
        return round(float(m.group(1)) * {"us": 0.001, "ms": 1, "s": 1000}[m.group(2)], 3)

    result: dict[str, Any] = {
        "rps": float(rps.group(1)) if rps else None,
        "p50_ms": ms(p50), "p99_ms": ms(p99),
        "non_2xx": int(non2xx.group(1)) if non2xx else 0,
        "socket_errors": errors.group(1).strip() if errors else "",
    }
    n = int(total.group(1)) if total else 0
    for name, seconds in used.items():
        result[f"{name}_cpu_us_per_request"] = round(seconds / n * 1e6, 1) if n else None
    return result


def run_openloop(address: str, body: dict[str, Any], rate: float, duration: float,
                 cpus: set[int] | None = None) -> dict[str, Any]:
    return run_openloop_turns([address], body, rate, duration, 0.0, cpus)[address]


def run_openloop_turns(addresses: list[str], body: dict[str, Any], rate: float, duration: float,
                       slice_s: float, cpus: set[int] | None = None) -> dict[str, dict[str, Any]]:
    """
    One open-loop generator for C{addresses} (L{openloop}): the figures for
    each address, or C{{"error": ...}} for each if the generator gave none.
    """
    out = subprocess.run(
        [sys.executable, __file__, "openloop", ",".join(addresses), "/v1/chat/completions",
         json.dumps(body), str(rate), str(duration), "1.0", str(slice_s)],
        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)),
        # The whole schedule (L{openloop}: warm-ups of 1 s, the gaps) and
        # the generator's own 30 s to wait for stragglers, with room.
        timeout=len(addresses) * (1.0 + duration + (duration / slice_s + 2 if slice_s > 0 else 2) * SLICE_GAP) + 60,
        preexec_fn=_affinity(cpus),
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {address: {"error": out.stderr[-500:]} for address in addresses}
    return json.loads(lines[-1])["by_address"]  # type: ignore[no-any-return]


def open_loop(
    targets: dict[str, tuple[int, Any]], rate: float, duration: float, n_rounds: int,
    cpus: set[int] | None,
) -> tuple[dict[str, Any], dict[str, dict[str, list[dict[str, Any]]]]]:
    """
    Open-loop runs in rounds, each target in turn, so that a change in the
    machine's background load hits direct and proxied runs alike.
    """
    rounds: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for _ in range(n_rounds):
        for mode, body in (("non_streaming", CHAT), ("streaming", STREAM)):
            for name, (port, _) in targets.items():
                rounds.setdefault(mode, {}).setdefault(name, []).append(
                    run_openloop(f"127.0.0.1:{port}", body, rate, duration, cpus)
                )
    out: dict[str, Any] = {}
    for mode, by_name in rounds.items():
        for name, runs in by_name.items():
            entry: dict[str, Any] = {"rounds": runs}
            for key in ("p50_ms", "p90_ms", "p99_ms", "ttfb_p50_ms", "ttfb_p99_ms"):
                entry[f"median_{key}"] = _median([r.get(key) for r in runs])
            entry["errors"] = sum(r.get("errors", 0) for r in runs)
            out.setdefault(mode, {})[name] = entry
    out["rate_rps"] = rate
    out["seconds_per_round"] = duration
    out["method"] = (
        "requests sent at a fixed rate, each timed from when it was due; each round runs "
        "direct, gateway and bare proxy in turn; medians over the rounds"
    )
    return out, rounds


def added(rounds: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """
    The gateway's added latency: per round, gateway minus direct; and the
    median of those.
    """
    out: dict[str, Any] = {}
    for mode in ("non_streaming", "streaming"):
        d_runs, g_runs = rounds[mode]["direct"], rounds[mode]["gateway"]
        for key, label in (("p50_ms", "p50"), ("p99_ms", "p99"), ("ttfb_p50_ms", "ttfb_p50")):
            diffs = [g[key] - d[key] for d, g in zip(d_runs, g_runs, strict=True)
                     if d.get(key) is not None and g.get(key) is not None]
            out[f"{mode}_added_{label}_ms"] = _median(diffs)
            out[f"{mode}_added_{label}_ms_per_round"] = [round(x, 3) for x in diffs]
    return out


def metrics_cost(requests: int = 200_000, rounds: int = 5) -> dict[str, Any]:
    """
    CPU the gateway's metrics take per request, in this process: what
    C{ProxyCall} does for each request (a counter, two histograms, the clock
    reads that time them), against the same loop calling no-ops (the
    baseline, measured in the same run). Medians of C{rounds}.
    """
    from prometheus_client import CollectorRegistry

    from llmgw.gateway.metrics import GatewayMetrics

    m = GatewayMetrics(CollectorRegistry(), dict)

    class Noop:
        def count(self, model: str, path: str, status: int) -> None:
            pass

        def observe(self, model: str, seconds: float) -> None:
            pass

        def first_byte(self, model: str, seconds: float) -> None:
            pass

    def per_request(target: Any, clock: Any) -> float:
        start = time.process_time()
        for _ in range(requests):
            t0 = clock()
            target.first_byte(MODEL, clock() - t0)
            target.count(MODEL, "/v1/chat/completions", 200)
            target.observe(MODEL, clock() - t0)
        return (time.process_time() - start) / requests * 1e6

    def zero() -> float:
        return 0.0

    with_metrics = [per_request(m, time.monotonic) for _ in range(rounds)]
    baseline = [per_request(Noop(), zero) for _ in range(rounds)]
    net = (_median(with_metrics) or 0) - (_median(baseline) or 0)
    return {
        "what": "per request: one counter inc, two histogram observes, three monotonic reads",
        "requests_per_round": requests,
        "rounds": rounds,
        "us_per_request": round(_median(with_metrics) or 0, 3),
        "baseline_noop_us_per_request": round(_median(baseline) or 0, 3),
        "metrics_us_per_request": round(net, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per closed-loop run")
    ap.add_argument("--rate", type=float, default=500.0, help="open-loop requests per second")
    ap.add_argument("--rounds", type=int, default=3, help="open-loop rounds (medians are reported)")
    ap.add_argument("--quick", action="store_true", help="1 s runs (a smoke test of the script)")
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="leave CPU placement to the scheduler (default: pin, see the docstring)")
    ap.add_argument("--metrics-cost", action="store_true",
                    help="measure only the metrics' CPU per request (in process, no wrk)")
    args = ap.parse_args()
    if args.metrics_cost:
        load = [round(x, 2) for x in os.getloadavg()]
        out = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
               "metrics_cost": metrics_cost(),
               "load_average": {"before": load, "after": [round(x, 2) for x in os.getloadavg()]}}
        print(json.dumps(out, indent=2))
        return
    cpus = placement(args.pin)
    # Whatever else runs on the machine shows here; the figures are only
    # as good as the machine was quiet.
    load_before = [round(x, 2) for x in os.getloadavg()]
    busy_before, own_before = machine_busy_seconds(), own_seconds()
    if shutil.which("wrk") is None:
        sys.exit("bench/gateway.py needs wrk (apt-get install wrk)")
    duration = 1.0 if args.quick else args.duration
    procs = Procs()
    try:
        fm, gw, bare = free_port(), free_port(), free_port()
        fm_proc = procs.start("-m", "llmgw.testing.fakemodel", "--port", str(fm), "--model", MODEL,
                              cpus=cpus["upstream"])
        wait_port(fm)
        upstream = f"127.0.0.1:{fm}"
        gw_proc = procs.start(__file__, "serve-gateway", str(gw), upstream, cpus=cpus["proxy"])
        bare_proc = procs.start(__file__, "serve-bare", str(bare), upstream, cpus=cpus["proxy"])
        wait_port(gw)
        wait_port(bare)
        targets = {"direct": (fm, None), "gateway": (gw, gw_proc), "bare_proxy": (bare, bare_proc)}
        result: dict[str, Any] = {
            "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
            "upstream": "llmgw.testing.fakemodel (16-word replies, unpaced)",
            "cpu_pinning": (
                {"proxy_under_test": sorted(cpus["proxy"] or ()),
                 "model_server": sorted(cpus["upstream"] or ()),
                 "load_generators": sorted(cpus["load"] or ()),
                 "note": "the proxy alone on its CPU; model server and load generators share "
                         "the other, in the direct runs too"}
                if cpus["proxy"] is not None else "none: placement left to the scheduler"
            ),
            "closed_loop": {}, "open_loop": {},
        }
        for name, (port, proc) in targets.items():
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            watch = {"model_server": fm_proc.pid}
            if proc is not None:
                watch["proxy"] = proc.pid
            wrk(url, CHAT, 50, 1.0, cpus["load"])  # warm up connections and code paths
            for mode, body in (("non_streaming", CHAT), ("streaming", STREAM)):
                runs = result["closed_loop"].setdefault(mode, {}).setdefault(name, {})
                for c in (1, 50, 200):
                    runs[f"c{c}"] = wrk(url, body, c, duration, cpus["load"], watch)
        # The bar is judged with placement left to the scheduler: at this
        # rate nothing competes for a core, and pinning would put every hop
        # of the proxied path across CPUs (an idle vCPU's wake-up each) while
        # the direct path stays on one. The pinned placement is reported too.
        servers = [(fm_proc, cpus["upstream"]), (gw_proc, cpus["proxy"]), (bare_proc, cpus["proxy"])]
        everywhere = set(range(os.cpu_count() or 1))
        for proc, _ in servers:
            os.sched_setaffinity(proc.pid, everywhere)
        result["open_loop"], rounds = open_loop(targets, args.rate, duration, args.rounds, None)
        result["open_loop"]["cpu_pinning"] = "none: placement left to the scheduler"
        if cpus["proxy"] is not None:
            for proc, where in servers:
                os.sched_setaffinity(proc.pid, where)  # type: ignore[arg-type]
            result["open_loop_pinned"], pinned_rounds = open_loop(
                targets, args.rate, duration, args.rounds, cpus["load"]
            )
            result["open_loop_pinned"]["cpu_pinning"] = "as for the closed loop"
        procs.stop()

        # The gateway's own ceiling, against an upstream that is not the bottleneck.
        procs = Procs()
        fast, gw2 = free_port(), free_port()
        procs.start(__file__, "serve-fast", str(fast), cpus=cpus["upstream"])
        wait_port(fast)
        gw2_proc = procs.start(__file__, "serve-gateway", str(gw2), f"127.0.0.1:{fast}", cpus=cpus["proxy"])
        wait_port(gw2)
        fast_runs: dict[str, Any] = {}
        for name, port, watch2 in (("direct", fast, {}), ("gateway", gw2, {"proxy": gw2_proc.pid})):
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            wrk(url, CHAT, 50, 1.0, cpus["load"])
            fast_runs[name] = {f"c{c}": wrk(url, CHAT, c, duration, cpus["load"], watch2) for c in (50, 200)}
        result["minimal_upstream_non_streaming"] = fast_runs
        procs.stop()
        busy, own = machine_busy_seconds() - busy_before, own_seconds() - own_before
        result["machine_cpu_during_run"] = {
            "all_seconds": round(busy, 1),
            "this_benchmark_seconds": round(own, 1),
            "note": "all minus this benchmark is what else ran (other work, and kernel time "
                    "not charged to a process, such as loopback softirqs)",
        }

        summary: dict[str, Any] = {}
        ns = result["closed_loop"]["non_streaming"]
        best = {n: max(r["rps"] or 0 for r in ns[n].values()) for n in ns}
        summary["non_streaming_best_rps"] = best
        summary["gateway_vs_direct"] = round(best["gateway"] / best["direct"], 3) if best["direct"] else None
        summary["bare_proxy_vs_direct"] = round(best["bare_proxy"] / best["direct"], 3) if best["direct"] else None
        summary["gateway_vs_bare_proxy"] = round(best["gateway"] / best["bare_proxy"], 2) if best["bare_proxy"] else None
        gw_fast = max(r["rps"] or 0 for r in fast_runs["gateway"].values())
        summary["gateway_best_rps_minimal_upstream"] = gw_fast
        summary["gateway_cpu_us_per_request_c50"] = ns["gateway"]["c50"].get("proxy_cpu_us_per_request")
        summary["bare_proxy_cpu_us_per_request_c50"] = ns["bare_proxy"]["c50"].get("proxy_cpu_us_per_request")
        result["metrics_cost"] = metrics_cost()
        cpu_c50 = summary["gateway_cpu_us_per_request_c50"]
        if cpu_c50:
            summary["metrics_share_of_gateway_cpu_c50"] = round(
                result["metrics_cost"]["metrics_us_per_request"] / cpu_c50, 3
            )
        summary.update(added(rounds))
        if cpus["proxy"] is not None:
            summary["pinned"] = added(pinned_rounds)
        result["load_average"] = {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()]}
        summary["bar"] = {
            "3000_rps_through_gateway": max(best["gateway"], gw_fast) >= 3000,
            "3000_rps_through_gateway_with_fakemodel": best["gateway"] >= 3000,
            "added_p50_under_1ms": (summary.get("non_streaming_added_p50_ms") or 99) < 1,
            "added_p99_under_5ms": (summary.get("non_streaming_added_p99_ms") or 99) < 5,
            "better_than_bare_proxy": best["gateway"] > best["bare_proxy"],
        }
        result["summary"] = summary
        print(json.dumps(result, indent=2))
    finally:
        procs.stop()


# -- against the Rust routers ---------------------------------------------------

#: The candidates, in the order each round runs them.
FRONTS = ("lean", "httptools", "twisted_web")
VENV = ROOT / ".venv-bench"


def vllm_router_exe() -> Path:
    """
    C{vllm-router} from the bench's own environment (C{.venv-bench}, made
    and filled from PyPI on first use).
    """
    exe = VENV / "bin" / "vllm-router"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", "vllm-router"], check=True)
    return exe


def wait_answers(port: int, timeout: float = 30.0) -> None:
    """
    Wait until C{port} answers a chat completion with a 200.
    """
    body = json.dumps(CHAT).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    end = time.time() + timeout
    while time.time() < end:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as c:
                c.sendall(request)
                if c.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"port {port} gives no 200 after {timeout} s")  # the caller says whose


def rss_mib(pid: int) -> dict[str, float]:
    status = Path(f"/proc/{pid}/status").read_text()
    out = {}
    for key in ("VmRSS", "VmHWM"):
        m = re.search(rf"{key}:\s+(\d+) kB", status)
        if m:
            out[key] = round(int(m.group(1)) / 1024, 1)
    return out


def wrk_direct(ports: list[int], connections: int, duration: float) -> dict[str, Any]:
    """
    The direct baseline for a proxy spreading C{connections} over the model
    servers on C{ports}: one C{wrk} per server at once, the connections
    split between them; their requests per second add up.
    """
    from concurrent.futures import ThreadPoolExecutor

    share = max(1, connections // len(ports))
    with ThreadPoolExecutor(len(ports)) as pool:
        runs = list(pool.map(
            lambda port: wrk(f"http://127.0.0.1:{port}/v1/chat/completions", CHAT, share, duration), ports
        ))
    return {
        "rps": round(sum(r["rps"] or 0 for r in runs), 1),
        "p99_ms": max((r["p99_ms"] or 0) for r in runs),
        "non_2xx": sum(r["non_2xx"] for r in runs),
        "socket_errors": "; ".join(r["socket_errors"] for r in runs if r["socket_errors"]),
    }


def _commit(root: Path) -> str:
    """
    The commit checked out at C{root}, or C{"?"}.
    """
    r = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "?"


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def routing_guard(summary: dict[str, Any]) -> dict[str, Any]:
    """
    Issue 12's guard: today's gateway on its default policy against the
    gateway from before the routing policies, in the same run: throughput
    within 5% at 50 and 200 connections, and the added p99 at the open
    loop's rate.
    """
    now, before = summary["llmgw_default"], summary["llmgw_before_routing"]
    out: dict[str, Any] = {}
    for c in ("c50", "c200"):
        ratio = (now[f"{c}_rps"] or 0) / before[f"{c}_rps"] if before[f"{c}_rps"] else None
        out[f"{c}_rps_ratio"] = None if ratio is None else round(ratio, 3)
        out[f"{c}_within_5pct"] = ratio is not None and ratio >= 0.95
    out["added_p99_ms"] = {"now": now["added_p99_ms"], "before": before["added_p99_ms"]}
    return out


def build_compiled(dest: Path) -> Path:
    """
    This checkout, built with its hot path compiled (setup.py,
    C{LLMGW_COMPILE=1}), installed into C{dest} (put it on C{PYTHONPATH});
    returns C{dest}.
    """
    if importlib.util.find_spec("mypyc") is None:
        sys.exit("--compiled needs mypyc: pip install -e '.[compile]'")
    with tempfile.TemporaryDirectory(prefix="llmgw-source-") as source:
        # From a copy: a build in the checkout would leave build/ there, and
        # reuse what an earlier build left in it.
        for name in ("llmgw", "twisted", "setup.py", "setup.cfg", "pyproject.toml", "README.md"):
            if (ROOT / name).is_dir():
                shutil.copytree(ROOT / name, Path(source) / name,
                                ignore=shutil.ignore_patterns("__pycache__", "*.so"))
            else:
                shutil.copy2(ROOT / name, Path(source) / name)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "--target",
             str(dest), source],
            env=dict(os.environ, LLMGW_COMPILE="1"), check=True, stdout=subprocess.DEVNULL,
        )
    if not list(dest.rglob("llmgw/gateway/*.so")):
        sys.exit(f"the compiled build in {dest} holds no compiled module")
    return dest


def versus(duration: float, rate: float, n_rounds: int, fronts: tuple[str, ...],
           baseline: Path | None = None, policy: str = "round_robin",
           cache_aware: bool = False, guard: Path | None = None,
           forwarded: str = "none", default_headers: bool = False,
           compiled: Path | None = None, slice_s: float = 1.0) -> dict[str, Any]:
    """
    Direct, llmgw on each front in C{fronts}, and C{vllm-router}, with the
    same two fake model servers, C{wrk} at 50 and 200 connections and the
    open-loop generator at C{rate} (plain and streamed), in C{n_rounds}
    interleaved rounds; medians, and per round the ratio to (or the latency
    added over) direct in the same round. In a round each target has its
    C{wrk} runs in turn (the order rotated from round to round); then one
    open-loop generator calls them all, taking turns in slices of about
    C{slice_s} seconds (L{openloop}), so that the latencies compared were
    measured under the same background load; C{slice_s} 0 gives each
    target its whole run in one go. With C{baseline} (another
    checkout of llmgw, such as the code before a change), its gateway on
    its C{lean} front runs in the same rounds as C{llmgw_baseline}.

    Like for like: llmgw routes by C{policy} (round-robin by default, as
    C{vllm-router} is run; the baseline too). With C{cache_aware}, the
    prefix-aware policies are compared as well: llmgw's default policy
    (C{prefix}; C{llmgw_default}) against C{vllm-router}'s C{cache_aware}
    (C{vllm_router_cache_aware}). With C{guard} (a checkout from before
    the routing policies), its gateway runs on its own default
    as C{llmgw_before_routing}, against today's default (C{llmgw_default}):
    the guard that routing costs the gateway at most 5%.

    Like for like in what the replicas are told: C{vllm-router} sends no
    forwarded headers, so llmgw (and the baseline) run with
    C{--forwarded-headers} C{forwarded} (C{none} by default). With
    C{default_headers}, llmgw on its lean front with the gateway's default
    (C{X-Forwarded-For} and C{-Proto}) runs as well
    (C{llmgw_lean_default_headers}): what those two headers cost.

    With C{compiled} (a directory holding llmgw built with its hot path
    compiled, L{build_compiled}), that build's gateway on its lean front
    runs as well (C{llmgw_lean_compiled}), with the same settings as
    C{llmgw_lean}.
    """
    if shutil.which("wrk") is None:
        sys.exit("bench/gateway.py needs wrk (apt-get install wrk)")
    router = vllm_router_exe()
    skipped = {}
    if "httptools" in fronts and importlib.util.find_spec("httptools") is None:
        skipped["httptools"] = "not installed (pip install -e '.[bench]')"
        fronts = tuple(f for f in fronts if f != "httptools")
    procs = Procs()
    started_uptime = uptime()
    try:
        fms = [free_port(), free_port()]
        fm_procs = [procs.start("-m", "llmgw.testing.fakemodel", "--port", str(p), "--model", MODEL) for p in fms]
        for p in fms:
            wait_port(p)
        upstreams = ",".join(f"127.0.0.1:{p}" for p in fms)
        targets: dict[str, tuple[int, Any]] = {"direct": (fms[0], None)}
        for front in fronts:
            port = free_port()
            targets[f"llmgw_{front}"] = (port, procs.start(
                __file__, "serve-gateway", str(port), upstreams, front, policy, forwarded))
        if compiled is not None:
            port = free_port()
            targets["llmgw_lean_compiled"] = (port, procs.start(
                str(Path(__file__).resolve()), "serve-gateway", str(port), upstreams, "lean", policy, forwarded,
                root=compiled))
        if default_headers:
            port = free_port()
            targets["llmgw_lean_default_headers"] = (port, procs.start(
                __file__, "serve-gateway", str(port), upstreams, "lean", policy, ""))
        if baseline is not None:
            # This file's serve-gateway (it names the policy) on the
            # baseline's llmgw.
            port = free_port()
            targets["llmgw_baseline"] = (port, procs.start(
                str(Path(__file__).resolve()), "serve-gateway", str(port), upstreams, "lean", policy, forwarded,
                root=baseline))
        if cache_aware or guard is not None:
            port = free_port()
            targets["llmgw_default"] = (port, procs.start(
                __file__, "serve-gateway", str(port), upstreams, "lean", ""))
        if guard is not None:
            port = free_port()
            targets["llmgw_before_routing"] = (port, procs.start(
                str(Path(__file__).resolve()), "serve-gateway", str(port), upstreams, "lean", "", root=guard))

        def start_router(router_policy: str) -> tuple[int, Any]:
            vr_port = free_port()
            vr = subprocess.Popen(
                [str(router), "--host", "127.0.0.1", "--port", str(vr_port), "--policy", router_policy,
                 # Each its own metrics port (two on 29000 would not both start).
                 "--prometheus-port", str(free_port()),
                 "--log-level", "warning", "--worker-urls", *[f"http://127.0.0.1:{p}" for p in fms]],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            procs.procs.append(vr)  # type: ignore[arg-type]
            return vr_port, vr

        targets["vllm_router"] = start_router("round_robin")
        if cache_aware:
            targets["vllm_router_cache_aware"] = start_router("cache_aware")
        for name, (port, _) in targets.items():
            try:
                wait_answers(port)
            except RuntimeError as e:
                raise RuntimeError(f"{name}: {e}") from None
            if name != "direct":
                wrk(f"http://127.0.0.1:{port}/v1/chat/completions", CHAT, 50, 1.0)  # warm up
        rounds: list[dict[str, dict[str, Any]]] = []
        names = list(targets)
        for n in range(n_rounds):
            this: dict[str, dict[str, Any]] = {}
            # Each round starts from the next target, so that none always
            # runs first or right after another.
            for name in names[n % len(names):] + names[:n % len(names)]:
                port = targets[name][0]
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                this[name] = {
                    f"c{c}": wrk_direct(fms, c, duration) if name == "direct" else wrk(url, CHAT, c, duration)
                    for c in (50, 200)
                }
            addresses = {name: f"127.0.0.1:{targets[name][0]}" for name in names}
            for mode, body in (("open_loop", CHAT), ("open_loop_streaming", STREAM)):
                turns = run_openloop_turns(list(addresses.values()), body, rate, duration, slice_s)
                for name, address in addresses.items():
                    this[name][mode] = turns[address]
            rounds.append({name: this[name] for name in names})
        rss = {name: rss_mib(proc.pid) for name, (_, proc) in targets.items() if proc is not None}
        rss["model_servers"] = {str(i): rss_mib(p.pid)["VmRSS"] for i, p in enumerate(fm_procs)}
    finally:
        procs.stop()

    summary: dict[str, Any] = {}
    for name in targets:
        out: dict[str, Any] = {}
        for c in ("c50", "c200"):
            out[f"{c}_rps"] = _median([r[name][c]["rps"] for r in rounds])
            if name != "direct":
                out[f"{c}_vs_direct"] = _median(
                    [r[name][c]["rps"] / r["direct"][c]["rps"] for r in rounds if r["direct"][c]["rps"]]
                )
            out[f"{c}_errors"] = sum(r[name][c]["non_2xx"] for r in rounds)
        for key, mode, field in (("p99_ms", "open_loop", "p99_ms"), ("stream_ttfb_p99_ms", "open_loop_streaming",
                                                                      "ttfb_p99_ms")):
            out[key] = _median([r[name][mode].get(field) for r in rounds])
            if name != "direct":
                diffs = [r[name][mode][field] - r["direct"][mode][field] for r in rounds
                         if r[name][mode].get(field) is not None and r["direct"][mode].get(field) is not None]
                out[f"added_{key}"] = _median(diffs)
                out[f"added_{key}_per_round"] = [round(d, 3) for d in diffs]
        out["open_loop_errors"] = sum(r[name]["open_loop"].get("errors", 0) + r[name]["open_loop_streaming"].get(
            "errors", 0) for r in rounds)
        if name in rss:
            out["rss_mib"] = rss[name]
        summary[name] = out

    def bar(front: str, peer: str = "vllm_router") -> dict[str, bool]:
        g, v = summary[f"llmgw_{front}"], summary[peer]
        return {
            "c50_rps_at_least_vllm_router": (g["c50_rps"] or 0) >= (v["c50_rps"] or 0),
            "c200_rps_at_least_vllm_router": (g["c200_rps"] or 0) >= (v["c200_rps"] or 0),
            "added_p99_no_worse_than_vllm_router_and_under_1ms":
                (g["added_p99_ms"] or 99) < 1 and (g["added_p99_ms"] or 99) <= (v["added_p99_ms"] or 0),
            "added_stream_ttfb_p99_no_worse_than_vllm_router_and_under_1ms":
                (g["added_stream_ttfb_p99_ms"] or 99) < 1
                and (g["added_stream_ttfb_p99_ms"] or 99) <= (v["added_stream_ttfb_p99_ms"] or 0),
            "rss_under_80_mb": g["rss_mib"].get("VmHWM", 999) * 1.048576 < 80,
        }

    return {
        "what": "llmgw's front on each parser against vllm-router, same two fake model servers, "
                "wrk (closed loop) and an open-loop generator at a fixed rate; interleaved rounds, medians",
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "uptime": {"before": started_uptime, "after": uptime()},
        "seconds_per_run": duration, "rate_rps": rate, "rounds": n_rounds,
        "open_loop_slices": (f"each target's {duration} s in slices of about {slice_s} s, the targets "
                             "taking turns, the order rotated each turn" if slice_s > 0
                             else "each target's run in one go, the targets in turn"),
        "direct": "both fake model servers at once, one wrk each with half the connections (throughput); "
                  "the first one (open-loop latency)",
        "summary": summary,
        "policy": {"llmgw": policy, "vllm_router": "round_robin"},
        "forwarded_headers": {"llmgw": forwarded, "vllm_router": "none (it sends no forwarded headers)",
                              "llmgw_lean_default_headers": "the gateway's default" if default_headers else None},
        "bars": dict(
            {front: bar(front) for front in fronts + (("baseline",) if baseline is not None else ())
             + (("lean_default_headers",) if default_headers else ())
             + (("lean_compiled",) if compiled is not None else ())},
            **({"default_vs_cache_aware": bar("default", "vllm_router_cache_aware")} if cache_aware else {}),
        ),
        "routing_guard": None if guard is None else routing_guard(summary),
        "guard": None if guard is None else f"{guard} at {_commit(guard)}",
        "fronts_skipped": skipped,
        "baseline": None if baseline is None else f"{baseline} at {_commit(baseline)}",
        "compiled": None if compiled is None else sorted(
            str(p.relative_to(compiled)) for p in compiled.rglob("llmgw/**/*.so")),
        "per_round": rounds,
    }


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve-gateway":
        serve_gateway(int(sys.argv[2]), sys.argv[3], *sys.argv[4:7])
    elif len(sys.argv) > 1 and sys.argv[1] == "serve-bare":
        serve_bare(int(sys.argv[2]), sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "serve-fast":
        serve_fast(int(sys.argv[2]))
    elif len(sys.argv) > 1 and sys.argv[1] == "versus":
        vp = argparse.ArgumentParser(prog="bench/gateway.py versus", description=versus.__doc__)
        vp.add_argument("--duration", type=float, default=3.0, help="seconds per run")
        vp.add_argument("--rate", type=float, default=500.0, help="open-loop requests per second")
        vp.add_argument("--rounds", type=int, default=5)
        vp.add_argument("--slice", type=float, default=1.0,
                        help="open-loop slice in seconds, the targets taking turns (0: each target's run in one go)")
        vp.add_argument("--fronts", default=",".join(FRONTS), help="llmgw fronts to run, comma-separated")
        vp.add_argument("--baseline", type=Path, help="another llmgw checkout to run beside (llmgw_baseline)")
        vp.add_argument("--policy", default="round_robin",
                        help="llmgw's routing policy (vllm-router runs round_robin)")
        vp.add_argument("--cache-aware", action="store_true",
                        help="also llmgw's default policy (prefix) against vllm-router's cache_aware")
        vp.add_argument("--guard", type=Path,
                        help="a checkout from before the routing policies, on its default (the guard that routing costs at most 5%%)")
        vp.add_argument("--forwarded", default="none",
                        help="llmgw's --forwarded-headers (default none: vllm-router sends none)")
        vp.add_argument("--default-headers", action="store_true",
                        help="also llmgw on the gateway's default forwarded headers")
        vp.add_argument("--compiled", action="store_true",
                        help="also this checkout built with its hot path compiled (setup.py, LLMGW_COMPILE=1)")
        va = vp.parse_args(sys.argv[2:])
        with tempfile.TemporaryDirectory(prefix="llmgw-compiled-") as built:
            compiled_at = build_compiled(Path(built)) if va.compiled else None
            print(json.dumps(versus(va.duration, va.rate, va.rounds, tuple(va.fronts.split(",")), va.baseline,
                                    va.policy, va.cache_aware, va.guard, va.forwarded, va.default_headers,
                                    compiled_at, va.slice), indent=2))
    elif len(sys.argv) > 1 and sys.argv[1] == "openloop":
        a = sys.argv[2:]
        openloop(a[0].split(","), a[1], a[2].encode(), float(a[3]), float(a[4]), float(a[5]),
                 float(a[6]) if len(a) > 6 else 0.0)
    else:
        main()
