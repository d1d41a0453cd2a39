"""
Streams that outlive their replica (DESIGN §23): a streamed chat or text
completion whose replica fails after the client got part of it is continued
on another replica, and the client sees one stream.

L{StreamResume} watches the stream's server-sent events as they pass (whole
events, split where L{llmgw.gateway.usage} splits them) and keeps what a
continuation needs: the text so far (and the token ids, where the replica
sends them), the stream's C{id} and C{created}, and the count of tokens
sent. L{StreamResume.continuation} is the request for the next replica:

- text completions: C{prompt} is the original prompt and the text so far
  (token-exact where the replica gave token ids: the prompt, then the ids,
  in llama.cpp's mixed form, or as ids where the replica gave the prompt's
  too), C{max_tokens} less the tokens sent;
- chat: the partial answer as a final assistant message, continued
  (C{continue_final_message}, no generation prompt), C{max_tokens} (and
  C{max_completion_tokens}) less the tokens sent.

The continuation's events are rewritten on their way: the first answer's
C{id} and C{created}, no second role chunk, an echo of the partial answer
at the start of the continuation left out where the engine is known to
repeat it (C{echoes}; llama.cpp and vLLM stream only what they generate,
and an answer may well begin with the words it was cut after, which must
not be taken for an echo), and its
C{usage} counted as one answer's (prompt tokens the original's, completion
tokens those sent before and the continuation's).

Bounds: L{DEFAULT_MAX_MIGRATIONS} continuations a request, L{DEFAULT_MAX_TEXT}
bytes of text kept (past it the stream is not resumable and breaks as
before), and the deployment's switch (C{resume_streams}). A stream that
carries what a continuation cannot restore (tool calls, reasoning, more
than one choice) is not resumed either.

On the path of every streamed completion, compiled with it (setup.py's
C{COMPILED}): no class decorators, ClassVar loggers, Final constants.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, ClassVar, Final

from prometheus_client import CollectorRegistry, Counter
from twisted.logger import Logger

from llmgw.gateway.forwarding import forwarded_head
from llmgw.gateway.usage import event_end

if TYPE_CHECKING:
    from llmgw.gateway.proxy import ProxyCall

#: Continuations one request may have.
DEFAULT_MAX_MIGRATIONS: Final = 2
#: Bytes of generated text kept per request (UTF-8); past it, not resumable.
DEFAULT_MAX_TEXT: Final = 256 * 1024
#: The paths whose streams can be continued.
RESUMABLE_PATHS: Final = frozenset({"/v1/chat/completions", "/v1/completions"})
#: The outcomes L{ResumeMetrics} counts.
OUTCOMES: Final = ("resumed", "finished", "limit", "not_resumable", "no_replica", "refused")

_DATA: Final = b"data:"
_DONE: Final = b"[DONE]"
#: Delta members a continuation cannot restore.
_UNRESTORABLE: Final = ("tool_calls", "function_call", "reasoning_content", "reasoning")


class ResumeMetrics:
    """
    C{llmgw_gateway_stream_resumes_total{model,outcome}}: streams whose
    replica failed mid-answer, by what became of them (L{OUTCOMES}).
    """

    def __init__(self, registry: CollectorRegistry):
        self.resumes = Counter(
            "llmgw_gateway_stream_resumes",
            "Streamed answers whose replica failed after the client got part of them, by outcome: "
            "resumed (continued on another replica), finished (it had ended), limit (migration "
            "limit or text cap reached), not_resumable, no_replica, refused (the next replica "
            "refused the continuation)",
            ["model", "outcome"],
            registry=registry,
        )

    def count(self, model: str, outcome: str) -> None:
        self.resumes.labels(model, outcome).inc()


def _event(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


def _payload(event: bytes) -> bytes | None:
    """
    The C{data} of a one-line server-sent event, or C{None}.
    """
    for line in event.splitlines():
        if line.startswith(_DATA):
            return line[5:].strip()
    return None


class StreamResume:
    """
    One streamed completion's record for a continuation. C{path} is the
    request's path, C{body} the body the first replica was sent.

    Feed it every piece of the response body (L{feed}), which returns what
    goes on to the client; when the replica fails, L{continuation} is the
    next request (or C{None}: not resumable), and L{begin} starts the next
    response's rewriting.
    """

    log: ClassVar[Logger] = Logger(namespace=f"{__name__}.StreamResume")
    __slots__ = (
        "path", "body", "max_migrations", "max_text", "migrations", "held", "text", "text_bytes", "ids",
        "prompt_ids", "tokens", "stream_id", "created", "finished", "done", "resumable", "why", "base",
        "echo", "probe", "pending", "model", "label", "metrics", "echoes",
    )

    def __init__(self, path: str, body: bytes, max_migrations: int = DEFAULT_MAX_MIGRATIONS,
                 max_text: int = DEFAULT_MAX_TEXT, model: str = "", label: str = "",
                 metrics: ResumeMetrics | None = None, echoes: bool = False):
        self.path = path
        #: Whether the engine repeats a continued chat answer's partial
        #: text before the new text (then left out of what the client gets).
        self.echoes = echoes
        #: The request's model, its metrics label, where outcomes are counted.
        self.model = model
        self.label = label
        self.metrics = metrics
        self.body = body
        self.max_migrations = max_migrations
        self.max_text = max_text
        self.migrations = 0
        #: An unfinished last event, not yet passed on.
        self.held = b""
        self.text: list[str] = []
        self.text_bytes = 0
        #: The generated token ids, while every chunk carried them.
        self.ids: list[int] | None = []
        self.prompt_ids: list[int] | None = None
        #: Tokens sent to the client (chunks with text, or ids).
        self.tokens = 0
        self.stream_id: Any = None
        self.created: Any = None
        #: A finish_reason went by; C{done}: the [DONE] line did.
        self.finished = False
        self.done = False
        self.resumable = True
        self.why = ""
        #: Tokens sent before the running continuation (its prompt holds them).
        self.base = 0
        #: The partial answer the running continuation may echo first, what
        #: of its text was held while that is not known, and its events.
        self.echo = ""
        self.probe = ""
        self.pending: list[dict[str, Any]] = []

    # the stream as it passes

    def feed(self, data: bytes) -> bytes:
        """
        Take in the next piece of the body; return the whole events in it
        to pass on (the first answer's as they came, a continuation's
        rewritten).
        """
        held = self.held
        data = held + data if held else data
        end = event_end(data)
        if end < 0:
            self.held = data
            return b""
        whole, self.held = data[:end], data[end:]
        events = (whole.replace(b"\r\n", b"\n") if b"\r" in whole else whole).split(b"\n\n")
        if self.migrations == 0:
            # The first answer goes on byte for byte; it is only read.
            for event in events:
                if event.strip():
                    self._note(event, None)
            return whole
        return b"".join(self._rewrite(event) for event in events if event.strip())

    def _note(self, event: bytes, doc: dict[str, Any] | None) -> dict[str, Any] | None:
        """
        Record what C{event} (or its parsed C{doc}) adds to the answer.
        """
        if doc is None:
            payload = _payload(event)
            if payload is None:
                return None
            if payload == _DONE:
                self.done = True
                return None
            try:
                # Any first: compiled, a non-dict assigned to doc would raise.
                parsed: Any = json.loads(payload)
            except ValueError:
                return None
            if not isinstance(parsed, dict):
                return None
            doc = parsed
        if self.stream_id is None:
            self.stream_id = doc.get("id")
            self.created = doc.get("created")
        if self.prompt_ids is None and isinstance(doc.get("prompt_token_ids"), list):
            self.prompt_ids = doc["prompt_token_ids"]
        choices = doc.get("choices")
        if not isinstance(choices, list):
            return doc
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if choice.get("index", 0) != 0:
                self._not_resumable("more than one choice")
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                for name in _UNRESTORABLE:
                    if delta.get(name):
                        self._not_resumable(f"the answer has {name}")
                text = delta.get("content")
            else:
                text = choice.get("text")
            if self.prompt_ids is None and isinstance(choice.get("prompt_token_ids"), list):
                self.prompt_ids = choice["prompt_token_ids"]
            ids = choice.get("token_ids", choice.get("tokens", doc.get("tokens")))
            if ids is None:
                ids = _logprob_ids(choice.get("logprobs"))
            if isinstance(text, str) and text:
                self._add_text(text)
                if self.ids is not None and isinstance(ids, list) and ids:
                    self.ids.extend(ids)
                    self.tokens += len(ids)
                else:
                    self.ids = None
                    self.tokens += 1
            elif self.ids is not None and isinstance(ids, list) and ids:
                # Ids of text held back (an unfinished UTF-8 sequence).
                self.ids.extend(ids)
                self.tokens += len(ids)
            if choice.get("finish_reason"):
                self.finished = True
        return doc

    def _add_text(self, text: str) -> None:
        self.text.append(text)
        self.text_bytes += len(text.encode())
        if self.text_bytes > self.max_text:
            self._not_resumable(f"more than {self.max_text} bytes of text")
            self.text = []

    def _not_resumable(self, why: str) -> None:
        if self.resumable:
            self.resumable = False
            self.why = why

    def _rewrite(self, event: bytes) -> bytes:
        event = event.rstrip(b"\r\n") + b"\n\n"
        payload = _payload(event)
        if payload is None:
            return event
        if payload == _DONE:
            self.done = True
            return self._release() + event
        try:
            doc = json.loads(payload)
        except ValueError:
            return event
        if not isinstance(doc, dict):
            return event
        if self.stream_id is not None:
            doc["id"] = self.stream_id
        if self.created is not None:
            doc["created"] = self.created
        usage = doc.get("usage")
        if isinstance(usage, dict):
            self._count_once(usage)
        choices = doc.get("choices")
        content: Any = None
        finishing = False
        if isinstance(choices, list):
            for choice in choices:
                if not isinstance(choice, dict):
                    continue
                delta = choice.get("delta")
                if isinstance(delta, dict):
                    # The client had its role chunk from the first answer.
                    delta.pop("role", None)
                    content = delta.get("content")
                    empty = all(v is None for v in delta.values())
                    if empty and not choice.get("finish_reason") and not isinstance(usage, dict):
                        return b""
                else:
                    content = choice.get("text")
                if choice.get("finish_reason"):
                    finishing = True
        if self.echo and isinstance(content, str):
            return self._check_echo(doc, content, finishing)
        if self.pending and finishing:
            return self._release() + self._pass(doc)
        return self._pass(doc)

    def _pass(self, doc: dict[str, Any]) -> bytes:
        self._note(b"", doc)
        return _event(doc)

    def _check_echo(self, doc: dict[str, Any], content: str, finishing: bool) -> bytes:
        """
        A continuation's text while it may still be an echo of the partial
        answer: held until it is known, then passed on, less the echo.
        """
        self.probe += content
        self.pending.append(doc)
        echo, probe = self.echo, self.probe
        if len(probe) < len(echo) and echo.startswith(probe) and not finishing:
            return b""
        if probe.startswith(echo):
            # The partial answer again: only what follows it is new.
            rest = probe[len(echo):]
            self.echo, self.probe, pending = "", "", self.pending
            self.pending = []
            last = pending[-1]
            _set_text(last, rest)
            if not rest and not _finish_of(last) and not isinstance(last.get("usage"), dict):
                return b""
            return self._pass(last)
        return self._release()

    def _release(self) -> bytes:
        """
        The held events as they came: the continuation did not echo.
        """
        self.echo, self.probe = "", ""
        pending, self.pending = self.pending, []
        return b"".join(self._pass(doc) for doc in pending)

    def _count_once(self, usage: dict[str, Any]) -> None:
        # The continuation's prompt held the tokens already sent: those
        # count once, as completion tokens.
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(completion, int):
            usage["prompt_tokens"] = max(0, prompt - self.base)
            usage["completion_tokens"] = completion + self.base
            if isinstance(usage.get("total_tokens"), int):
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]

    def flush(self) -> bytes:
        """
        The response ended: what is still held (an unfinished last event,
        an echo not yet decided), to pass on.
        """
        held, self.held = self.held, b""
        if self.migrations == 0:
            return held
        out = self._release()
        return out + self._rewrite(held) if held.strip() else out

    # the continuation

    def count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.count(self.label, outcome)

    def broke(self, replica: str) -> tuple[str, bytes | None]:
        """
        L{next_step}, counted and logged: C{replica} failed mid-answer.
        """
        outcome, body, why = self.next_step()
        self.count(outcome)
        self.log.info("{model}: stream from replica {replica} broke after {tokens} tokens: {outcome}{why}",
                      model=self.model, replica=replica, tokens=self.tokens, outcome=outcome,
                      why=f" ({why})" if why else "")
        return outcome, body

    def refused(self, replica: str, status: int) -> None:
        """
        C{replica} answered the continuation with C{status}, not 2xx.
        """
        self.count("refused")
        self.log.warn("{model}: replica {replica} refused a stream's continuation ({status})",
                      model=self.model, replica=replica, status=status)

    def next_step(self) -> tuple[str, bytes | None, str]:
        """
        What to do now that the replica failed: the outcome (one of
        L{OUTCOMES}), the continuation's body when it is C{"resumed"}, and
        why not otherwise. C{"finished"}: the answer had ended (or used up
        its C{max_tokens}); L{ending} completes it.
        """
        if self.finished or self.done or self.exhausted():
            return "finished", None, "the answer was complete"
        if not self.resumable:
            return ("limit" if self.text_bytes > self.max_text else "not_resumable"), None, self.why
        if self.migrations >= self.max_migrations:
            return "limit", None, f"it was continued {self.migrations} time(s) already"
        if self.stream_id is None:
            return "not_resumable", None, "no chunk of it was read"
        body = self.continuation()
        if body is None:
            return "not_resumable", None, "its request cannot be continued"
        return "resumed", body, ""

    def continuation(self) -> bytes | None:
        """
        The body of the request that continues the answer on another
        replica, or C{None} when the original body cannot be continued
        (not the JSON of a one-choice completion). Call L{begin} when it
        goes.
        """
        try:
            doc = json.loads(self.body)
        except ValueError:
            return None
        if not isinstance(doc, dict) or doc.get("n", 1) != 1:
            return None
        text = "".join(self.text)
        if self.path == "/v1/completions":
            if doc.get("echo") or doc.get("best_of", 1) != 1:
                return None
            prompt = doc.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            ids = self.ids
            if ids:
                if self.prompt_ids is not None:
                    doc["prompt"] = self.prompt_ids + ids
                elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                    doc["prompt"] = prompt + ids
                elif isinstance(prompt, str):
                    # llama.cpp's mixed prompt: the text, then token ids.
                    doc["prompt"] = [prompt, *ids]
                else:
                    return None
            elif isinstance(prompt, str):
                doc["prompt"] = prompt + text
            else:
                return None
            names: tuple[str, ...] = ("max_tokens",)
        else:
            messages = doc.get("messages")
            if not isinstance(messages, list) or not messages:
                return None
            last = messages[-1]
            if doc.get("continue_final_message") and isinstance(last, dict) and last.get("role") == "assistant":
                # The client's own prefill, continued.
                if not isinstance(last.get("content"), str):
                    return None
                messages[-1] = {**last, "content": last["content"] + text}
            else:
                messages.append({"role": "assistant", "content": text})
            doc["continue_final_message"] = True
            doc["add_generation_prompt"] = False
            names = ("max_tokens", "max_completion_tokens")
        for name in names:
            limit = doc.get(name)
            if isinstance(limit, int) and not isinstance(limit, bool):
                doc[name] = limit - self.tokens
        return json.dumps(doc, separators=(",", ":")).encode()

    def exhausted(self) -> bool:
        """
        The tokens sent already reach the request's C{max_tokens}: nothing
        is left to generate (L{ending} ends the stream).
        """
        try:
            doc = json.loads(self.body)
        except ValueError:
            return False
        if not isinstance(doc, dict):
            return False
        for name in ("max_tokens", "max_completion_tokens"):
            limit = doc.get(name)
            if isinstance(limit, int) and not isinstance(limit, bool) and limit - self.tokens <= 0:
                return True
        return False

    def begin(self) -> None:
        """
        A continuation goes out: rewrite the response that comes back.
        """
        self.migrations += 1
        self.held = b""
        self.base = self.tokens
        self.pending = []
        self.probe = ""
        # An engine that repeats the partial chat answer first: that much
        # of the continuation is held until it is known to be the echo.
        # Text completions never repeat it (the prompt is not echoed).
        chat = self.path == "/v1/chat/completions"
        self.echo = "".join(self.text) if chat and self.echoes else ""

    def ending(self) -> bytes:
        """
        The end of a stream whose replica failed after its last token or
        its last chunk: a finish chunk where none went, and C{[DONE]}.
        """
        out = b""
        if not self.finished:
            obj = "chat.completion.chunk" if self.path == "/v1/chat/completions" else "text_completion"
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            if obj == "text_completion":
                choice["text"] = ""
            else:
                choice["delta"] = {}
            out = _event({"id": self.stream_id, "object": obj, "created": self.created, "choices": [choice]})
            self.finished = True
        if not self.done:
            out += b"data: [DONE]\n\n"
            self.done = True
        return out


def _logprob_ids(logprobs: Any) -> list[int] | None:
    """
    The token ids in a chunk's C{logprobs} (llama.cpp's
    C{logprobs.content[].id}, there when the client asked for logprobs),
    or C{None}.
    """
    if not isinstance(logprobs, dict):
        return None
    content = logprobs.get("content")
    if not isinstance(content, list) or not content:
        return None
    ids = [t.get("id") for t in content if isinstance(t, dict)]
    if len(ids) != len(content) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return None
    return ids  # type: ignore[return-value]


def _finish_of(doc: dict[str, Any]) -> Any:
    choices = doc.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0].get("finish_reason")
    return None


def _set_text(doc: dict[str, Any], text: str) -> None:
    choices = doc.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        choice = choices[0]
        delta = choice.get("delta")
        if isinstance(delta, dict):
            delta["content"] = text
        else:
            choice["text"] = text


def record_for(call: ProxyCall) -> StreamResume | None:
    """
    The record of C{call}'s stream, whose first answer's head has come,
    when it may be continued elsewhere: a chat or text completion, a
    deployment that lets streams go on (its route's C{resume}), and a
    gateway that allows it (C{max_stream_resumes} above 0). Its
    continuations are not searched for an echo of the partial answer: the
    engines llmgw runs (llama.cpp, vLLM) stream only the new text.
    """
    route, gw = call.route, call.gw
    config = gw.config
    if call.path_label not in RESUMABLE_PATHS or route is None or not route.resume:
        return None
    if config.max_stream_resumes <= 0:
        return None
    return StreamResume(call.path_label, call.body, config.max_stream_resumes, config.max_resume_text,
                        call.model, gw.metrics.model_label(call.model), gw.resumes)


def continued(call: Any, status: int) -> bool:
    """
    The head of a continuation's response, on the L{ProxyCall} C{call}:
    the client has its own already; a refusal ends the client's stream.
    """
    call.gw.router.succeeded(call.route.replica_id)
    if not 200 <= status < 300:
        call.resume.refused(call.route.replica_id, status)
        conn, call.conn = call.conn, None
        if conn is not None:
            conn.abort()
        call._cancel_timer()
        call._abort_client(502)
    return True


def break_off(call: Any, status: int) -> None:
    """
    The replica of the L{ProxyCall} C{call} failed mid-answer: on to
    another, when the stream may be continued; else the client's stream
    is cut with C{status} recorded.
    """
    resume = call.resume
    if resume is None:
        call._abort_client(status)
        return
    call._end_attempt()
    outcome, body = resume.broke(call.route.replica_id)
    if outcome == "finished":
        call.response_data(resume.ending())
        call.response_finished()
    elif body is None:
        call._abort_client(status)
    else:
        resume.begin()
        call.body = body
        call.head = forwarded_head(call.request, len(body), call.gw.config.forwarded_headers)
        call.fresh_retry_used = False
        call._attempt(None)
