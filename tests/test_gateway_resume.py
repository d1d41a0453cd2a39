"""
Streams that outlive their replica (llmgw.gateway.resume): a streamed
completion whose replica fails mid-answer goes on on another replica, and
the client sees one stream. The gateway's front in memory, its replicas
answered by the test.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.error import ConnectionLost
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from llmgw.gateway.proxy import Gateway, GatewayConfig
from llmgw.gateway.resource import GatewayResource, GatewaySite
from llmgw.gateway.resume import StreamResume
from llmgw.routing import Route, RoutingSnapshot, snapshot_from_json, snapshot_to_json
from tests.test_gateway_resource import parse, post
from tests.test_gateway_stream_usage import UPSTREAM_SSE, chunked

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
DONE = b"data: [DONE]\n\n"
HI = [{"role": "user", "content": "hi"}]


def chat_event(cid: str, created: int, delta: dict[str, Any], finish: str | None = None,
               usage: dict[str, int] | None = None) -> bytes:
    doc: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": "demo",
                           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        doc["usage"] = usage
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def text_event(cid: str, created: int, text: str, finish: str | None = None, **extra: Any) -> bytes:
    doc = {"id": cid, "object": "text_completion", "created": created, "model": "demo",
           "choices": [{"index": 0, "text": text, "finish_reason": finish, **extra}]}
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def client_text(body: bytes) -> tuple[str, list[dict[str, Any]], int]:
    """
    The text a client reads from a stream, its chunks, and its [DONE]s.
    """
    docs = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            docs.append(json.loads(line[6:]))
    text = ""
    for d in docs:
        for c in d.get("choices", []):
            text += (c.get("delta", {}).get("content") or "") if "delta" in c else c.get("text", "")
    return text, docs, body.count(DONE)


class ResumeFrontTests(SynchronousTestCase):
    """
    The front and the proxy in memory; three replicas of one model.
    """

    def setUp(self) -> None:
        self.clock = MemoryReactorClock()
        self.routes = [Route(f"r{i}", "demo", f"10.0.0.{i}:8000") for i in (1, 2, 3)]
        self.config = GatewayConfig()

    def start(self, body: dict[str, Any], path: str = CHAT, resume: bool = True) -> tuple[StringTransport, Any]:
        routes = [Route(r.replica_id, r.model, r.address, resume=resume) for r in self.routes]
        self.gateway = Gateway(self.clock, RoutingSnapshot(routes, ["demo"]), self.config)
        site = GatewaySite(GatewayResource(self.gateway))
        proto = site.buildProtocol(None)
        client = StringTransport()
        proto.makeConnection(client)
        proto.dataReceived(post(json.dumps(body).encode(), path=path.encode()))
        return client, self.upstream()

    def upstream(self) -> tuple[StringTransport, Any]:
        _, _, factory, _, _ = self.clock.tcpClients[-1]
        conn = factory.buildProtocol(None)
        transport = StringTransport()
        conn.makeConnection(transport)
        return transport, conn

    def sent(self, transport: StringTransport) -> dict[str, Any]:
        return json.loads(transport.value().partition(b"\r\n\r\n")[2])  # type: ignore[no-any-return]

    def die(self, conn: Any) -> None:
        conn.connectionLost(Failure(ConnectionLost("the replica died")))

    def resumes(self, outcome: str) -> float:
        value = self.gateway.registry.get_sample_value(
            "llmgw_gateway_stream_resumes_total", {"model": "demo", "outcome": outcome})
        return value or 0.0

    def test_chat_one_stream(self) -> None:
        """
        A chat stream whose replica dies after two tokens goes on on
        another replica, sent the partial answer as a final assistant
        message to continue with C{max_tokens} less the two; the client
        gets one stream: the first answer's id and created throughout, one
        role chunk, the text once and whole, the finish reason from the end, one
        usage (the original prompt's tokens, all completion tokens) and
        one [DONE].
        """
        body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "max_tokens": 10, "stream_options": {"include_usage": True}}
        client, (up1, conn1) = self.start(body)
        conn1.dataReceived(UPSTREAM_SSE + chunked(
            chat_event("c1", 100, {"role": "assistant", "content": None})
            + chat_event("c1", 100, {"content": "Hello"}) + chat_event("c1", 100, {"content": " wor"})))
        self.die(conn1)
        up2, conn2 = self.upstream()
        sent = self.sent(up2)
        self.assertEqual(sent["messages"][-1], {"role": "assistant", "content": "Hello wor"})
        self.assertEqual((sent["continue_final_message"], sent["add_generation_prompt"], sent["max_tokens"]),
                         (True, False, 8))
        self.assertEqual(sent["messages"][:-1], body["messages"])
        conn2.dataReceived(UPSTREAM_SSE + chunked(
            chat_event("c2", 200, {"role": "assistant", "content": None})
            + chat_event("c2", 200, {"content": "ld"}) + chat_event("c2", 200, {"content": "!"})
            + chat_event("c2", 200, {}, "stop")
            + b'data: {"id":"c2","created":200,"choices":[],"usage":{"prompt_tokens":9,'
              b'"completion_tokens":2,"total_tokens":11}}\n\n' + DONE) + b"0\r\n\r\n")
        status, _, got = parse(client.value())
        text, docs, dones = client_text(got)
        self.assertEqual((status, text, dones), (200, "Hello world!", 1))
        self.assertEqual({(d["id"], d["created"]) for d in docs}, {("c1", 100)})
        roles = [d for d in docs if d["choices"] and "role" in d["choices"][0]["delta"]]
        self.assertEqual(len(roles), 1)
        self.assertEqual([d["choices"][0]["finish_reason"] for d in docs if d["choices"]][-1], "stop")
        self.assertEqual(docs[-1]["usage"], {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11})
        row = self.gateway.usage.row(None, "demo")
        self.assertEqual((row.requests, row.prompt_tokens, row.completion_tokens), (1, 7, 4))
        self.assertEqual(self.resumes("resumed"), 1)

    def test_chat_without_echo(self) -> None:
        """
        A continuation that does not repeat the partial answer is passed on
        whole, even when its first text is a prefix of the partial answer.
        """
        client, (_, conn1) = self.start({"model": "demo", "messages": HI, "stream": True})
        conn1.dataReceived(UPSTREAM_SSE + chunked(
            chat_event("c1", 1, {"role": "assistant", "content": ""}) + chat_event("c1", 1, {"content": "ab"})))
        self.die(conn1)
        _, conn2 = self.upstream()
        conn2.dataReceived(UPSTREAM_SSE + chunked(
            chat_event("c2", 2, {"content": "a"}) + chat_event("c2", 2, {"content": "c"})
            + chat_event("c2", 2, {}, "length") + DONE) + b"0\r\n\r\n")
        self.assertEqual(client_text(parse(client.value())[2])[0], "abac")

    def test_chat_answer_beginning_like_its_part(self) -> None:
        """
        A continuation whose new text begins with the whole partial answer
        (a model repeating itself: " the the" then " the the reply") is
        passed on whole: the engines run stream only new text, so it is
        not taken for an echo.
        """
        client, (_, conn1) = self.start({"model": "demo", "messages": HI, "stream": True})
        conn1.dataReceived(UPSTREAM_SSE + chunked(
            chat_event("c1", 1, {"role": "assistant", "content": None})
            + chat_event("c1", 1, {"content": " the"}) + chat_event("c1", 1, {"content": " the"})))
        self.die(conn1)
        _, conn2 = self.upstream()
        conn2.dataReceived(UPSTREAM_SSE + chunked(
            chat_event("c2", 2, {"content": " the"}) + chat_event("c2", 2, {"content": " the"})
            + chat_event("c2", 2, {"content": " reply"}) + chat_event("c2", 2, {}, "length") + DONE)
            + b"0\r\n\r\n")
        self.assertEqual(client_text(parse(client.value())[2])[0], " the the the the reply")

    def test_echo_left_out_for_an_echoing_engine(self) -> None:
        """
        For an engine that repeats the partial answer first (C{echoes}),
        the repeat is left out, however it is split into chunks, and the
        text after it is passed on.
        """
        record = StreamResume(CHAT, json.dumps({"messages": HI, "stream": True}).encode(), echoes=True)
        record.feed(chat_event("c1", 1, {"role": "assistant", "content": None})
                    + chat_event("c1", 1, {"content": "Hello"}) + chat_event("c1", 1, {"content": " wor"}))
        record.begin()
        out = record.feed(chat_event("c2", 2, {"content": "Hel"}) + chat_event("c2", 2, {"content": "lo wor"})
                          + chat_event("c2", 2, {"content": "ld"}) + chat_event("c2", 2, {}, "stop") + DONE)
        self.assertEqual(client_text(out + record.flush())[0], "ld")

    def test_completions_logprob_ids(self) -> None:
        """
        A text completion whose chunks carry their tokens' ids in
        C{logprobs.content} (llama.cpp, when the client asked for
        logprobs) is continued token-exact: the prompt, then those ids.
        """
        body = {"model": "demo", "prompt": "Once", "stream": True, "max_tokens": 5, "logprobs": 1}
        client, (_, conn1) = self.start(body, path=TEXT)

        def lp(i: int, token: str) -> dict[str, Any]:
            return {"content": [{"id": i, "token": token, "logprob": -0.1, "top_logprobs": []}]}

        conn1.dataReceived(UPSTREAM_SSE + chunked(
            text_event("t1", 5, " upon", logprobs=lp(11, " upon")) + text_event("t1", 5, " a", logprobs=lp(12, " a"))))
        self.die(conn1)
        up2, conn2 = self.upstream()
        sent = self.sent(up2)
        self.assertEqual((sent["prompt"], sent["max_tokens"]), (["Once", 11, 12], 3))

    def test_completions_token_ids(self) -> None:
        """
        A text completion whose chunks carry token ids is continued
        token-exact: the prompt, then the ids so far; C{max_tokens} less
        the tokens sent; the client's text is each token once.
        """
        body = {"model": "demo", "prompt": "Once", "stream": True, "max_tokens": 5}
        client, (_, conn1) = self.start(body, TEXT)
        conn1.dataReceived(UPSTREAM_SSE + chunked(
            text_event("t1", 5, " upon", tokens=[11]) + text_event("t1", 5, " a", tokens=[12])))
        self.die(conn1)
        up2, conn2 = self.upstream()
        sent = self.sent(up2)
        self.assertEqual((sent["prompt"], sent["max_tokens"]), (["Once", 11, 12], 3))
        conn2.dataReceived(UPSTREAM_SSE + chunked(
            text_event("t2", 6, " time", tokens=[13]) + text_event("t2", 6, "", "length") + DONE) + b"0\r\n\r\n")
        text, docs, dones = client_text(parse(client.value())[2])
        self.assertEqual((text, dones, {d["id"] for d in docs}), (" upon a time", 1, {"t1"}))

    def test_completions_text(self) -> None:
        """
        Without token ids a text completion is continued from the prompt
        and the text so far.
        """
        client, (_, conn1) = self.start({"model": "demo", "prompt": "Once", "stream": True}, TEXT)
        conn1.dataReceived(UPSTREAM_SSE + chunked(text_event("t1", 5, " upon")))
        self.die(conn1)
        up2, _ = self.upstream()
        self.assertEqual(self.sent(up2)["prompt"], "Once upon")

    def test_migration_limit(self) -> None:
        """
        A stream is continued at most C{max_stream_resumes} times; the next
        failure breaks it off as before (an unfinished response).
        """
        self.config = GatewayConfig(max_stream_resumes=1)
        client, (_, conn1) = self.start({"model": "demo", "messages": HI, "stream": True})
        conn1.dataReceived(UPSTREAM_SSE + chunked(chat_event("c1", 1, {"content": "a"})))
        self.die(conn1)
        connects = len(self.clock.tcpClients)
        _, conn2 = self.upstream()
        conn2.dataReceived(UPSTREAM_SSE + chunked(chat_event("c2", 1, {"content": "b"})))
        self.die(conn2)
        self.assertEqual(len(self.clock.tcpClients), connects)
        self.assertTrue(client.disconnecting or client.disconnected)
        self.assertEqual((self.resumes("resumed"), self.resumes("limit")), (1, 1))

    def test_text_cap(self) -> None:
        """
        A stream whose text passed C{max_resume_text} bytes is not
        continued.
        """
        self.config = GatewayConfig(max_resume_text=4)
        client, (_, conn1) = self.start({"model": "demo", "messages": HI, "stream": True})
        conn1.dataReceived(UPSTREAM_SSE + chunked(chat_event("c1", 1, {"content": "abcde"})))
        connects = len(self.clock.tcpClients)
        self.die(conn1)
        self.assertEqual(len(self.clock.tcpClients), connects)
        self.assertEqual(self.resumes("limit"), 1)

    def test_off_per_deployment(self) -> None:
        """
        A deployment with C{resume_streams = false} (its routes'
        C{resume}) breaks the stream off as before, and the switch travels
        in the routes document a standalone gateway reads.
        """
        client, (_, conn1) = self.start({"model": "demo", "messages": HI, "stream": True}, resume=False)
        conn1.dataReceived(UPSTREAM_SSE + chunked(chat_event("c1", 1, {"content": "a"})))
        connects = len(self.clock.tcpClients)
        self.die(conn1)
        self.assertEqual(len(self.clock.tcpClients), connects)
        self.assertTrue(client.disconnecting or client.disconnected)
        doc = snapshot_to_json(RoutingSnapshot([Route("r", "demo", "h:1", resume=False),
                                                Route("s", "demo", "h:2")], ["demo"]), 0.0)
        snap, problems = snapshot_from_json(json.loads(json.dumps(doc)), 0.0)
        self.assertEqual(([r.resume for r in snap.routes("demo")], problems), ([False, True], []))

    def test_after_the_end(self) -> None:
        """
        A replica that fails after the finish chunk is not asked again: the
        stream ends with its one [DONE].
        """
        client, (_, conn1) = self.start({"model": "demo", "messages": HI, "stream": True})
        conn1.dataReceived(UPSTREAM_SSE + chunked(
            chat_event("c1", 1, {"content": "a"}) + chat_event("c1", 1, {}, "stop")))
        connects = len(self.clock.tcpClients)
        self.die(conn1)
        self.assertEqual(len(self.clock.tcpClients), connects)
        status, _, got = parse(client.value())
        self.assertEqual((status, client_text(got)[0], got.count(DONE)), (200, "a", 1))
        self.assertEqual(self.resumes("finished"), 1)

    def test_not_streamed_unchanged(self) -> None:
        """
        A request that does not stream is untouched: a replica that breaks
        off its JSON answer breaks the client's response.
        """
        client, (_, conn1) = self.start({"model": "demo", "messages": HI})
        conn1.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 50\r\n\r\n{\"id\"")
        connects = len(self.clock.tcpClients)
        self.die(conn1)
        self.assertEqual(len(self.clock.tcpClients), connects)
        self.assertTrue(client.disconnecting or client.disconnected)

    def test_no_other_replica(self) -> None:
        """
        With no other replica to go on on, the stream breaks off as before.
        """
        self.routes = self.routes[:1]
        client, (_, conn1) = self.start({"model": "demo", "messages": HI, "stream": True})
        conn1.dataReceived(UPSTREAM_SSE + chunked(chat_event("c1", 1, {"content": "a"})))
        self.die(conn1)
        self.assertTrue(client.disconnecting or client.disconnected)
        self.assertEqual(self.resumes("no_replica"), 1)


class StreamResumeTests(SynchronousTestCase):
    def test_tool_calls_not_resumable(self) -> None:
        """
        An answer that streams tool calls cannot be continued.
        """
        r = StreamResume(CHAT, b'{"messages":[]}')
        r.feed(chat_event("c", 1, {"tool_calls": [{"index": 0}]}))
        self.assertEqual(r.next_step()[0], "not_resumable")

    def test_split_events(self) -> None:
        """
        Events split across reads are recorded once whole, and the first
        answer's bytes pass unchanged.
        """
        r = StreamResume(CHAT, b'{"messages":[]}')
        e = chat_event("c", 1, {"content": "xy"})
        self.assertEqual(r.feed(e[:10]) + r.feed(e[10:]), e)
        self.assertEqual(("".join(r.text), r.tokens), ("xy", 1))

    def test_events_that_are_not_objects_pass(self) -> None:
        """
        An event whose data is JSON but not an object (a number, a list)
        passes through unchanged and records nothing (compiled, it once
        raised).
        """
        r = StreamResume(CHAT, b'{"messages":[]}')
        self.assertEqual(r.feed(b"data: 1\n\ndata: [1, 2]\n\n"), b"data: 1\n\ndata: [1, 2]\n\n")
        self.assertEqual((r.text, r.tokens), ([], 0))


class DeploymentSwitchTests(SynchronousTestCase):
    def test_catalog_to_routes(self) -> None:
        """
        A deployment's C{resume_streams = false} reaches the routing
        table: its routes are published with C{resume} off, others' on; a
        value that is not true or false is refused, naming the field.
        """
        from twisted.internet.task import Clock

        from llmgw.control.core.catalog import CatalogError, parse_catalog
        from llmgw.routing import RoutingTable

        profiles = {"p": {"command": ["x"]}}
        catalog = parse_catalog({"profiles": profiles, "deployments": [
            {"model": "a", "profile": "p", "resume_streams": False}, {"model": "b", "profile": "p"}]})
        self.assertEqual(catalog.resume_off(), frozenset({"a"}))
        table = RoutingTable(Clock())
        table.resume_off_source = catalog.resume_off
        table.publish([Route("r1", "a", "h:1"), Route("r2", "b", "h:2")], ["a", "b"])
        table.publish_model("a", [Route("r3", "a", "h:3")])
        self.assertEqual([r.resume for r in table.routes("a")] + [r.resume for r in table.routes("b")],
                         [False, True])
        with self.assertRaises(CatalogError) as e:
            parse_catalog({"profiles": profiles, "deployments": [
                {"model": "a", "profile": "p", "resume_streams": "no"}]})
        self.assertIn("resume_streams", str(e.exception))
