"""
Usage and limits per API key (DESIGN §18).

The gateway counts, per key name and model, the requests it forwards and
the tokens the replicas report in their answers' C{usage} (prompt and
completion; a stream reports them in its last chunk when the client asked
for C{stream_options.include_usage}). L{Usage} holds the counts and each
key's limits; L{UsageCollector} shows the counts in C{/metrics};
L{UsageResource} serves them as JSON (C{GET /api/v1/usage}).

Limits are token buckets on the injected clock: a key with
C{requests_per_minute = N} has a bucket of N requests that refills at N/60
a second, and a request is refused (429) when the bucket holds less than
one; C{tokens_per_minute} likewise, in tokens, except that a request is
let through while the bucket holds anything and its tokens are taken when
its answer is complete: a request goes while the bucket holds one token,
so the request that empties it may take it below zero (it overshoots
once), and the next ones wait for the refill.

Finding C{usage} costs little: a response's body is passed through as it
comes, and L{UsageMeter} keeps only its last L{TAIL} bytes, in which it
looks for the last C{"usage"} key once, at the end. Label sets are bounded:
key names come from the keys file (L{ANONYMOUS} when the gateway has
none), models are the labels L{llmgw.gateway.metrics.GatewayMetrics}
gives (known models, capped).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from twisted.internet.interfaces import IReactorTime
from twisted.web.resource import Resource

from llmgw.gateway import errors
from llmgw.hostcheck import HostCheck
from llmgw.untrusted import clip

#: The key label of requests to a gateway that has no API keys.
ANONYMOUS: Final = "_anonymous"
#: How much of a response's end is kept to find its C{usage} in.
TAIL: Final = 8 * 1024
#: Token counts past this in a replica's C{usage} are not believed.
MAX_TOKENS: Final = 2**31
#: What a limit's window is: the bucket holds a minute's worth.
WINDOW: Final = 60.0
_SPACE: Final = b" \t\r\n"
_KEY_BEFORE: Final = b"{,"
#: A C{"usage"} key whose value is an object, and that object's fields up
#: to its end or its first nested object; the counts among them.
_USAGE_AT: Final = re.compile(rb'"usage"[ \t\r\n]*:[ \t\r\n]*\{([^{}]*)')
_USUAL: Final = re.compile(
    rb'"usage"[ \t\r\n]*:[ \t\r\n]*\{[^{}]*?"prompt_tokens"[ \t\r\n]*:[ \t\r\n]*([0-9]{1,12})(?![0-9])'
    rb'[^{}]*?"completion_tokens"[ \t\r\n]*:[ \t\r\n]*([0-9]{1,12})(?![0-9])'
)
_COUNT: Final = re.compile(rb'"(prompt|completion)_tokens"[ \t\r\n]*:[ \t\r\n]*([0-9]{1,12})(?![0-9])')


@dataclass(frozen=True)
class KeyLimits:
    """
    One key's limits; C{None} is no limit.
    """

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def __bool__(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


class Bucket:
    """
    A token bucket of C{capacity} that refills at C{capacity / WINDOW} a
    second, full at the start. Pure: every method takes C{now}.
    """

    __slots__ = ("capacity", "rate", "level", "updated")

    def __init__(self, capacity: float, now: float):
        self.capacity = capacity
        self.rate = capacity / WINDOW
        self.level = capacity
        self.updated = now

    def refill(self, now: float) -> float:
        """
        The level at C{now}.
        """
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now
        return self.level

    def wait(self, now: float, need: float) -> float:
        """
        Seconds from C{now} until the bucket holds C{need} (0: it does).
        """
        short = need - self.refill(now)
        # Refills add up in floating point: a hair short is there.
        return 0.0 if short <= 1e-9 else short / self.rate


def retry_after(seconds: float) -> int:
    """
    A wait as C{Retry-After} seconds: rounded up, at least 1.
    """
    return max(1, math.ceil(seconds - 1e-9))


class KeyBudget:
    """
    What one key may still spend: its buckets, with limits scaled by the
    gateway's share (at least 1 each).
    """

    __slots__ = ("limits", "requests", "tokens")

    def __init__(self, limits: KeyLimits, share: float, now: float):
        self.limits = limits
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        self.requests = Bucket(max(1.0, math.floor(rpm * share)), now) if rpm else None
        self.tokens = Bucket(max(1.0, math.floor(tpm * share)), now) if tpm else None

    def refusal(self, now: float) -> tuple[str, float] | None:
        """
        C{None} when a request may go now, and then it is taken from the
        request bucket; else which limit refuses it (C{"requests"} or
        C{"tokens"}) and the seconds until it would not.
        """
        requests, tokens = self.requests, self.tokens
        if requests is not None:
            wait = requests.wait(now, 1.0)
            if wait > 0:
                return "requests", wait
        if tokens is not None:
            # One token left lets a request through, however many it takes.
            wait = tokens.wait(now, 1.0)
            if wait > 0:
                return "tokens", wait
        if requests is not None:
            requests.level -= 1.0
        return None

    def spend(self, now: float, tokens: int) -> None:
        if self.tokens is not None:
            self.tokens.refill(now)
            self.tokens.level -= tokens


def find_usage(tail: bytes, start: int = 0) -> tuple[int, int] | None:
    """
    The C{(prompt_tokens, completion_tokens)} of the last C{"usage"} object
    in C{tail} from C{start} on (the end of a JSON body, or of a stream of server-sent
    events), or C{None} when the last C{"usage"} key holds no such object
    (C{null} in a stream's chunks before the last) or there is none.

    Only a key counts: the quote must follow C{{} or C{,} (in a string's
    content it would be escaped). The counts are found, not parsed: in the
    object's own fields, up to its end or its first nested object (the
    details, which follow the counts).
    """
    start = max(start, 0)
    i = tail.rfind(b'"usage"', start)
    while i >= 0:
        j = i - 1
        while j >= 0 and tail[j] in _SPACE:
            j -= 1
        if j < 0 or tail[j] in _KEY_BEFORE:
            # Nearly every server writes the prompt's count first.
            m = _USUAL.match(tail, i)
            if m is not None:
                counts = (int(m.group(1)), int(m.group(2)))
                return None if max(counts) >= MAX_TOKENS else counts
            m = _USAGE_AT.match(tail, i)
            if m is None:
                return None
            prompt = completion = -1
            for name, digits in _COUNT.findall(m.group(1)):
                if name == b"prompt":
                    prompt = int(digits)
                else:
                    completion = int(digits)
            if prompt < 0 and completion < 0:
                return None
            counts = (max(prompt, 0), max(completion, 0))
            return None if max(counts) >= MAX_TOKENS else counts
        i = tail.rfind(b'"usage"', start, i)
    return None


class UsageRow:
    """
    The counts of one key and model.
    """

    __slots__ = ("requests", "prompt_tokens", "completion_tokens", "unreported",
                 "limited_requests", "limited_tokens")

    def __init__(self) -> None:
        self.requests = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        #: Answers (2xx) that reported no usage: their tokens are not counted.
        self.unreported = 0
        self.limited_requests = 0
        self.limited_tokens = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "unreported": self.unreported,
            "limited_requests": self.limited_requests,
            "limited_tokens": self.limited_tokens,
        }


class UsageMeter:
    """
    One forwarded request's share of the accounting: fed the response's
    body as it passes (L{feed}), it finds the tokens at the end
    (L{finish}). It holds at most about 2 * L{TAIL} bytes.
    """

    __slots__ = ("usage", "row", "budget", "tail", "parts", "size")

    def __init__(self, usage: Usage, row: UsageRow, budget: KeyBudget | None):
        self.usage = usage
        self.row = row
        self.budget = budget
        # The first piece alone (most answers are one), then a list.
        self.tail = b""
        self.parts: list[bytes] | None = None
        self.size = 0

    def feed(self, data: bytes) -> None:
        parts = self.parts
        if parts is None:
            first = self.tail
            if not first:
                self.tail = data
                return
            parts = self.parts = [first]
            self.size = len(first)
        parts.append(data)
        self.size += len(data)
        if self.size > 2 * TAIL:
            kept = b"".join(parts)[-TAIL:]
            parts.clear()
            parts.append(kept)
            self.size = len(kept)

    def finish(self, status: int) -> None:
        """
        The response (of HTTP C{status}) is complete: count its tokens.
        """
        if not 200 <= status < 300:
            return
        parts = self.parts
        tail = self.tail if parts is None else b"".join(parts)
        self.tail, self.parts = b"", None
        found = find_usage(tail, len(tail) - 2 * TAIL)
        row = self.row
        if found is None:
            row.unreported += 1
            return
        prompt, completion = found
        row.prompt_tokens += prompt
        row.completion_tokens += completion
        if self.budget is not None:
            self.budget.spend(self.usage.clock.seconds(), prompt + completion)


class Usage:
    """
    The gateway's counts per key and model, and the keys' budgets.

    C{limits} are the keys' limits by name (keys without limits may be
    left out); C{share} scales every limit (see docs/operations.md, "Usage
    and limits": each of N gateways enforces its share of a limit).
    """

    def __init__(self, clock: IReactorTime, limits: dict[str, KeyLimits] | None = None, share: float = 1.0):
        if not 0 < share <= 1:
            raise ValueError(f"the limit share must be in (0, 1], not {share}")
        self.clock = clock
        self.share = share
        self.started = clock.seconds()
        self.limits = {name: lim for name, lim in (limits or {}).items() if lim}
        now = clock.seconds()
        self._budgets = {name: KeyBudget(lim, share, now) for name, lim in self.limits.items()}
        self._rows: dict[tuple[str, str], UsageRow] = {}

    def row(self, key: str | None, model: str) -> UsageRow:
        k = (key or ANONYMOUS, model)
        row = self._rows.get(k)
        if row is None:
            row = self._rows[k] = UsageRow()
        return row

    def admit(self, key: str | None, model: str) -> UsageMeter:
        """
        Count a request of key C{key} (C{None}: no keys) for C{model} (a
        bounded label), and return the meter of its answer.

        @raise errors.GatewayError: 429, the key is over a limit; with
            C{Retry-After}.
        """
        rows = self._rows
        k = (key or ANONYMOUS, model)
        row = rows.get(k)
        if row is None:
            row = rows[k] = UsageRow()
        budget = self._budgets.get(k[0]) if self._budgets else None
        if budget is not None:
            refused = budget.refusal(self.clock.seconds())
            if refused is not None:
                which, wait = refused
                if which == "requests":
                    row.limited_requests += 1
                else:
                    row.limited_tokens += 1
                raise rate_limited(key or ANONYMOUS, model, which, budget, wait)
        row.requests += 1
        return UsageMeter(self, row, budget)

    def rows(self) -> list[tuple[str, str, UsageRow]]:
        return [(k, m, row) for (k, m), row in sorted(self._rows.items())]

    def snapshot(self) -> dict[str, Any]:
        """
        What C{GET /api/v1/usage} answers: the counts per key and model
        since C{since} (the gateway's start), and each limited key's limits
        (as configured, and this gateway's share of them) with what is
        left now.
        """
        now = self.clock.seconds()
        limits = []
        for name, budget in sorted(self._budgets.items()):
            entry: dict[str, Any] = {
                "key": name,
                "requests_per_minute": budget.limits.requests_per_minute,
                "tokens_per_minute": budget.limits.tokens_per_minute,
            }
            for kind in ("requests", "tokens"):
                bucket = getattr(budget, kind)
                entry[f"{kind}_per_minute_here"] = int(bucket.capacity) if bucket is not None else None
                entry[f"{kind}_available"] = math.floor(bucket.refill(now)) if bucket is not None else None
            limits.append(entry)
        return {
            "since": self.started,
            "share": self.share,
            "usage": [{"key": k, "model": m, **row.as_dict()} for k, m, row in self.rows()],
            "limits": limits,
        }


def rate_limited(key: str, model: str, which: str, budget: KeyBudget, wait: float) -> errors.GatewayError:
    """
    The 429 for key C{key} over its C{which} limit (C{"requests"} or
    C{"tokens"}), in OpenAI's shape: C{type} names the limit, C{code} is
    C{rate_limit_exceeded}, and C{Retry-After} says when to try again.
    """
    seconds = retry_after(wait)
    bucket = budget.requests if which == "requests" else budget.tokens
    assert bucket is not None
    configured = budget.limits.requests_per_minute if which == "requests" else budget.limits.tokens_per_minute
    short = "RPM" if which == "requests" else "TPM"
    here = int(bucket.capacity)
    limit = f"Limit {configured}" + (f" ({here} on this gateway)" if here != configured else "")
    return errors.GatewayError(
        429,
        f"Rate limit reached for {clip(model)} for key {clip(key)} on {which} per min ({short}): "
        f"{limit}. Please try again in {seconds}s.",
        which,
        "rate_limit_exceeded",
        {b"Retry-After": b"%d" % seconds},
    )


class UsageCollector(Collector):
    """
    L{Usage}'s counts as Prometheus counters, read at scrape time.
    """

    def __init__(self, usage: Callable[[], Usage | None]):
        self._usage = usage

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        families = {
            "requests": CounterMetricFamily(
                "llmgw_gateway_usage_requests", "Requests forwarded, by API key name and model",
                labels=["key", "model"]),
            "prompt_tokens": CounterMetricFamily(
                "llmgw_gateway_usage_prompt_tokens", "Prompt tokens the replicas reported, by key and model",
                labels=["key", "model"]),
            "completion_tokens": CounterMetricFamily(
                "llmgw_gateway_usage_completion_tokens",
                "Completion tokens the replicas reported, by key and model", labels=["key", "model"]),
            "unreported": CounterMetricFamily(
                "llmgw_gateway_usage_unreported",
                "Successful answers that reported no usage (their tokens are not counted), by key and model",
                labels=["key", "model"]),
        }
        limited = CounterMetricFamily(
            "llmgw_gateway_usage_limited", "Requests refused with 429 over a key's limit, by key, model and limit",
            labels=["key", "model", "limit"])
        usage = self._usage()
        if usage is not None:
            for key, model, row in usage.rows():
                for name, family in families.items():
                    family.add_metric([key, model], getattr(row, name))
                if row.limited_requests:
                    limited.add_metric([key, model, "requests"], row.limited_requests)
                if row.limited_tokens:
                    limited.add_metric([key, model, "tokens"], row.limited_tokens)
        yield from families.values()
        yield limited


class UsageResource(Resource):
    """
    C{GET /api/v1/usage} for a standalone gateway's metrics listener: the
    JSON of L{Usage.snapshot}.
    """

    isLeaf = True

    def __init__(self, usage: Usage, hosts: HostCheck | None = None):
        super().__init__()
        self.usage = usage
        #: The names it answers to (a page under another name, rebound to
        #: this address, must not read key names and limits).
        self.hosts = hosts if hosts is not None else HostCheck(option="--gateway-hosts")

    def render_GET(self, request: Any) -> bytes:
        request.setHeader(b"content-type", b"application/json; charset=utf-8")
        host = request.getHeader(b"host")
        if not self.hosts.allows(host):
            request.setResponseCode(421)
            message = (f"this gateway does not answer for host {clip(host.decode('latin-1'))!r}; "
                       f"add it to {self.hosts.option}")
            return (json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                          "code": "misdirected_request"}}) + "\n").encode()
        return (json.dumps(self.usage.snapshot()) + "\n").encode()
