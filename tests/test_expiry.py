"""
Tests for L{llmgw.control.core.expiry}: the pure expiry decision.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.core.expiry import ExpiryRules, judge

RULES = ExpiryRules(suspect_after=15, lost_after=300, freeze_share=0.5)

silences = st.dictionaries(st.sampled_from([f"n{i}" for i in range(12)]),
                           st.floats(0, 1000), min_size=1)


class JudgeTests(SynchronousTestCase):
    @settings(max_examples=300, deadline=None)
    @given(silences, st.sets(st.sampled_from([f"n{i}" for i in range(12)])), st.booleans(),
           st.floats(0, 600))
    def test_rules(self, silent: dict[str, float], suspect: set[str], frozen: bool,
                   clock_restart: float) -> None:
        """
        For any fleet: a node heard from within suspect_after is never
        judged suspect or lost; a node is lost only when silent for
        lost_after since both its last message and its lost clock, and
        never while replacements are frozen; a lift restarts the clock of
        every node still suspect.
        """
        now = 1000.0
        last = {n: now - s for n, s in silent.items()}
        suspect &= set(last)
        due = [n for n in last if n not in suspect]
        lost_clock = {n: now - clock_restart for n in suspect}
        out = judge(due, suspect, len(last), 0, last.get, lost_clock, frozen, now, RULES)
        judged_suspect = {n for n, _ in out.suspect}
        judged_lost = {n for n, _ in out.lost}
        for n in judged_suspect | judged_lost:
            self.assertGreaterEqual(now - last[n], RULES.suspect_after)
        for n in judged_lost:
            since = max(last[n], lost_clock.get(n, last[n]))
            self.assertGreaterEqual(now - since, RULES.lost_after)
            self.assertNotIn(n, out.fresh_clock)
        still = (suspect | judged_suspect) - set(out.back)
        now_frozen = frozen if out.frozen is None else out.frozen
        if now_frozen:
            self.assertEqual(judged_lost, set())
        self.assertEqual(now_frozen, len(suspect | judged_suspect) > 0.5 * len(last))
        if out.frozen is False:
            self.assertEqual(set(out.fresh_clock), suspect | judged_suspect)
        for n in out.back:
            self.assertLess(now - last[n], RULES.suspect_after)
        self.assertLessEqual(judged_lost, still)

    def test_lift_spares_the_rest(self) -> None:
        """
        The check that lifts a freeze declares none of the nodes still
        suspect lost, however long they were silent.
        """
        last = {"a": 0.0, "b": 0.0, "c": 990.0, "d": 995.0}
        out = judge([], {"a", "b"}, 4, 0, last.get, {}, True, 1000.0,
                    ExpiryRules(15, 300, 0.5))
        self.assertEqual(out.frozen, False)
        self.assertEqual(out.lost, [])
        self.assertEqual(out.fresh_clock, ["a", "b"])
