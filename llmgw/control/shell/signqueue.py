"""
Certificate requests handled in turn, a slice at a time: each costs about a
millisecond of the reactor (the request's checks, signing, the record), and
a burst (many streams asking in one reactor turn, a join storm) done at
once would hold the reactor for all of them. Requests run at once while the
current turn's budget lasts; past it they wait, in order, for the next
turns, each of which does at most a budget's worth; past a bound they are
turned away, to ask again later.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

#: The reactor time requests may take in one turn, in seconds.
TURN_BUDGET = 0.005
#: Requests that may wait for a turn; past it a new one is turned away.
MAX_WAITING = 4096


class SigningQueue:
    """
    Runs submitted work in order, at most about C{budget} seconds of it per
    reactor turn (a piece of work already begun runs to its end).
    """

    log = Logger()

    def __init__(self, clock: IReactorTime, budget: float = TURN_BUDGET, max_waiting: int = MAX_WAITING,
                 timer: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.budget = budget
        self.max_waiting = max_waiting
        self.timer = timer
        self._waiting: deque[Callable[[], None]] = deque()
        self._spent = 0.0
        self._next: IDelayedCall | None = None
        #: The most that waited at once, since start.
        self.waiting_peak = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def submit(self, work: Callable[[], None]) -> bool:
        """
        Run C{work} now, or once earlier work is done and a turn has room
        for it. Returns C{False}, and runs nothing, when C{max_waiting}
        already wait.
        """
        if not self._waiting and self._spent < self.budget:
            self._run(work)
            self._schedule()  # the next turn starts with a budget of its own
            return True
        if len(self._waiting) >= self.max_waiting:
            return False
        self._waiting.append(work)
        self.waiting_peak = max(self.waiting_peak, len(self._waiting))
        self._schedule()
        return True

    def _run(self, work: Callable[[], None]) -> None:
        started = self.timer()
        try:
            work()
        except Exception:
            self.log.failure("a certificate request failed")
        finally:
            self._spent += self.timer() - started

    def _schedule(self) -> None:
        if self._next is None:
            self._next = self.clock.callLater(0, self._turn)

    def _turn(self) -> None:
        self._next = None
        self._spent = 0.0
        # At least one a turn, whatever the budget: the queue always moves.
        first = True
        while self._waiting and (first or self._spent < self.budget):
            first = False
            self._run(self._waiting.popleft())
        if self._waiting:
            self._schedule()
