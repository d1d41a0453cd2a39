"""
Engines benchmark: prints JSON.

    python bench/engines.py [--runs 3] [--scrape-seconds 20] [--shards 16]

1. Start to ready, and death to a ready replacement, through the real
   L{Supervisor} (real processes, real HTTP health checks on 127.0.0.1):
   for the fake model server (the baseline) and for llama.cpp's
   C{llama-server} serving the tiny GGUF model (skipped, saying so, when
   the binary is absent). "Death to ready replacement" is SIGKILL of the
   engine to the supervisor's failure report plus a new start of the same
   shard to ready: what the agent adds. The control plane's backoff before
   it re-places a failed deployment (10 s after a first failure) comes on
   top in a fleet and is not measured here.
2. The agent's CPU for scraping C{--shards} shards at 1 Hz: the real
   L{Scraper} and L{HttpFetcher} against a separate process serving a
   realistic vLLM /metrics document (~100 KB: the gauges llmgw reads plus
   the histograms vLLM exports) on that many ports. The CPU of this process
   over the window, less the same window idle (the baseline, measured in
   the same run), over the wall time. Bar: under 2% of a core.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from twisted.internet import defer, reactor, task

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmgw.agent.probe import HttpProber  # noqa: E402
from llmgw.agent.scrape import HttpFetcher, Scraper  # noqa: E402
from llmgw.agent.shard import READY, Shard  # noqa: E402
from llmgw.agent.state import ShardSpec, StateDir  # noqa: E402
from llmgw.agent.supervisor import Supervisor  # noqa: E402
from llmgw.engines import metric_names_for  # noqa: E402
from llmgw.testing.engines import find_llama_server  # noqa: E402
from llmgw.testing.procs import free_port  # noqa: E402


def vllm_document() -> bytes:
    """
    A vLLM-shaped /metrics of about 100 KB: the sample's gauges and
    counters, and twenty histograms of twenty buckets for two engines.
    """
    head = (ROOT / "tests" / "data" / "metrics-vllm.txt").read_text()
    lines = [head]
    for h in range(20):
        name = f"vllm:bench_histogram_{h}_seconds"
        lines.append(f"# HELP {name} A histogram like vLLM's latency ones.\n# TYPE {name} histogram")
        for engine in ("0", "1"):
            for b in range(20):
                lines.append(f'{name}_bucket{{engine="{engine}",le="{0.001 * 2 ** b}",'
                             f'model_name="meta-llama/Llama-3.1-8B-Instruct"}} {b * 3}.0')
            lines.append(f'{name}_count{{engine="{engine}",model_name="meta-llama/Llama-3.1-8B-Instruct"}} 60.0')
            lines.append(f'{name}_sum{{engine="{engine}",model_name="meta-llama/Llama-3.1-8B-Instruct"}} 12.5')
    return ("\n".join(lines) + "\n").encode()


SERVER = r"""
import sys
from twisted.internet import reactor
from twisted.web import resource, server
body = open(sys.argv[1], 'rb').read()
class M(resource.Resource):
    isLeaf = True
    def render_GET(self, request):
        request.setHeader(b'content-type', b'text/plain; version=0.0.4')
        return body
site = server.Site(M())
site.log = lambda r: None
for p in sys.argv[2:]:
    reactor.listenTCP(int(p), site, interface='127.0.0.1')
print('serving', flush=True)
reactor.run()
"""


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class FakeSupervisor:
    def __init__(self, ports: list[int]):
        self.shards = {}
        for i, port in enumerate(ports):
            s = Shard(ShardSpec(shard_id=f"s{i}", replica_id=f"r{i}", model="m", profile="p",
                                argv=["x"], gpu_indices=[], port=port, metrics_path="/metrics",
                                metric_names=metric_names_for("vllm")), READY)
            self.shards[s.shard_id] = s

    def live_shards(self) -> list[Shard]:
        return list(self.shards.values())


@defer.inlineCallbacks
def scrape_cpu(shards: int, seconds: float) -> Any:
    doc = vllm_document()
    tmp = Path(tempfile.mkdtemp())
    (tmp / "metrics.txt").write_bytes(doc)
    ports = [free_port() for _ in range(shards)]
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(tmp / "metrics.txt"),
                               *map(str, ports)], stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None
        server.stdout.readline()
        # Baseline: the same window with the reactor idle.
        c0, w0 = cpu(), time.monotonic()
        yield task.deferLater(reactor, seconds, lambda: None)
        idle = (cpu() - c0) / (time.monotonic() - w0)
        fetcher = HttpFetcher(reactor)
        scraper = Scraper(reactor, FakeSupervisor(ports), fetcher.get)  # type: ignore[arg-type]
        scraper.startService()
        yield task.deferLater(reactor, 2.5, lambda: None)  # connections open, warm
        before = {k: v.scrapes for k, v in scraper.samples.items()}
        c0, w0 = cpu(), time.monotonic()
        yield task.deferLater(reactor, seconds, lambda: None)
        busy = (cpu() - c0) / (time.monotonic() - w0)
        scrapes = sum(v.scrapes - before.get(k, 0) for k, v in scraper.samples.items())
        failures = sum(v.failures for v in scraper.samples.values())
        sample = scraper.samples["s0"].signals
        scraper.stopService()
        yield fetcher.close()
    finally:
        server.terminate()
        server.wait(10)
    return {
        "shards": shards,
        "document_bytes": len(doc),
        "window_s": seconds,
        "scrapes": scrapes,
        "scrapes_per_shard_per_s": round(scrapes / shards / seconds, 3),
        "failures": failures,
        "cpu_idle_baseline_pct": round(100 * idle, 3),
        "cpu_scraping_pct": round(100 * busy, 3),
        "cpu_for_scraping_pct": round(100 * (busy - idle), 3),
        "bar_pct": 2.0,
        "within_bar": (busy - idle) * 100 < 2.0,
        "sample_running": sample.running if sample else None,
    }


@defer.inlineCallbacks
def lifecycle(name: str, argv: list[str], runs: int, probe_interval: float) -> Any:
    state = StateDir(tempfile.mkdtemp())
    prober = HttpProber(reactor)
    sup = Supervisor(reactor, lambda *a, **kw: reactor.spawnProcess(*a, **kw), state,
                     prober=prober, probe_interval_starting=probe_interval,
                     base_env={k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ})
    sup.startService()
    events: dict[str, defer.Deferred[Any]] = {}

    def listener(shard: Shard) -> None:
        d = events.pop(shard.state, None)
        if d is not None:
            d.callback(time.monotonic())

    sup.add_listener(listener)

    def expect(state_name: str) -> defer.Deferred[Any]:
        d: defer.Deferred[Any] = defer.Deferred()
        events[state_name] = d
        return d.addTimeout(120, reactor)

    starts, replacements = [], []
    try:
        for run in range(runs):
            port = free_port()
            spec = ShardSpec(shard_id=f"{name}-{run}", replica_id="r", model="tiny", profile="p",
                             argv=argv, gpu_indices=[], port=port, stop_grace_s=5,
                             startup_timeout_s=120, env={"PYTHONPATH": str(ROOT)})
            ready = expect(READY)
            t0 = time.monotonic()
            shard = sup.start(spec)
            t1 = yield ready
            starts.append(t1 - t0)
            failed = expect("failed")
            t2 = time.monotonic()
            os.kill(shard.pid, signal.SIGKILL)  # type: ignore[arg-type]
            yield failed
            ready = expect(READY)
            again = sup.start(ShardSpec(**{**spec.__dict__, "shard_id": f"{name}-{run}b",
                                           "port": free_port()}))
            t3 = yield ready
            replacements.append(t3 - t2)
            stopped = expect("stopped")
            sup.stop(again.shard_id)
            yield stopped
    finally:
        sup.stopService()
    return {
        "runs": runs,
        "probe_interval_starting_s": probe_interval,
        "start_to_ready_s": [round(x, 3) for x in starts],
        "start_to_ready_median_s": round(sorted(starts)[len(starts) // 2], 3),
        "death_to_ready_replacement_s": [round(x, 3) for x in replacements],
        "death_to_ready_replacement_median_s": round(sorted(replacements)[len(replacements) // 2], 3),
    }


@defer.inlineCallbacks
def main(args: argparse.Namespace) -> Any:
    out: dict[str, Any] = {"bench": "engines", "load_before": os.getloadavg()}
    fake = ["{python}", "-m", "llmgw.testing.fakemodel", "--model", "tiny", "--port", "{port}"]
    for interval in (1.0, 0.1):
        key = f"fake_model_server_probe_{interval:g}s"
        out[key] = yield lifecycle("fake", fake, args.runs, interval)
    binary = find_llama_server()
    if binary is None:
        out["llama_server"] = {"skipped": "no llama-server binary (.ci/build-llama-server)"}
    else:
        from llmgw.testing.tinygguf import write

        model = write(Path(tempfile.mkdtemp()) / "tiny.gguf")
        argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", "{port}",
                "--metrics", "-c", "512", "-np", "1", "-t", "1", "--no-warmup"]
        for interval in (1.0, 0.1):
            out[f"llama_server_probe_{interval:g}s"] = yield lifecycle("llama", argv, args.runs,
                                                                       interval)
    out["scrape"] = yield scrape_cpu(args.shards, args.scrape_seconds)
    out["load_after"] = os.getloadavg()
    print(json.dumps(out, indent=2))


def run() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--scrape-seconds", type=float, default=20.0)
    args = p.parse_args()
    result: dict[str, Any] = {}

    def go() -> None:
        d = main(args)
        d.addErrback(lambda f: (result.setdefault("error", f), f.printTraceback()))
        d.addBoth(lambda _: reactor.stop())

    reactor.callWhenRunning(go)
    reactor.run()
    if "error" in result:
        sys.exit(1)


if __name__ == "__main__":
    run()
