"""
The figures of L{bench.abuse} from what it recorded, and the bars: pure
functions of plain data, so that the judgement is tested without running
anything.

A well-behaved request is a sample C{(stream, due, done, status)}: it
belongs to the phase its due time falls in, its latency is C{done - due},
and it is refused when its status is not 2xx (an HTTP error, or
C{"error:NAME"} when no answer came). Resource samples are C{(t, rss_kb,
fds)}, C{fds} C{None} where it was not read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

#: The bars: a well-behaved client's p99 under this during an attack ...
P99_MS = 50.0
#: ... the target's RSS under its baseline plus this ...
RSS_HEADROOM_MIB = 100.0
#: ... and no legitimate request refused.
MAX_REFUSALS = 0


def _percentile(sorted_values: Sequence[float], p: float) -> float | None:
    if not sorted_values:
        return None
    rank = max(1, min(len(sorted_values), int(-(-p * len(sorted_values) // 100))))
    return sorted_values[rank - 1]


def refused(status: int | str) -> bool:
    """
    Whether a well-behaved request with this outcome counts as refused.
    """
    return not (isinstance(status, int) and 200 <= status < 300)


def latency_summary(samples: Sequence[Sequence[Any]], start: float, end: float) -> dict[str, Any]:
    """
    Per stream, for the samples due in C{[start, end)}: count, p50, p99 and
    max latency in ms, refusals and the statuses seen.
    """
    by_stream: dict[str, list[Sequence[Any]]] = {}
    for s in samples:
        if start <= s[1] < end:
            by_stream.setdefault(s[0], []).append(s)
    out: dict[str, Any] = {}
    for name, rows in sorted(by_stream.items()):
        ms = sorted((done - due) * 1000 for _, due, done, _ in rows)
        p50, p99 = _percentile(ms, 50), _percentile(ms, 99)
        out[name] = {
            "n": len(rows),
            "p50_ms": None if p50 is None else round(p50, 1),
            "p99_ms": None if p99 is None else round(p99, 1),
            "max_ms": round(ms[-1], 1),
            "refused": sum(1 for r in rows if refused(r[3])),
            "statuses": dict(Counter(str(r[3]) for r in rows)),
        }
    return out


def resource_summary(
    samples: Sequence[Sequence[Any]], alone: tuple[float, float], attack: tuple[float, float],
    after: tuple[float, float],
) -> dict[str, Any]:
    """
    The target's RSS (MiB) and open descriptors: before the attack (the last
    sample of the C{alone} window: the baseline), the peak during it, and
    at the end of the C{after} window.
    """

    def within(window: tuple[float, float], index: int) -> list[float]:
        return [s[index] for s in samples if window[0] <= s[0] < window[1] and s[index] is not None]

    def mib(kb: float | None) -> float | None:
        return None if kb is None else round(kb / 1024, 1)

    rss_alone, rss_attack, rss_after = within(alone, 1), within(attack, 1), within(after, 1)
    fds_alone, fds_attack, fds_after = within(alone, 2), within(attack, 2), within(after, 2)
    return {
        "rss_mib": {
            "before": mib(rss_alone[-1] if rss_alone else None),
            "peak_during": mib(max(rss_attack) if rss_attack else None),
            "after": mib(rss_after[-1] if rss_after else None),
        },
        "fds": {
            "before": int(fds_alone[-1]) if fds_alone else None,
            "peak_during": int(max(fds_attack)) if fds_attack else None,
            "after": int(fds_after[-1]) if fds_after else None,
        },
    }


def judge(attack: dict[str, Any], resources: dict[str, Any]) -> dict[str, Any]:
    """
    The bars for one scenario, from the well-behaved client's figures
    during the attack (L{latency_summary}) and the target's
    (L{resource_summary}): each bar's measured value, its limit and
    whether it passed, and C{passed} for all three. A stream with no
    sample at all during the attack fails the latency bar (nothing came
    back to measure).
    """
    p99s = {name: s["p99_ms"] for name, s in attack.items()}
    worst = max((v for v in p99s.values() if v is not None), default=None)
    latency_ok = bool(attack) and all(v is not None and v < P99_MS for v in p99s.values())
    refusals = sum(s["refused"] for s in attack.values())
    rss = resources["rss_mib"]
    growth = None
    if rss["before"] is not None and rss["peak_during"] is not None:
        growth = round(rss["peak_during"] - rss["before"], 1)
    bars: dict[str, Any] = {
        "p99_under_50ms": {"value_ms": worst, "per_stream_ms": p99s, "limit_ms": P99_MS,
                           "passed": latency_ok},
        "rss_under_baseline_plus_100mib": {"growth_mib": growth, "limit_mib": RSS_HEADROOM_MIB,
                                           "passed": growth is not None and growth < RSS_HEADROOM_MIB},
        "no_legitimate_request_refused": {"refused": refusals, "passed": refusals <= MAX_REFUSALS},
    }
    bars["passed"] = all(b["passed"] for b in bars.values())
    return bars
