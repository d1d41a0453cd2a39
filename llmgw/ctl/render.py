"""
How C{llmgw ctl} shows the admin API's answers to a person: tables with
control characters escaped, times as ISO-8601 UTC or "12s ago", durations
and small numbers in fixed form with their unit (never C{8.5677e-05}).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any


def clean(text: str) -> str:
    """
    C{text} on one line with control characters escaped: what reaches the
    terminal from a node or a model process cannot move the cursor or
    change colours.
    """
    text = text.replace("\r\n", " ").replace("\n", " ").replace("\t", " ")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def value(v: Any) -> str:
    """
    One cell for a person: C{-} for nothing, yes/no, C{k=v} pairs, lists
    joined, and floats in fixed form (never C{8.5677e-05}).
    """
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return number(v)
    if isinstance(v, dict):
        return " ".join(f"{clean(str(k))}={value(x)}" for k, x in v.items()) or "-"
    if isinstance(v, list | tuple):
        return ", ".join(value(x) for x in v) or "-"
    return clean(str(v))


def number(n: float) -> str:
    """
    C{n} in fixed form with at most 6 significant digits: C{0.0000857},
    C{12.5}, C{3}.
    """
    if n != n or n in (float("inf"), float("-inf")):
        return str(n)
    if n == int(n) and abs(n) < 1e15:
        return str(int(n))
    digits = max(0, 5 - int(f"{abs(n):e}".split("e")[1]))
    return f"{n:.{digits}f}".rstrip("0").rstrip(".")


def seconds(d: Any) -> str:
    """
    A duration in seconds with its unit, scaled to stay readable:
    C{85.7 us}, C{12.3 ms}, C{2.50 s}.
    """
    if not isinstance(d, int | float) or isinstance(d, bool):
        return value(d)
    if d == 0:
        return "0 s"
    if abs(d) < 1e-3:
        return f"{d * 1e6:.1f} us"
    if abs(d) < 1:
        return f"{d * 1e3:.1f} ms"
    return f"{d:.2f} s"


def iso_time(when: Any) -> str:
    """
    Seconds since 1970 as ISO-8601 UTC (C{2026-05-01T12:00:00Z}); C{-} for
    what is not a time.
    """
    if not isinstance(when, int | float) or isinstance(when, bool):
        return "-"
    try:
        t = datetime.datetime.fromtimestamp(when, datetime.UTC)
    except (OverflowError, OSError, ValueError):
        return clean(repr(when))
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """
    Left-aligned columns two spaces apart; the last column is not padded.
    """
    cells = [[value(c) if not isinstance(c, str) else clean(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))
    lines = []
    for row in [list(headers), *cells]:
        parts = [c.ljust(widths[i]) for i, c in enumerate(row[:-1])] + [row[-1]]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines) + "\n"


def ago(when: Any, now: float) -> str:
    if not isinstance(when, int | float) or isinstance(when, bool) or when <= 0:
        return "-"
    d = now - when
    if d < 0:
        return "in " + _duration(-d)
    return _duration(d) + " ago"


def _duration(d: float) -> str:
    if d < 120:
        return f"{d:.0f}s"
    if d < 7200:
        return f"{d / 60:.0f}m"
    if d < 172800:
        return f"{d / 3600:.0f}h"
    return f"{d / 86400:.0f}d"


def clock_time(when: Any) -> str:
    """
    An event's time: ISO-8601 UTC, as L{iso_time}.
    """
    return iso_time(when)


#: Status fields that are times (seconds since 1970) and durations (seconds).
STATUS_TIMES = frozenset({"placing_after", "published_at", "since"})
STATUS_DURATIONS = frozenset({"last_pass_seconds", "max_pass_seconds", "pass_seconds_total", "lease_ttl"})


def status_value(key: str, v: Any, now: float) -> str:
    """
    One status field for a person: a time as ISO-8601 UTC and how long ago
    (or until), a duration with its unit, an epoch (milliseconds since
    1970 at a control plane's start) with the time it names.
    """
    if key in STATUS_TIMES and isinstance(v, int | float) and not isinstance(v, bool):
        return f"{iso_time(v)} ({ago(v, now)})"
    if key in STATUS_DURATIONS or key.endswith("_seconds"):
        return seconds(v)
    if key == "epoch" and isinstance(v, int) and not isinstance(v, bool) and v > 10**12:
        return f"{v} (from {iso_time(v / 1000)})"
    return value(v)


def render_status(admin: str, status: dict[str, Any], deployments: list[dict[str, Any]], now: float) -> str:
    """
    The control plane's status, one field a line, then its deployments.
    """
    lines = [f"control plane  {admin}"]
    if status.get("replacements_frozen"):
        reason = status.get("frozen_reason") or status.get("frozen_because") or ""
        lines.append("WARNING        replacements are FROZEN" + (f": {clean(str(reason))}" if reason else ""))
    skip = {"frozen_reason", "frozen_because"}
    width = max([len(k) for k in status if k not in skip] + [13])
    for key, v in status.items():
        if key in skip:
            continue
        lines.append(f"{clean(key).ljust(width)}  {status_value(key, v, now)}")
    for d in deployments:
        if isinstance(d.get("held"), dict):
            lines.append(f"WARNING        deployment {clean(str(d['model']))} is HELD after a "
                         f"{clean(str(d['held'].get('crash_class') or '?'))} failure; "
                         f"`llmgw ctl retry {clean(str(d['model']))}` places it again")
    lines.append("")
    lines.append(render_deployments(deployments, now).rstrip("\n"))
    return "\n".join(lines) + "\n"


def _failure_text(failure: Any, now: float) -> str:
    if not isinstance(failure, dict):
        return "-"
    what = failure.get("error") or (
        f"exit {failure.get('exit_code')}" if failure.get("exit_code") else
        f"signal {failure.get('signal')}" if failure.get("signal") else "failed"
    )
    cls = failure.get("crash_class")
    return f"{ago(failure.get('time'), now)} on {failure.get('node') or '?'}: " + (
        f"[{cls}] {what}" if cls else str(what)
    )


def _held_text(held: Any, now: float) -> str:
    if not isinstance(held, dict):
        return "-"
    reason = held.get("reason")
    return f"since {ago(held.get('since'), now)} [{held.get('crash_class') or '?'}]" + (
        f": {reason}" if reason else ""
    )


def render_deployments(deployments: list[dict[str, Any]], now: float) -> str:
    """
    One row a deployment; a held one says so with its class and reason,
    and the last failure shows its class.
    """
    if not deployments:
        return "no deployments\n"
    rows = []
    for d in deployments:
        backoff = d.get("backoff_until")
        backoff_text = ago(backoff, now) if isinstance(backoff, int | float) and backoff > now else "-"
        desired: Any = d.get("desired")
        auto = d.get("autoscale")
        if isinstance(auto, dict):
            desired = f"{desired} (auto {auto.get('min_replicas')}-{auto.get('max_replicas')})"
        variants = d.get("variants")
        profile = d.get("profile")
        if isinstance(variants, list) and variants:
            # Cheapest first, each with its cost and the replicas on it.
            profile = " ".join(f"{v.get('profile')}(${_number(v.get('cost'))}):{v.get('replicas')}"
                               for v in variants if isinstance(v, dict))
        rows.append([d["model"], profile, desired, d.get("ready"), backoff_text,
                     _held_text(d.get("held"), now), _failure_text(d.get("last_failure"), now)])
    return table(["MODEL", "PROFILE", "DESIRED", "READY", "BACKOFF", "HELD", "LAST FAILURE"], rows)


def render_nodes(nodes: list[dict[str, Any]], now: float) -> str:
    if not nodes:
        return "no nodes\n"
    rows = []
    for n in nodes:
        gpus = n.get("gpus") or []
        total = sum(g.get("memory_total_mb", 0) for g in gpus)
        used = sum(g.get("memory_used_mb", 0) for g in gpus)
        problems = [f"gpu{g.get('index')}: {', '.join(map(str, g['problems']))}" for g in gpus if g.get("problems")]
        sched = "draining" if n.get("draining") else "cordoned" if n.get("cordoned") else "ok"
        rows.append([
            n["id"], n.get("state"), bool(n.get("connected")), sched, gpu_names_text(gpus),
            f"{(total - used) / 1024:.0f}/{total / 1024:.0f} GiB", len(n.get("shards") or []),
            ago(n.get("last_seen"), now), cert_left(n.get("certificate_not_after"), now),
            _strays_text(n.get("stray_processes")), "; ".join(problems) or "-",
        ])
    return table(["NODE", "STATE", "CONNECTED", "SCHEDULING", "GPUS", "MEM FREE", "SHARDS", "LAST SEEN",
                  "CERT ENDS", "STRAYS", "PROBLEMS"], rows)


def cert_left(not_after: Any, now: float) -> str:
    """
    How long a node's certificate has left: C{12d}, C{5h}, with C{ (soon)}
    within 7 days, C{ended} past its end, C{-} when unknown.
    """
    if not isinstance(not_after, (int, float)) or not_after <= 0:
        return "-"
    left = not_after - now
    if left <= 0:
        return "ended"
    text = f"{left / 86400:.0f}d" if left >= 2 * 86400 else f"{left / 3600:.0f}h" if left >= 3600 else f"{left:.0f}s"
    return text + (" (soon)" if left < 7 * 86400 else "")


def _number(n: Any) -> str:
    return f"{n:g}" if isinstance(n, int | float) and not isinstance(n, bool) else "?"


def gpu_names_text(gpus: list[Any]) -> str:
    """
    A node's GPUs as counts of each model name, in index order of first
    appearance: C{2x L4, 1x H100}; C{0} for none.
    """
    counts: dict[str, int] = {}
    for g in gpus:
        name = str(g.get("name") or "?") if isinstance(g, dict) else "?"
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n}x {name}" for name, n in counts.items()) or "0"


def _strays_text(strays: Any) -> str:
    """
    A node's stray processes as C{pid (shard)} items, at most five shown.
    """
    if not isinstance(strays, list) or not strays:
        return "-"
    items = [f"{s.get('pid')} ({s.get('shard_id') or '?'})" for s in strays[:5] if isinstance(s, dict)]
    more = len(strays) - 5
    return ", ".join(items) + (f" +{more} more" if more > 0 else "")


def render_replicas(replicas: list[dict[str, Any]]) -> str:
    if not replicas:
        return "no replicas\n"
    rows = []
    for r in replicas:
        shards = sorted(r.get("shards") or [], key=lambda s: s.get("rank", 0))
        leader = shards[0].get("address") if shards else None
        state = str(r.get("state")) + (" (draining)" if r.get("draining") else "")
        state += " (asleep)" if r.get("sleeping") else ""
        lent_to = r.get("displaced_by")
        if isinstance(lent_to, list) and lent_to:
            state += f" (displaced by {', '.join(map(str, lent_to))})"
        lent_by = r.get("borrowing_from")
        if isinstance(lent_by, list) and lent_by:
            state += f" (borrowing from {', '.join(map(str, lent_by))})"
        starts_in = r.get("starts_in")
        if isinstance(starts_in, int | float) and not isinstance(starts_in, bool):
            state += f" (starts in {starts_in:g}s)"
        fetching = [s["fetch"] for s in shards if isinstance(s.get("fetch"), dict)]
        if fetching:
            # The shard furthest from having its weights says how far off the replica is.
            state += " " + fetch_text(min(fetching, key=lambda f: _fraction(f)))
        signals = shards[0].get("signals") if shards else None
        rows.append([
            r["id"], r.get("model"), r.get("profile"), state, leader or "-",
            *engine_columns(signals),
            " ".join(f"{s.get('node')}/{s.get('rank')}:{s.get('state')}" for s in shards) or "-",
            ",".join(str(a) for a in r.get("adapters") or ()) or "-",
        ])
    head = ["REPLICA", "MODEL", "PROFILE", "STATE", "ADDRESS", "WAITING", "RUNNING", "KV",
            "SIGNALS AGE", "SHARDS (NODE/RANK:STATE)", "ADAPTERS"]
    if not any(r.get("adapters") for r in replicas):
        # A fleet without adapters keeps its table as it was.
        head, rows = head[:-1], [row[:-1] for row in rows]
    return table(head, rows)


def size_text(n: Any) -> str:
    """
    A byte count in binary units, a decimal under ten: C{1.2 GiB},
    C{85 MiB}, C{512 B}.
    """
    if not isinstance(n, int | float) or isinstance(n, bool) or n != n:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or abs(n) >= 10 else f"{n:.1f} {unit}"
        n /= 1024
    return "?"  # pragma: no cover - the loop returns


def _fraction(fetch: dict[str, Any]) -> float:
    done, total = fetch.get("done"), fetch.get("total")
    if isinstance(done, int | float) and isinstance(total, int | float) and total > 0:
        return float(done) / float(total)
    return 0.0


def fetch_text(fetch: dict[str, Any]) -> str:
    """
    A fetch's progress as C{41% 1.2 GiB/2.9 GiB 85 MiB/s}; without a total
    (not known yet), C{1.2 GiB 85 MiB/s}.
    """
    done, total, rate = fetch.get("done"), fetch.get("total"), fetch.get("rate")
    parts = []
    if isinstance(total, int | float) and total > 0:
        parts += [f"{_fraction(fetch) * 100:.0f}%", f"{size_text(done)}/{size_text(total)}"]
    else:
        parts.append(size_text(done))
    if isinstance(rate, int | float) and rate > 0:
        parts.append(f"{size_text(rate)}/s")
    return " ".join(parts)


def engine_columns(signals: dict[str, Any] | None) -> list[str]:
    """
    The leader's engine signals as table cells: waiting, running, KV-cache
    use, and their age ("-" where the engine has no such figure; the age
    says "stale" with the scrape's error when the last scrape failed).
    """
    if not signals:
        return ["-", "-", "-", "-"]

    def count(v: Any) -> str:
        return "-" if v is None else f"{v:g}"

    kv = signals.get("kv_cache_usage")
    age = signals.get("age_s")
    age_text = "-" if age is None else f"{age:.1f}s"
    if signals.get("error"):
        age_text += f" (stale: {signals['error']})"
    return [count(signals.get("waiting")), count(signals.get("running")),
            "-" if kv is None else f"{kv * 100:.0f}%", age_text]


def render_events(events: list[dict[str, Any]]) -> str:
    if not events:
        return "no events\n"
    rows = []
    for e in events:
        reason = str(e.get("reason") or "")
        # An agent's reason says how the process ended ("killed by signal
        # 9"); the figure is added only where it does not.
        if e.get("exit_code"):
            if f"exit code {e['exit_code']}" not in reason:
                reason += f" (exit {e['exit_code']})"
        elif e.get("signal") and f"signal {e['signal']}" not in reason:
            reason += f" (signal {e['signal']})"
        if e.get("crash_class"):
            reason += f" [{e['crash_class']}]"
        rows.append([
            clock_time(e.get("time")), e.get("kind"), e.get("node") or "-",
            e.get("replica") or "-", e.get("shard") or "-", reason,
        ])
    return table(["TIME", "KIND", "NODE", "REPLICA", "SHARD", "REASON"], rows)

