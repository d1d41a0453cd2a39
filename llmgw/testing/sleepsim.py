"""
The engine simulator's sleep (DESIGN §22): the fake model server
(L{llmgw.testing.fakemodel}) taught the sleep endpoints of vLLM and SGLang
in their documented shapes, with times like a real engine's, so that
sleeping and waking can be tested and measured without a GPU. (vLLM's
sleep mode and SGLang's memory saver need a GPU: CI cannot run them.)

  - vLLM: C{POST /sleep?level=N} (answers once asleep), C{POST /wake_up}
    (once awake), C{GET /is_sleeping} -> C{{"is_sleeping": bool}};
  - SGLang: C{POST /release_memory_occupation} and
    C{POST /resume_memory_occupation}, each with a JSON object.

Falling asleep takes C{sleep_s}; waking takes C{wake_s} from level 1 (the
weights come back from CPU memory) and C{reload_s} from level 2 (they are
read again). While asleep or waking the engine answers generation
requests with 503 (a real engine would fail them or hang: either way the
gateway must not send them). A sleep or wake asked while one is under way
answers when that one ends.

Run as C{python -m llmgw.testing.sleepsim --sleep-mode vllm [--sleep-ms N]
[--wake-ms N] [--reload-ms N] FAKEMODEL-ARGS...}.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

#: The engines whose sleep endpoints are simulated.
MODES = ("vllm", "sglang")


@dataclass(frozen=True)
class SleepSimConfig:
    """
    Which engine's endpoints, and how long each move takes in seconds
    (defaults: a 7-8B model on one GPU, in the order vLLM reports).
    """

    mode: str = "vllm"
    sleep_s: float = 0.5
    wake_s: float = 1.5
    reload_s: float = 6.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"sleep mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if min(self.sleep_s, self.wake_s, self.reload_s) < 0:
            raise ValueError("sleep and wake times must not be negative")


class SleepSim:
    """
    An engine's sleep as a state on C{clock}: C{awake}, C{falling} (asleep
    soon), C{asleep}, C{waking}.
    """

    def __init__(self, clock: IReactorTime, config: SleepSimConfig | None = None):
        self.clock = clock
        self.config = config if config is not None else SleepSimConfig()
        self.state = "awake"
        self.level = 0
        self.sleeps = 0
        self.wakes = 0
        #: Generation requests refused while not awake.
        self.refused = 0
        self._moving: list[Deferred[None]] = []

    @property
    def sleeping(self) -> bool:
        """What C{/is_sleeping} says: anything but awake."""
        return self.state != "awake"

    def _move(self, through: str, to: str, seconds: float) -> Deferred[None]:
        d: Deferred[None] = Deferred()
        if self.state == to:
            d.callback(None)
            return d
        self._moving.append(d)
        if self.state != through:
            self.state = through
            self.clock.callLater(seconds, self._arrive, to)
        return d

    def _arrive(self, to: str) -> None:
        self.state = to
        if to == "asleep":
            self.sleeps += 1
        else:
            self.wakes += 1
        moving, self._moving = self._moving, []
        for d in moving:
            d.callback(None)

    def sleep(self, level: int = 1) -> Deferred[None]:
        """Fires once asleep (at once if it is)."""
        if self.state == "waking":
            d: Deferred[None] = Deferred()
            self._moving.append(d)
            return d.addCallback(lambda _: self.sleep(level))
        self.level = level if self.state == "awake" else max(self.level, level)
        return self._move("falling", "asleep", self.config.sleep_s)

    def wake(self) -> Deferred[None]:
        """Fires once awake (at once if it is)."""
        if self.state == "falling":
            d: Deferred[None] = Deferred()
            self._moving.append(d)
            return d.addCallback(lambda _: self.wake())
        seconds = self.config.reload_s if self.level >= 2 else self.config.wake_s
        return self._move("waking", "awake", seconds)


class _Call(Resource):
    isLeaf = True

    def __init__(self, sim: SleepSim, what: str):
        super().__init__()
        self.sim, self.what = sim, what

    def render_GET(self, request: Any) -> bytes:
        if self.what != "status":
            request.setResponseCode(405)
            return b""
        request.setHeader(b"content-type", b"application/json")
        return json.dumps({"is_sleeping": self.sim.sleeping}).encode()

    def render_POST(self, request: Any) -> Any:
        if self.what == "status":
            request.setResponseCode(405)
            return b""
        if self.what == "sleep":
            raw = request.args.get(b"level", [b"1"])[0]
            try:
                level = int(raw)
            except ValueError:
                level = -1
            if level not in (1, 2):
                request.setResponseCode(400)
                return b'{"error": "level must be 1 or 2"}'
            d = self.sim.sleep(level)
        else:
            d = self.sim.wake()
        gone: list[bool] = []
        request.notifyFinish().addErrback(lambda _: gone.append(True))

        def answer(_: None) -> None:
            if not gone:
                request.setHeader(b"content-type", b"application/json")
                request.write(b"{}")
                request.finish()

        d.addCallback(answer)
        return NOT_DONE_YET


class _Gate(Resource):
    """Generation paths refused with 503 while the engine is not awake."""

    def __init__(self, sim: SleepSim, inner: Resource):
        super().__init__()
        self.sim, self.inner = sim, inner

    def getChildWithDefault(self, path: bytes, request: Any) -> Resource:  # noqa: N802
        if self.sim.sleeping:
            self.sim.refused += 1
            return _Asleep()
        return self.inner.getChildWithDefault(path, request)


class _Asleep(Resource):
    isLeaf = True

    def render(self, request: Any) -> bytes:
        request.setResponseCode(503)
        request.setHeader(b"content-type", b"application/json")
        return b'{"error": {"message": "the engine is sleeping", "type": "server_error", "code": 503}}'


def install(app: Any, config: SleepSimConfig) -> SleepSim:
    """
    Give a fake model server (L{llmgw.testing.fakemodel.FakeModelApp}) the
    sleep endpoints of C{config.mode}; returns its L{SleepSim}, also kept
    as C{app.sleep}.
    """
    sim = app.sleep = SleepSim(app.clock, config)
    root = app.root
    if config.mode == "vllm":
        root.putChild(b"sleep", _Call(sim, "sleep"))
        root.putChild(b"wake_up", _Call(sim, "wake"))
        root.putChild(b"is_sleeping", _Call(sim, "status"))
    else:
        root.putChild(b"release_memory_occupation", _Call(sim, "sleep"))
        root.putChild(b"resume_memory_occupation", _Call(sim, "wake"))
    root.putChild(b"v1", _Gate(sim, root.children[b"v1"]))
    return sim


def main(argv: list[str] | None = None) -> int:
    """
    The fake model server with a sleep mode (see the module).
    """
    import argparse

    from llmgw.testing import fakemodel

    p = argparse.ArgumentParser(prog="python -m llmgw.testing.sleepsim",
                                description="The fake model server with an engine's sleep endpoints.")
    p.add_argument("--sleep-mode", choices=MODES, default="vllm")
    p.add_argument("--sleep-ms", type=float, default=SleepSimConfig.sleep_s * 1000)
    p.add_argument("--wake-ms", type=float, default=SleepSimConfig.wake_s * 1000)
    p.add_argument("--reload-ms", type=float, default=SleepSimConfig.reload_s * 1000)
    args, rest = p.parse_known_args(argv)
    try:
        config = SleepSimConfig(args.sleep_mode, args.sleep_ms / 1000, args.wake_ms / 1000, args.reload_ms / 1000)
    except ValueError as e:
        print(f"sleepsim: {e}", file=sys.stderr)
        return 2
    fakemodel.APP_HOOKS.append(lambda app: install(app, config))
    return fakemodel.main(rest)


if __name__ == "__main__":
    sys.exit(main())
