"""
Helpers for integration tests that run real processes on loopback.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.internet.protocol import ProcessProtocol

# Where tests get the ports their children bind; kept importable from here.
from llmgw.testing.ports import free_port as free_port

#: How much of a child's output L{ProcessOutput} keeps.
KEEP_BYTES = 200_000


class ProcessOutput(ProcessProtocol):
    """
    Keeps the tail of a child's stdout and stderr; C{ended} fires with the
    reason's value when the process has ended and its pipes are closed.
    """

    def __init__(self) -> None:
        self.data = b""
        self.ended: defer.Deferred[Any] = defer.Deferred()

    def childDataReceived(self, fd: int, data: bytes) -> None:
        self.data = (self.data + data)[-KEEP_BYTES:]

    def processEnded(self, reason: Any) -> None:
        self.ended.callback(reason.value)

    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


def wait_until(
    reactor: Any, predicate: Callable[[], bool], timeout: float, what: str,
    interval: float = 0.02,
) -> defer.Deferred[None]:
    """
    Fire once C{predicate()} is true, checked every C{interval} seconds on
    C{reactor}; fail with C{TimeoutError} naming C{what} after C{timeout}.
    For bounded integration tests with real processes.
    """
    from twisted.internet.task import deferLater

    deadline = reactor.seconds() + timeout

    @defer.inlineCallbacks
    def loop() -> Any:
        while not predicate():
            if reactor.seconds() > deadline:
                raise TimeoutError(f"{what}: not within {timeout}s")
            yield deferLater(reactor, interval, lambda: None)

    return loop()  # type: ignore[no-any-return]


def process_alive(pid: int) -> bool:
    """
    Whether C{pid} is a live process (a zombie is not).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rfind(b")") + 2 :][:1] not in (b"Z", b"X")


#: A shard main process that starts a child in its own process group (the
#: child writes its pid to argv[1]; with argv[2] == "ignore" it ignores TERM),
#: waits until the child is up, then ends as argv[3] says: "exit" (code 1),
#: "segv", or "wait" (sleep until TERMed, then exit at once).
PARENT_WITH_CHILD = r"""
import os, signal, subprocess, sys, time
pidfile, mode, how = sys.argv[1], sys.argv[2], sys.argv[3]
child = (
    "import os, signal, sys, time\n"
    + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if mode == "ignore" else "")
    + "open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid()))\n"
    + "os.rename(sys.argv[1] + '.tmp', sys.argv[1])\n"
    + "time.sleep(120)\n"
)
subprocess.Popen([sys.executable, "-c", child, pidfile])
while not os.path.exists(pidfile):
    time.sleep(0.01)
print("child started", flush=True)
if how == "exit":
    sys.exit(1)
if how == "segv":
    os.kill(os.getpid(), signal.SIGSEGV)
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
time.sleep(120)
"""

#: Scripts that end the way each crash class looks; argv[1] is a port that
#: is already taken (for port_in_use).
CRASH_SCRIPTS: dict[str, str] = {
    "config": (
        "import sys\n"
        "print('usage: api_server.py [-h] [--model MODEL]', file=sys.stderr)\n"
        "print('api_server.py: error: unrecognized arguments: --bogus', file=sys.stderr)\n"
        "sys.exit(2)\n"
    ),
    "oom": (
        "class OutOfMemoryError(RuntimeError):\n    pass\n"
        "raise OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
        "total capacity of 79.15 GiB of which 1.23 GiB is free.')\n"
    ),
    "port_in_use": (
        "import socket, sys\n"
        "s = socket.socket()\n"
        "s.bind(('127.0.0.1', int(sys.argv[1])))\n"
    ),
    "engine_crash": "import os, signal\nprint('loading', flush=True)\nos.kill(os.getpid(), signal.SIGSEGV)\n",
    "traceback": "def load():\n    raise KeyError('layers.0.weight')\nload()\n",
    "killed": "import os, signal\nprint('serving', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "unknown": "import sys\nprint('done')\nsys.exit(3)\n",
}


def processes_marked(state_root: str) -> list[int]:
    """
    Pids of live processes started by an agent whose state directory is
    under C{state_root} (their C{LLMGW_AGENT_STATE} says so): shards and
    what they forked, for tests' cleanup and "nothing left" checks.
    """
    needle = b"LLMGW_AGENT_STATE=" + state_root.encode()
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                entries = f.read().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(needle) for e in entries) and process_alive(int(name)):
            pids.append(int(name))
    return pids
