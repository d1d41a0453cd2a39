"""
The fake model server with a way to wedge its engine simulator from outside,
for tests that run it as a real replica process::

    python -m llmgw.testing.hangsim --engine-sim [any fakemodel option]

SIGUSR1 wedges every engine simulator in the process
(L{llmgw.testing.enginesim.EngineSim.hang}): generation stops for good while
C{/health} and C{/metrics} go on answering (running requests, a flat token
counter), as an engine core stuck behind a healthy front does. Everything
else is L{llmgw.testing.fakemodel}'s.
"""

from __future__ import annotations

import signal
import sys
from typing import Any

from llmgw.testing import fakemodel
from llmgw.testing.enginesim import hang_all


def main(argv: list[str] | None = None, reactor: Any = None) -> int:
    """
    Run the fake model server with the SIGUSR1 handler; returns its exit status.
    """
    if reactor is None:
        from twisted.internet import reactor as _reactor

        reactor = _reactor

    def hang(signum: int, frame: Any) -> None:
        # On the reactor's thread, between its calls, not inside one.
        reactor.callFromThread(wedge)

    def wedge() -> None:
        n = hang_all()
        print(f"hangsim: SIGUSR1: {n} engine simulator(s) wedged", file=sys.stderr, flush=True)

    signal.signal(signal.SIGUSR1, hang)
    return fakemodel.main(argv, reactor)


if __name__ == "__main__":
    sys.exit(main())
