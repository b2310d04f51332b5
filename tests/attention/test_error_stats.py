"""Bias statistics: a planted bias is detected, a zero-mean error is not, at the stated rates;
the unit decides the confidence; paired comparisons cancel what two arithmetics share."""
from __future__ import annotations

import math

import pytest
import torch

from flashguard.attention.error_stats import (ALPHA, BIAS_RATIO_MIN, bias_stats, leans_beyond_floor, paired_bias,
                                              sign_test_p, unit_means)


def test_sign_test_exact_values():
    assert sign_test_p(9, 1) == pytest.approx(2 * 11 / 1024)
    assert sign_test_p(5, 5) == 1.0 and sign_test_p(0, 0) == 1.0
    assert sign_test_p(1000, 900) < 0.05 < sign_test_p(520, 480)


def test_false_alarm_and_detection_rates():
    g = torch.Generator().manual_seed(0)
    trials, n = 400, 1000
    noise = torch.randn(trials, n, generator=g, dtype=torch.float64)
    false = sum(bias_stats(noise[i], "row").biased for i in range(trials))
    # ALPHA = 1e-3: 0.4 expected false alarms in 400 trials; 3 or more has probability < 1 %
    assert false <= 2, false
    shift = 0.2  # z ~ 0.2 sqrt(1000) = 6.3 on average: detected almost always
    hits = sum(bias_stats(noise[i] + shift, "row").verdict == "biased +" for i in range(trials))
    assert hits >= trials - 2
    hits = sum(bias_stats(noise[i] - shift, "row").verdict == "biased -" for i in range(trials))
    assert hits >= trials - 2


def test_effect_size_floor_and_units():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2_000_000, generator=g, dtype=torch.float64) + 0.01  # z ~ 14 but ratio ~ 0.0125
    s = bias_stats(x, "row")
    assert abs(s.z) > 10 and abs(s.bias_ratio) < BIAS_RATIO_MIN and not s.biased
    # (B, H, T, D) errors whose features share a row component: one value per row, not per feature
    err = torch.randn(4, 2, 64, 1, generator=g) + 0.01 * torch.randn(4, 2, 64, 32, generator=g)
    rows = unit_means(err, "row")
    assert rows.shape == (4 * 2 * 64,)
    seqs = unit_means(err, "sequence")
    assert seqs.shape == (8,) and torch.allclose(seqs, err.double().mean(dim=(2, 3)).reshape(-1))
    assert unit_means(err[..., 0], "row", feature_dim=False).shape == (512,)
    with pytest.raises(ValueError, match="'feature'"):
        unit_means(err, "feature")
    with pytest.raises(ValueError, match=r"\(B, H, T, D\).*\(4, 2, 64\)"):   # the shape wanted, the shape got
        unit_means(err[..., 0], "row")


def test_counting_features_as_samples_is_overconfident():
    # a row-level error shared by the row's 64 features, plus small per-feature noise: per-element
    # statistics would claim sqrt(64) = 8 times the confidence the rows support
    g = torch.Generator().manual_seed(2)
    row = torch.randn(1, 1, 400, 1, generator=g, dtype=torch.float64) + 0.12
    err = row + 0.01 * torch.randn(1, 1, 400, 64, generator=g, dtype=torch.float64)
    per_row = bias_stats(unit_means(err, "row"), "row")
    per_element = bias_stats(err.reshape(-1), "element-as-if-independent")
    assert per_element.z / per_row.z > 7


def test_paired_comparison_cancels_the_shared_part():
    g = torch.Generator().manual_seed(3)
    shared = torch.randn(3000, generator=g, dtype=torch.float64) + 0.5   # both arithmetics' floor lean
    own = 0.05 * torch.randn(3000, generator=g, dtype=torch.float64)
    same = paired_bias(shared + own, shared, "row")
    assert not same.biased
    leaning = paired_bias(shared + own + 0.02, shared, "row")
    assert leaning.verdict == "biased +" and leaning.bias_ratio > 0
    with pytest.raises(ValueError, match="differ in shape"):
        paired_bias(shared, shared[:10], "row")


def test_non_finite_is_not_hidden():
    x = torch.tensor([0.1, float("nan"), 0.2], dtype=torch.float64)
    s = bias_stats(x, "row")
    assert s.verdict == "non-finite" and not s.biased and math.isnan(s.mean)
    assert ALPHA == 1e-3


@pytest.mark.parametrize("floor_mean, own_mean, leans", [
    (0.0, 0.3, True),     # the floor is unbiased, the arithmetic leans: a lean
    (0.3, 0.6, True),     # both lean +, the arithmetic further: a lean
    (-0.3, 0.3, True),    # the arithmetic leans the other way than the floor: a lean of its own
    (-0.3, 0.0, False),   # unbiased against fp64 while the floor leans: differs from the floor, no lean
    (0.6, 0.3, False),    # between the floor and the truth: less biased than the floor, no lean
    (0.0, 0.0, False),    # neither leans
])
def test_lean_beyond_the_floor_needs_a_bias_of_its_own_in_that_direction(floor_mean, own_mean, leans):
    g = torch.Generator().manual_seed(4)
    n = 3000
    floor = floor_mean + torch.randn(n, generator=g, dtype=torch.float64)
    # the arithmetic's error: the problems' shared part (the floor's) plus noise of its own, re-centred on own_mean
    own = floor - floor_mean + own_mean + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)
    assert leans_beyond_floor(bias_stats(own, "row"), paired_bias(own, floor, "row")) is leans
