"""
A fake model server: a test tool, not an inference engine.

It speaks enough of the OpenAI HTTP API (the shapes vLLM, SGLang and
llama.cpp's server answer with) for the supervisor, the gateway and the
benchmarks to run their real paths without a GPU::

    python -m llmgw.testing.fakemodel --port 8001 --model tiny \\
        [--host 127.0.0.1] [--startup-delay 2] [--tokens-per-second 50] \\
        [--tokens 16] [--fail-health] [--exit-after 30 [--exit-code 3]] \\
        [--ignore-term] [--metrics vllm|sglang|llamacpp|garbage|hang]
        [--engine-sim [--kv-blocks 2048] [--block-tokens 16] [--max-running 64]
         [--step-ms 10] [--step-per-seq-ms 0.3] [--prefill-us-per-token 50]]

Without C{--port} it listens on C{$LLMGW_PORT}, as the agent sets for a shard.

Endpoints:

    GET  /health                200 once up; 503 during --startup-delay or
                                with --fail-health
    GET  /metrics               with --metrics: Prometheus text shaped like
                                vLLM's, SGLang's or llama.cpp's (live counts:
                                running = requests being answered), or
                                garbage, or an answer that never comes
    GET  /v1/models             the one model it serves
    POST /v1/chat/completions   OpenAI chat completion, streaming or not
    POST /v1/completions        OpenAI text completion, streaming or not
    POST /v1/embeddings         deterministic embeddings

A request for another model gets 404 (as vLLM answers), a malformed body
400, and anything before the start-up delay has passed 503; errors are
OpenAI-shaped JSON. Every response carries C{X-Fakemodel-Instance} (by
default C{HOST:PORT}) so a test can tell which server answered.

Replies are deterministic: C{--tokens} words (fewer with C{max_tokens}),
streamed as server-sent events paced at C{--tokens-per-second} (0: as fast
as possible).

With C{--engine-sim} generation is timed by an engine simulator instead
(L{llmgw.testing.enginesim}: a bounded KV cache in blocks with an LRU prefix
cache, prefill time per uncached prompt token, decode steps that grow with
the batch, queueing when the cache is full), C{max_tokens} (else
C{--tokens}) words are generated, C{usage} says how many prompt tokens came
from the cache (C{prompt_tokens_details.cached_tokens}), and C{/metrics}
is vLLM's names with the simulator's figures.

In-process use: L{make_resource} returns the C{Resource} for a
L{FakeModelConfig} and a clock, and L{listen} serves it on a reactor.
Replies that take time (paced streams, the simulator's) are in
L{llmgw.testing.fakereplies}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import uuid
from dataclasses import dataclass
from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.web import server
from twisted.web.resource import Resource

from llmgw.testing.enginesim import CannotFit, EngineSim, EngineSimConfig, chat_tokens
from llmgw.testing.enginesim import prompt_tokens as sim_prompt_tokens
from llmgw.testing.fakereplies import SimReply, StreamedReply, finish_with

DEFAULT_MODEL = "fake-model"
DEFAULT_TOKENS = 16
EMBEDDING_DIMENSIONS = 8
#: Requests larger than this are refused: the fake has no use for big bodies.
MAX_BODY = 4 * 1024 * 1024

_WORDS = ["This", " is", " a", " reply", " from", " the", " fake", " model", "."]


@dataclass
class FakeModelConfig:
    """
    How a fake model server behaves.
    """

    model: str = DEFAULT_MODEL
    #: Seconds after start during which /health (and every API call) is 503.
    startup_delay: float = 0.0
    #: Pace of generated tokens; 0 sends them all at once.
    tokens_per_second: float = 0.0
    #: Words in a full reply.
    tokens: int = DEFAULT_TOKENS
    fail_health: bool = False
    #: Who answered, in the X-Fakemodel-Instance header.
    instance: str = ""
    #: The shape of /metrics (L{METRICS_SHAPES}); "" serves none (404).
    metrics: str = ""
    #: Seconds after start from which /metrics hangs (None: never), and the engine
    #: simulator that times generation (None: --tokens-per-second).
    metrics_hang_after: float | None = None
    engine_sim: EngineSimConfig | None = None
    #: False: ignore C{stream_options}, as some engines do (no usage in streams).
    stream_usage: bool = True


METRICS_SHAPES = ("vllm", "sglang", "llamacpp", "garbage", "hang")
#: Called with each new app (L{llmgw.testing.sleepsim} adds its endpoints).
APP_HOOKS: list[Any] = []


class _Error(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param


def error_body(message: str, type_: str = "invalid_request_error",
               code: str | None = None, param: str | None = None) -> bytes:
    """
    An OpenAI-shaped error document.
    """
    return json.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    ).encode()


def reply_words(n: int) -> list[str]:
    """
    The first C{n} words of every fake reply.
    """
    words = [_WORDS[i % len(_WORDS)] for i in range(n)]
    # Sentences after the first start with a space, like every other word.
    return [" " + w if i and not i % len(_WORDS) else w for i, w in enumerate(words)]


def embedding(text: str, dimensions: int) -> list[float]:
    """
    A deterministic unit-ish vector for C{text}.
    """
    digest = b""
    counter = 0
    while len(digest) < dimensions:
        digest += hashlib.sha256(f"{counter}:{text}".encode()).digest()
        counter += 1
    return [round(b / 127.5 - 1.0, 6) for b in digest[:dimensions]]


def _count_words(value: Any) -> int:
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(_count_words(v) for v in value)
    if isinstance(value, dict):
        return _count_words(value.get("content", "")) + _count_words(value.get("text", ""))
    return 0


class _Base(Resource):
    isLeaf = True

    def __init__(self, app: FakeModelApp):
        super().__init__()
        self.app = app

    def render(self, request: Any) -> Any:
        request.setHeader(b"x-fakemodel-instance", self.app.config.instance.encode())
        try:
            return super().render(request)
        except _Error as e:
            return self.app.fail(request, e)


class _Health(_Base):
    def render_GET(self, request: Any) -> bytes:
        request.setHeader(b"content-type", b"application/json")
        if self.app.config.fail_health:
            request.setResponseCode(503)
            return b'{"status": "failing"}'
        if not self.app.up():
            request.setResponseCode(503)
            return b'{"status": "starting"}'
        return b'{"status": "ok"}'


class _Metrics(_Base):
    def render_GET(self, request: Any) -> Any:
        from twisted.web.server import NOT_DONE_YET

        shape = self.app.config.metrics
        after = self.app.config.metrics_hang_after
        if after is not None and self.app.clock.seconds() - self.app.started >= after:
            shape = "hang"
        if shape == "hang":
            # Headers and no body, ever: the scraper's timeout must end it.
            request.setHeader(b"content-type", b"text/plain")
            request.write(b"")
            self.app.hanging.append(request)
            request.notifyFinish().addBoth(lambda _: self.app.hanging.remove(request))
            return NOT_DONE_YET
        request.setHeader(b"content-type", b"text/plain; version=0.0.4")
        if shape == "garbage":
            return b"<html>this is not a metrics endpoint</html>\n\x00\x01\xff\n"
        return self.app.metrics_text(shape).encode()


class _Models(_Base):
    def render_GET(self, request: Any) -> bytes:
        self.app.require_up()
        request.setHeader(b"content-type", b"application/json")
        return json.dumps(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.app.config.model,
                        "object": "model",
                        "created": self.app.created,
                        "owned_by": "llmgw-fakemodel",
                    }
                ],
            }
        ).encode()


class _Generate(_Base):
    kind = "chat"

    def render_POST(self, request: Any) -> Any:
        self.app.require_up()
        body = self.app.parse_body(request)
        if self.kind == "embeddings":
            return self.app.embeddings(request, body)
        return self.app.generate(request, body, self.kind)


class _Chat(_Generate):
    kind = "chat"


class _Completions(_Generate):
    kind = "completions"


class _Embeddings(_Generate):
    kind = "embeddings"


class _NotFound(_Base):
    def render(self, request: Any) -> Any:
        request.setHeader(b"x-fakemodel-instance", self.app.config.instance.encode())
        path = request.path.decode("utf-8", "replace")
        return self.app.fail(request, _Error(404, f"no route for {path}", code="not_found"))


class _Dir(Resource):
    """A path segment whose unknown children answer with an OpenAI-shaped 404."""

    def __init__(self, missing: Resource):
        super().__init__()
        self.missing = missing

    def getChild(self, path: bytes, request: Any) -> Resource:
        return self.missing

    def render(self, request: Any) -> Any:
        return self.missing.render(request)


class FakeModelApp:
    """
    The fake server's state and generation logic; L{root} is its resource.
    """

    log = Logger()

    def __init__(self, config: FakeModelConfig, clock: IReactorTime):
        self.config = config
        self.clock = clock
        self.started = clock.seconds()
        self.created = int(self.started)
        #: Requests answered, by path, for tests, and the output tokens of all.
        self.requests: dict[str, int] = {}
        self.generated_tokens = 0
        missing = _NotFound(self)
        self.root = _Dir(missing)
        self.root.putChild(b"health", _Health(self))
        if config.metrics:
            self.root.putChild(b"metrics", _Metrics(self))
        #: Requests being answered now, and /metrics requests left hanging.
        self.running = 0
        self.hanging: list[Any] = []
        self.sim = EngineSim(clock, config.engine_sim) if config.engine_sim is not None else None
        v1 = _Dir(missing)
        self.root.putChild(b"v1", v1)
        v1.putChild(b"models", _Models(self))
        chat = _Dir(missing)
        v1.putChild(b"chat", chat)
        chat.putChild(b"completions", _Chat(self))
        v1.putChild(b"completions", _Completions(self))
        v1.putChild(b"embeddings", _Embeddings(self))
        for hook in APP_HOOKS:
            hook(self)

    # -- helpers --------------------------------------------------------------

    def up(self) -> bool:
        return self.clock.seconds() - self.started >= self.config.startup_delay

    def require_up(self) -> None:
        if not self.up():
            raise _Error(503, "the model is still loading", type_="server_error",
                         code="model_loading")

    def fail(self, request: Any, error: _Error) -> bytes:
        request.setResponseCode(error.status)
        request.setHeader(b"content-type", b"application/json")
        return error_body(error.message, error.type, error.code, error.param)

    def parse_body(self, request: Any) -> dict[str, Any]:
        raw = request.content.read(MAX_BODY + 1)
        if len(raw) > MAX_BODY:
            raise _Error(413, f"request body is over {MAX_BODY} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise _Error(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise _Error(400, "the request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise _Error(400, "'model' is required and must be a string", param="model")
        if model != self.config.model:
            raise _Error(
                404,
                f"The model `{model}` does not exist; this server serves "
                f"`{self.config.model}`.",
                code="model_not_found",
                param="model",
            )
        return body

    def _count(self, kind: str) -> None:
        self.requests[kind] = self.requests.get(kind, 0) + 1

    def metrics_text(self, shape: str) -> str:
        """
        Prometheus text in C{shape}'s names (C{tests/data/metrics-*.txt}): C{running}
        requests, none waiting, KV cache use 0.25 per running request (at most 1), 10
        prompt tokens per request answered (the repeats' 8 cached), its output tokens.
        """
        if self.sim is not None and shape == "vllm":
            return self.sim.metrics_text(self.config.model)
        answered = sum(self.requests.values())
        running = self.running
        queries, hits = 10.0 * answered, 8.0 * max(0, answered - 1)
        usage = min(1.0, 0.25 * running)
        label = f'{{model_name="{self.config.model}"}}'
        if shape == "vllm":
            lines = [
                "# TYPE vllm:num_requests_running gauge",
                f"vllm:num_requests_running{label} {running}.0",
                "# TYPE vllm:num_requests_waiting gauge",
                f"vllm:num_requests_waiting{label} 0.0",
                "# TYPE vllm:kv_cache_usage_perc gauge",
                f"vllm:kv_cache_usage_perc{label} {usage}",
                "# TYPE vllm:prefix_cache_queries_total counter",
                f"vllm:prefix_cache_queries_total{label} {queries}",
                "# TYPE vllm:prefix_cache_hits_total counter",
                f"vllm:prefix_cache_hits_total{label} {hits}",
            ]
        elif shape == "sglang":
            lines = [
                "# TYPE sglang:num_running_reqs gauge",
                f"sglang:num_running_reqs{label} {running}.0",
                "# TYPE sglang:num_queue_reqs gauge",
                f"sglang:num_queue_reqs{label} 0.0",
                "# TYPE sglang:token_usage gauge",
                f"sglang:token_usage{label} {usage}",
                "# TYPE sglang:prompt_tokens_total counter",
                f"sglang:prompt_tokens_total{label} {queries}",
                "# TYPE sglang:cached_tokens_total counter",
                f"sglang:cached_tokens_total{label} {hits}",
            ]
        else:
            lines = [
                "# TYPE llamacpp:prompt_tokens_total counter",
                f"llamacpp:prompt_tokens_total {queries - hits:g}",
                "# TYPE llamacpp:prompt_tokens_cached_total counter",
                f"llamacpp:prompt_tokens_cached_total {hits:g}",
                "# TYPE llamacpp:requests_processing gauge",
                f"llamacpp:requests_processing {running}",
                "# TYPE llamacpp:requests_deferred gauge",
                "llamacpp:requests_deferred 0",
            ]
        gen = "llamacpp:n_decode_total" if shape == "llamacpp" else f"{shape}:generation_tokens_total"
        lines += [f"# TYPE {gen} counter", f"{gen} {self.generated_tokens:g}"]
        return "\n".join(lines) + "\n"

    # -- generation -------------------------------------------------------------

    def generate(self, request: Any, body: dict[str, Any], kind: str) -> Any:
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) for m in messages
            ):
                raise _Error(400, "'messages' must be a non-empty list of objects",
                             param="messages")
            tokens = chat_tokens(messages) if self.sim is not None else []
            prompt_tokens = _count_words(messages)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, (str, list)):
                raise _Error(400, "'prompt' must be a string or a list", param="prompt")
            tokens = sim_prompt_tokens(prompt) if self.sim is not None else []
            prompt_tokens = _count_words(prompt)
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is not None and (
            not isinstance(limit, int) or isinstance(limit, bool) or limit < 0
        ):
            raise _Error(400, "'max_tokens' must be a non-negative integer", param="max_tokens")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise _Error(400, "'stream' must be true or false", param="stream")
        if self.sim is not None:
            return self._simulate(request, body, kind, tokens, limit, stream)
        n = self.config.tokens if limit is None else min(limit, self.config.tokens)
        finish = "length" if limit is not None and limit < self.config.tokens else "stop"
        words = reply_words(n)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n,
            "total_tokens": prompt_tokens + n,
        }
        self._count(kind)
        self.generated_tokens += n
        if stream:
            opts = body.get("stream_options")
            include_usage = self.config.stream_usage and isinstance(opts, dict) and opts.get("include_usage") is True
            return StreamedReply(self, request, kind, words, finish, usage if include_usage else None).begin()
        return self._whole(request, kind, words, finish, usage)

    def _simulate(self, request: Any, body: dict[str, Any], kind: str, tokens: list[str],
                  limit: int | None, stream: bool) -> Any:
        assert self.sim is not None
        n = max(1, self.config.tokens if limit is None else limit)
        words = reply_words(n)
        self._count(kind)
        opts = body.get("stream_options")
        include_usage = (self.config.stream_usage and isinstance(opts, dict)
                         and opts.get("include_usage") is True)
        out = SimReply(self, request, kind, words, stream, include_usage, len(tokens))
        try:
            out.sim_request = self.sim.submit(tokens, n, out.token, out.done)
        except CannotFit as e:
            raise _Error(400, str(e), param="max_tokens") from None
        return out.begin()

    def _whole(self, request: Any, kind: str, words: list[str], finish: str,
               usage: dict[str, Any]) -> Any:
        data = self._whole_bytes(kind, words, finish, usage)
        request.setHeader(b"content-type", b"application/json")
        delay = len(words) / self.config.tokens_per_second if self.config.tokens_per_second else 0
        if not delay:
            return data
        call = self.clock.callLater(delay, finish_with, request, data)

        def gone(_: Any) -> None:
            if call.active():
                call.cancel()

        request.notifyFinish().addErrback(gone)
        return server.NOT_DONE_YET

    def _whole_bytes(self, kind: str, words: list[str], finish: str,
                     usage: dict[str, Any]) -> bytes:
        created = int(self.clock.seconds())
        text = "".join(words)
        if kind == "chat":
            doc: dict[str, Any] = {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": created,
                "model": self.config.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": None,
                        "finish_reason": finish,
                    }
                ],
                "usage": usage,
            }
        else:
            doc = {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": created,
                "model": self.config.model,
                "choices": [
                    {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
                ],
                "usage": usage,
            }
        return json.dumps(doc).encode()

    def embeddings(self, request: Any, body: dict[str, Any]) -> bytes:
        inputs = body.get("input")
        if isinstance(inputs, str):
            items: list[Any] = [inputs]
        elif isinstance(inputs, list) and inputs:
            items = inputs
        else:
            raise _Error(400, "'input' must be a string or a non-empty list", param="input")
        if any(not isinstance(i, (str, list)) for i in items):
            raise _Error(400, "each 'input' item must be a string or a list of tokens",
                         param="input")
        dims = body.get("dimensions", EMBEDDING_DIMENSIONS)
        if not isinstance(dims, int) or isinstance(dims, bool) or not 1 <= dims <= 4096:
            raise _Error(400, "'dimensions' must be an integer in 1..4096", param="dimensions")
        self._count("embeddings")
        tokens = sum(_count_words(i) if isinstance(i, str) else len(i) for i in items)
        request.setHeader(b"content-type", b"application/json")
        return json.dumps(
            {
                "object": "list",
                "data": [
                    {"object": "embedding", "index": i, "embedding": embedding(json.dumps(item), dims)}
                    for i, item in enumerate(items)
                ],
                "model": self.config.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        ).encode()


class _Site(server.Site):
    """
    The fake's site: request bodies are JSON, never forms, so they are not
    parsed as forms (which costs a good share of a request's CPU), and
    there is no access log (nothing would show it).
    """

    noisy = False

    def __init__(self, resource: Resource):
        super().__init__(resource, parsePOSTFormSubmission=False)

    def log(self, request: Any) -> None:
        pass


def make_resource(config: FakeModelConfig, clock: IReactorTime) -> Resource:
    """
    The fake server's root resource. Its start-up delay counts from now on
    C{clock}.
    """
    return FakeModelApp(config, clock).root


def listen(reactor: Any, config: FakeModelConfig, port: int = 0,
           host: str = "127.0.0.1") -> Any:
    """
    Serve a fake model on C{host}:C{port} (0: any free port); returns the
    C{IListeningPort}. C{config.instance} defaults to C{HOST:PORT}.
    """
    app = FakeModelApp(config, reactor)
    site = _Site(app.root)
    listening = reactor.listenTCP(port, site, interface=host, backlog=1024)
    if not config.instance:
        config.instance = f"{host}:{listening.getHost().port}"
    return listening


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m llmgw.testing.fakemodel",
        description="A fake OpenAI-style model server for tests (no model, no GPU).",
    )
    p.add_argument("--port", type=int, default=None,
                   help="port to listen on (default: $LLMGW_PORT)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the model name it serves")
    p.add_argument("--startup-delay", type=float, default=0.0,
                   help="seconds of 503 from /health after start")
    p.add_argument("--tokens-per-second", type=float, default=0.0,
                   help="pace of streamed tokens (0: unpaced)")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="words in a full reply")
    p.add_argument("--fail-health", action="store_true", help="/health always answers 503")
    p.add_argument("--exit-after", type=float, default=None,
                   help="exit on its own after this many seconds")
    p.add_argument("--exit-code", type=int, default=3, help="exit status for --exit-after")
    p.add_argument("--metrics", choices=METRICS_SHAPES, default="",
                   help="serve /metrics shaped like this engine's (or garbage, or hang)")
    p.add_argument("--metrics-hang-after", type=float, default=None,
                   help="from this many seconds after start, /metrics never answers")
    sim = EngineSimConfig()
    p.add_argument("--engine-sim", action="store_true",
                   help="time generation with the engine simulator (llmgw.testing.enginesim); "
                        "implies --metrics vllm unless another is given")
    p.add_argument("--kv-blocks", type=int, default=sim.kv_blocks, help="simulated KV-cache blocks")
    p.add_argument("--block-tokens", type=int, default=sim.block_tokens, help="tokens per KV block")
    p.add_argument("--max-running", type=int, default=sim.max_running,
                   help="most requests decoded together")
    p.add_argument("--step-ms", type=float, default=sim.step_s * 1000,
                   help="milliseconds a decode step takes with nothing running")
    p.add_argument("--step-per-seq-ms", type=float, default=sim.step_per_seq_s * 1000,
                   help="milliseconds each running request adds to a step")
    p.add_argument("--prefill-us-per-token", type=float, default=sim.prefill_s_per_token * 1e6,
                   help="microseconds of prefill per uncached prompt token")
    p.add_argument("--ignore-term", action="store_true",
                   help="ignore SIGTERM (to exercise a supervisor's KILL after the grace)")
    return p


def main(argv: list[str] | None = None, reactor: Any = None,
         environ: dict[str, str] | None = None) -> int:
    """
    Run the fake model server until it is stopped; returns the exit status.
    """
    args = _parser().parse_args(argv)
    env = os.environ if environ is None else environ
    port = args.port
    if port is None:
        try:
            port = int(env["LLMGW_PORT"])
        except (KeyError, ValueError):
            print("fakemodel: give --port or set LLMGW_PORT to a port number", file=sys.stderr)
            return 2
    if args.tokens < 0 or args.tokens_per_second < 0 or args.startup_delay < 0:
        print("fakemodel: --tokens, --tokens-per-second and --startup-delay must not be "
              "negative", file=sys.stderr)
        return 2
    if reactor is None:
        from twisted.internet import reactor as _reactor

        reactor = _reactor
    engine_sim = None
    if args.engine_sim:
        try:
            engine_sim = EngineSimConfig(
                kv_blocks=args.kv_blocks,
                block_tokens=args.block_tokens,
                max_running=args.max_running,
                step_s=args.step_ms / 1000,
                step_per_seq_s=args.step_per_seq_ms / 1000,
                prefill_s_per_token=args.prefill_us_per_token / 1e6,
            )
        except ValueError as e:
            print(f"fakemodel: bad engine simulator parameters: {e}", file=sys.stderr)
            return 2
    config = FakeModelConfig(
        model=args.model,
        startup_delay=args.startup_delay,
        tokens_per_second=args.tokens_per_second,
        tokens=args.tokens,
        fail_health=args.fail_health,
        metrics=args.metrics or ("vllm" if engine_sim is not None else ""),
        metrics_hang_after=args.metrics_hang_after,
        engine_sim=engine_sim,
    )
    try:
        listening = listen(reactor, config, port, args.host)
    except Exception as e:  # CannotListenError and friends
        print(f"fakemodel: cannot listen on {args.host}:{port}: {e}", file=sys.stderr)
        return 1
    status = {"code": 0}
    print(
        f"fakemodel: serving model {args.model!r} on {args.host}:{listening.getHost().port}"
        f" (pid {os.getpid()}, startup delay {args.startup_delay}s)",
        flush=True,
    )
    if args.exit_after is not None:
        def leave() -> None:
            print(f"fakemodel: exiting with status {args.exit_code} after "
                  f"{args.exit_after}s as asked (--exit-after)", file=sys.stderr, flush=True)
            status["code"] = args.exit_code
            reactor.stop()

        reactor.callLater(args.exit_after, leave)
    if args.ignore_term:
        def ignore(signum: int, frame: Any) -> None:
            print("fakemodel: ignoring SIGTERM (--ignore-term)", file=sys.stderr, flush=True)

        reactor.callWhenRunning(signal.signal, signal.SIGTERM, ignore)
    reactor.run()
    return status["code"]


if __name__ == "__main__":
    sys.exit(main())
