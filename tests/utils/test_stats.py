"""flashguard.utils.stats against known answers and brute force: Fisher's exact test, the
log-rank test, Holm's adjustment; bad input named."""
from __future__ import annotations

import itertools
import math

import pytest

from flashguard.utils.stats import fisher_one_sided, holm, log_rank


def _brute_fisher(k1, n1, k2, n2):
    """P(arm-1 count <= k1 | margins) by enumerating which of the n1 + n2 runs are arm 1."""
    outcomes = [1] * (k1 + k2) + [0] * (n1 + n2 - k1 - k2)
    hits = total = 0
    for arm1 in itertools.combinations(range(n1 + n2), n1):
        total += 1
        hits += sum(outcomes[i] for i in arm1) <= k1
    return hits / total


@pytest.mark.parametrize("k1,n1,k2,n2", [(0, 5, 5, 5), (1, 5, 4, 5), (2, 4, 2, 4), (3, 6, 1, 4), (0, 3, 0, 4),
                                         (4, 4, 4, 4)])
def test_fisher_equals_brute_force(k1, n1, k2, n2):
    assert fisher_one_sided(k1, n1, k2, n2) == pytest.approx(_brute_fisher(k1, n1, k2, n2), rel=1e-12)


def test_fisher_known_answers_each_way():
    assert fisher_one_sided(0, 10, 10, 10) == pytest.approx(1 / math.comb(20, 10))  # 5.4e-6: fewer, decisively
    assert fisher_one_sided(10, 10, 0, 10) == 1.0                                    # more: no evidence of fewer
    assert fisher_one_sided(5, 10, 10, 10) == pytest.approx(math.comb(10, 5) / math.comb(20, 5))  # 0.0163
    with pytest.raises(ValueError, match="arm 2"):
        fisher_one_sided(1, 2, 3, 2)


def test_log_rank_known_answer():
    """Arm 1 events at 1 and 3, arm 2 censored at 4 twice: by hand, at t=1 4 at risk (2 in arm 1),
    1 event: E1 = 1/2, V = 1/4; at t=3 3 at risk (1 in arm 1): E1 = 1/3, V = 2/9. O1 = 2."""
    r = log_rank([1, 3], [True, True], [4, 4], [False, False])
    exp, var = 0.5 + 1 / 3, 0.25 + 2 / 9
    assert r["expected1"] == pytest.approx(exp) and r["variance"] == pytest.approx(var)
    assert r["chi2"] == pytest.approx((2 - exp) ** 2 / var)
    assert r["p"] == pytest.approx(math.erfc(math.sqrt(r["chi2"] / 2))) and r["earlier"] == 1
    same = log_rank([5, 6], [True, True], [5, 6], [True, True])
    assert same["chi2"] == pytest.approx(0.0) and same["earlier"] is None
    none = log_rank([9, 9], [False, False], [9, 9], [False, False])
    assert none["p"] == 1.0 and none["earlier"] is None
    assert log_rank([1, 3], [True, True], [4, 4], [False, False])["p"] < log_rank([1, 3], [True, True], [2, 4],
                                                                                  [True, False])["p"]
    with pytest.raises(ValueError, match="arm 2"):
        log_rank([1], [True], [1, 2], [True])


def test_holm_known_answer_and_order():
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])
    assert holm([]) == []
    with pytest.raises(ValueError, match="p-values"):
        holm([1.5])
