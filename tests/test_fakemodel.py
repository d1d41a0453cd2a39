"""
Tests for L{llmgw.testing.fakemodel}, the fake model server test tool.
"""

from __future__ import annotations

import io
import json
import os
import sys
from typing import Any

import treq
from treq.testing import StubTreq
from twisted.internet import defer, utils
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase

import llmgw
from llmgw.testing import fakemodel
from llmgw.testing.fakemodel import FakeModelConfig, make_resource, reply_words

BASE = "http://fake.test"


def parse_sse(body: bytes) -> list[Any]:
    """
    The events of an SSE body: JSON documents, and the string C{[DONE]}.
    """
    events: list[Any] = []
    for block in body.split(b"\n\n"):
        if not block:
            continue
        assert block.startswith(b"data: "), block
        data = block[len(b"data: "):].decode()
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


class FakeModelTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1000)

    def stub(self, **kw: Any) -> StubTreq:
        kw.setdefault("model", "tiny")
        kw.setdefault("instance", "test-1")
        return StubTreq(make_resource(FakeModelConfig(**kw), self.clock))

    def get(self, stub: StubTreq, path: str) -> tuple[int, Any, Any]:
        response = self.successResultOf(stub.get(BASE + path))
        body = self.successResultOf(response.content())
        return response.code, json.loads(body), response

    def post(self, stub: StubTreq, path: str, body: Any, raw: bytes | None = None) -> tuple[int, Any]:
        data = raw if raw is not None else json.dumps(body).encode()
        response = self.successResultOf(
            stub.post(BASE + path, data=data, headers={b"content-type": [b"application/json"]})
        )
        stub.flush()
        return response.code, json.loads(self.successResultOf(response.content()))

    def test_health_during_startup_delay(self) -> None:
        """
        /health answers 503 until the start-up delay has passed on the clock,
        then 200.
        """
        stub = self.stub(startup_delay=5)
        code, body, _ = self.get(stub, "/health")
        self.assertEqual((code, body["status"]), (503, "starting"))
        self.clock.advance(4.9)
        self.assertEqual(self.get(stub, "/health")[0], 503)
        self.clock.advance(0.1)
        code, body, response = self.get(stub, "/health")
        self.assertEqual((code, body["status"]), (200, "ok"))
        self.assertEqual(response.headers.getRawHeaders(b"x-fakemodel-instance"), [b"test-1"])

    def test_api_refused_while_loading(self) -> None:
        """
        API calls before the start-up delay has passed get an OpenAI-shaped
        503.
        """
        stub = self.stub(startup_delay=5)
        code, body = self.post(stub, "/v1/chat/completions",
                               {"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
        self.assertEqual(code, 503)
        self.assertEqual(body["error"]["code"], "model_loading")

    def test_fail_health(self) -> None:
        """
        With fail_health, /health answers 503 even after start-up.
        """
        stub = self.stub(fail_health=True)
        self.assertEqual(self.get(stub, "/health")[0], 503)

    def test_models(self) -> None:
        """
        /v1/models lists the one model it serves.
        """
        code, body, _ = self.get(self.stub(), "/v1/models")
        self.assertEqual(code, 200)
        self.assertEqual(body["object"], "list")
        self.assertEqual([m["id"] for m in body["data"]], ["tiny"])

    def test_chat_whole(self) -> None:
        """
        A non-streaming chat completion has OpenAI's shape, the configured
        number of words, usage counts and finish_reason stop.
        """
        code, body = self.post(
            self.stub(tokens=5),
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}]},
        )
        self.assertEqual(code, 200)
        self.assertEqual(body["object"], "chat.completion")
        self.assertEqual(body["model"], "tiny")
        choice = body["choices"][0]
        self.assertEqual(choice["message"], {"role": "assistant", "content": "".join(reply_words(5))})
        self.assertEqual(choice["finish_reason"], "stop")
        self.assertEqual(body["usage"], {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7})

    def test_max_tokens(self) -> None:
        """
        max_tokens below the reply length cuts it and gives finish_reason
        length.
        """
        code, body = self.post(
            self.stub(tokens=5), "/v1/completions",
            {"model": "tiny", "prompt": "a b c", "max_tokens": 2},
        )
        self.assertEqual(code, 200)
        self.assertEqual(body["object"], "text_completion")
        self.assertEqual(body["choices"][0]["text"], "".join(reply_words(2)))
        self.assertEqual(body["choices"][0]["finish_reason"], "length")
        self.assertEqual(body["usage"]["completion_tokens"], 2)

    def test_whole_paced(self) -> None:
        """
        With a token rate, a non-streaming reply comes after tokens/rate
        seconds on the clock.
        """
        stub = self.stub(tokens=4, tokens_per_second=2)
        d = stub.post(BASE + "/v1/completions",
                      data=json.dumps({"model": "tiny", "prompt": "x"}).encode())
        stub.flush()
        self.assertNoResult(d)
        self.clock.advance(1.9)
        stub.flush()
        self.assertNoResult(d)
        self.clock.advance(0.1)
        stub.flush()
        body = self.successResultOf(self.successResultOf(d).content())
        self.assertEqual(json.loads(body)["usage"]["completion_tokens"], 4)

    def test_chat_stream_paced(self) -> None:
        """
        A streaming chat completion sends the role chunk at once, then one
        chunk per word at the configured pace, a final chunk with
        finish_reason, then [DONE].
        """
        stub = self.stub(tokens=3, tokens_per_second=10)
        d = stub.post(
            BASE + "/v1/chat/completions",
            data=json.dumps({"model": "tiny", "stream": True,
                             "messages": [{"role": "user", "content": "hi"}]}).encode(),
        )
        stub.flush()
        response = self.successResultOf(d)
        self.assertEqual(response.headers.getRawHeaders(b"content-type"), [b"text/event-stream"])
        chunks: list[bytes] = []
        done = treq.collect(response, chunks.append)
        stub.flush()
        self.assertEqual(len(parse_sse(b"".join(chunks))), 1)
        self.clock.advance(0.1)
        stub.flush()
        self.assertEqual(len(parse_sse(b"".join(chunks))), 2)
        self.assertNoResult(done)
        self.clock.advance(0.1)
        self.clock.advance(0.1)
        stub.flush()
        self.successResultOf(done)
        events = parse_sse(b"".join(chunks))
        self.assertEqual(events[-1], "[DONE]")
        docs = events[:-1]
        self.assertTrue(all(e["object"] == "chat.completion.chunk" for e in docs))
        self.assertEqual(docs[0]["choices"][0]["delta"], {"role": "assistant", "content": ""})
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in docs)
        self.assertEqual(text, "".join(reply_words(3)))
        self.assertEqual(docs[-1]["choices"][0]["finish_reason"], "stop")
        self.assertEqual(len({e["id"] for e in docs}), 1)

    def test_completion_stream_with_usage(self) -> None:
        """
        An unpaced streaming text completion sends every word at once and,
        with stream_options.include_usage, a usage chunk before [DONE].
        """
        stub = self.stub(tokens=4)
        d = stub.post(
            BASE + "/v1/completions",
            data=json.dumps({"model": "tiny", "prompt": "p", "stream": True,
                             "stream_options": {"include_usage": True}}).encode(),
        )
        stub.flush()
        self.clock.advance(0)
        stub.flush()
        events = parse_sse(self.successResultOf(self.successResultOf(d).content()))
        self.assertEqual(events[-1], "[DONE]")
        self.assertEqual(events[-2]["usage"]["completion_tokens"], 4)
        self.assertEqual(events[-2]["choices"], [])
        text = "".join(e["choices"][0]["text"] for e in events[:-2])
        self.assertEqual(text, "".join(reply_words(4)))

    def test_embeddings(self) -> None:
        """
        Embeddings come one per input, with the asked dimensions, and are the
        same for the same input.
        """
        stub = self.stub()
        code, body = self.post(stub, "/v1/embeddings",
                               {"model": "tiny", "input": ["a b", "c", "a b"], "dimensions": 4})
        self.assertEqual(code, 200)
        self.assertEqual(body["object"], "list")
        vectors = [d["embedding"] for d in body["data"]]
        self.assertEqual([len(v) for v in vectors], [4, 4, 4])
        self.assertEqual(vectors[0], vectors[2])
        self.assertNotEqual(vectors[0], vectors[1])
        self.assertEqual(body["usage"]["prompt_tokens"], 5)

    def test_malformed_bodies(self) -> None:
        """
        A body that is not JSON, not an object, or lacks required fields gets
        a 400 with an OpenAI-shaped error saying what was wrong.
        """
        stub = self.stub()
        cases: list[tuple[str, bytes, str]] = [
            ("/v1/chat/completions", b"{not json", "not valid JSON"),
            ("/v1/chat/completions", b"[1, 2]", "JSON object"),
            ("/v1/chat/completions", b'{"messages": []}', "'model'"),
            ("/v1/chat/completions", b'{"model": "tiny", "messages": []}', "'messages'"),
            ("/v1/completions", b'{"model": "tiny", "prompt": 3}', "'prompt'"),
            ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": -1}', "max_tokens"),
            ("/v1/embeddings", b'{"model": "tiny"}', "'input'"),
        ]
        for path, raw, fragment in cases:
            code, body = self.post(stub, path, None, raw=raw)
            self.assertEqual(code, 400, (path, raw))
            self.assertIn(fragment, body["error"]["message"])
            self.assertEqual(body["error"]["type"], "invalid_request_error")

    def test_other_model(self) -> None:
        """
        A request for a model this server does not serve gets 404
        model_not_found.
        """
        code, body = self.post(self.stub(), "/v1/completions", {"model": "big", "prompt": "x"})
        self.assertEqual(code, 404)
        self.assertEqual(body["error"]["code"], "model_not_found")

    def test_unknown_path(self) -> None:
        """
        An unknown path gets an OpenAI-shaped 404.
        """
        code, body, _ = self.get(self.stub(), "/v1/nothing")
        self.assertEqual(code, 404)
        self.assertIn("/v1/nothing", body["error"]["message"])

    def test_port_required(self) -> None:
        """
        Without --port or LLMGW_PORT, main refuses to start with status 2.
        """
        err = io.StringIO()
        self.patch(sys, "stderr", err)
        self.assertEqual(fakemodel.main([], reactor=object(), environ={}), 2)
        self.assertIn("LLMGW_PORT", err.getvalue())


class FakeModelProcessTests(TestCase):
    timeout = 20

    @defer.inlineCallbacks
    def test_exit_after(self) -> Any:
        """
        As a real process (port from LLMGW_PORT), --exit-after makes it say
        so and exit with --exit-code.
        """
        root = os.path.dirname(os.path.dirname(os.path.abspath(llmgw.__file__)))
        env = dict(os.environ, LLMGW_PORT="0", PYTHONPATH=root)
        out, err, code = yield utils.getProcessOutputAndValue(
            sys.executable,
            ["-m", "llmgw.testing.fakemodel", "--exit-after", "0.2", "--exit-code", "7",
             "--model", "m1"],
            env=env,
        )
        self.assertEqual(code, 7, err)
        self.assertIn(b"serving model 'm1' on 127.0.0.1:", out)
        self.assertIn(b"exiting with status 7", err)
