"""
Token limits bind streaming clients (llmgw.gateway.usage, llmgw.gateway.proxy):
a streamed completion whose client did not ask for usage is sent on asking
for it, and its usage chunk kept from the client; a stream without usage
is counted from its chunks. Pure functions, the meter, the gateway's front
in memory with its replica answered by the test, and a real gateway on
loopback in front of the project's fake model server.
"""

from __future__ import annotations

import json
from typing import Any

import treq
from twisted.internet.defer import inlineCallbacks
from twisted.internet.error import ConnectionLost
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmgw.gateway.errors import GatewayError
from llmgw.gateway.follower import RoutingSnapshot
from llmgw.gateway.keys import KeyRing
from llmgw.gateway.proxy import Gateway, GatewayConfig
from llmgw.gateway.resource import GatewayResource, GatewaySite
from llmgw.gateway.usage import (
    INCLUDE_USAGE,
    MAX_EVENT,
    SCAN_BUDGET,
    KeyLimits,
    Usage,
    ask_for_usage,
    count_streamed,
    drop_usage_events,
)
from llmgw.routing import Route
from tests.gateway_helpers import Harness
from tests.test_gateway_resource import parse, post

USAGE = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}


def event(**fields: Any) -> bytes:
    doc = {"id": "c1", "object": "chat.completion.chunk", "model": "demo", **fields}
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def content(text: str) -> bytes:
    return event(choices=[{"index": 0, "delta": {"content": text}, "finish_reason": None}])


DONE = b"data: [DONE]\n\n"
USAGE_EVENT = event(choices=[], usage=USAGE)


def asked(body: dict[str, Any], **dumps: Any) -> dict[str, Any] | None:
    raw = ask_for_usage(json.dumps(body, **dumps).encode())
    return None if raw is None else json.loads(raw)  # type: ignore[no-any-return]


class AskForUsageTests(SynchronousTestCase):
    def test_streamed_without_options(self) -> None:
        """
        A streamed request that sets no C{stream_options} gets
        C{include_usage} added first in its object, whatever the place of
        C{"stream"} and the spacing; everything else is as the client sent
        it, byte for byte.
        """
        for body in (
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True},
            {"stream": True, "model": "m"},
            {"model": "m", "stream": True, "max_tokens": 3, "tools": [{"a": [1, {"b": "]}"}]}]},
        ):
            for dumps in ({}, {"separators": (",", ":")}, {"indent": 2}):
                raw = json.dumps(body, **dumps).encode()
                out = ask_for_usage(raw)
                assert out is not None
                self.assertEqual(json.loads(out), {"stream_options": {"include_usage": True}, **body})
                self.assertEqual(out.replace(INCLUDE_USAGE, b"", 1), raw)

    def test_left_alone(self) -> None:
        """
        A body is left alone (C{None}) when it does not stream, when the
        client set C{stream_options} (even without C{include_usage}), and
        when C{"stream": true} is only nested or inside a string: an engine
        refuses C{stream_options} on a request that does not stream.
        """
        for body in (
            {"model": "m", "messages": []},
            {"model": "m", "stream": False},
            {"model": "m", "stream": True, "stream_options": {"include_usage": False}},
            {"model": "m", "stream": True, "stream_options": {"include_usage": True}},
            {"model": "m", "metadata": {"stream": True}},
            {"model": "m", "tools": [{"stream": True}], "stream": False},
            {"model": "m", "messages": [{"content": '", "stream": true, "x": "'}]},
            {"model": "m", "messages": [{"content": '{"stream": true}'}]},
        ):
            self.assertIsNone(asked(body), body)
        self.assertEqual(asked({"model": "m", "metadata": {"stream": True}, "stream": True}),
                         {"stream_options": {"include_usage": True}, "model": "m",
                          "metadata": {"stream": True}, "stream": True})

    def test_bounded(self) -> None:
        """
        A large body is decided from the shorter side of its C{"stream"}
        key: a huge prompt before it and little after is asked for; one
        with more than L{SCAN_BUDGET} bytes on both sides is left alone
        rather than scanned.
        """
        big = [{"role": "user", "content": "x" * 100}] * (SCAN_BUDGET // 50)
        self.assertIsNotNone(asked({"model": "m", "messages": big, "stream": True}))
        self.assertIsNotNone(asked({"stream": True, "model": "m", "messages": big}))
        self.assertIsNone(asked({"model": "m", "messages": big, "stream": True, "tools": big}))


class CountTests(SynchronousTestCase):
    def test_count_streamed(self) -> None:
        """
        Each generated string counts a token per four bytes, at least one;
        empty strings, roles, finish chunks and usage count nothing; text
        completions, reasoning and tool-call arguments count too.
        """
        self.assertEqual(count_streamed(content("")), 0)
        self.assertEqual(count_streamed(content("a") + content(" the") + content("x" * 20)), 1 + 1 + 5)
        self.assertEqual(count_streamed(event(choices=[{"delta": {"role": "assistant"}}])), 0)
        self.assertEqual(count_streamed(USAGE_EVENT + DONE), 0)
        self.assertEqual(count_streamed(event(choices=[{"text": "hello"}])), 1)
        self.assertEqual(count_streamed(event(choices=[{"delta": {"reasoning_content": "hmm"}}])), 1)
        call = {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]}
        # 22 bytes as sent, escapes included.
        self.assertEqual(count_streamed(event(choices=[{"delta": call}])), 5)

    def test_drop_usage_events(self) -> None:
        """
        Only the usage-only chunk (C{"choices": []}) is taken out; a chunk
        with choices and usage beside them stays, as do C{"usage": null}s.
        """
        first = content("a")
        self.assertEqual(drop_usage_events(first + USAGE_EVENT + DONE), first + DONE)
        self.assertEqual(drop_usage_events(USAGE_EVENT), b"")
        crlf = USAGE_EVENT.replace(b"\n\n", b"\r\n\r\n")
        self.assertEqual(drop_usage_events(first + crlf + DONE), first + DONE)
        beside = event(choices=[{"delta": {"content": "a"}}], usage=USAGE)
        nulls = event(choices=[{"delta": {"content": "a"}}], usage=None)
        self.assertEqual(drop_usage_events(nulls + beside + DONE), nulls + beside + DONE)


class MeterTests(SynchronousTestCase):
    def meter(self, asked: bool, limits: KeyLimits | None = None) -> Any:
        self.usage = Usage(Clock(), {"k": limits} if limits else None)
        meter = self.usage.admit("k", "demo")
        meter.asked = asked
        meter.stream = True
        return meter

    def test_asked_drops_usage_counts_once(self) -> None:
        """
        In a stream the gateway asked usage for, the client gets every byte
        but the usage chunk, in any split of the pieces; an unfinished event
        waits for its end; the tokens counted are the usage's, not the
        chunks' as well.
        """
        stream = content("Hello") + content(" world") + USAGE_EVENT + DONE
        for cut in range(1, len(stream), 7):
            meter = self.meter(asked=True)
            out = meter.feed(stream[:cut]) + meter.feed(stream[cut:]) + meter.flush()
            self.assertEqual(out, content("Hello") + content(" world") + DONE)
            meter.finish(200)
            row = self.usage.row("k", "demo")
            self.assertEqual((row.prompt_tokens, row.completion_tokens, row.estimated, row.unreported),
                             (7, 5, 0, 0))

    def test_not_asked_passes_every_byte(self) -> None:
        """
        In a stream the client asked usage for itself, every piece goes on
        at once and unchanged, usage chunk included, and only the usage
        counts.
        """
        meter = self.meter(asked=False)
        stream = content("Hello") + USAGE_EVENT + DONE
        pieces = [stream[:10], stream[10:60], stream[60:]]
        self.assertEqual([meter.feed(p) for p in pieces], pieces)
        self.assertEqual(meter.flush(), b"")
        meter.finish(200)
        row = self.usage.row("k", "demo")
        self.assertEqual((row.prompt_tokens, row.completion_tokens, row.estimated), (7, 5, 0))

    def test_no_usage_counts_chunks_and_limits(self) -> None:
        """
        A stream that ends without usage counts its chunks' tokens (as
        estimated), and they bind the key's token limit: the next request
        is refused; one cut short counts what came.
        """
        meter = self.meter(asked=True, limits=KeyLimits(tokens_per_minute=50))
        for _ in range(60):
            meter.feed(content("word"))
        meter.feed(DONE)
        meter.finish(200)
        row = self.usage.row("k", "demo")
        self.assertEqual((row.completion_tokens, row.estimated, row.unreported), (60, 1, 0))
        self.assertRaises(GatewayError, self.usage.admit, "k", "demo")
        self.assertEqual(row.limited_tokens, 1)

    def test_long_event_is_let_go(self) -> None:
        """
        An unfinished event is held at most L{MAX_EVENT} bytes: past that
        its bytes go on to the client rather than wait.
        """
        meter = self.meter(asked=True)
        self.assertEqual(meter.feed(b"data: " + b"x" * 100), b"")
        out = meter.feed(b"x" * MAX_EVENT)
        self.assertEqual(len(out), 106 + MAX_EVENT)
        self.assertEqual(meter.held, b"")


UPSTREAM_SSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
UPSTREAM_SSE_LENGTH = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nContent-Length: %d\r\n\r\n"
)


def chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class FrontTests(SynchronousTestCase):
    """
    The gateway's front in memory, its replica answered by the test.
    """

    def setUp(self) -> None:
        self.clock = MemoryReactorClock()
        keys = KeyRing({"team-a": "sk-team-a-0001"}, {"team-a": KeyLimits(tokens_per_minute=50)})
        table = RoutingSnapshot([Route("r1", "demo", "10.0.0.9:8000")], ["demo"])
        self.gateway = Gateway(self.clock, table, GatewayConfig(), keys=keys)
        self.site = GatewaySite(GatewayResource(self.gateway))

    def request(self, body: dict[str, Any]) -> tuple[StringTransport, StringTransport, Any]:
        proto = self.site.buildProtocol(None)
        client = StringTransport()
        proto.makeConnection(client)
        proto.dataReceived(post(json.dumps(body).encode(), extra=b"Authorization: Bearer sk-team-a-0001\r\n"))
        _, _, factory, _, _ = self.clock.tcpClients[-1]
        conn = factory.buildProtocol(None)
        upstream = StringTransport()
        conn.makeConnection(upstream)
        return client, upstream, conn

    def test_asks_and_drops(self) -> None:
        """
        A streamed request without C{stream_options} reaches the replica
        asking for usage (its Content-Length the new body's); the client
        gets the stream without the usage chunk, byte for byte otherwise;
        the usage counts, and the key, now over its 50 tokens a minute, is
        refused its next request with 429.
        """
        body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        client, upstream, conn = self.request(body)
        sent = upstream.value()
        head, _, forwarded = sent.partition(b"\r\n\r\n")
        self.assertEqual(json.loads(forwarded), {"stream_options": {"include_usage": True}, **body})
        self.assertIn(b"content-length: %d\r\n" % len(forwarded), head.lower())
        events = [content("word") for _ in range(3)] + [
            event(choices=[], usage={"prompt_tokens": 40, "completion_tokens": 30}), DONE]
        conn.dataReceived(UPSTREAM_SSE)
        for e in events:
            conn.dataReceived(chunked(e))
        conn.dataReceived(b"0\r\n\r\n")
        status, _, got = parse(client.value())
        self.assertEqual((status, got), (200, b"".join(events[:3]) + DONE))
        row = self.gateway.usage.row("team-a", "demo")
        self.assertEqual((row.prompt_tokens, row.completion_tokens, row.estimated), (40, 30, 0))
        refused, _, _ = parse(self.request_refused(body))
        self.assertEqual(refused, 429)

    def request_refused(self, body: dict[str, Any]) -> bytes:
        proto = self.site.buildProtocol(None)
        client = StringTransport()
        proto.makeConnection(client)
        connects = len(self.clock.tcpClients)
        proto.dataReceived(post(json.dumps(body).encode(), extra=b"Authorization: Bearer sk-team-a-0001\r\n"))
        self.assertEqual(len(self.clock.tcpClients), connects)
        return client.value()

    def test_length_framed_stream_is_rechunked(self) -> None:
        """
        A stream the replica framed with Content-Length (relayed as it
        came otherwise) goes to the client chunked when a chunk may be
        taken out of it, so that its framing holds.
        """
        client, _, conn = self.request({"model": "demo", "stream": True, "messages": []})
        stream = content("a") + USAGE_EVENT + DONE
        conn.dataReceived(UPSTREAM_SSE_LENGTH % len(stream) + stream)
        status, headers, got = parse(client.value())
        self.assertEqual((status, dict(headers).get(b"transfer-encoding"), got), (200, b"chunked", content("a") + DONE))

    def test_client_asked_gets_its_usage(self) -> None:
        """
        A client that asked for usage itself gets the request forwarded
        unchanged and the whole stream, usage chunk included; the usage
        counts once.
        """
        body = {"model": "demo", "stream": True, "stream_options": {"include_usage": True}, "messages": []}
        client, upstream, conn = self.request(body)
        self.assertEqual(upstream.value().partition(b"\r\n\r\n")[2], json.dumps(body).encode())
        stream = content("word") * 4 + USAGE_EVENT + DONE
        conn.dataReceived(UPSTREAM_SSE + chunked(stream) + b"0\r\n\r\n")
        self.assertEqual(parse(client.value())[2], stream)
        row = self.gateway.usage.row("team-a", "demo")
        self.assertEqual((row.prompt_tokens, row.completion_tokens, row.estimated), (7, 5, 0))

    def test_cut_short_counts(self) -> None:
        """
        A stream the replica breaks off (the client gets an unfinished
        response) still counts the chunks that came, and binds the limit.
        """
        client, _, conn = self.request({"model": "demo", "stream": True, "messages": []})
        conn.dataReceived(UPSTREAM_SSE + chunked(content("word") * 60))
        conn.connectionLost(Failure(ConnectionLost()))
        row = self.gateway.usage.row("team-a", "demo")
        self.assertEqual((row.completion_tokens, row.estimated), (60, 1))
        self.assertEqual(parse(self.request_refused({"model": "demo", "messages": []}))[0], 429)

    def test_non_streamed_unchanged(self) -> None:
        """
        A request that does not stream is forwarded byte for byte, and its
        answer's usage counts as before.
        """
        body = {"model": "demo", "messages": [], "stream": False}
        client, upstream, conn = self.request(body)
        self.assertEqual(upstream.value().partition(b"\r\n\r\n")[2], json.dumps(body).encode())
        answer = json.dumps({"choices": [], "usage": USAGE}).encode()
        conn.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                          % (len(answer), answer))
        self.assertEqual(parse(client.value())[2], answer)
        row = self.gateway.usage.row("team-a", "demo")
        self.assertEqual((row.prompt_tokens, row.completion_tokens), (7, 5))


def events_of(text: str) -> list[Any]:
    """
    A stream's events as JSON, with what differs between two replies (ids,
    times) left out.
    """
    out: list[Any] = []
    for block in text.split("\n\n"):
        if not block:
            continue
        data = block.removeprefix("data: ")
        if data == "[DONE]":
            out.append(data)
            continue
        doc = json.loads(data)
        doc.pop("id", None)
        doc.pop("created", None)
        out.append(doc)
    return out


class LoopbackTests(TestCase):
    """
    A real gateway on loopback in front of the project's fake model server.
    """

    timeout = 20

    def setUp(self) -> None:
        keys = KeyRing({"team-a": "sk-team-a-0001"}, {"team-a": KeyLimits(tokens_per_minute=50)})
        self.h = Harness(self, keys=keys)

    def auth(self) -> dict[bytes, list[bytes]]:
        return {b"Authorization": [b"Bearer sk-team-a-0001"]}

    @inlineCallbacks
    def direct(self, server: Any, extra: dict[str, Any]) -> Any:
        body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], **extra}
        r = yield treq.post(f"http://{server.address()}/v1/chat/completions", json.dumps(body).encode(),
                            headers={b"Content-Type": [b"application/json"]}, pool=self.h.pool)
        text = yield treq.text_content(r)
        return text

    @inlineCallbacks
    def test_without_include_usage(self) -> Any:
        """
        A key limited to 50 tokens a minute streams 60 tokens without
        C{include_usage}: the client's events are the engine's, less the
        usage chunk it did not ask for; the tokens count, from the engine's
        usage; the key's next request is refused with 429.
        """
        server = self.h.fakemodel("r1", model="demo", tokens=60)
        r = yield self.h.chat(headers=self.auth(), extra={"stream": True})
        text = yield treq.text_content(r)
        self.assertEqual(r.code, 200)
        plain = yield self.direct(server, {"stream": True})
        self.assertEqual(events_of(text), events_of(plain))
        self.assertNotIn('"usage"', text)
        row = self.h.gateway.usage.row("team-a", "demo")
        self.assertEqual((row.completion_tokens, row.estimated, row.unreported), (60, 0, 0))
        self.assertGreater(row.prompt_tokens, 0)
        r = yield self.h.chat(headers=self.auth(), extra={"stream": True})
        body = yield r.json()
        self.assertEqual((r.code, body["error"]["type"]), (429, "tokens"))

    @inlineCallbacks
    def test_with_include_usage(self) -> Any:
        """
        A client that asks for usage gets the engine's stream with its
        usage chunk, and the tokens count once.
        """
        server = self.h.fakemodel("r1", model="demo", tokens=6)
        extra = {"stream": True, "stream_options": {"include_usage": True}}
        r = yield self.h.chat(headers=self.auth(), extra=extra)
        text = yield treq.text_content(r)
        plain = yield self.direct(server, extra)
        self.assertEqual(events_of(text), events_of(plain))
        got = events_of(text)[-2]
        self.assertEqual(got["usage"]["completion_tokens"], 6)
        row = self.h.gateway.usage.row("team-a", "demo")
        self.assertEqual((row.prompt_tokens, row.completion_tokens, row.estimated),
                         (got["usage"]["prompt_tokens"], 6, 0))

    @inlineCallbacks
    def test_engine_without_usage(self) -> Any:
        """
        An engine that ignores C{stream_options}: the stream counts from
        its chunks (as estimated), the client gets it unchanged, and the
        key is limited all the same.
        """
        server = self.h.fakemodel("r1", model="demo", tokens=60, stream_usage=False)
        r = yield self.h.chat(headers=self.auth(), extra={"stream": True})
        text = yield treq.text_content(r)
        plain = yield self.direct(server, {"stream": True})
        self.assertEqual(events_of(text), events_of(plain))
        row = self.h.gateway.usage.row("team-a", "demo")
        self.assertEqual((row.prompt_tokens, row.completion_tokens, row.estimated, row.unreported), (0, 60, 1, 0))
        r = yield self.h.chat(headers=self.auth())
        yield r.json()
        self.assertEqual(r.code, 429)
