"""The stabilizers' promises.

safe: (a) no Pbar rounds to exactly 1 in the Pbar format, (b) no row whose maximum is finite
underflows (no NaN, no all-zero row), max logits of +-1e4 included, (c) in fp64 it equals
unstabilized attention to 1e-12. paper: reproduces the study's rule, and fails (b) where its
beta * r shift underflows - the motivation for safe.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashguard.attention import (PaperStabilizer, SafeStabilizer, flash_attention, flash_forward,
                                  get_stabilizer, reference_attention)
from flashguard.numerics import get_policy
from flashguard.numerics.arith import cast

PRESETS = ["paper", "fa2", "fa2-fp16", "fa2-e4m3", "fa2-e5m2", "fp32"]
MAX_LOGITS = [-1e4, -100.0, -1.0, -1e-3, 0.0, 1e-3, 1.0, 100.0, 1e4]


def tied_problem(max_logit: float, ties: int, t_k: int = 24, seed: int = 0, rows: int = 4):
    """Scores s_ij = q_i * k_j (D = 1, scale 1) whose row maximum ``max_logit`` repeats
    ``ties`` times; the other scores lie 0.01-3 below it. Exact in fp32 inputs."""
    g = torch.Generator().manual_seed(seed)
    q = torch.ones(1, 1, rows, 1)
    k = max_logit - 0.01 - 3 * torch.rand(1, 1, t_k, 1, generator=g)
    idx = torch.randperm(t_k, generator=g)[:ties]
    k[..., idx, :] = max_logit
    v = torch.randn(1, 1, t_k, 8, generator=g)
    return q, k, v


def forward_with_pbars(q, k, v, precision, stabilizer, block_k=8, causal=False):
    policy = get_policy(precision)
    seen = []
    qc, kc, vc = (cast(t, policy.inputs) for t in (q, k, v))
    o, lse, _ = flash_forward(qc, kc, vc, keep=None, bias=None, causal=causal, scale=1.0, policy=policy,
                              stabilizer=get_stabilizer(stabilizer), block_q=64, block_k=block_k,
                              observe=lambda tile, **vals: seen.append(vals["pbar"].float()))
    return o.float(), lse.float(), seen


@pytest.mark.parametrize("precision", PRESETS)
@pytest.mark.parametrize("max_logit", MAX_LOGITS)
@pytest.mark.parametrize("ties", [1, 2, 3, 4, 8])
def test_safe_never_makes_pbar_one_and_never_underflows(precision, max_logit, ties):
    q, k, v = tied_problem(max_logit, ties, seed=ties)
    o, lse, pbars = forward_with_pbars(q, k, v, precision, "safe")
    if precision == "paper" and abs(max_logit) >= 1024:
        # bf16 statistics: the smallest gap above r is an ulp (64 at 1e4) and exp(-64) would sink
        # under the reference's 1e-10 row-sum floor, so safe keeps the plain maximum there
        assert any((p == 1).any() for p in pbars)
    else:
        assert all((p < 1).all() for p in pbars), "a Pbar rounded to exactly 1"
    row_max = torch.stack([p.amax(-1) for p in pbars]).amax(0)
    assert (row_max > 0).all(), "a row underflowed to all zeros"
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    # and the attention is still right, to the precision of the format
    kq = cast(k, get_policy(precision).inputs).double()
    ref = reference_attention(q.double(), kq, cast(v, get_policy(precision).inputs).double(), scale=1.0)
    tol = {"paper": 0.05, "fa2": 0.02, "fa2-fp16": 0.01, "fa2-e4m3": 0.15, "fa2-e5m2": 0.3, "fp32": 1e-5}[precision]
    assert (o.double() - ref).abs().max() <= tol * ref.abs().max() + 1e-6


@pytest.mark.parametrize("precision", ["paper", "fa2"])
def test_without_stabilizer_tied_maxima_give_pbar_exactly_one(precision):
    # the premise of the whole study, and the negative control of the test above
    q, k, v = tied_problem(1.0, 2)
    _, _, pbars = forward_with_pbars(q, k, v, precision, "none", block_k=64)
    assert any((p == 1).sum(-1).ge(2).any() for p in pbars)


def test_paper_stabilizer_underflows_where_safe_does_not():
    # tied maximum -1e4: paper moves the shift to 0 and exp(-1e4) underflows the whole row
    q, k, v = tied_problem(-1e4, 2)
    ref = reference_attention(q.double(), cast(k, get_policy("fa2").inputs).double(),
                              cast(v, get_policy("fa2").inputs).double(), scale=1.0)
    o_paper, _, pbars = forward_with_pbars(q, k, v, "fa2", "paper")
    assert all((p == 0).all() for p in pbars)
    assert (o_paper - ref.float()).abs().max() > 0.1
    o_safe, _, _ = forward_with_pbars(q, k, v, "fa2", "safe")
    assert (o_safe.double() - ref).abs().max() < 0.02 * ref.abs().max()
    # and +1e4 with beta = 2 shifts by 1e4: underflow again
    q, k, v = tied_problem(1e4, 2)
    _, _, pbars = forward_with_pbars(q, k, v, "fa2", "paper")
    assert all((p == 0).all() for p in pbars)


@settings(max_examples=60, deadline=None)
@given(max_logit=st.floats(-1e4, 1e4, allow_nan=False), ties=st.integers(1, 8),
       precision=st.sampled_from(PRESETS), seed=st.integers(0, 2**16), block_k=st.sampled_from([3, 8, 64]))
def test_safe_properties_hold_for_any_logits(max_logit, ties, precision, seed, block_k):
    q, k, v = tied_problem(max_logit, ties, seed=seed)
    o, _, pbars = forward_with_pbars(q, k, v, precision, "safe", block_k=block_k)
    if not (precision == "paper" and abs(max_logit) >= 1000):  # see the test above
        assert all((p < 1).all() for p in pbars)
    assert (torch.stack([p.amax(-1) for p in pbars]).amax(0) > 0).all()
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("stabilizer", ["safe", "paper"])
def test_stabilizers_are_exact_in_fp64(stabilizer, causal):
    g = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(2, 2, 50, 16, generator=g, dtype=torch.float64) * 2 for _ in range(4))
    k[..., ::5, :] = k[..., :1, :].clone()  # ties
    mask = torch.rand(2, 1, 50, 50, generator=g) > 0.2

    def run(stab):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = flash_attention(*leaves, attn_mask=mask, is_causal=causal, precision="fp64", stabilizer=stab,
                            block_q=16, block_k=8)
        o.backward(do)
        return [o.detach()] + [t.grad for t in leaves]

    for a, b in zip(run(stabilizer), run("none")):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_get_stabilizer_parses_options_and_rejects_bad_ones():
    assert get_stabilizer("paper:beta=7") == PaperStabilizer(beta=7.0)
    assert get_stabilizer("paper:beta=7,tol=0") == PaperStabilizer(beta=7.0, tol=0.0)
    assert isinstance(get_stabilizer("safe"), SafeStabilizer)
    for bad, msg in [("fancy", "unknown stabilizer"), ("paper:beta", "key=value"),
                     ("paper:beta=x", "needs a number"), ("safe:beta=2", "takes no option"),
                     ("paper:beta=0.5", "beta must be > 1")]:
        with pytest.raises(ValueError, match=msg):
            get_stabilizer(bad)
    with pytest.raises(TypeError):
        get_stabilizer(3)


@pytest.mark.parametrize("n", [1, 7, 8, 64, 512, 2040, 2048, 3000])
def test_count_true_matches_a_plain_sum(n):
    from flashguard.attention.stabilizers import count_true
    g = torch.Generator().manual_seed(n)
    for density in (0.0, 0.01, 0.5, 1.0):
        mask = torch.rand(3, 5, n, generator=g) < density
        assert torch.equal(count_true(mask), mask.sum(-1, keepdim=True).to(torch.int32))
    assert torch.equal(count_true(mask[..., ::2]), mask[..., ::2].sum(-1, keepdim=True).to(torch.int32))


def test_safe_is_retired_with_a_warning_in_production_arithmetic():
    """'safe' warns where it was measured to add a lean (a row sum from the unrounded Pbar), and
    stays quiet where the lab reproduces its measurement in the reference arithmetic."""
    import warnings

    from flashguard.attention.options import FlashOptions, RetiredStabilizerWarning
    with pytest.warns(RetiredStabilizerWarning, match="retired"):
        FlashOptions(precision="fa2", stabilizer="safe", block_q=48)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RetiredStabilizerWarning)
        FlashOptions(precision="paper", stabilizer="safe", block_q=48)
        FlashOptions(precision="fa2", stabilizer="none", block_q=48)
