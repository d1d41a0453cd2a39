"""
The curves the console draws (DESIGN §21): L{SeriesKeeper} samples, every
L{STEP_S} seconds on the injected clock, what the gateways and agents
already report, into bounded rings (L{llmgw.control.state.series}) that
hold the last L{KEEP_S} seconds; C{GET /api/v1/series} serves them
(L{SeriesKeeper.view}).

Per model: requests per second, time to first byte (p50, p99) and output
(completion) tokens per second, from the embedded gateway's counters,
histogram and usage (the traffic of standalone gateways shows in their own
C{/metrics}); requests waiting in admission queues and in flight from the
demand the gateways report (standalone gateways report it for autoscaled
models only). Per node: the share of its GPU memory in use, from the
heartbeats. Per API key: requests and tokens (prompt and completion) per
second from the embedded gateway's usage. And the fleet's totals.

A sample reads each source once, and nothing per shard: one look at every
node's record (no copy) per step, the gateway's counts per model and key.
The per-node part runs in slices of L{SLICE_NODES} nodes, one a reactor
turn, so that a sample at 10,000 nodes never holds the reactor for more
than a few milliseconds; the sample is published whole when the last slice
is done (L{SeriesKeeper.sample}).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import islice
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from twisted.application.service import Service
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from llmgw.control.state.series import (
    KEEP_S,
    STEP_S,
    SeriesFamily,
    bucket_deltas,
    compact_time,
    histogram_quantile,
    points_for,
    rates,
)

#: Most models with curves of their own; the rest add up in C{_other}.
MAX_MODELS = 200
#: Most nodes with a curve; past it a node has none (it still counts in the
#: fleet's totals).
MAX_NODES = 20_000
#: Most API keys with curves of their own; the rest add up in C{_other}.
MAX_KEYS = 100
#: Nodes a sample reads in one reactor turn: at 10,000 nodes a sample is
#: 35-45 ms of CPU, which in slices of this many is 21 turns of about 1.6 ms
#: (the first, which also reads the gateway's counts, 3.4 ms; bench/page.py).
SLICE_NODES = 500
#: What the nodes' read is called in the log.
NODES_PART = "the nodes' GPU memory"
#: Nodes a C{GET /api/v1/series} answers by default: the ones using the
#: most GPU memory now.
DEFAULT_TOP_NODES = 8
#: Most nodes one answer may carry (by C{top} or by name).
MAX_ANSWER_NODES = 200

MODEL_METRICS = ("requests_per_s", "ttfb_p50_s", "ttfb_p99_s", "output_tokens_per_s", "queue", "in_flight")
NODE_METRICS = ("gpu_memory_used_pct",)
KEY_METRICS = ("requests_per_s", "tokens_per_s")
FLEET_METRICS = ("requests_per_s", "output_tokens_per_s", "gpu_memory_used_gib", "gpu_memory_total_gib")


class ControlSources:
    """
    What the keeper reads, from the control plane's parts as they are: the
    fleet (the reconciler: C{engine_signal_rows()}, C{demand()}), the
    inventory (C{ids()}, C{peek()}) and the embedded gateway (C{gateway()}
    returns it or C{None}: its C{metrics} and C{usage}). A part that is
    missing, or lacks what is read, gives nothing.
    """

    def __init__(self, fleet: Any, inventory: Any, gateway: Callable[[], Any]):
        self.fleet = fleet
        self.inventory = inventory
        self.gateway = gateway

    def requests_by_model(self) -> dict[str, float]:
        """Requests the embedded gateway answered, per model, since it started."""
        metrics = getattr(self.gateway(), "metrics", None)
        counts = getattr(getattr(metrics, "requests", None), "counts", None) or {}
        out: dict[str, float] = {}
        for labels, n in list(counts.items()):
            out[labels[0]] = out.get(labels[0], 0) + n
        return out

    def first_byte_buckets(self) -> tuple[tuple[float, ...], dict[str, list[float]]]:
        """
        The embedded gateway's time-to-first-byte histogram: its bucket
        bounds, and per model the count in each bucket (not cumulative,
        C{+Inf} last).
        """
        ttfb = getattr(getattr(self.gateway(), "metrics", None), "ttfb", None)
        if ttfb is None:
            return (), {}
        return tuple(ttfb.bounds), {m: list(s[:-1]) for m, s in list(ttfb.series.items())}

    def demand(self) -> Mapping[str, Any]:
        """Per model, the requests in flight and waiting the gateways report (L{Demand}s)."""
        demand = getattr(self.fleet, "demand", None)
        return demand() if demand is not None else {}

    def node_memory(self) -> Iterable[tuple[str, int, int]]:
        """(node, GPU memory used, GPU memory in all) in MB, per node with GPUs."""
        inventory = self.inventory
        if inventory is None:
            return
        peek = inventory.peek
        for node_id in inventory.ids():
            node = peek(node_id)
            if node is None or not node.gpus:
                continue
            used = total = 0
            for g in node.gpus:
                used += g.memory_used_mb
                total += g.memory_total_mb
            yield node_id, used, total

    def usage(self) -> list[tuple[str, str, int, int, int]]:
        """
        (key name, model, requests, prompt tokens, completion tokens) the
        embedded gateway counted since it started, per key and model.
        """
        usage = getattr(self.gateway(), "usage", None)
        rows = usage.rows() if usage is not None else ()
        return [(k, m, r.requests, r.prompt_tokens, r.completion_tokens) for k, m, r in rows]


class NodeMemoryCollector(Collector):
    """
    C{/metrics}: each node's GPU memory in use and in all (summed over its
    GPUs, in bytes, from its heartbeats), the per-node curve for those who
    draw with Prometheus and Grafana. Nodes without GPUs have no sample.
    """

    log = Logger()

    def __init__(self, inventory: Callable[[], Any]):
        self.inventory = inventory

    def collect(self) -> Iterable[GaugeMetricFamily]:
        used = GaugeMetricFamily("llmgw_node_gpu_memory_used_bytes",
                                 "GPU memory in use on each node (all its GPUs), as its latest heartbeat said.",
                                 labels=["node"])
        total = GaugeMetricFamily("llmgw_node_gpu_memory_total_bytes",
                                  "GPU memory of each node (all its GPUs).", labels=["node"])
        try:
            for node_id, u, t in ControlSources(None, self.inventory(), lambda: None).node_memory():
                used.add_metric([node_id], u * 2**20)
                total.add_metric([node_id], t * 2**20)
        except Exception:
            self.log.failure("reading the nodes' GPU memory for /metrics failed; left out")
        yield used
        yield total


class _Pass:
    """One sample under way: what was read at its time, the nodes read so far."""

    def __init__(self, t: float):
        self.t = t
        self.models: dict[str, list[float | None]] = {}
        self.keys: dict[str, list[float | None]] = {}
        self.rps: float | None = None
        self.tokens: float | None = None
        self.node_rows: Iterator[tuple[str, int, int]] = iter(())
        self.nodes_failed = False
        self.used = 0
        self.total = 0
        #: The next slice's turn, while one is due.
        self.call: IDelayedCall | None = None
        self.done: Deferred[None] = Deferred()


class SeriesKeeper(Service):
    """
    Samples C{sources} (a L{ControlSources}) every C{step_s} seconds on
    C{clock} while running, keeping C{keep_s} seconds of each curve.

    Rates and quantiles are over the step before each sample, so the first
    sample after a start gives only levels (GPU memory, queues). A source
    that fails is logged once (until it works again) and its curves get no
    point; the others go on.

    A sample reads the nodes C{slice_nodes} a reactor turn and is
    published whole, every family at its time, after the last
    (L{sample}); stopping the keeper cancels a sample under way.
    """

    log = Logger()

    def __init__(self, clock: IReactorTime, sources: Any, step_s: float = STEP_S, keep_s: float = KEEP_S,
                 max_models: int = MAX_MODELS, max_nodes: int = MAX_NODES, max_keys: int = MAX_KEYS,
                 slice_nodes: int = SLICE_NODES):
        if slice_nodes < 1:
            raise ValueError(f"slice_nodes is {slice_nodes}; a reactor turn reads at least one node")
        self.clock = clock
        self.slice_nodes = slice_nodes
        self.sources = sources
        self.step_s = step_s
        self.keep_s = keep_s
        points = points_for(keep_s, step_s)
        self.models = SeriesFamily(MODEL_METRICS, points, max_models,
                                   additive=("requests_per_s", "output_tokens_per_s", "queue", "in_flight"))
        # Hundredths of a percent in two bytes: 10,000 nodes' hour is 7 MB.
        self.nodes = SeriesFamily(NODE_METRICS, points, max_nodes, typecode="H", scale=100.0, other=None)
        self.keys = SeriesFamily(KEY_METRICS, points, max_keys)
        self.fleet = SeriesFamily(FLEET_METRICS, points, 1, other=None)
        self.samples = 0
        self._last_t: float | None = None
        self._requests: dict[str, float] = {}
        self._ttfb: dict[str, list[float]] = {}
        self._tokens: dict[str, float] = {}
        self._keys: dict[str, float] = {}
        self._key_tokens: dict[str, float] = {}
        self._failing: set[str] = set()
        self._loop: LoopingCall | None = None
        self._pass: _Pass | None = None

    def startService(self) -> None:
        super().startService()
        loop = self._loop = LoopingCall(self.sample)
        loop.clock = self.clock
        loop.start(self.step_s, now=True)

    def stopService(self) -> Any:
        super().stopService()
        loop, self._loop = self._loop, None
        if loop is not None and loop.running:
            loop.stop()
        self._cancel()
        return None

    def _failed(self, part: str) -> None:
        if part not in self._failing:
            self._failing.add(part)
            self.log.failure("curves: reading {part} failed; its curves get no points until it works",
                             part=part)

    def _worked(self, part: str) -> None:
        if part in self._failing:
            self._failing.discard(part)
            self.log.info("curves: reading {part} works again", part=part)

    def _read(self, part: str, read: Callable[[], Any], empty: Any) -> Any:
        try:
            result = read()
        except Exception:
            self._failed(part)
            return empty
        self._worked(part)
        return result

    def sample(self) -> Deferred[None]:
        """
        Take one sample of every curve at the clock's time now. Never fails.

        The nodes are read C{slice_nodes} a reactor turn, the first in this
        call and the others each in a turn of its own (C{callLater(0)}); the
        sample is published, every family at once and at this time, when
        the last is read: until then readers see the samples before it. The
        L{Deferred} returned fires (with C{None}) then, or when the pass is
        cancelled (the service stopped); the loop waits for it, so its
        samples never overlap. A pass still under way when C{sample} is
        called is finished first, in this call, then the new one begins.
        """
        if self._pass is not None:
            self._finish_now()
        try:
            p = self._pass = self._begin(self.clock.seconds())
        except Exception:
            self.log.failure("curves: a sample failed; the next one is taken as usual")
            self.nodes.abandon()
            return succeed(None)
        done = p.done
        self._step()
        return done

    def _begin(self, now: float) -> _Pass:
        src = self.sources
        dt = now - self._last_t if self._last_t is not None else 0.0
        self._last_t = now
        # The gateway's counters start at a model's or key's first request:
        # one new in the step counts from zero.
        rps = rates(self._requests, self._read("the gateway's requests", src.requests_by_model, {}), dt, True)
        bounds, buckets = self._read("the gateway's first bytes", src.first_byte_buckets, ((), {}))
        ttfb = bucket_deltas(self._ttfb, buckets, dt > 0)
        usage = self._read("the gateway's usage", src.usage, [])
        output: dict[str, float] = {}
        key_requests: dict[str, float] = {}
        key_tokens: dict[str, float] = {}
        for key, model, requests, prompt, completion in usage:
            output[model] = output.get(model, 0) + completion
            key_requests[key] = key_requests.get(key, 0) + requests
            key_tokens[key] = key_tokens.get(key, 0) + prompt + completion
        tokens = rates(self._tokens, output, dt, True)
        demand = self._read("the gateways' demand", src.demand, {})
        p = _Pass(now)
        for model in dict.fromkeys([*rps, *ttfb, *tokens, *demand]):
            counts = ttfb.get(model)
            d = demand.get(model)
            p.models[model] = [
                rps.get(model),
                histogram_quantile(0.5, bounds, counts) if counts else None,
                histogram_quantile(0.99, bounds, counts) if counts else None,
                tokens.get(model),
                d.waiting if d is not None else None,
                d.in_flight if d is not None else None,
            ]
        key_rps = rates(self._keys, key_requests, dt, True)
        key_tps = rates(self._key_tokens, key_tokens, dt, True)
        p.keys = {k: [key_rps.get(k), key_tps.get(k)] for k in dict.fromkeys([*key_rps, *key_tps])}
        p.rps = sum(rps.values()) if dt > 0 else None
        p.tokens = sum(tokens.values()) if dt > 0 else None
        try:
            p.node_rows = iter(src.node_memory())
        except Exception:
            self._failed(NODES_PART)
            p.node_rows = iter(())
            p.nodes_failed = True
        self.nodes.begin(now)
        return p

    def _slice(self, p: _Pass) -> bool:
        """Read and write the next C{slice_nodes} nodes; whether the node pass is done."""
        rows: dict[str, list[float | None]] = {}
        try:
            for node_id, used, total in islice(p.node_rows, self.slice_nodes):
                p.used += used
                p.total += total
                rows[node_id] = [100.0 * used / total if total > 0 else None]
        except Exception:
            # As if the nodes had given nothing: none gets a point now.
            self._failed(NODES_PART)
            p.nodes_failed = True
            self.nodes.abandon()
            self.nodes.begin(p.t)
            return True
        self.nodes.write(rows)
        return len(rows) < self.slice_nodes

    def _step(self) -> None:
        p = self._pass
        if p is None:
            return
        p.call = None
        try:
            if not self._slice(p):
                p.call = self.clock.callLater(0, self._step)
                return
            self._publish(p)
        except Exception:
            self.log.failure("curves: a sample failed; the next one is taken as usual")
            self._cancel()

    def _finish_now(self) -> None:
        p = self._pass
        if p is None:
            return
        if p.call is not None and p.call.active():
            p.call.cancel()
        p.call = None
        try:
            while not self._slice(p):
                pass
            self._publish(p)
        except Exception:
            self.log.failure("curves: a sample failed; the next one is taken as usual")
            self._cancel()

    def _publish(self, p: _Pass) -> None:
        """The sample read, every family at its time, in one turn."""
        self._pass = None
        now = p.t
        if not p.nodes_failed:
            self._worked(NODES_PART)
        self.nodes.commit()
        self.models.add(now, p.models)
        self.keys.add(now, p.keys)
        used = None if p.nodes_failed or not p.total else p.used / 1024
        total = None if p.nodes_failed or not p.total else p.total / 1024
        self.fleet.add(now, {"fleet": [p.rps, p.tokens, used, total]})
        self.samples += 1
        p.done.callback(None)

    def _cancel(self) -> None:
        """Drop the pass under way, if any: nothing of it is published, no call is left."""
        p, self._pass = self._pass, None
        if p is None:
            return
        if p.call is not None and p.call.active():
            p.call.cancel()
        p.call = None
        self.nodes.abandon()
        p.done.callback(None)

    # -- the answer ---------------------------------------------------------------------

    def busiest_nodes(self, n: int) -> list[str]:
        """The C{n} nodes using the most of their GPU memory now, busiest first."""
        if n <= 0:
            return []
        latest = self.nodes.latest
        return heapq.nlargest(n, self.nodes.names(), key=lambda name: latest(name) or -1.0)

    def view(self, since: float, top: int = DEFAULT_TOP_NODES, nodes: Iterable[str] = ()) -> dict[str, Any]:
        """
        What C{GET /api/v1/series?since=T} answers: per family, C{{name:
        {metric: [[t, v], ...]}}} for the samples after C{since}; nodes are
        C{nodes} (by id) and the C{top} busiest, at most
        L{MAX_ANSWER_NODES} in all. Points without a value are left out; a
        sample still being read (L{sample}) is not in it, nor is the oldest
        one, whose slot it overwrites.
        """
        chosen = list(dict.fromkeys([*nodes, *self.busiest_nodes(top)]))[:MAX_ANSWER_NODES]
        newest = self.models.times[self.models.slot] if self.samples else None
        return {
            "step_s": self.step_s,
            "keep_s": self.keep_s,
            "now": compact_time(self.clock.seconds()),
            "newest": compact_time(newest) if newest is not None else None,
            "models": self.models.read(since),
            "keys": self.keys.read(since),
            "fleet": self.fleet.read(since).get("fleet", {}),
            "nodes": self.nodes.read(since, chosen),
            "nodes_total": len(self.nodes),
        }

    def nbytes(self) -> int:
        """The bytes the rings' values hold, all families together."""
        return sum(f.nbytes() for f in (self.models, self.nodes, self.keys, self.fleet))
