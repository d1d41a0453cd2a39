"""
Tests for L{llmgw.gateway.deadline}.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.gateway.deadline import Deadline
from tests.gateway_helpers import cyclic_leftovers


class CountingClock(Clock):
    """
    A L{Clock} that counts the calls made on it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.made = 0

    def callLater(self, delay: float, f: Any, *args: Any, **kw: Any) -> Any:
        self.made += 1
        return super().callLater(delay, f, *args, **kw)


class DeadlineTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = CountingClock()
        self.fired: list[float] = []
        self.deadline = Deadline(self.clock, lambda: self.fired.append(self.clock.seconds()))

    def test_due_once_at_its_time(self) -> None:
        """
        Set, the callback is called once, when the clock reaches the
        deadline; not before.
        """
        self.deadline.set(5)
        self.clock.advance(4.9)
        self.assertEqual(self.fired, [])
        self.clock.advance(0.1)
        self.assertEqual(self.fired, [5.0])
        self.assertFalse(self.deadline.armed)
        self.clock.advance(100)
        self.assertEqual(self.fired, [5.0])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_later_costs_no_call_until_due(self) -> None:
        """
        Put later, over and over, the deadline makes no reactor call until
        its call comes due; then one for the rest, and the callback is
        called at the last deadline set.
        """
        self.deadline.set(10)
        for _ in range(9):
            self.clock.advance(1)
            self.deadline.set(10)
        self.assertEqual(self.clock.made, 1)
        self.clock.advance(1)  # t=10: the first call comes due early
        self.assertEqual(self.fired, [])
        self.assertEqual(self.clock.made, 2)
        self.assertEqual(len(self.clock.getDelayedCalls()), 1)
        self.clock.advance(8.9)
        self.assertEqual(self.fired, [])
        self.clock.advance(0.1)
        self.assertEqual(self.fired, [19.0])

    def test_sooner_replaces_the_call(self) -> None:
        """
        Put sooner than its call, the deadline replaces the call: the
        callback comes at the sooner time, and only one call is pending.
        """
        self.deadline.set(100)
        self.deadline.set(3)
        self.assertEqual(len(self.clock.getDelayedCalls()), 1)
        self.clock.advance(3)
        self.assertEqual(self.fired, [3.0])
        self.clock.advance(200)
        self.assertEqual(self.fired, [3.0])

    def test_clear_keeps_the_call_for_the_next(self) -> None:
        """
        Cleared, the callback is not called; the call stays, and a later
        deadline set next uses it.
        """
        self.deadline.set(10)
        self.deadline.clear()
        self.clock.advance(2)
        self.deadline.set(10)
        self.assertEqual(self.clock.made, 1)
        self.clock.advance(8)  # the first call comes due: made again for the rest
        self.assertEqual(self.fired, [])
        self.clock.advance(2)
        self.assertEqual(self.fired, [12.0])

    def test_cleared_call_does_nothing(self) -> None:
        """
        A cleared deadline's call comes due and calls nothing, and makes
        no other.
        """
        self.deadline.set(10)
        self.deadline.clear()
        self.clock.advance(10)
        self.assertEqual(self.fired, [])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_stop_drops_the_call(self) -> None:
        """
        Stopped, the callback is not called and no call is left pending.
        """
        self.deadline.set(10)
        self.deadline.stop()
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.clock.advance(20)
        self.assertEqual(self.fired, [])
        self.deadline.set(1)
        self.clock.advance(1)
        self.assertEqual(self.fired, [21.0])

    def test_set_from_the_callback(self) -> None:
        """
        The callback may set the deadline again.
        """
        seen: list[float] = []

        def again() -> None:
            seen.append(self.clock.seconds())
            if len(seen) < 3:
                deadline.set(2)

        deadline = Deadline(self.clock, again)
        deadline.set(2)
        self.clock.advance(2)
        self.clock.advance(2)
        self.clock.advance(2)
        self.assertEqual(seen, [2.0, 4.0, 6.0])
        self.assertEqual(self.clock.getDelayedCalls(), [])


class Owner:
    """
    What a deadline's owner usually is: its callback is a method of the
    object that holds it.
    """

    def __init__(self, clock: Clock):
        self.deadline = Deadline(clock, self.due)
        self.calls = 0

    def due(self) -> None:
        self.calls += 1


class CloseTests(SynchronousTestCase):
    def test_closed_calls_nothing(self) -> None:
        """
        A closed deadline does not call its callback, whether it was set
        before it was closed or is set after, and set after, it makes no
        reactor call.
        """
        clock = Clock()
        owner = Owner(clock)
        owner.deadline.set(1)
        owner.deadline.close()
        self.assertEqual(clock.getDelayedCalls(), [])
        clock.advance(2)
        owner.deadline.set(1)
        self.assertEqual(clock.getDelayedCalls(), [])
        self.assertFalse(owner.deadline.armed)
        clock.advance(2)
        self.assertEqual(owner.calls, 0)

    def test_closed_lets_go_of_its_owner(self) -> None:
        """
        Closed, a deadline no longer holds its callback, so an owner whose
        method it is goes when the owner's last reference does, not when
        the cyclic garbage collector comes by.
        """

        def run() -> None:
            owner = Owner(Clock())
            owner.deadline.set(1)
            owner.deadline.close()

        self.assertEqual(cyclic_leftovers(run, Owner, Deadline), 0)
