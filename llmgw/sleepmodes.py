"""
How each engine sleeps and wakes (DESIGN §22), as plain data shared by the
catalog (which flags turn sleeping on), the agent (which calls put an
engine to sleep and tell whether it sleeps) and the gateway (which call
wakes it). Pure: no I/O.

  - vLLM (C{--enable-sleep-mode}, its development endpoints on with
    C{VLLM_SERVER_DEV_MODE=1}): C{POST /sleep?level=N} (1 offloads the
    weights to CPU memory and drops the KV cache, 2 drops both),
    C{POST /wake_up}, C{GET /is_sleeping} answering
    C{{"is_sleeping": bool}}.
  - SGLang (C{--enable-memory-saver}): C{POST /release_memory_occupation}
    and C{POST /resume_memory_occupation}, each with a JSON object; it has
    no call that says whether it sleeps, so the agent keeps its own word.
  - llama.cpp's server (C{--sleep-idle-seconds N}): sleeps by itself after
    C{N} idle seconds, says so as C{is_sleeping} in C{GET /props}, and
    wakes on the next request: there is no call to make.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class SleepMode:
    """
    One engine's sleep calls. A path of "" is a call the engine lacks.

    @ivar sleep_path: what the agent POSTs to put it to sleep ("": it
        sleeps by itself); C{{level}} is filled with the profile's level.
    @ivar wake_path: what a gateway POSTs to wake it ("": a request wakes it).
    @ivar status_path: what the agent GETs to learn whether it sleeps
        ("": no such call), read by L{read_status}.
    @ivar self_timed: the engine keeps its own idle timer (a flag at start).
    """

    engine: str
    sleep_path: str
    wake_path: str
    status_path: str
    self_timed: bool = False


MODES = {
    "vllm": SleepMode("vllm", "/sleep?level={level}", "/wake_up", "/is_sleeping"),
    "sglang": SleepMode("sglang", "/release_memory_occupation", "/resume_memory_occupation", ""),
    "llamacpp": SleepMode("llamacpp", "", "", "/props", self_timed=True),
}

#: The deepest sleep level any engine takes (vLLM's 2).
MAX_LEVEL = 2


def mode(engine: str) -> SleepMode | None:
    """
    C{engine}'s sleep calls, or C{None} when llmgw cannot put it to sleep.
    """
    return MODES.get(engine)


def start_flags(engine: str, sleep_after_s: float) -> tuple[str, ...]:
    """
    The engine flags that turn sleeping on, for the command llmgw writes.
    """
    if engine == "vllm":
        return ("--enable-sleep-mode",)
    if engine == "sglang":
        return ("--enable-memory-saver",)
    if engine == "llamacpp":
        # llama.cpp counts whole seconds; at least one.
        return ("--sleep-idle-seconds", str(max(1, round(sleep_after_s))))
    return ()


def start_env(engine: str) -> dict[str, str]:
    """
    Environment the engine needs for its sleep calls to be served.
    """
    return {"VLLM_SERVER_DEV_MODE": "1"} if engine == "vllm" else {}


def read_status(engine: str, body: bytes) -> bool:
    """
    Whether the answer to C{engine}'s status call says it sleeps.

    @raise ValueError: the answer is not what the engine sends.
    """
    try:
        data = json.loads(body)
    except ValueError as e:
        raise ValueError(f"{engine}'s sleep status is not JSON: {e}") from None
    value = data.get("is_sleeping") if isinstance(data, dict) else None
    if not isinstance(value, bool):
        raise ValueError(f"{engine}'s sleep status has no boolean is_sleeping")
    return value


def sleep_body(engine: str) -> bytes:
    """
    The body of the sleep and wake calls (SGLang takes a JSON object).
    """
    return b"{}" if engine == "sglang" else b""
