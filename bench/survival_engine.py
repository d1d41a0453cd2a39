"""
A fake engine for the kill benchmark (L{bench.survival_kill}): a process
of its own per replica, so that SIGKILL ends it as it ends a real engine.

Unlike L{llmgw.testing.fakemodel} (which answers the same words whatever
the prompt), each next word is a function of the whole context so far (the
prompt, or the chat rendered as a template renders it, and the words
generated): a continuation sent the prompt and the text so far (or the
partial assistant message with C{continue_final_message}) goes on with
exactly the words the unbroken answer has. L{reply} is that function, so
the benchmark computes every reference answer itself.

Timing: the first word after C{--prefill-ms} plus C{--prefill-us-per-char}
per character of context, then one word every 1/C{--tps} s.

    python bench/survival_engine.py --port PORT [--model M] [--tps 20]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
import uuid
from typing import Any

from twisted.internet import reactor as _reactor
from twisted.web import resource, server

WORDS = [" the", " a", " model", " reply", " tiny", " engine", " is", " here", ".", " and"]


def render(messages: list[dict[str, Any]], continue_final: bool) -> str:
    """
    The context of a chat: each message as C{<role>content} and a newline;
    the final one left open when continued, else an open assistant turn.
    """
    out = "".join(f"<{m.get('role')}>{m.get('content')}\n" for m in messages)
    return out[:-1] if continue_final else out + "<assistant>"


def reply(context: str, n: int) -> list[str]:
    """
    The C{n} words that follow C{context}: each chosen by a hash of
    everything before it, so C{reply(c, n)[k:] == reply(c + "".join(reply(c, k)), n - k)}.
    """
    h = hashlib.sha256(context.encode())
    words = []
    for _ in range(n):
        word = WORDS[h.copy().digest()[0] % len(WORDS)]
        h.update(word.encode())
        words.append(word)
    return words


class Engine(resource.Resource):
    isLeaf = True

    def __init__(self, model: str, tps: float, prefill_ms: float, prefill_us_per_char: float):
        super().__init__()
        self.model, self.tps = model, tps
        self.prefill_ms, self.prefill_us_per_char = prefill_ms, prefill_us_per_char

    def render_GET(self, request: Any) -> bytes:
        if request.path == b"/health":
            return b'{"status":"ok"}'
        request.setResponseCode(404)
        return b"{}"

    def render_POST(self, request: Any) -> Any:
        body = json.loads(request.content.read())
        chat = request.path == b"/v1/chat/completions"
        if chat:
            context = render(body["messages"], bool(body.get("continue_final_message")))
        else:
            context = body["prompt"]
        n = int(body.get("max_tokens") or 16)
        words = reply(context, n)
        usage = {"prompt_tokens": len(context.split()), "completion_tokens": n,
                 "total_tokens": len(context.split()) + n}
        cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:12]
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        request.setHeader(b"content-type", b"text/event-stream")
        # Which engine answered: the benchmark tells a killed one's streams by it.
        request.setHeader(b"x-survival-engine", str(os.getpid()).encode())
        include_usage = (body.get("stream_options") or {}).get("include_usage") is True

        def event(choice: dict[str, Any], **extra: Any) -> bytes:
            doc = {"id": cid, "object": obj, "created": created, "model": self.model,
                   "choices": [{"index": 0, **choice}], **extra}
            return b"data: " + json.dumps(doc).encode() + b"\n\n"

        def piece(text: str, finish: str | None = None) -> dict[str, Any]:
            if chat:
                return {"delta": {"content": text} if text else {}, "finish_reason": finish}
            return {"text": text, "finish_reason": finish}

        if chat:
            request.write(event({"delta": {"role": "assistant", "content": None}, "finish_reason": None}))
        state = {"i": 0, "call": None}

        def step() -> None:
            i = state["i"]
            if i < n:
                request.write(event(piece(words[i])))
                state["i"] = i + 1
                state["call"] = _reactor.callLater(1 / self.tps, step)  # type: ignore[attr-defined]
                return
            request.write(event(piece("", "length")))
            if include_usage:
                request.write(b"data: " + json.dumps({"id": cid, "object": obj, "created": created,
                                                      "choices": [], "usage": usage}).encode() + b"\n\n")
            request.write(b"data: [DONE]\n\n")
            request.finish()

        def gone(_: Any) -> None:
            call = state["call"]
            if call is not None and call.active():  # type: ignore[attr-defined]
                call.cancel()  # type: ignore[attr-defined]

        request.notifyFinish().addErrback(gone)
        delay = (self.prefill_ms + self.prefill_us_per_char * len(context) / 1000) / 1000
        state["call"] = _reactor.callLater(delay, step)  # type: ignore[attr-defined]
        return server.NOT_DONE_YET


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="tiny")
    p.add_argument("--tps", type=float, default=20.0)
    p.add_argument("--prefill-ms", type=float, default=100.0)
    p.add_argument("--prefill-us-per-char", type=float, default=20.0)
    args = p.parse_args()
    site = server.Site(Engine(args.model, args.tps, args.prefill_ms, args.prefill_us_per_char))
    site.noisy = False
    _reactor.listenTCP(args.port, site, interface="127.0.0.1")  # type: ignore[attr-defined]
    _reactor.run()  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
