"""
An engine simulator: a test tool that behaves, in time, like a
continuous-batching inference engine (vLLM's scheduler, much simplified).
It computes nothing; it decides when each token of each request would come
out, on a clock, so that routing and admission can be measured without a
GPU. The fake model server serves it with C{--engine-sim}
(L{llmgw.testing.fakemodel}).

The model:

Tokens
    A prompt is split into words (whitespace), each word one token; a chat's
    messages are laid out as C{"ROLE: CONTENT"} one after the other, so a
    conversation's next turn starts with exactly the tokens of the one
    before it.
KV cache
    C{kv_blocks} blocks of C{block_tokens} tokens. A request holds, from its
    admission to its end, the blocks of its prompt and of its output
    (C{ceil((prompt + max_tokens) / block_tokens)}). The prompt's full
    blocks are named by a chained hash (block i covers tokens 0 to
    (i + 1) * block_tokens), so requests with the same leading tokens share
    them. A block no request holds stays cached (LRU) until its space is
    needed.
Prefix cache
    At admission, the prompt's leading full blocks that are cached are hits:
    their tokens need no prefill. Every admitted prompt's tokens count as
    queries, its hit tokens as hits (C{vllm:prefix_cache_queries_total},
    C{vllm:prefix_cache_hits_total}).
Scheduling
    Steps, one after the other while there is work. At the start of a step
    waiting requests are admitted first come, first served while fewer than
    C{max_running} run and the KV cache has room (free or evictable blocks);
    otherwise they wait (C{vllm:num_requests_waiting}). A step lasts
    C{step_s + step_per_seq_s * running} plus C{prefill_s_per_token} for
    each uncached prompt token of the requests admitted in it (prefill is
    done in the step that admits them). At the end of a step every running
    request has one more output token (the first is its time to first
    token); one that has all of its tokens ends and frees its blocks.
    A request that could never fit (more blocks than C{kv_blocks}) is
    refused.
Metrics
    C{vllm:num_requests_running}, C{vllm:num_requests_waiting},
    C{vllm:kv_cache_usage_perc} (blocks held by requests / C{kv_blocks}),
    the prefix-cache counters above, and C{vllm:generation_tokens_total}
    (every output token of every request).
Hanging
    L{EngineSim.hang} wedges the engine the way a stuck engine core does:
    no step runs any more, so no request gets another token, while what
    runs and waits stays as it was and the metrics (running requests, a
    flat token counter) and health go on answering.
"""

from __future__ import annotations

import hashlib
import json
import math
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from twisted.internet.interfaces import IDelayedCall, IReactorTime


@dataclass(frozen=True)
class EngineSimConfig:
    """
    The simulated engine's capacity and speed (defaults: a small GPU's
    worth, scaled so that tests and benchmarks run in seconds).
    """

    #: KV-cache capacity, in blocks.
    kv_blocks: int = 2048
    #: Tokens per block.
    block_tokens: int = 16
    #: Requests decoded together at most.
    max_running: int = 64
    #: Seconds a step takes with nothing running.
    step_s: float = 0.010
    #: Seconds each running request adds to a step.
    step_per_seq_s: float = 0.0003
    #: Seconds of prefill per uncached prompt token.
    prefill_s_per_token: float = 0.00005

    def __post_init__(self) -> None:
        if self.kv_blocks < 1 or self.block_tokens < 1 or self.max_running < 1:
            raise ValueError("kv_blocks, block_tokens and max_running must be at least 1")
        if min(self.step_s, self.step_per_seq_s, self.prefill_s_per_token) < 0:
            raise ValueError("step and prefill times must not be negative")


def chat_tokens(messages: list[Any]) -> list[str]:
    """
    The tokens of a chat prompt (see the module's model).
    """
    out: list[str] = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):
            content = " ".join(
                p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
        out.append(f"{m.get('role')}:")
        out.extend(str(content or "").split())
    return out


def prompt_tokens(prompt: Any) -> list[str]:
    if isinstance(prompt, list):
        return " ".join(str(p) for p in prompt).split()
    return str(prompt).split()


def block_hashes(tokens: list[str], block_tokens: int) -> list[bytes]:
    """
    Chained hashes of C{tokens}' full blocks.
    """
    out = []
    h = b""
    for i in range(len(tokens) // block_tokens):
        chunk = "\x00".join(tokens[i * block_tokens : (i + 1) * block_tokens])
        h = hashlib.blake2b(h + chunk.encode("utf-8", "surrogatepass"), digest_size=12).digest()
        out.append(h)
    return out


class CannotFit(ValueError):
    """
    A request needs more KV blocks than the engine has.
    """


class SimRequest:
    """
    One request in the simulated engine. C{on_token(n)} is called as the
    n-th output token (1-based) comes out, C{on_done()} after the last.
    """

    def __init__(
        self,
        tokens: list[str],
        max_tokens: int,
        hashes: list[bytes],
        on_token: Callable[[int], None],
        on_done: Callable[[], None],
    ):
        self.tokens = tokens
        self.max_tokens = max_tokens
        self.hashes = hashes
        self.on_token = on_token
        self.on_done = on_done
        self.generated = 0
        self.cached_tokens = 0
        self.private_blocks = 0
        self.state = "waiting"  # running, done, cancelled


#: The simulators of this process, for L{hang_all}.
LIVE: weakref.WeakSet[EngineSim] = weakref.WeakSet()


def hang_all() -> int:
    """
    Wedge every simulator of this process (L{EngineSim.hang}); returns how
    many.
    """
    sims = list(LIVE)
    for sim in sims:
        sim.hang()
    return len(sims)


class EngineSim:
    """
    The simulated engine (see the module's model), on C{clock}.
    """

    def __init__(self, clock: IReactorTime, config: EngineSimConfig | None = None):
        LIVE.add(self)
        self.clock = clock
        self.config = config = config if config is not None else EngineSimConfig()
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        #: Shared prompt blocks held by running requests: hash -> holders.
        self._held: dict[bytes, int] = {}
        #: Blocks no request holds but still cached, oldest first.
        self._cached: OrderedDict[bytes, None] = OrderedDict()
        self._private = 0
        self._step: IDelayedCall | None = None
        self._admitted_this_step: list[SimRequest] = []
        self.queries = 0
        self.hits = 0
        #: Output tokens of all requests so far.
        self.generated = 0
        #: Wedged (L{hang}): no step runs again.
        self.hung = False

    # -- figures ----------------------------------------------------------------------

    def used_blocks(self) -> int:
        return len(self._held) + self._private

    def kv_usage(self) -> float:
        return self.used_blocks() / self.config.kv_blocks

    def metrics_text(self, model: str) -> str:
        """
        Prometheus text with vLLM's names.
        """
        label = f'{{model_name="{model}"}}'
        return (
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{label} {float(len(self.running))}\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{label} {float(len(self.waiting))}\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{label} {self.kv_usage()}\n"
            "# TYPE vllm:prefix_cache_queries_total counter\n"
            f"vllm:prefix_cache_queries_total{label} {float(self.queries)}\n"
            "# TYPE vllm:prefix_cache_hits_total counter\n"
            f"vllm:prefix_cache_hits_total{label} {float(self.hits)}\n"
            "# TYPE vllm:generation_tokens_total counter\n"
            f"vllm:generation_tokens_total{label} {float(self.generated)}\n"
        )

    def hang(self) -> None:
        """
        Wedge the engine for good: the step under way never ends and no
        other starts; requests stay running and waiting, tokenless.
        """
        self.hung = True
        if self._step is not None and self._step.active():
            self._step.cancel()
        self._step = None

    # -- requests ---------------------------------------------------------------------

    def blocks_needed(self, prompt: int, max_tokens: int) -> int:
        return math.ceil((prompt + max_tokens) / self.config.block_tokens)

    def submit(
        self,
        tokens: list[str],
        max_tokens: int,
        on_token: Callable[[int], None],
        on_done: Callable[[], None],
    ) -> SimRequest:
        """
        Queue a request.

        @raise CannotFit: it needs more blocks than the whole KV cache.
        """
        need = self.blocks_needed(len(tokens), max_tokens)
        if need > self.config.kv_blocks:
            raise CannotFit(
                f"the prompt and max_tokens need {need} KV blocks; this engine has "
                f"{self.config.kv_blocks}"
            )
        req = SimRequest(tokens, max_tokens, block_hashes(tokens, self.config.block_tokens), on_token, on_done)
        self.waiting.append(req)
        self._wake()
        return req

    def cancel(self, req: SimRequest) -> None:
        """
        The client went away: the request leaves the queue or the batch.
        """
        if req.state == "waiting":
            self.waiting.remove(req)
        elif req.state == "running":
            self.running.remove(req)
            self._release(req)
        req.state = "cancelled"

    # -- the scheduler ----------------------------------------------------------------

    def _wake(self) -> None:
        if self._step is None and not self.hung:
            self._step = self.clock.callLater(0, self._begin_step)

    def _free_space(self) -> int:
        # Blocks neither held nor cached.
        return self.config.kv_blocks - self.used_blocks() - len(self._cached)

    def _try_admit(self, req: SimRequest) -> bool:
        hashes = req.hashes
        hit = 0
        for h in hashes:
            if h in self._held or h in self._cached:
                hit += 1
            else:
                break
        new_shared = [h for h in hashes if h not in self._held]
        from_cache = [h for h in new_shared if h in self._cached]
        need_private = self.blocks_needed(len(req.tokens), req.max_tokens) - len(hashes)
        # Cached blocks it reuses move to held in place; the rest need free
        # space, made by evicting the least recently used cached blocks.
        need = len(new_shared) - len(from_cache) + need_private
        if need > self._free_space() + len(self._cached) - len(from_cache):
            return False
        for h in from_cache:
            del self._cached[h]
            self._held[h] = 0
        while self._free_space() < need:
            self._cached.popitem(last=False)
        for h in hashes:
            self._held[h] = self._held.get(h, 0) + 1
        req.private_blocks = need_private
        self._private += need_private
        req.cached_tokens = hit * self.config.block_tokens
        self.queries += len(req.tokens)
        self.hits += req.cached_tokens
        req.state = "running"
        return True

    def _release(self, req: SimRequest) -> None:
        self._private -= req.private_blocks
        req.private_blocks = 0
        for h in req.hashes:
            n = self._held[h] - 1
            if n:
                self._held[h] = n
            else:
                del self._held[h]
                self._cached[h] = None

    def _begin_step(self) -> None:
        self._step = None
        if self.hung:
            return
        c = self.config
        prefill = 0
        admitted = []
        while self.waiting and len(self.running) < c.max_running:
            req = self.waiting[0]
            if not self._try_admit(req):
                break
            self.waiting.popleft()
            self.running.append(req)
            admitted.append(req)
            prefill += len(req.tokens) - req.cached_tokens
        if not self.running:
            return
        duration = c.step_s + c.step_per_seq_s * len(self.running) + c.prefill_s_per_token * prefill
        self._step = self.clock.callLater(duration, self._end_step)

    def _end_step(self) -> None:
        self._step = None
        still = []
        finished = []
        for req in self.running:
            req.generated += 1
            self.generated += 1
            if req.generated >= req.max_tokens:
                finished.append(req)
            else:
                still.append(req)
        self.running = still
        for req in finished:
            req.state = "done"
            self._release(req)
        # Callbacks last: they may cancel or submit.
        for req in still + finished:
            if req.state in ("running", "done"):
                req.on_token(req.generated)
        for req in finished:
            req.on_done()
        if self.running or self.waiting:
            self._begin_step()


class SimLoras:
    """
    vLLM's runtime LoRA endpoints as documented (its "LoRA Adapters"
    page, "Dynamically serving LoRA Adapters"), for tests of what loads
    and unloads adapters without a GPU: the shapes, not the weights.

    Served only when the engine runs with C{VLLM_ALLOW_RUNTIME_LORA_UPDATING}
    (C{enabled}); otherwise the paths are unknown (404), as in vLLM.

    - C{POST /v1/load_lora_adapter} with C{{"lora_name", "lora_path"}}:
      200 and the text C{Success: LoRA adapter 'NAME' added successfully.};
      400 when either is missing or the name is already loaded.
    - C{POST /v1/unload_lora_adapter} with C{{"lora_name"}}: 200 and
      C{Success: LoRA adapter 'NAME' removed successfully.}; 400 without a
      name, 404 for one not loaded.
    - Errors are vLLM's JSON error object. Loaded adapters are served
      under their names (L{serves}) and listed by C{/v1/models} with the
      base as C{parent} and the path as C{root}.

    C{max_loras} is what the engine batches at once; vLLM itself keeps
    more loaded than that (on the CPU), so more are not refused here
    either: keeping to C{max_loras} is the caller's business.
    """

    LOAD = "/v1/load_lora_adapter"
    UNLOAD = "/v1/unload_lora_adapter"

    def __init__(self, enabled: bool = True, max_loras: int = 1):
        self.enabled = enabled
        self.max_loras = max_loras
        #: name -> path, in the order loaded
        self.loaded: dict[str, str] = {}
        #: (path, name) of every call answered, in order
        self.calls: list[tuple[str, str]] = []

    def handles(self, path: str) -> bool:
        return self.enabled and path in (self.LOAD, self.UNLOAD)

    def serves(self, model: str) -> bool:
        return model in self.loaded

    def models(self, base: str) -> list[dict[str, Any]]:
        return [{"id": name, "object": "model", "owned_by": "vllm", "root": path, "parent": base}
                for name, path in self.loaded.items()]

    def handle(self, path: str, body: bytes) -> tuple[int, str, bytes]:
        """
        Answer a C{POST} to C{path} (one L{handles}): status, content type, body.
        """
        try:
            req = json.loads(body or b"{}")
        except ValueError:
            req = None
        if not isinstance(req, dict):
            return self._error(400, "The request body must be a JSON object.", "BadRequestError")
        name = req.get("lora_name")
        self.calls.append((path, str(name)))
        if path == self.LOAD:
            if not name or not req.get("lora_path"):
                return self._error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
            if name in self.loaded:
                return self._error(400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput")
            self.loaded[name] = str(req["lora_path"])
            return 200, "text/plain", f"Success: LoRA adapter '{name}' added successfully.".encode()
        if not name:
            return self._error(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        if name not in self.loaded:
            return self._error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.loaded[name]
        return 200, "text/plain", f"Success: LoRA adapter '{name}' removed successfully.".encode()

    @staticmethod
    def _error(status: int, message: str, kind: str) -> tuple[int, str, bytes]:
        doc = {"error": {"message": message, "type": kind, "param": None, "code": status}}
        return status, "application/json", json.dumps(doc).encode()
