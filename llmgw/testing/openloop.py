"""
An open-loop client for tests and benchmarks that change a fleet under
load: requests are sent at a fixed rate whatever the answers (each in a
thread of its own, so a slow answer delays no other request), half of
them streamed by default, and each answer is judged whole or not.

A streamed answer is whole when it is a 200 whose events parse, none of
them an error, one of them carries a C{finish_reason}, and the last is
C{data: [DONE]}; any other ending (a cut connection, an error event, no
C{[DONE]}) is a broken stream. A plain answer is whole when it is a 200
with a choice.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Answer:
    """
    One request's fate.

    @ivar sent: when it was sent, seconds after the client started.
    @ivar status: the HTTP status (0: none came).
    @ivar first_byte: seconds from sending to the answer's headers (None:
        none came).
    @ivar latency: seconds from sending to the answer's end.
    @ivar broken: why the answer is not whole ("" when it is).
    """

    sent: float
    streamed: bool
    status: int = 0
    first_byte: float | None = None
    latency: float = 0.0
    broken: str = ""
    body: str = field(default="", repr=False)


def judge_stream(body: str) -> str:
    """
    Why the server-sent events C{body} are not a whole chat stream ("" when
    they are).
    """
    events = [line[len("data:"):].strip() for line in body.splitlines() if line.startswith("data:")]
    if not events:
        return "no events"
    if events[-1] != "[DONE]":
        return f"the last event is not [DONE]: {events[-1][:200]!r}"
    finished = False
    for data in events[:-1]:
        try:
            chunk = json.loads(data)
        except ValueError:
            return f"an event is not JSON: {data[:200]!r}"
        if not isinstance(chunk, dict) or "error" in chunk:
            return f"an error event: {data[:200]!r}"
        for choice in chunk.get("choices") or ():
            finished = finished or bool(choice.get("finish_reason"))
    return "" if finished else "no event carries a finish_reason"


class OpenLoopClient:
    """
    Sends chat completions for C{model} to the gateway at C{host}:C{port},
    C{rate} a second, from L{start} until L{stop}; every C{stream_every}th
    request is streamed (0: none).
    """

    def __init__(self, host: str, port: int, model: str, rate: float, stream_every: int = 2,
                 max_tokens: int = 8, timeout: float = 60.0):
        if rate <= 0:
            raise ValueError(f"rate must be positive, not {rate!r}")
        self.host, self.port, self.model = host, port, model
        self.rate, self.stream_every = rate, stream_every
        self.max_tokens, self.timeout = max_tokens, timeout
        self.answers: list[Answer] = []
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._pacer: threading.Thread | None = None
        self._lock = threading.Lock()
        #: When L{start} was called (C{time.monotonic}); L{Answer.sent} counts from it.
        self.started_at = 0.0
        #: The most seconds a send started after its due time (the pacer's
        #: own lag: an open loop that fell behind is not one).
        self.worst_lag = 0.0

    def start(self) -> None:
        self.started_at = time.monotonic()
        self._pacer = threading.Thread(target=self._pace, name="open-loop pacer", daemon=True)
        self._pacer.start()

    def stop(self) -> list[Answer]:
        """
        Stop sending and wait for the answers of the requests sent (each
        bounded by the client's C{timeout}); returns every answer, in the
        order they were sent.
        """
        self._stopping.set()
        if self._pacer is not None:
            self._pacer.join(self.timeout)
        for t in list(self._threads):
            t.join(self.timeout + 5)
        with self._lock:
            return sorted(self.answers, key=lambda a: a.sent)

    def _pace(self) -> None:
        n = 0
        while not self._stopping.is_set():
            due = self.started_at + n / self.rate
            now = time.monotonic()
            if due > now:
                # The pacer's own timing, not a synchronisation.
                if self._stopping.wait(due - now):
                    break
                now = time.monotonic()
            self.worst_lag = max(self.worst_lag, now - due)
            streamed = self.stream_every > 0 and n % self.stream_every == 0
            t = threading.Thread(target=self._one, args=(n, streamed), daemon=True)
            self._threads.append(t)
            t.start()
            n += 1

    def _one(self, n: int, streamed: bool) -> None:
        answer = Answer(sent=time.monotonic() - self.started_at, streamed=streamed)
        body = json.dumps({
            "model": self.model, "stream": streamed, "max_tokens": self.max_tokens,
            "messages": [{"role": "user", "content": f"request {n}"}],
        })
        began = time.monotonic()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            answer.first_byte = time.monotonic() - began
            answer.status = response.status
            answer.body = response.read().decode("utf-8", "replace")
            if answer.status != 200:
                answer.broken = f"status {answer.status}: {answer.body[:300]}"
            elif streamed:
                answer.broken = judge_stream(answer.body)
            else:
                answer.broken = _judge_whole(answer.body)
        except (OSError, http.client.HTTPException) as e:
            answer.broken = f"{type(e).__name__}: {e}"
        finally:
            conn.close()
            answer.latency = time.monotonic() - began
            with self._lock:
                self.answers.append(answer)


def _judge_whole(body: str) -> str:
    try:
        doc: Any = json.loads(body)
    except ValueError:
        return f"not JSON: {body[:200]!r}"
    if not isinstance(doc, dict) or not doc.get("choices"):
        return f"no choices: {body[:200]!r}"
    return ""


def tally(answers: list[Answer]) -> dict[str, Any]:
    """
    Counts of C{answers}: sent, streamed, non-2xx (no answer counts),
    broken streams, other broken answers, and the first few reasons.
    """
    non_2xx = [a for a in answers if not 200 <= a.status < 300]
    broken_streams = [a for a in answers if a.streamed and a.broken and 200 <= a.status < 300]
    broken_plain = [a for a in answers if not a.streamed and a.broken and 200 <= a.status < 300]
    return {
        "sent": len(answers),
        "streamed": sum(a.streamed for a in answers),
        "non_2xx": len(non_2xx),
        "broken_streams": len(broken_streams),
        "broken_plain": len(broken_plain),
        "reasons": sorted({a.broken for a in answers if a.broken})[:5],
    }
