"""
Inference engines (DESIGN §15): what llmgw knows about vLLM, SGLang and
llama.cpp's server, as plain data, and the normalisation of their
Prometheus metrics into L{EngineSignals}.

A profile names its engine (C{engine = "vllm"}); L{ENGINES} supplies the
defaults the profile does not set itself: health path, metrics path and
metric names, stop signal and grace, startup timeout. C{"generic"} is what
llmgw did before engines existed: C{/health}, no metrics, TERM, 30 s.

The metric names were checked against each engine's sources and
documentation; the samples in C{tests/data/metrics-*.txt} say where each
came from. Counters are matched with and without the C{_total} suffix,
because C{prometheus_client} appends it on the wire to a counter declared
without it (vLLM's C{vllm:prefix_cache_queries} is exposed as
C{vllm:prefix_cache_queries_total}).

Everything here is pure: no reactor, no clock, no I/O.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from llmgw.routing import EngineSignals

#: The normalised signals, in the order tables show them.
SIGNALS = ("waiting", "running", "kv_cache_usage", "prefix_cache_queries", "prefix_cache_hits",
           "generated_tokens")

#: Signals that are fractions (several series are combined by their maximum,
#: the conservative reading); the others are counts and are summed.
FRACTIONS = frozenset({"kv_cache_usage"})

#: Stop signals a profile may name.
STOP_SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT, "SIGQUIT": signal.SIGQUIT}


@dataclass(frozen=True)
class Engine:
    """
    One engine's defaults. C{metric_names} maps a signal to the metric
    names that carry it, tried in order; a signal may be the sum of several
    (llama.cpp's prefix-cache queries are its uncached plus cached prompt
    tokens), written C{"a+b"}.
    """

    name: str
    health_path: str = "/health"
    metrics_path: str = ""
    metric_names: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    stop_signal: str = "SIGTERM"
    stop_grace_s: int = 30
    startup_timeout_s: int = 600
    #: What readiness means, for the docs and the admin API.
    readiness: str = "GET health_path answers 200"


ENGINES: dict[str, Engine] = {
    "generic": Engine(name="generic"),
    # vLLM's OpenAI server: /health is 200 once the engine is up (nothing
    # listens before); /metrics is always on. KV-cache use was
    # gpu_cache_usage_perc before v0.10 (V0 engine).
    "vllm": Engine(
        name="vllm",
        metrics_path="/metrics",
        metric_names={
            "waiting": ("vllm:num_requests_waiting",),
            "running": ("vllm:num_requests_running",),
            "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
            "prefix_cache_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
            "prefix_cache_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
            "generated_tokens": ("vllm:generation_tokens",),
        },
        stop_grace_s=30,
        # Loading a large model, compiling and capturing CUDA graphs.
        startup_timeout_s=1800,
    ),
    # SGLang: /metrics needs --enable-metrics; token_usage is the KV pool's
    # used fraction; prompt_tokens_total counts every prompt token and
    # cached_tokens_total those served from the radix cache.
    "sglang": Engine(
        name="sglang",
        metrics_path="/metrics",
        metric_names={
            "waiting": ("sglang:num_queue_reqs",),
            "running": ("sglang:num_running_reqs",),
            "kv_cache_usage": ("sglang:token_usage",),
            "prefix_cache_queries": ("sglang:prompt_tokens",),
            "prefix_cache_hits": ("sglang:cached_tokens",),
            "generated_tokens": ("sglang:generation_tokens",),
        },
        stop_grace_s=30,
        startup_timeout_s=1800,
    ),
    # llama.cpp's llama-server: /health answers 503 while the model loads,
    # 200 once it can serve; /metrics needs --metrics. kv_cache_usage_ratio
    # exists only in older builds; current ones report none.
    "llamacpp": Engine(
        name="llamacpp",
        metrics_path="/metrics",
        metric_names={
            "waiting": ("llamacpp:requests_deferred",),
            "running": ("llamacpp:requests_processing",),
            "kv_cache_usage": ("llamacpp:kv_cache_usage_ratio",),
            "prefix_cache_queries": ("llamacpp:prompt_tokens+llamacpp:prompt_tokens_cached",),
            "prefix_cache_hits": ("llamacpp:prompt_tokens_cached",),
            # Progress, not a token count: llama.cpp adds a request's
            # predicted tokens only when it ends, so a long generation
            # would look flat; its decode steps move while any request runs.
            "generated_tokens": ("llamacpp:n_decode",),
        },
        stop_grace_s=10,
        startup_timeout_s=600,
    ),
}

#: What a generic profile with a metrics path but no names of its own reads:
#: every engine's names, so a fake or wrapped engine of any shape is understood.
ANY_ENGINE_NAMES: dict[str, tuple[str, ...]] = {
    s: tuple(n for e in ("vllm", "sglang", "llamacpp") for n in ENGINES[e].metric_names[s])
    for s in SIGNALS
}


def metric_names_for(engine: str, overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """
    The metric names a shard's scraper looks for, signal -> comma-separated
    names (the form they travel in C{StartShard}): the engine's, with the
    profile's C{overrides} winning.
    """
    base = ENGINES[engine].metric_names if ENGINES[engine].metric_names else ANY_ENGINE_NAMES
    out = {s: ",".join(names) for s, names in base.items()}
    out.update(overrides or {})
    return out


def stop_signal_number(name: str) -> int:
    """
    The signal number for a stop signal's name (C{SIGTERM} if unknown).
    """
    return int(STOP_SIGNALS.get(name, signal.SIGTERM))


# -- Prometheus text parsing ----------------------------------------------------


class MetricsError(ValueError):
    """
    A metrics document could not be read; the message says why.
    """


def _base_name(name: str) -> str:
    # Counters are matched with or without the _total the client library adds.
    return name[:-6] if name.endswith("_total") else name


def _wanted(names: Mapping[str, str]) -> set[str]:
    out: set[str] = set()
    for spec in names.values():
        for alternative in spec.split(","):
            for part in alternative.split("+"):
                part = part.strip()
                if part:
                    out.add(_base_name(part))
    return out


def parse_samples(text: str, wanted: set[str]) -> dict[str, list[float]]:
    """
    The values of the samples whose metric name (less any C{_total}) is in
    C{wanted}, every label set kept as one more value. Comments, other
    metrics and samples whose value is not a finite number are skipped; a
    document with no line that looks like a sample raises L{MetricsError}.
    """
    out: dict[str, list[float]] = {}
    samples = 0
    # Most of a document (histogram buckets) is none of ours: a prefix test
    # skips those lines before any parsing.
    prefixes = tuple(wanted)
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        if not line.startswith(prefixes):
            if samples == 0 and _looks_like_sample(line):
                samples = 1
            continue
        # NAME[{labels}] VALUE [TIMESTAMP]; label values may hold spaces.
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name = line[:brace]
            close = line.rfind("}")
            if close == -1:
                continue
            rest = line[close + 1 :].split()
        else:
            if space == -1:
                continue
            name = line[:space]
            rest = line[space + 1 :].split()
        if not rest or not name:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        samples = 1
        base = _base_name(name)
        if base in wanted and math.isfinite(value):
            out.setdefault(base, []).append(value)
    if samples == 0:
        raise MetricsError("no Prometheus samples in the response")
    return out


def _looks_like_sample(line: str) -> bool:
    parts = line.rsplit("}", 1)[-1].split() if "{" in line else line.split()[1:]
    if not parts:
        return False
    try:
        float(parts[0])
    except ValueError:
        return False
    return True


def normalise(
    text: str, names: Mapping[str, str], sampled_at: float
) -> EngineSignals:
    """
    Read an engine's C{/metrics} text into L{EngineSignals}. C{names} maps
    each signal to comma-separated metric names, the first one present
    winning; C{"a+b"} sums two. Several label sets of one metric (vLLM's
    per-engine series, SGLang's per-rank ones) are summed, or for a fraction
    the largest is taken. A signal no name matches is C{None}.

    @raise MetricsError: C{text} holds no samples at all.
    """
    found = parse_samples(text, _wanted(names))
    values: dict[str, float | None] = {}
    for signal_name in SIGNALS:
        values[signal_name] = _pick(found, names.get(signal_name, ""), signal_name in FRACTIONS)
    usage = values["kv_cache_usage"]
    if usage is not None:
        values["kv_cache_usage"] = min(1.0, max(0.0, usage))
    return EngineSignals(sampled_at=sampled_at, **cast(dict[str, Any], values))


def _pick(found: Mapping[str, list[float]], spec: str, fraction: bool) -> float | None:
    for alternative in spec.split(","):
        parts = [_base_name(p.strip()) for p in alternative.split("+") if p.strip()]
        if not parts or not all(p in found for p in parts):
            continue
        total = 0.0
        for p in parts:
            total += max(found[p]) if fraction else sum(found[p])
        return total
    return None


def check_metric_names(where: str, names: Mapping[str, object]) -> dict[str, str]:
    """
    Validate a profile's C{metric_names} table.

    @raise ValueError: an unknown signal or a value that is not a non-empty
        string; the message names which.
    """
    out: dict[str, str] = {}
    for key, value in names.items():
        if key not in SIGNALS:
            raise ValueError(f"{where}: unknown signal {key!r} (known: {', '.join(SIGNALS)})")
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{where}: {key!r} must be a metric name (or 'a,b' or 'a+b'), not {value!r}")
        out[key] = value.strip()
    return out


def known_engines() -> Iterable[str]:
    return sorted(ENGINES)


_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-:_")


def advertise_address_problem(address: str) -> str | None:
    """
    What is wrong with an advertised shard address (a host name or an IP
    address, no port), or C{None}; empty is allowed (not advertised).
    """
    if not address:
        return None
    if len(address) > 253 or not set(address) <= _HOST_CHARS or address.startswith(("-", ".")):
        return f"advertise_address {address!r} is not a host name or IP address"
    return None


def health_url(host: str, spec: object) -> str:
    """
    The URL a shard's health check GETs on C{host}, or "" when the shard is
    ready while its process lives (no health path).
    """
    from llmgw.addresses import format_address

    path = getattr(spec, "health_path", "")
    if not path:
        return ""
    return f"http://{format_address(host, getattr(spec, 'port', 0))}{path}"
