"""The divergence rule shared by the trainer and the run summaries."""
import math

import pytest

from flashguard.train.divergence import LossWatch


@pytest.mark.parametrize("losses, after, expect", [
    ([5.0, 3.0, 2.0, 1.0, 1.9, 2.0], 0, 5),           # 2.0 >= 2 x 1.0 at step 5
    ([5.0, 3.0, 2.0, 1.0, 1.9, 1.99], 0, None),       # just under
    ([5.0, 1.0, 2.5, 2.2], 2, None),                  # the dip at step 1 is in the warm-up: ignored
    ([5.0, 1.0, 2.0, 4.0], 2, 3),                     # min 2.0 from step 2; 4.0 doubles it
    ([3.0, float("nan"), 1.0], 0, 1),                 # non-finite always counts
])
def test_first_divergent_step(losses, after, expect):
    w = LossWatch(2.0, after=after)
    hits = [s for s, x in enumerate(losses) if w.update(s, x) is not None]
    assert (hits[0] if hits else None) == expect


def test_factor_none_counts_only_non_finite_and_names_the_reason():
    w = LossWatch(None)
    assert w.update(0, 1.0) is None and w.update(1, 100.0) is None
    why = w.update(2, 1.0, grad_norm=math.inf)
    assert why is not None and "non-finite" in why
    w = LossWatch(1.5)
    w.update(0, 2.0)
    assert "1.5 x its running minimum 2" in w.update(1, 3.0)
