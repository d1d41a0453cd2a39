"""
Engine signals on the control plane's side (DESIGN §15):
what agents send in heartbeats, kept per shard with the sample's age on
this process's clock, for the routing table, the admin API and C{/metrics}.

L{SignalStore} is plain data. A node's heartbeat replaces everything that
node said before, so a shard that stopped being scraped (not ready any
more, or gone) drops out with the next heartbeat, and the store holds at
most what the connected nodes are running.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from twisted.logger import Logger

from llmgw.api.v1 import agent_pb2 as pb
from llmgw.engines import SIGNALS
from llmgw.routing import EngineSignals

#: Longest scrape error kept per shard.
ERROR_MAX = 500


@dataclass(frozen=True)
class ShardSignals:
    """
    One shard's newest figures (C{None} before the agent had a good
    scrape) and why its latest scrape failed ("" if it did not).
    """

    signals: EngineSignals | None
    error: str = ""
    #: Seconds the agent has seen requests running with flat progress
    #: counters, as of its latest scrape; C{None}: not watched, or an older
    #: agent.
    flat_for_s: float | None = None


def from_message(msg: pb.ShardSignals, now: float) -> ShardSignals:
    """
    Read one C{ShardSignals}: its age becomes a time on C{now}'s clock.
    Figures that are not finite or are negative are dropped, not trusted.
    """
    error = msg.error[:ERROR_MAX]
    flat: float | None = None
    if msg.HasField("flat_for_s") and math.isfinite(msg.flat_for_s) and msg.flat_for_s >= 0:
        flat = msg.flat_for_s
    if not msg.HasField("age_s"):
        return ShardSignals(None, error, flat)
    age = msg.age_s if math.isfinite(msg.age_s) and msg.age_s >= 0 else 0.0
    values: dict[str, float | None] = {}
    for name in SIGNALS:
        value = getattr(msg, name) if msg.HasField(name) else None
        if value is not None and not (math.isfinite(value) and value >= 0):
            value = None
        values[name] = value
    sleeping = msg.sleeping if msg.HasField("sleeping") else None
    # The wake path is the agent's word on its engine: a path, bounded.
    wake = msg.wake_path if msg.wake_path.startswith("/") and len(msg.wake_path) <= 200 else ""
    return ShardSignals(EngineSignals(sampled_at=now - min(age, 1e9), sleeping=sleeping, wake_path=wake, **values),
                        error, flat)


class SignalStore:
    """
    Shard id -> L{ShardSignals}, replaced per node on each heartbeat.
    """

    def __init__(self) -> None:
        self._by_shard: dict[str, ShardSignals] = {}
        self._by_node: dict[str, frozenset[str]] = {}

    def record(self, node_id: str, shards: Iterable[tuple[str, ShardSignals]]) -> None:
        """
        What C{node_id}'s latest heartbeat said; replaces what it said before.
        """
        for shard_id in self._by_node.pop(node_id, frozenset()):
            self._by_shard.pop(shard_id, None)
        ids = []
        for shard_id, sample in shards:
            self._by_shard[shard_id] = sample
            ids.append(shard_id)
        if ids:
            self._by_node[node_id] = frozenset(ids)

    def forget_node(self, node_id: str) -> None:
        self.record(node_id, ())

    def get(self, shard_id: str) -> ShardSignals | None:
        return self._by_shard.get(shard_id)

    def signals(self, shard_id: str) -> EngineSignals | None:
        entry = self._by_shard.get(shard_id)
        return entry.signals if entry is not None else None

    def __len__(self) -> int:
        return len(self._by_shard)


def signals_json(entry: ShardSignals | None, now: float) -> dict[str, Any] | None:
    """
    The admin API's form of one shard's signals: each figure (C{None}
    where the engine has none), C{age_s} (C{None} before a first sample)
    and C{error}.
    """
    if entry is None:
        return None
    out: dict[str, Any] = dict.fromkeys(SIGNALS)
    out["age_s"] = out["sleeping"] = None
    if entry.signals is not None:
        for name in SIGNALS:
            out[name] = getattr(entry.signals, name)
        out["age_s"] = round(entry.signals.age(now), 3)
        out["sleeping"] = entry.signals.sleeping
    out["error"] = entry.error or None
    return out


_METRICS = {
    "waiting": ("llmgw_engine_requests_waiting", "Requests the engine has queued, per shard."),
    "running": ("llmgw_engine_requests_running", "Requests the engine is running, per shard."),
    "kv_cache_usage": ("llmgw_engine_kv_cache_usage_ratio", "Fraction of the engine's KV cache in use."),
    "prefix_cache_queries": ("llmgw_engine_prefix_cache_queries", "Prompt tokens looked up in the prefix cache since the engine started."),
    "prefix_cache_hits": ("llmgw_engine_prefix_cache_hits", "Prompt tokens found in the prefix cache since the engine started."),
    "generated_tokens": ("llmgw_engine_generated_tokens", "Output tokens the engine generated since it started."),
}


class EngineSignalsCollector(Collector):
    """
    C{/metrics} for engine signals: one gauge per figure, labelled by
    model, replica and shard, and C{llmgw_engine_signals_age_seconds}.

    @param rows: returns (model, replica, shard, ShardSignals) for every
        shard with signals; called at each scrape.
    """

    log = Logger()

    def __init__(self, rows: Callable[[], Iterable[tuple[str, str, str, ShardSignals]]],
                 clock: Callable[[], float]):
        self.rows = rows
        self.clock = clock

    def collect(self) -> Iterable[Metric]:
        try:
            rows = list(self.rows())
        except Exception:
            self.log.failure("reading engine signals for /metrics failed; left out")
            return
        now = self.clock()
        labels = ["model", "replica", "shard"]
        families = {s: GaugeMetricFamily(n, doc, labels=labels) for s, (n, doc) in _METRICS.items()}
        age = GaugeMetricFamily(
            "llmgw_engine_signals_age_seconds",
            "Age of the newest engine signals of each shard (grows while scrapes fail).",
            labels=labels,
        )
        sleeping = GaugeMetricFamily(
            "llmgw_engine_sleeping",
            "1 while the shard's engine sleeps (its memory freed, its process kept), 0 while "
            "awake; absent for engines that do not sleep.",
            labels=labels,
        )
        for model, replica, shard, entry in rows:
            if entry.signals is None:
                continue
            key = [model, replica, shard]
            for name, family in families.items():
                value = getattr(entry.signals, name)
                if value is not None:
                    family.add_metric(key, value)
            age.add_metric(key, entry.signals.age(now))
            if entry.signals.sleeping is not None:
                sleeping.add_metric(key, 1.0 if entry.signals.sleeping else 0.0)
        yield from families.values()
        yield age
        yield sleeping
