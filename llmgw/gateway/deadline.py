"""
A deadline that mostly moves later, on one reactor call.

The gateway's timeouts are put later far more often than they come due: a
kept-alive client connection's idle wait restarts with every request, a
replica connection's idle wait with every piece of a response. Moving a
Twisted C{DelayedCall} later is cheap, but it is several calls into the
reactor's Python code per move; at tens of thousands of moves a second,
that was a few percent of the gateway's CPU.

A L{Deadline} keeps the time its callback is due as a number, and one
reactor call that comes due no later than it. Put later, only the number
changes. When the call comes due before the deadline, it is made again for
the rest of the time; so a deadline that keeps moving later costs one
reactor call per timeout period, not one operation per move. Put sooner,
the call is replaced (a reactor finds a call by a search of its heap to
move it sooner; cancelling is free and a new call is log n).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from twisted.internet.interfaces import IDelayedCall

#: A call that comes due this close before its deadline (clock rounding)
#: calls the callback rather than waiting out the rest.
SLACK: Final = 1e-6


def _nothing() -> None:
    pass


class Deadline:
    """
    C{callback}, called once when C{clock} reaches the deadline last
    L{set}, unless L{clear}ed or L{stop}ped first.

    Cleared, the reactor call stays (coming due, it does nothing) for the
    next L{set}, which is then free when it is later; L{stop} drops it too,
    and L{close} the callback as well, at the owner's end.
    """

    def __init__(self, clock: Any, callback: Callable[[], object]):
        self._clock = clock
        self._callback = callback
        self._call: IDelayedCall | None = None
        #: When C{_call} comes due.
        self._call_at = 0.0
        #: When the callback is due, while armed.
        self.at = 0.0
        self.armed = False
        self._closed = False

    def set(self, delay: float) -> None:
        """
        Call the callback C{delay} seconds from now (instead of when it was
        due, if it was).
        """
        if self._closed:
            return
        clock = self._clock
        at = clock.seconds() + delay
        self.at = at
        self.armed = True
        call = self._call
        if call is not None:
            if self._call_at <= at:
                return
            call.cancel()
        self._call_at = at
        self._call = clock.callLater(delay, self._came_due)

    def clear(self) -> None:
        """
        The callback is not called; the reactor call stays, for the next
        L{set}.
        """
        self.armed = False

    def stop(self) -> None:
        """
        The callback is not called, and the reactor call goes.
        """
        self.armed = False
        call, self._call = self._call, None
        if call is not None:
            call.cancel()

    def close(self) -> None:
        """
        As L{stop}, and the callback is let go of for good: set again, the
        deadline does nothing, and makes no reactor call. (The callback is
        often a method of the deadline's owner, which holds the deadline:
        kept, the two would outlive the owner's end until the cyclic
        garbage collector came by.)
        """
        self.stop()
        self._closed = True
        self._callback = _nothing

    def _came_due(self) -> None:
        self._call = None
        if not self.armed:
            return
        left = self.at - self._clock.seconds()
        if left > SLACK:
            # Put later since the call was made: wait out the rest.
            self._call_at = self.at
            self._call = self._clock.callLater(left, self._came_due)
            return
        self.armed = False
        self._callback()
