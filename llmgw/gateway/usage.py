"""
Usage and limits per API key (DESIGN §18).

The gateway counts, per key name and model, the requests it forwards and
the tokens the replicas report in their answers' C{usage} (prompt and
completion; a stream reports them in its last chunk when asked with
C{stream_options.include_usage}, else they are counted from its chunks, see
below). L{Usage} holds the counts and each
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
looks for the last C{"usage"} key once, at the end.

Streams count whether or not the client asked for usage. A streamed chat
or text completion whose client did not set C{stream_options} is sent on
with C{"stream_options": {"include_usage": true}} added (L{ask_for_usage});
its answer's usage-only chunk, which that client did not ask for, is taken
out of what the client gets. When a stream ends without usage (an engine
that ignores C{stream_options}, a stream cut short), its completion tokens
are estimated from its chunks as they pass: each C{content}, C{text},
C{reasoning_content} or tool-call C{arguments} string counts one token per
four bytes, at least one (L{count_streamed}). Label sets are bounded:
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
#: An unfinished server-sent event held longer than this is let go: its
#: bytes are passed on (and not counted) rather than held without bound.
MAX_EVENT: Final = 64 * 1024
#: What is added to a streamed request whose client set no C{stream_options}.
INCLUDE_USAGE: Final = b'"stream_options":{"include_usage":true},'
_STREAM_KEY: Final = b'"stream"'
_OPTIONS_KEY: Final = b'"stream_options"'
#: A C{"stream": true} member (after its C{{} or C{,}).
_STREAM_TRUE: Final = re.compile(rb'"stream"[ \t\r\n]*:[ \t\r\n]*true(?=[ \t\r\n,}])')
#: Most C{"stream"} strings that are looked at.
_MAX_CANDIDATES: Final = 16
#: A whole JSON string (a key or a value).
_STRING: Final = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_OPEN: Final = re.compile(rb"[ \t\r\n]*\{")
#: The bytes of a body that L{ask_for_usage} reads past its regular
#: expressions' scan, at most: a few milliseconds.
SCAN_BUDGET: Final = 256 * 1024
#: A string member that holds generated text in a streamed chunk.
_GENERATED: Final = re.compile(
    rb'"(?:content|text|reasoning_content|reasoning|arguments)"[ \t\r\n]*:[ \t\r\n]*"([^"\\]*(?:\\.[^"\\]*)*)"',
    re.S,
)
#: A C{"usage"} member whose value is an object (not C{null}).
_USAGE_OBJECT: Final = re.compile(rb'"usage"[ \t\r\n]*:[ \t\r\n]*\{')
_NO_CHOICES: Final = re.compile(rb'"choices"[ \t\r\n]*:[ \t\r\n]*\[[ \t\r\n]*\]')
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
    if start < 0:
        start = 0
    i = tail.rfind(b'"usage"', start)
    while i >= 0:
        j = i - 1
        while j >= 0 and tail[j] in _SPACE:
            j -= 1
        if j < 0 or tail[j] in _KEY_BEFORE:
            # Nearly every server writes the prompt's count first.
            m = _USUAL.match(tail, i)
            if m is not None:
                prompt_digits, completion_digits = m.group(1, 2)
                prompt, completion = int(prompt_digits), int(completion_digits)
                return None if prompt >= MAX_TOKENS or completion >= MAX_TOKENS else (prompt, completion)
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


def ask_for_usage(body: bytes) -> bytes | None:
    """
    C{body} with C{"stream_options": {"include_usage": true}} added first in
    its object, when it is a streamed request (C{"stream": true} a member of
    the top-level object) that names no C{stream_options} anywhere; else
    C{None}, and the body goes on unchanged.

    Found, not parsed, in C (regular expressions and byte counts) and
    within L{SCAN_BUDGET} bytes, so it costs a bounded time whatever the
    body: C{body} is valid JSON (the front has checked it), so a
    C{"stream": true} after C{{} or C{,} is a key, and it is the top-level
    one when the brackets outside strings on the shorter side of it (to the
    body's start or to its end) leave it one deep. A body it cannot decide
    within the budget is left alone, as is every doubtful one: an engine
    refuses C{stream_options} on a request that does not stream.
    """
    # Literal searches first: regular expressions that start with a class
    # try every position, ten times slower over a large body. (find, not
    # in: bytes' in tries its operand as a number first, a TypeError made
    # and dropped.)
    if body.find(_OPTIONS_KEY) >= 0:
        return None
    opened = _OPEN.match(body)
    if opened is None:
        return None
    first = opened.end()
    budget = SCAN_BUDGET
    i = body.find(_STREAM_KEY, first)
    looked = 0
    while i >= 0:
        looked += 1
        if looked > _MAX_CANDIDATES:
            return None
        # What precedes it, past a little whitespace (more: not decided).
        before = body[max(0, i - 64) : i].rstrip(_SPACE)
        at = i - 1 - (min(i, 64) - len(before))
        m = _STREAM_TRUE.match(body, i) if before and before[-1] in _KEY_BEFORE else None
        i = body.find(_STREAM_KEY, i + 8)
        if m is None:
            continue
        after = m.end()
        if at == first - 1:
            # The body's own "{" before it: the first member.
            top = True
        elif at - first <= len(body) - after:
            budget -= at - first
            if budget < 0:
                return None
            top = _nesting(body[first:at]) == 0
        else:
            budget -= len(body) - after
            if budget < 0:
                return None
            # From the member's end, only the body's closing brace is left open.
            top = _nesting(body[after:]) == -1
        if top:
            return body[:first] + INCLUDE_USAGE + body[first:]
    return None


def _nesting(stretch: bytes) -> int:
    """
    Brackets opened less those closed in C{stretch}, a stretch of JSON that
    starts outside any string, not counting those inside strings.
    """
    if b"\\" in stretch:
        outside = _STRING.sub(b"", stretch)
    else:
        # Without escapes strings are what lies between quotes.
        outside = b"".join(stretch.split(b'"')[::2])
    return outside.count(b"{") + outside.count(b"[") - outside.count(b"}") - outside.count(b"]")


def count_streamed(events: bytes) -> int:
    """
    The completion tokens estimated from whole server-sent events: each
    generated string (C{content}, C{text}, C{reasoning_content},
    C{reasoning}, tool-call C{arguments}) that is not empty counts a token
    per four bytes as sent, at least one.
    """
    n = 0
    for m in _GENERATED.finditer(events):
        size = m.end(1) - m.start(1)
        if size:
            n += max(1, size >> 2)
    return n


def event_end(data: bytes) -> int:
    """
    Where the last whole event in C{data} ends (after its blank line), or
    -1 when none does.
    """
    end = data.rfind(b"\n\n")
    if end >= 0:
        end += 2
    crlf = data.rfind(b"\r\n\r\n")
    if crlf >= 0 and crlf + 4 > end:
        end = crlf + 4
    return end


def drop_usage_events(events: bytes) -> bytes:
    """
    C{events} (whole server-sent events) without those that only carry
    C{usage}: an object there, and C{"choices": []}. A chunk that carries
    usage beside choices stays.
    """
    pos = 0
    while True:
        m = _USAGE_OBJECT.search(events, pos)
        if m is None:
            return events
        at = m.start()
        start = max(events.rfind(b"\n\n", 0, at), events.rfind(b"\r\n\r\n", 0, at))
        start = 0 if start < 0 else start + (2 if events[start] == 10 else 4)
        lf = events.find(b"\n\n", at)
        crlf = events.find(b"\r\n\r\n", at)
        ends = [e + k for e, k in ((lf, 2), (crlf, 4)) if e >= 0]
        end = min(ends) if ends else len(events)
        if _NO_CHOICES.search(events, start, end) is not None:
            events = events[:start] + events[end:]
            pos = start
        else:
            pos = end


class UsageRow:
    """
    The counts of one key and model.
    """

    __slots__ = ("requests", "prompt_tokens", "completion_tokens", "unreported", "estimated",
                 "limited_requests", "limited_tokens")

    def __init__(self) -> None:
        self.requests = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        #: Answers (2xx) that reported no usage and streamed no text either:
        #: their tokens are not counted.
        self.unreported = 0
        #: Streamed answers (2xx) that reported no usage: their completion
        #: tokens are counted from their chunks (L{count_streamed}).
        self.estimated = 0
        self.limited_requests = 0
        self.limited_tokens = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "unreported": self.unreported,
            "estimated": self.estimated,
            "limited_requests": self.limited_requests,
            "limited_tokens": self.limited_tokens,
        }


class UsageMeter:
    """
    One forwarded request's share of the accounting: fed the response's
    body as it passes (L{feed}, which returns what the client gets), it
    finds the tokens at the end (L{finish}). It holds at most about
    2 * L{TAIL} bytes, and for a stream one unfinished event of at most
    L{MAX_EVENT} bytes more.

    C{asked}: the gateway asked the engine for usage on the client's behalf
    (L{ask_for_usage}), so the usage-only chunk is taken out of the stream.
    C{stream}: the answer is a stream of server-sent events (set when its
    head says so, before the first L{feed}).
    """

    __slots__ = ("usage", "row", "budget", "tail", "parts", "size", "asked", "stream", "held", "streamed",
                 "finished")

    def __init__(self, usage: Usage, row: UsageRow, budget: KeyBudget | None):
        self.usage = usage
        self.row = row
        self.budget = budget
        # The first piece alone (most answers are one), then a list.
        self.tail = b""
        self.parts: list[bytes] | None = None
        self.size = 0
        self.asked = False
        self.stream = False
        #: The stream's unfinished last event, not yet counted (nor, when
        #: C{asked}, passed on).
        self.held = b""
        #: Completion tokens counted from the stream's chunks so far.
        self.streamed = 0
        self.finished = False

    def feed(self, data: bytes) -> bytes:
        """
        Take in the next piece of the body; return what of it goes to the
        client now: C{data} itself, except in a stream the gateway asked
        usage for, where an unfinished event waits for its end and the
        usage-only chunk is left out.
        """
        parts = self.parts
        if parts is None:
            first = self.tail
            if not first:
                self.tail = data
                return self._events(data) if self.stream else data
            parts = self.parts = [first]
            self.size = len(first)
        parts.append(data)
        self.size += len(data)
        if self.size > 2 * TAIL:
            kept = b"".join(parts)[-TAIL:]
            parts.clear()
            parts.append(kept)
            self.size = len(kept)
        return self._events(data) if self.stream else data

    def _events(self, piece: bytes) -> bytes:
        held = self.held
        data = held + piece if held else piece
        end = event_end(data)
        if end < 0:
            whole, rest = b"", data
        elif end == len(data):
            whole, rest = data, b""
        else:
            whole, rest = data[:end], data[end:]
        if len(rest) > MAX_EVENT:
            # An event this long is no token chunk: let it go uncounted.
            whole, rest = data, b""
        self.held = rest
        if whole:
            self.streamed += count_streamed(whole)
            if self.asked:
                return drop_usage_events(whole)
        if self.asked:
            return whole
        # Nothing is held back from the client: only counted later.
        return piece

    def flush(self) -> bytes:
        """
        The stream ended: what it still holds (an unfinished last event) to
        pass on, counted.
        """
        held, self.held = self.held, b""
        if held and self.stream:
            self.streamed += count_streamed(held)
            if self.asked:
                return held
        return b""

    def finish(self, status: int) -> None:
        """
        The response (of HTTP C{status}) is complete, or was cut short:
        count its tokens, once.
        """
        if self.finished:
            return
        self.finished = True
        self.held = b""
        if not 200 <= status < 300:
            return
        parts = self.parts
        tail = self.tail if parts is None else b"".join(parts)
        self.tail, self.parts = b"", None
        found = find_usage(tail, len(tail) - 2 * TAIL)
        row = self.row
        if found is None:
            if not self.streamed:
                row.unreported += 1
                return
            found = (0, self.streamed)
            row.estimated += 1
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
                "Completion tokens the replicas reported (or counted from streamed chunks), by key and model",
                labels=["key", "model"]),
            "unreported": CounterMetricFamily(
                "llmgw_gateway_usage_unreported",
                "Successful answers that reported no usage (their tokens are not counted), by key and model",
                labels=["key", "model"]),
            "estimated": CounterMetricFamily(
                "llmgw_gateway_usage_estimated",
                "Streamed answers that reported no usage: completion tokens counted from their chunks, "
                "by key and model", labels=["key", "model"]),
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
