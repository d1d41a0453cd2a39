"""
The console's costs (issue bars, DESIGN §21), printed as JSON.

Section C{curves}: what keeping the curves costs the control plane at
10,000 nodes (bar: under 1% of a core and under 20 MiB). In one process, a
reconciler holds 10,000 simulated nodes of 8 GPUs with half of them
running single-GPU replicas of 10 deployments (40,000 shards), each node's
heartbeat carrying its GPU memory and its shards' engine signals, and an
embedded gateway counting requests, first bytes and tokens for 10 models
and 50 API keys. Each
simulated 10-second step does the control plane's work (every node's
heartbeat, ten reconcile passes, the gateway's requests) and then one
sample of the L{SeriesKeeper}, as its 10 s loop would.

  - CPU: the keeper's sample, timed alone (process CPU time): median, p99,
    max, and its share of a core (mean sample / step). Also the steps'
    CPU with and without the keeper, the same work otherwise (noisy on a
    shared machine; the timed sample is the figure).
  - memory: what the keeper holds once its rings are full (an hour of
    samples, 361), by tracemalloc from its creation on; and the rings'
    own bytes. Also the process's RSS growth over that hour.
  - the reactor's turns: a sample's node pass runs in slices, one a
    reactor turn (C{callLater(0)}); each turn is timed alone (process CPU
    time) on the keeper's own clock, the longest one the figure the
    reactor feels (C{turn_cpu_ms_max}), with the turns a sample takes.
    C{--slice-nodes} sets the nodes a turn (0: the keeper's default). The
    first turn also reads the gateway's counts, the last publishes the
    sample: each has its own figure.
  - the answer: C{GET /api/v1/series}'s view, first (since=0) and a
    poll's (since the newest), its time and JSON size.

The collector runs as in a control-plane process (C{--gc-threshold},
default 50,000, the heap frozen after the fleet is built); C{0} leaves
Python's defaults.

Section C{browser}: what the page costs a browser (bar: with 1,000 nodes
and 4,000 replicas changing at the watch stream's rate, the page's main
thread busy under 25% of the time, a click answered within 100 ms). An
admin API on loopback (this process, its real watch stream) over a fake
fleet of C{--browser-nodes} nodes of 8 GPUs with 4 replicas each; every
C{views_interval} (0.5 s, when the stream diffs the views) C{--churn} of
the nodes (their GPU memory) and of the replicas (their engine signals)
change, so each sends a message every pass at the default of 1.0: 10,000
messages a second. Chromium (headless, chromium-driver) shows the page;
after a warm-up the main thread's busy share is read from chromium's own
metrics (C{TaskDuration} over C{--seconds}), then C{--clicks} clicks on
the nodes table's pager and on a node's cordon button, each timed from
the click to the next paint (L{llmgw.testing.chromium.measure}). The
control plane runs in this process at C{--server-nice} (10) and chromium,
started first, at the usual priority: in a fleet they are on different
machines, here they share the cores.

Run: PYTHONPATH=. python bench/page.py [--section curves|browser] [--nodes 10000] [--steps 30]
     [--gc-threshold N] [--slice-nodes N] [--browser-nodes 1000] [--churn 1.0] [--seconds 20] [--clicks 30] [--server-nice 10]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import tomllib
import tracemalloc
from typing import Any

from twisted.internet.task import Clock

from bench.reconcile import DEPLOYMENTS, catalog_text, make_ready, passes_until_done
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.core.catalog import parse_catalog
from llmgw.control.core.kept import KeptState
from llmgw.control.shell.reconciler import Reconciler
from llmgw.control.shell.series import ControlSources, SeriesKeeper
from llmgw.control.state.inventory import Inventory
from llmgw.control.state.series import KEEP_S, STEP_S, points_for
from llmgw.gateway.keys import KeyRing
from llmgw.gateway.service import GatewayService
from llmgw.routing import Route, RoutingSnapshot
from llmgw.testing.simfleet import FakeDispatcher, sim_fleet

KEYS = 50
REQUESTS_PER_MODEL = 40


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Fleet:
    """The simulated control plane: reconciler, inventory, embedded gateway."""

    def __init__(self, nodes: int):
        self.clock = Clock()
        self.clock.advance(1_700_000_000)
        self.inv = Inventory()
        self.ids = sim_fleet(self.inv, nodes, gpus=8)
        per_dep = nodes * 4 // DEPLOYMENTS
        cat = parse_catalog(tomllib.loads(catalog_text(per_dep, 0)))
        self.dispatcher = FakeDispatcher(connected=set(self.ids))
        self.rec = Reconciler(cat, self.inv, self.clock, self.dispatcher, adoption_grace=0,
                              pending_timeout=1e9, fleet_state=KeptState(None))
        for node_id in self.ids:
            self.rec.adopt(node_id, [])
            self.rec.node_registered(node_id)
        self.clock.advance(1)
        passes_until_done(self.rec)
        self.shards: dict[str, list[str]] = {}
        for cmd in self.dispatcher.starts:
            self.shards.setdefault(cmd.node_id, []).append(cmd.shard_id)
        make_ready(self.rec, self.clock, self.dispatcher)
        keys = {f"key-{i:02}": f"sk-bench-key-{i:04}" for i in range(KEYS)}
        self.gateway = GatewayService(self.clock, RoutingSnapshot([Route("r1", "m0", "10.0.0.9:8000")]),
                                      port=0, keys=KeyRing(keys)).gateway
        self.key_names = sorted(keys)
        self.tokens = 0.0
        self.step_no = 0

    def heartbeats(self) -> None:
        now_tokens = self.tokens
        for i, node_id in enumerate(self.ids):
            shards = self.shards.get(node_id, [])
            used = [1000 + (self.step_no * 37 + i + g) % 50_000 for g in range(8)]
            self.inv.apply_heartbeat(node_id, used, [])
            self.inv.touch(node_id, self.clock.seconds())
            self.rec.record_engine_signals(node_id, [
                pb.ShardSignals(shard_id=s, age_s=0.5, waiting=1, running=2, generated_tokens=now_tokens + i)
                for s in shards])

    def traffic(self) -> None:
        metrics, usage = self.gateway.metrics, self.gateway.usage
        for m in range(DEPLOYMENTS):
            model = f"m{m}"
            for r in range(REQUESTS_PER_MODEL):
                metrics.count(model, "/v1/chat/completions", 200)
                metrics.first_byte(model, 0.05 + 0.01 * (r % 20))
                meter = usage.admit(self.key_names[(m * REQUESTS_PER_MODEL + r) % KEYS], model)
                meter.feed(b'{"usage": {"prompt_tokens": 30, "completion_tokens": 70, "total_tokens": 100}}')
                meter.finish(200)

    def step(self) -> None:
        """The control plane's work over one 10 s step, the keeper aside."""
        self.step_no += 1
        self.tokens += 500.0
        self.heartbeats()
        self.traffic()
        for _ in range(10):
            self.clock.advance(1)
            passes_until_done(self.rec)

    def keeper(self, slice_nodes: int = 0) -> SeriesKeeper:
        extra = {"slice_nodes": slice_nodes} if slice_nodes else {}
        return SeriesKeeper(TurnClock(self.clock), ControlSources(self.rec, self.inv, lambda: self.gateway),
                            **extra)


class TurnClock:
    """
    The keeper's clock: the fleet's time, and its own calls (the slices
    of a sample's pass), each timed alone in process CPU time, run by
    L{sample}.
    """

    def __init__(self, fleet_clock: Clock):
        self.fleet_clock = fleet_clock
        self.own = Clock()
        self.turns: list[float] = []

    def seconds(self) -> float:
        return self.fleet_clock.seconds()

    def callLater(self, delay: float, f: Any, *args: Any, **kw: Any) -> Any:  # noqa: N802
        def timed() -> None:
            t0 = time.process_time()
            f(*args, **kw)
            self.turns.append(time.process_time() - t0)
        return self.own.callLater(delay, timed)

    def getDelayedCalls(self) -> Any:  # noqa: N802
        return self.own.getDelayedCalls()


def sample(keeper: SeriesKeeper) -> list[float]:
    """One sample to its end, as the reactor would run it: each turn's CPU seconds."""
    clock: TurnClock = keeper.clock  # type: ignore[assignment]
    clock.turns = []
    t0 = time.process_time()
    keeper.sample()
    turns = [time.process_time() - t0]
    while clock.own.getDelayedCalls():
        clock.own.advance(max(0.0, min(c.getTime() for c in clock.own.getDelayedCalls()) - clock.own.seconds()))
    return turns + clock.turns


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def curves(nodes: int, steps: int, gc_threshold: int, slice_nodes: int = 0) -> dict[str, Any]:
    started = time.monotonic()
    fleet = Fleet(nodes)
    setup_s = time.monotonic() - started
    if gc_threshold:
        # As a control-plane process runs (--gc-threshold, CollectorTuning):
        # the fleet's records frozen out of the collector's scans.
        gc.collect()
        gc.freeze()
        gc.set_threshold(gc_threshold)
    fleet.step()
    keeper = fleet.keeper(slice_nodes)
    sample(keeper)
    # CPU: steps with and without the keeper, alternating, so that drift
    # on a shared machine falls on both.
    with_keeper, without, samples = [], [], []
    turns: list[float] = []
    firsts: list[float] = []
    lasts: list[float] = []
    turns_per_sample: list[int] = []
    for i in range(2 * steps):
        t0 = time.process_time()
        fleet.step()
        if i % 2 == 0:
            these = sample(keeper)
            samples.append(sum(these))
            turns.extend(these)
            firsts.append(these[0])
            lasts.append(these[-1])
            turns_per_sample.append(len(these))
            with_keeper.append(time.process_time() - t0)
        else:
            without.append(time.process_time() - t0)
    mean_sample = statistics.fmean(samples)
    # The answer, with an hour of curves or what there is.
    t0 = time.perf_counter()
    first = json.dumps(keeper.view(0.0))
    view_ms = (time.perf_counter() - t0) * 1000
    newest = keeper.models.times[keeper.models.slot]
    fleet.step()
    sample(keeper)
    t0 = time.perf_counter()
    poll = json.dumps(keeper.view(newest))
    poll_ms = (time.perf_counter() - t0) * 1000

    # Memory: a new keeper, filled for an hour, traced from its creation.
    points = points_for(KEEP_S, STEP_S)
    del keeper
    gc.collect()
    rss0 = rss_bytes()
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    keeper = fleet.keeper(slice_nodes)
    # No heartbeats meanwhile: what they replace in the fleet's records
    # would be traced as new, and the rings' size does not depend on the
    # values they hold.
    for _ in range(points + 5):
        fleet.clock.advance(STEP_S)
        sample(keeper)
    gc.collect()
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss1 = rss_bytes()
    full_view = json.dumps(keeper.view(0.0))
    return {
        "nodes": nodes,
        "gpus": nodes * 8,
        "shards": sum(len(s) for s in fleet.shards.values()),
        "models": DEPLOYMENTS,
        "api_keys": KEYS,
        "setup_s": round(setup_s, 1),
        "step_s": STEP_S,
        "steps_timed": steps,
        "sample_cpu_ms_median": round(statistics.median(samples) * 1000, 2),
        "sample_cpu_ms_p99": round(pct(samples, 0.99) * 1000, 2),
        "sample_cpu_ms_max": round(max(samples) * 1000, 2),
        "core_share_pct": round(100 * mean_sample / STEP_S, 3),
        "slice_nodes": getattr(keeper, "slice_nodes", None),
        "turns_per_sample_median": statistics.median(turns_per_sample),
        "turn_cpu_ms_median": round(statistics.median(turns) * 1000, 2),
        "turn_cpu_ms_p99": round(pct(turns, 0.99) * 1000, 2),
        "turn_cpu_ms_max": round(max(turns) * 1000, 2),
        "first_turn_cpu_ms_max": round(max(firsts) * 1000, 2),
        "last_turn_cpu_ms_max": round(max(lasts) * 1000, 2),
        "step_cpu_ms_with_keeper_median": round(statistics.median(with_keeper) * 1000, 1),
        "step_cpu_ms_without_median": round(statistics.median(without) * 1000, 1),
        "points_per_curve": points,
        "curves": {"models": len(keeper.models), "nodes": len(keeper.nodes), "keys": len(keeper.keys)},
        "memory_held_mib": round((held - base) / 2**20, 2),
        "memory_peak_mib": round((peak - base) / 2**20, 2),
        "rings_mib": round(keeper.nbytes() / 2**20, 2),
        "rss_growth_mib": round((rss1 - rss0) / 2**20, 1),
        "answer_first_kib": round(len(first) / 1024, 1),
        "answer_first_ms": round(view_ms, 2),
        "answer_poll_kib": round(len(poll) / 1024, 1),
        "answer_poll_ms": round(poll_ms, 2),
        "answer_full_hour_kib": round(len(full_view) / 1024, 1),
        "bar": {"core_share_pct_under": 1.0, "memory_mib_under": 20.0},
    }


def browser_section(nodes: int, churn: float, seconds: float, clicks: int, server_nice: int) -> dict[str, Any]:
    from twisted.internet import reactor
    from twisted.internet.task import LoopingCall
    from twisted.internet.threads import deferToThread

    from llmgw.control.admin.site import admin_service
    from llmgw.control.admin.watch import VIEWS_INTERVAL
    from llmgw.control.shell.metrics import make_registry
    from llmgw.routing import RoutingTable
    from llmgw.testing.chromium import Churn, browser, many_nodes_fleet, measure, wait_for

    fleet = many_nodes_fleet(nodes)
    fleet.routing_table = RoutingTable(reactor)
    fleet.publish_routes()
    svc = admin_service(reactor, "127.0.0.1", 0, fleet, make_registry())
    svc.startService()
    url = f"http://127.0.0.1:{svc.address()[1]}/"
    changes = Churn(fleet, churn)
    loop = LoopingCall(changes.step)
    cleanups: list[tuple[Any, tuple[Any, ...]]] = []
    result: dict[str, Any] = {}

    # Chromium is started before the control plane's thread lowers its
    # priority: in a fleet the two are on different machines, and here they
    # share the cores.
    driver = browser(lambda f, *a: cleanups.append((f, a)))
    if server_nice:
        os.nice(server_nice)

    def drive() -> None:
        driver.get(url)
        wait_for(driver, f"window.llmgwPage && window.llmgwPage.state.replicas.size === {nodes * 4}", 120)
        wait_for(driver, "document.querySelector('button[data-act=cordon]')", 30)
        reactor.callFromThread(loop.start, VIEWS_INTERVAL, False)
        time.sleep(3.0)  # the warm-up: the stream at its rate, the page's code compiled
        pattern = ['.pager[data-table=nodes] button[data-page=next]', '.pager[data-table=nodes] button[data-page=prev]',
                   '#nodes button[data-act=cordon]']
        result.update(measure(driver, seconds, [pattern[i % 3] for i in range(clicks)]))
        result["page_messages_total"] = driver.execute_script("return window.llmgwPage.stats.messages")

    def done(outcome: Any) -> Any:
        if loop.running:
            loop.stop()
        for f, a in reversed(cleanups):
            try:
                f(*a)
            except Exception as e:  # a browser already gone: still stop the rest
                print(f"cleanup {f}: {e}", file=sys.stderr)
        svc.stopService()
        reactor.stop()
        return outcome

    failure: list[Any] = []
    reactor.callWhenRunning(lambda: deferToThread(drive).addErrback(failure.append).addBoth(done))
    reactor.run()
    if failure:
        failure[0].raiseException()
    return {
        "nodes": nodes, "gpus": nodes * 8, "replicas": nodes * 4, "churn": churn,
        "server_nice": server_nice, "views_interval_s": VIEWS_INTERVAL, "changes_per_s": round(
            (nodes + nodes * 4) * churn / VIEWS_INTERVAL, 0), "steps": changes.steps, **result,
        "bar": {"busy_share_under": 0.25, "click_to_paint_ms_under": 100.0},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--section", choices=["curves", "browser"], default="curves")
    parser.add_argument("--browser-nodes", type=int, default=1000)
    parser.add_argument("--churn", type=float, default=1.0, help="share of nodes and replicas changed each pass")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds the busy share is read over")
    parser.add_argument("--clicks", type=int, default=30)
    parser.add_argument("--server-nice", type=int, default=10,
                        help="nice increment of the control plane's thread, chromium started before (0: none)")
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=30, help="10 s steps timed with the keeper (as many without)")
    parser.add_argument("--slice-nodes", type=int, default=0,
                        help="nodes a reactor turn of a sample's pass (0: the keeper's default)")
    parser.add_argument("--gc-threshold", type=int, default=50_000,
                        help="the collector's young threshold, as the control plane sets it (0: Python's, no freeze)")
    args = parser.parse_args(argv)
    out: dict[str, Any] = {"benchmark": "page", "python": sys.version.split()[0], "gc_threshold": args.gc_threshold}
    if args.section == "browser":
        b = out["browser"] = browser_section(args.browser_nodes, args.churn, args.seconds, args.clicks,
                                             args.server_nice)
        b["passed"] = (b["busy_share"] is not None and b["busy_share"] < 0.25 and b["clicks_painted"] == b["clicks"]
                       and b["click_to_paint_ms_max"] is not None and b["click_to_paint_ms_max"] < 100.0)
    else:
        out["curves"] = curves(args.nodes, args.steps, args.gc_threshold, args.slice_nodes)
        c = out["curves"]
        out["curves"]["passed"] = c["core_share_pct"] < 1.0 and c["memory_held_mib"] < 20.0
    out["load"] = os.getloadavg()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
