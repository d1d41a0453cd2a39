"""
Tests for L{llmgw.oslimits}: the open-file limit raised towards what a
process may hold, and one warning naming that process's options when the
hard limit does not allow it. The limits are injected; the process's own
are never touched.
"""

from __future__ import annotations

import resource

from twisted.trial.unittest import SynchronousTestCase

from llmgw.oslimits import FD_HEADROOM, FdNeed, fd_limit_problem, raise_fd_limit


class FakeLimit:
    """
    An open-file limit (soft, hard) that L{raise_fd_limit} reads and sets.
    """

    def __init__(self, soft: int, hard: int):
        self.limits = (soft, hard)
        self.sets: list[tuple[int, int]] = []

    def get(self) -> tuple[int, int]:
        return self.limits

    def set(self, limits: tuple[int, int]) -> None:
        if limits[1] != resource.RLIM_INFINITY and limits[0] > limits[1]:
            raise ValueError("soft over hard")
        self.sets.append(limits)
        self.limits = limits


AGENTS = FdNeed(15_000, "the agent port's connections", "--max-connections")


class RaiseTests(SynchronousTestCase):
    def test_raised_within_hard(self) -> None:
        """
        The soft limit is raised to the need when the hard limit allows it,
        to the hard limit when it does not, and left alone when it is
        already enough.
        """
        lim = FakeLimit(1024, 50_000)
        self.assertEqual(raise_fd_limit(20_000, lim.get, lim.set), 20_000)
        self.assertEqual(raise_fd_limit(60_000, lim.get, lim.set), 50_000)
        self.assertEqual(raise_fd_limit(100, lim.get, lim.set), 50_000)
        self.assertEqual(lim.sets, [(20_000, 50_000), (50_000, 50_000)])

    def test_no_hard_limit(self) -> None:
        """
        Without a hard limit the soft one goes to the need.
        """
        lim = FakeLimit(1024, resource.RLIM_INFINITY)
        self.assertEqual(raise_fd_limit(40_000, lim.get, lim.set), 40_000)


class ProblemTests(SynchronousTestCase):
    def test_enough_after_raising(self) -> None:
        """
        A limit that can be raised to what the process may hold draws no
        warning, whatever the soft limit was.
        """
        lim = FakeLimit(1024, 524_288)
        self.assertIsNone(fd_limit_problem([AGENTS], get=lim.get, set_=lim.set))
        self.assertEqual(lim.limits, (15_000 + FD_HEADROOM, 524_288))

    def test_no_cap_no_check(self) -> None:
        """
        Listeners without a cap (0) need nothing counted: no warning even
        on a tiny limit.
        """
        lim = FakeLimit(256, 256)
        self.assertIsNone(fd_limit_problem([FdNeed(0, "x", "--max-connections")], get=lim.get, set_=lim.set))

    def test_too_small(self) -> None:
        """
        When the hard limit is below the sum of what the process may hold
        and the headroom, one line gives the limit, the sum and its parts,
        names the options of this process that drive it (and only those),
        and says how to raise it.
        """
        lim = FakeLimit(1024, 20_000)
        gateway = FdNeed(20_000, "the gateway's 10000 client connections and their upstream ones")
        problem = fd_limit_problem([AGENTS, gateway], get=lim.get, set_=lim.set)
        assert problem is not None
        self.assertIn("the open-file limit is 20000, below the 36024 files", problem)
        self.assertIn("15000 for the agent port's connections (--max-connections)", problem)
        self.assertIn("20000 for the gateway's 10000 client connections", problem)
        self.assertIn("LimitNOFILE=36024", problem)
        self.assertIn("ulimit -n 36024", problem)
        self.assertTrue(problem.endswith("or lower --max-connections"), problem)
        self.assertNotIn("\n", problem)

    def test_no_option_to_lower(self) -> None:
        """
        A need no option sets is not followed by advice to lower one.
        """
        lim = FakeLimit(1024, 1024)
        problem = fd_limit_problem([FdNeed(2000, "the gateway's connections")], get=lim.get, set_=lim.set)
        assert problem is not None
        self.assertNotIn("lower", problem)
