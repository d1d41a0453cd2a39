"""
Usage and limits per API key (llmgw.gateway.usage): finding C{usage} in
an answer's tail, the token buckets on a C{Clock}, the 429 in OpenAI's
shape through the gateway's front in memory, the counts in C{/metrics},
and counts through a real gateway on loopback in front of the project's
fake model server, streamed and not.
"""

from __future__ import annotations

import json
from typing import Any

import treq
from prometheus_client import generate_latest
from twisted.internet.defer import inlineCallbacks
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmgw.gateway.errors import GatewayError
from llmgw.gateway.follower import RoutingSnapshot
from llmgw.gateway.keys import KeyRing
from llmgw.gateway.proxy import Gateway, GatewayConfig
from llmgw.gateway.resource import GatewayResource, GatewaySite
from llmgw.gateway.usage import (
    ANONYMOUS,
    TAIL,
    KeyLimits,
    Usage,
    UsageMeter,
    find_usage,
)
from llmgw.routing import Route
from tests.gateway_helpers import Harness
from tests.test_gateway_resource import LogCapture, error_of, parse, post

USAGE = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}


def chunk(**fields: Any) -> bytes:
    doc = {"id": "c1", "object": "chat.completion.chunk", "model": "demo", **fields}
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


class FindUsageTests(SynchronousTestCase):
    def test_whole_answer(self) -> None:
        """
        A JSON answer's C{usage} gives its prompt and completion tokens,
        with fields after it, details inside it, or spaces around it; an
        embeddings answer (no completion tokens) gives 0 for them.
        """
        body = json.dumps({
            "id": "x", "choices": [{"message": {"content": "hi"}}],
            "usage": {**USAGE, "prompt_tokens_details": {"cached_tokens": 3}},
            "kv_transfer_params": None,
        }).encode()
        self.assertEqual(find_usage(body), (7, 5))
        self.assertEqual(find_usage(b'{"usage" :\n { "prompt_tokens" : 2, "completion_tokens":9}}'), (2, 9))
        self.assertEqual(find_usage(b'{"data": [], "usage": {"prompt_tokens": 4, "total_tokens": 4}}'), (4, 0))

    def test_stream(self) -> None:
        """
        In a stream, the last chunk's C{usage} counts (the earlier chunks
        carry C{"usage": null}); a stream without one gives C{None}.
        """
        stream = (
            chunk(choices=[{"delta": {"content": "a"}}], usage=None)
            + chunk(choices=[{"delta": {}, "finish_reason": "stop"}], usage=None)
            + chunk(choices=[], usage=USAGE)
            + b"data: [DONE]\n\n"
        )
        self.assertEqual(find_usage(stream), (7, 5))
        plain = chunk(choices=[{"delta": {"content": "a"}}]) + b"data: [DONE]\n\n"
        self.assertIsNone(find_usage(plain))
        nulls = chunk(choices=[{"delta": {"content": "a"}}], usage=None) + b"data: [DONE]\n\n"
        self.assertIsNone(find_usage(nulls))

    def test_not_fooled_by_content(self) -> None:
        """
        A generated text that spells a usage object (escaped, inside a
        string) is not taken for one; malformed or absurd counts give
        C{None}.
        """
        content = json.dumps({"usage": {"prompt_tokens": 999999, "completion_tokens": 999999}})
        body = json.dumps({"choices": [{"message": {"content": content}}]}).encode()
        self.assertIsNone(find_usage(body))
        self.assertIsNone(find_usage(b'{"usage": {"prompt_tokens": "7"}}'))
        self.assertIsNone(find_usage(b'{"usage": {"prompt_tokens": 99999999999}}'))
        self.assertIsNone(find_usage(b'{"usage": {}}'))
        self.assertIsNone(find_usage(b""))

    def test_meter_keeps_a_bounded_tail(self) -> None:
        """
        The meter of a long stream holds at most about 2 * TAIL bytes
        however long the stream, and still finds the last chunk's usage;
        an error status counts nothing.
        """
        usage = Usage(Clock())
        meter = usage.admit(None, "demo")
        for _ in range(5000):
            meter.feed(chunk(choices=[{"delta": {"content": "word"}}], usage=None))
            self.assertLessEqual(sum(map(len, meter.parts or [meter.tail])), 2 * TAIL + 200)
        meter.feed(chunk(choices=[], usage=USAGE)[:40])
        meter.feed(chunk(choices=[], usage=USAGE)[40:] + b"data: [DONE]\n\n")
        meter.finish(200)
        row = usage.row(None, "demo")
        self.assertEqual((row.requests, row.prompt_tokens, row.completion_tokens, row.unreported), (1, 7, 5, 0))
        failed = usage.admit(None, "demo")
        failed.feed(b'{"error": {"message": "x"}, "usage": {"prompt_tokens": 50}}')
        failed.finish(500)
        self.assertEqual((row.requests, row.prompt_tokens, row.unreported), (2, 7, 0))


    def test_only_the_tail_is_searched(self) -> None:
        """
        A large answer in one piece is searched only in its last 2 * TAIL
        bytes: its usage is found at the end, and not found (counted as
        unreported) when more than that follows it.
        """
        usage = Usage(Clock())
        filler = b" " * (3 * TAIL)
        at_end = usage.admit(None, "demo")
        at_end.feed(b'{"text": "' + filler + b'", "usage": {"prompt_tokens": 1, "completion_tokens": 2}}')
        at_end.finish(200)
        far = usage.admit(None, "demo")
        far.feed(b'{"usage": {"prompt_tokens": 100, "completion_tokens": 200}, "text": "' + filler + b'"}')
        far.finish(200)
        row = usage.row(None, "demo")
        self.assertEqual((row.prompt_tokens, row.completion_tokens, row.unreported), (1, 2, 1))


def answer_meter(usage: Usage, key: str, model: str, prompt: int, completion: int) -> UsageMeter:
    meter = usage.admit(key, model)
    meter.feed(json.dumps({"usage": {"prompt_tokens": prompt, "completion_tokens": completion}}).encode())
    return meter


class LimitTests(SynchronousTestCase):
    def test_requests_per_minute(self) -> None:
        """
        With C{requests_per_minute = 3}, three requests go at once, the
        fourth is refused with a C{Retry-After} of the 20 s one request
        takes to refill; after it one more goes, not two. Other keys and
        unlimited keys are not held back.
        """
        clock = Clock()
        usage = Usage(clock, {"a": KeyLimits(requests_per_minute=3), "free": KeyLimits()})
        for _ in range(3):
            usage.admit("a", "demo")
        e = self.assertRaises(GatewayError, usage.admit, "a", "demo")
        self.assertEqual(e.status, 429)
        self.assertEqual(e.headers[b"Retry-After"], b"20")
        self.assertEqual((e.type, e.code), ("requests", "rate_limit_exceeded"))
        clock.advance(19)
        e = self.assertRaises(GatewayError, usage.admit, "a", "demo")
        self.assertEqual(e.headers[b"Retry-After"], b"1")
        clock.advance(1)
        usage.admit("a", "demo")
        self.assertRaises(GatewayError, usage.admit, "a", "demo")
        for _ in range(100):
            usage.admit("free", "demo")
            usage.admit("b", "demo")
        row = usage.row("a", "demo")
        self.assertEqual((row.requests, row.limited_requests, row.limited_tokens), (4, 3, 0))

    def test_refill_in_floating_point(self) -> None:
        """
        A bucket that has refilled one request's time (an inexact number
        of seconds) lets the request through, however the sums round.
        """
        for rpm in (7, 11, 13, 59, 61, 997):
            clock = Clock()
            usage = Usage(clock, {"a": KeyLimits(requests_per_minute=rpm)})
            for _ in range(rpm):
                usage.admit("a", "demo")
            for _ in range(5):
                for _ in range(3):
                    clock.advance(60 / rpm / 3)
                usage.admit("a", "demo")

    def test_tokens_per_minute(self) -> None:
        """
        With C{tokens_per_minute = 600} a request goes while the bucket
        holds a token; its tokens are taken when its answer is complete, so
        one answer may overshoot (the bucket goes below zero) and the next
        request waits for the refill, 10 tokens a second: Retry-After is
        the time to one token. Requests in flight are not cut off.
        """
        clock = Clock()
        usage = Usage(clock, {"a": KeyLimits(tokens_per_minute=600)})
        first = answer_meter(usage, "a", "demo", 500, 300)
        second = usage.admit("a", "demo")  # the first has not finished: nothing taken yet
        first.finish(200)
        e = self.assertRaises(GatewayError, usage.admit, "a", "demo")
        self.assertEqual((e.status, e.type, e.code), (429, "tokens", "rate_limit_exceeded"))
        # 200 below zero, 10 a second: 20.1 s to one token.
        self.assertEqual(e.headers[b"Retry-After"], b"21")
        self.assertIn("tokens per min (TPM): Limit 600", e.message)
        second.finish(200)  # reported no usage: counted as such, takes nothing
        clock.advance(20)
        self.assertRaises(GatewayError, usage.admit, "a", "demo")
        clock.advance(0.2)
        usage.admit("a", "demo")
        row = usage.row("a", "demo")
        self.assertEqual(
            (row.requests, row.prompt_tokens, row.completion_tokens, row.unreported, row.limited_tokens),
            (3, 500, 300, 1, 2),
        )

    def test_both_limits_and_share(self) -> None:
        """
        A request refused for tokens does not use up a request; with a
        share of 0.5 (two gateways) this gateway enforces half of each
        limit, which the 429 and the snapshot say.
        """
        clock = Clock()
        usage = Usage(clock, {"a": KeyLimits(requests_per_minute=4, tokens_per_minute=100)}, share=0.5)
        answer_meter(usage, "a", "demo", 40, 20).finish(200)
        for _ in range(3):
            e = self.assertRaises(GatewayError, usage.admit, "a", "demo")
            self.assertEqual(e.type, "tokens")
        self.assertIn("Limit 100 (50 on this gateway)", e.message)
        clock.advance(60)
        usage.admit("a", "demo")
        usage.admit("a", "demo")
        e = self.assertRaises(GatewayError, usage.admit, "a", "demo")
        self.assertEqual(e.type, "requests")
        self.assertIn("Limit 4 (2 on this gateway)", e.message)
        snap = usage.snapshot()
        self.assertEqual(snap["share"], 0.5)
        self.assertEqual(snap["limits"], [{
            "key": "a", "requests_per_minute": 4, "tokens_per_minute": 100,
            "requests_per_minute_here": 2, "requests_available": 0,
            "tokens_per_minute_here": 50, "tokens_available": 40,
        }])
        self.assertRaises(ValueError, Usage, clock, {}, 0)
        self.assertRaises(ValueError, Usage, clock, {}, 1.5)


UPSTREAM_OK = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s"
)


class FrontTests(SynchronousTestCase):
    """
    The gateway's front in memory, its replica answered by the test, its
    clock a L{MemoryReactorClock}.
    """

    def setUp(self) -> None:
        self.clock = MemoryReactorClock()
        keys = KeyRing(
            {"team-a": "sk-team-a-0001", "team-b": "sk-team-b-0002"},
            {"team-a": KeyLimits(requests_per_minute=2)},
        )
        table = RoutingSnapshot([Route("r1", "demo", "10.0.0.9:8000")], ["demo", "idle"])
        self.gateway = Gateway(self.clock, table, GatewayConfig(), keys=keys)
        self.site = GatewaySite(GatewayResource(self.gateway))

    def request(self, key: str, body: bytes = b'{"model": "demo"}') -> StringTransport:
        proto = self.site.buildProtocol(None)
        client = StringTransport()
        proto.makeConnection(client)
        proto.dataReceived(post(body, extra=b"Authorization: Bearer " + key.encode() + b"\r\n"))
        return client

    def answer_upstream(self, body: bytes) -> None:
        _, _, factory, _, _ = self.clock.tcpClients[-1]
        conn = factory.buildProtocol(None)
        conn.makeConnection(StringTransport())
        conn.dataReceived(UPSTREAM_OK % (len(body), body))

    def test_429_shape(self) -> None:
        """
        Past its limit a key gets 429 with C{Retry-After} and OpenAI's
        error body (C{type} the limit, C{code} C{rate_limit_exceeded}, a
        message naming the model, the key's name and the limit), before
        anything is forwarded; the refusal is counted per key and model,
        and the key's secret is nowhere in it. It is logged with the
        client's address and the key's name.
        """
        log = LogCapture(self)
        for _ in range(2):
            self.request("sk-team-a-0001")
            self.answer_upstream(json.dumps({"usage": USAGE}).encode())
        connects = len(self.clock.tcpClients)
        client = self.request("sk-team-a-0001")
        status, headers, body = parse(client.value())
        self.assertEqual(status, 429)
        self.assertTrue(client.value().startswith(b"HTTP/1.1 429 Too Many Requests\r\n"))
        self.assertEqual(dict(headers)[b"retry-after"], b"30")
        self.assertEqual(dict(headers)[b"content-type"], b"application/json")
        err = error_of(body)
        self.assertEqual((err["type"], err["code"], err["param"]), ("requests", "rate_limit_exceeded", None))
        self.assertIn("'demo'", err["message"])
        self.assertIn("'team-a'", err["message"])
        self.assertIn("requests per min (RPM): Limit 2", err["message"])
        self.assertIn("try again in 30s", err["message"])
        self.assertNotIn(b"sk-team-a", client.value())
        refusals = [line for line in log.text().splitlines() if "429" in line]
        self.assertEqual(len(refusals), 1)
        self.assertIn("(key team-a)", refusals[0])
        self.assertIn("192.168.1.1", refusals[0])
        self.assertNotIn("sk-team-a", log.text())
        self.assertEqual(len(self.clock.tcpClients), connects)
        # Another key is not held back.
        self.request("sk-team-b-0002")
        self.assertEqual(len(self.clock.tcpClients), connects + 1)
        self.clock.advance(30)
        self.request("sk-team-a-0001")
        self.assertEqual(len(self.clock.tcpClients), connects + 2)

    def test_metrics(self) -> None:
        """
        C{/metrics} shows requests, prompt and completion tokens and 429s
        per key and model; a request for a model the routing table does
        not know is a 404 and makes no usage label.
        """
        self.request("sk-team-a-0001")
        self.answer_upstream(json.dumps({"usage": USAGE}).encode())
        self.request("sk-team-a-0001")
        self.answer_upstream(b'{"no": "usage"}')
        self.request("sk-team-a-0001")
        status, _, _ = parse(self.request("sk-team-b-0002", b'{"model": "made-up"}').value())
        self.assertEqual(status, 404)
        text = generate_latest(self.gateway.registry).decode()
        self.assertIn('llmgw_gateway_usage_requests_total{key="team-a",model="demo"} 2.0', text)
        self.assertIn('llmgw_gateway_usage_prompt_tokens_total{key="team-a",model="demo"} 7.0', text)
        self.assertIn('llmgw_gateway_usage_completion_tokens_total{key="team-a",model="demo"} 5.0', text)
        self.assertIn('llmgw_gateway_usage_unreported_total{key="team-a",model="demo"} 1.0', text)
        self.assertIn('llmgw_gateway_usage_limited_total{key="team-a",limit="requests",model="demo"} 1.0',
                      text)
        self.assertNotIn("made-up", text)
        self.assertNotIn('key="team-b"', text)


class LoopbackTests(TestCase):
    """
    A real gateway on loopback in front of the project's fake model server.
    """

    timeout = 20

    def setUp(self) -> None:
        self.keys = KeyRing({"team-a": "sk-team-a-0001"}, {"team-a": KeyLimits(requests_per_minute=3)})
        self.h = Harness(self, keys=self.keys)
        self.h.fakemodel("r1", model="demo", tokens=4)

    def auth(self) -> dict[bytes, list[bytes]]:
        return {b"Authorization": [b"Bearer sk-team-a-0001"]}

    @inlineCallbacks
    def test_counts(self) -> Any:
        """
        A non-streamed answer, a stream with C{include_usage} and one
        without it (the gateway asks the engine for usage) count their
        prompt and completion tokens under the key and model; the fourth
        request in the minute is a 429 that OpenAI's error shape carries.
        """
        r = yield self.h.chat(headers=self.auth())
        whole = yield r.json()
        self.assertEqual(r.code, 200)
        r = yield self.h.chat(headers=self.auth(), extra={"stream": True, "stream_options": {"include_usage": True}})
        text = yield treq.text_content(r)
        self.assertIn('"usage"', text)
        r = yield self.h.chat(headers=self.auth(), extra={"stream": True})
        yield treq.text_content(r)
        row = self.h.gateway.usage.row("team-a", "demo")
        prompt = whole["usage"]["prompt_tokens"]
        self.assertEqual(whole["usage"]["completion_tokens"], 4)
        self.assertEqual(
            (row.requests, row.prompt_tokens, row.completion_tokens, row.unreported), (3, 3 * prompt, 12, 0)
        )
        r = yield self.h.chat(headers=self.auth())
        body = yield r.json()
        self.assertEqual(r.code, 429)
        # 20 s to refill one request, less what the test took.
        self.assertIn(int(r.headers.getRawHeaders(b"retry-after")[0]), range(15, 21))
        self.assertEqual(body["error"]["code"], "rate_limit_exceeded")
        self.assertEqual(row.limited_requests, 1)

    @inlineCallbacks
    def test_anonymous(self) -> Any:
        """
        A gateway without API keys counts under L{ANONYMOUS}.
        """
        h = Harness(self)
        h.fakemodel("r1", model="demo", tokens=3)
        r = yield h.chat()
        yield r.json()
        snap = h.gateway.usage.snapshot()
        self.assertEqual([(u["key"], u["model"], u["requests"], u["completion_tokens"]) for u in snap["usage"]],
                         [(ANONYMOUS, "demo", 1, 3)])
        self.assertEqual(snap["limits"], [])
