"""
The fake model server's replies that take time: a streamed reply paced on
the clock (L{StreamedReply}), and one timed by the engine simulator
(L{SimReply}), streamed or whole. L{llmgw.testing.fakemodel} makes them.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

from twisted.internet.interfaces import IDelayedCall
from twisted.web import server

from llmgw.testing.enginesim import SimRequest

if TYPE_CHECKING:
    from llmgw.testing.fakemodel import FakeModelApp


def finish_with(request: Any, data: bytes) -> None:
    """
    Write C{data} as the whole rest of C{request}'s body and finish it.
    """
    request.write(data)
    request.finish()


class SimReply:
    """
    One reply timed by the engine simulator: streamed a chunk per token as
    the simulator produces it, or whole when it is done.
    """

    def __init__(self, app: FakeModelApp, request: Any, kind: str, words: list[str],
                 stream: bool, include_usage: bool, prompt: int):
        self.app = app
        self.request = request
        self.kind = kind
        self.words = words
        self.stream = stream
        self.include_usage = include_usage
        self.prompt = prompt
        self.sim_request: SimRequest | None = None
        self.gone = False
        self.writer = StreamedReply(app, request, kind, words, "length", None)

    def begin(self) -> Any:
        req = self.request
        if self.stream:
            req.setHeader(b"content-type", b"text/event-stream")
            req.setHeader(b"cache-control", b"no-cache")
        else:
            req.setHeader(b"content-type", b"application/json")
        req.notifyFinish().addBoth(self._gone)
        self.app.running += 1
        return server.NOT_DONE_YET

    def _gone(self, _: Any) -> None:
        if self.gone:
            return
        self.gone = True
        self.app.running -= 1
        if self.sim_request is not None and self.app.sim is not None:
            self.app.sim.cancel(self.sim_request)

    def usage(self) -> dict[str, Any]:
        cached = self.sim_request.cached_tokens if self.sim_request is not None else 0
        n = len(self.words)
        return {
            "prompt_tokens": self.prompt,
            "completion_tokens": n,
            "total_tokens": self.prompt + n,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def token(self, n: int) -> None:
        if self.gone or not self.stream:
            return
        word = self.words[n - 1]
        w = self.writer
        if n == 1 and self.kind == "chat":
            # As engines do, the role comes when the first token does: the
            # first byte of the body is the time to first token.
            w._send(w._chunk({"role": "assistant", "content": ""}, None))
        w._send(w._chunk({"content": word} if self.kind == "chat" else word, None))

    def done(self) -> None:
        if self.gone:
            return
        if not self.stream:
            finish_with(self.request, self.app._whole_bytes(self.kind, self.words, "length", self.usage()))
            return
        w = self.writer
        w._send(w._chunk({} if self.kind == "chat" else "", "length"))
        if self.include_usage:
            doc = w._chunk({}, None)
            doc["choices"] = []
            doc["usage"] = self.usage()
            w._send(doc)
        w._send("[DONE]")
        self.request.finish()


class StreamedReply:
    """
    One streamed reply: a chunk per word, paced on the clock, then
    C{data: [DONE]}. Stops quietly if the client goes away.
    """

    def __init__(self, app: FakeModelApp, request: Any, kind: str, words: list[str],
                 finish: str, usage: dict[str, int] | None):
        self.app = app
        self.request = request
        self.kind = kind
        self.words = words
        self.finish = finish
        self.usage = usage
        self.next = 0
        self.gone = False
        self.call: IDelayedCall | None = None
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(app.clock.seconds())

    def begin(self) -> Any:
        req = self.request
        req.setHeader(b"content-type", b"text/event-stream")
        req.setHeader(b"cache-control", b"no-cache")
        req.notifyFinish().addBoth(self._gone)
        self.app.running += 1
        if self.kind == "chat":
            # The role comes first, before any token, as OpenAI sends it.
            self._send(self._chunk({"role": "assistant", "content": ""}, None))
        self._schedule()
        return server.NOT_DONE_YET

    def _gone(self, _: Any) -> None:
        if not self.gone:
            self.app.running -= 1
        self.gone = True
        if self.call is not None and self.call.active():
            self.call.cancel()

    def _schedule(self) -> None:
        tps = self.app.config.tokens_per_second
        self.call = self.app.clock.callLater(1.0 / tps if tps else 0, self._step)

    def _chunk(self, delta: dict[str, Any] | str, finish: str | None) -> dict[str, Any]:
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.app.config.model, "choices": [choice]}

    def _send(self, doc: dict[str, Any] | str) -> None:
        text = doc if isinstance(doc, str) else json.dumps(doc)
        self.request.write(b"data: " + text.encode() + b"\n\n")

    def _step(self) -> None:
        self.call = None
        if self.gone:
            return
        if self.next < len(self.words):
            word = self.words[self.next]
            self.next += 1
            self._send(self._chunk({"content": word} if self.kind == "chat" else word, None))
            if self.next < len(self.words) and self.app.config.tokens_per_second:
                self._schedule()
                return
            if self.next < len(self.words):
                # Unpaced: the rest at once.
                self._step()
                return
        self._send(self._chunk({} if self.kind == "chat" else "", self.finish))
        if self.usage is not None:
            doc = self._chunk({}, None)
            doc["choices"] = []
            doc["usage"] = self.usage
            self._send(doc)
        self._send("[DONE]")
        self.request.finish()


__all__ = ["SimReply", "StreamedReply", "finish_with"]
