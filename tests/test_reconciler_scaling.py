"""
Property tests for L{llmgw.control.core.scaling}: the scale decisions as pure
functions of counts and candidates.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.core.scaling import Candidate, scale_step, victims

candidates = st.lists(
    st.builds(Candidate, id=st.text("abc", min_size=1, max_size=3), ready=st.booleans(),
              load=st.integers(0, 4), created_at=st.integers(0, 5).map(float)),
    max_size=12, unique_by=lambda c: c.id,
)


class ScalingProperties(SynchronousTestCase):
    @given(candidates, st.integers(-2, 14), st.randoms(use_true_random=False))
    def test_victims(self, cands: list[Candidate], count: int, rnd: object) -> None:
        """
        victims picks min(count, candidates) distinct candidates; a ready
        one only once every not-ready one is taken; among equally ready
        ones, none left behind is on a more loaded node, or as loaded and
        newer; and the order the candidates come in does not matter.
        """
        got = victims(cands, count)
        self.assertEqual(len(got), max(0, min(count, len(cands))))
        self.assertEqual(len(set(got)), len(got))
        by_id = {c.id: c for c in cands}
        taken = [by_id[i] for i in got]
        left = [c for c in cands if c.id not in set(got)]
        if any(c.ready for c in taken):
            self.assertTrue(all(c.ready for c in left))
        for t in taken:
            for c in left:
                if c.ready == t.ready:
                    self.assertLessEqual((c.load, c.created_at), (t.load, t.created_at))
        shuffled = list(cands)
        rnd.shuffle(shuffled)  # type: ignore[attr-defined]
        self.assertEqual(victims(shuffled, count), got)

    @given(st.integers(0, 20), st.integers(0, 20), st.integers(0, 20), st.integers(0, 5),
           st.booleans(), st.booleans(), st.booleans())
    def test_scale_step(self, desired: int, active: int, ready: int, evacuating: int,
                        placing: bool, held: bool, backing_off: bool) -> None:
        """
        A step never both retires surplus and places; it retires exactly the
        surplus; it places exactly the shortfall when placing is allowed and
        the deployment is neither held nor backing off, else nothing (and
        says why); evacuated replicas go only once enough fresh ones are
        ready.
        """
        ready = min(ready, active)
        step = scale_step(desired, active, ready, evacuating,
                          placing=placing, held=held, backing_off=backing_off)
        self.assertFalse(step.retire and step.place)
        self.assertEqual(step.retire, max(0, active - desired))
        free = placing and not held and not backing_off
        self.assertEqual(step.place, max(0, desired - active) if free else 0)
        self.assertEqual(step.blocked != "", active < desired and not free)
        self.assertEqual(step.retire_evacuated, evacuating > 0 and ready >= desired)
