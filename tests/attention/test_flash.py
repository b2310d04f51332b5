"""Flash attention against the one fp64 reference, in the style of flash-attention's tests:
tolerances relative to what plain PyTorch attention achieves in the same dtype, awkward sizes
(T = 1, 97, 1025; head dim 59; T_q != T_k), causal, masks, fully masked rows."""
from __future__ import annotations

import pytest
import torch

from flashguard.attention import flash_attention, reference_attention
from flashguard.numerics import E4M3, E5M2, round_to


def _inputs(b, h, tq, tk, d, dtype, seed=0, dv=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, tq, d, generator=g)
    k = torch.randn(b, h, tk, d, generator=g)
    v = torch.randn(b, h, tk, dv or d, generator=g)
    do = torch.randn(b, h, tq, dv or d, generator=g)
    return tuple(t.to(dtype) for t in (q, k, v, do))


def _run(fn, q, k, v, do, **kw):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = fn(*leaves, **kw)
    o.backward(do.to(o.dtype))
    return [o.detach()] + [t.grad for t in leaves]


def _max_err(outs, refs):
    return [(a.double() - b).abs().max().item() for a, b in zip(outs, refs)]


SIZES = [  # (B, H, T_q, T_k, D)
    (2, 3, 1, 1, 64),
    (2, 3, 97, 97, 64),
    (1, 2, 1025, 1025, 64),
    (2, 2, 97, 97, 59),
    (2, 2, 97, 200, 32),
    (2, 2, 200, 97, 32),
]
NAMES = ["output", "dq", "dk", "dv"]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
def test_fp32_preset_matches_fp64_reference(size, causal):
    b, h, tq, tk, d = size
    q, k, v, do = _inputs(b, h, tq, tk, d, torch.float32, seed=tq + tk)
    refs = _run(reference_attention, q.double(), k.double(), v.double(), do.double(), is_causal=causal)
    got = _run(flash_attention, q, k, v, do, is_causal=causal, precision="fp32", block_q=64, block_k=48)
    for name, a, r in zip(NAMES, got, refs):
        # relative to the gradient's size, floored at the O(1) size of the inputs: with T_k = 1
        # softmax is constant and dq, dk are exactly 0, so a pure ratio would divide by ~0
        rel = (a.double() - r).abs().max() / r.abs().max().clamp(min=1.0)
        assert rel < 1e-5, f"{name}: relative error {rel:.2e}"


@pytest.mark.parametrize("precision,dtype,block,factor", [
    ("fa2", torch.bfloat16, 64, 2), ("fa2", torch.bfloat16, None, 2),
    ("fa2-fp16", torch.float16, 64, 2),
    # The paper preset is bit-identical to the study's reference code (test_paper_golden), and
    # that code's backward - dS = (P*scale)*(dP - delta) with every op in bf16 and bf16 dq/dk/dv
    # accumulators - measures 2.0-2.3x the gradient error of plain bf16 torch attention here.
    # 2x cannot hold for it without departing from the reference; the bound is 3x.
    ("paper", torch.bfloat16, None, 3),
])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("size", SIZES[1:], ids=lambda s: "x".join(map(str, s)))
def test_low_precision_within_2x_of_torch_same_dtype(size, causal, precision, dtype, block, factor):
    b, h, tq, tk, d = size
    q, k, v, do = _inputs(b, h, tq, tk, d, dtype, seed=3 * tq + tk)
    refs = _run(reference_attention, q.double(), k.double(), v.double(), do.double(), is_causal=causal)
    plain = _max_err(_run(reference_attention, q, k, v, do, is_causal=causal, dtype=dtype), refs)
    got = _max_err(_run(flash_attention, q, k, v, do, is_causal=causal, precision=precision,
                        block_q=block, block_k=block), refs)
    for name, e, p in zip(NAMES, got, plain):
        assert e <= factor * p + 1e-5, f"{name}: error {e:.3g} vs plain torch {dtype} {p:.3g}"


@pytest.mark.parametrize("precision,fmt", [("fa2-e4m3", E4M3), ("fa2-e5m2", E5M2)])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_presets_error_within_half_an_epsilon(precision, fmt, causal):
    # no torch attention computes in fp8, so the yardstick is the format itself: starting
    # from inputs already in the format, only Pbar and dS rounding remain, each at most half
    # an ulp, and the result must stay within eps/2 of the exact attention of those inputs
    q, k, v, do = (round_to(t, fmt) for t in _inputs(2, 2, 97, 130, 32, torch.float32, seed=11))
    refs = _run(reference_attention, q.double(), k.double(), v.double(), do.double(), is_causal=causal)
    got = _run(flash_attention, q, k, v, do, is_causal=causal, precision=precision, block_q=32, block_k=32)
    for name, a, r in zip(NAMES, got, refs):
        rel = ((a.double() - r).abs().max() / r.abs().max()).item()
        assert rel < fmt.eps / 2, f"{name}: {rel:.3f} of max vs eps/2 = {fmt.eps / 2}"


def test_gradcheck_fp64():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 7, 5, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.rand(1, 1, 7, 7, generator=g) > 0.3
    for kw in [dict(), dict(is_causal=True), dict(attn_mask=mask), dict(attn_mask=mask.double() * -0.7)]:
        for stab in ["none", "safe", "paper"]:
            def f(q, k, v, kw=kw, stab=stab):
                return flash_attention(q, k, v, precision="fp64", stabilizer=stab, block_q=3, block_k=2, **kw)
            assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("precision", ["fp32", "fa2", "paper"])
def test_masks_and_fully_masked_rows(precision):
    b, h, tq, tk, d = 2, 2, 33, 40, 16
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    q, k, v, do = _inputs(b, h, tq, tk, d, dtype, seed=5)
    g = torch.Generator().manual_seed(6)
    keep = torch.rand(b, 1, tq, tk, generator=g) > 0.5
    keep[:, :, 3] = False  # fully masked rows
    keep[1, :, 10] = False
    additive = torch.zeros(b, 1, tq, tk).masked_fill(~keep, float("-inf")) + torch.randn(b, 1, tq, tk, generator=g)
    for mask in (keep, additive.to(dtype)):
        for causal in (False, True):
            refs = _run(reference_attention, q.double(), k.double(), v.double(), do.double(),
                        attn_mask=mask if mask.dtype == torch.bool else mask.double(), is_causal=causal)
            got = _run(flash_attention, q, k, v, do, attn_mask=mask, is_causal=causal, precision=precision,
                       block_q=16, block_k=16)
            for name, a, r in zip(NAMES, got, refs):
                assert torch.isfinite(a).all(), f"{name} has NaN/Inf"
                tol = 1e-5 if precision == "fp32" else 0.05
                assert (a.double() - r).abs().max() <= tol * r.abs().max() + 1e-6, name
            assert (got[0][:, :, 3] == 0).all() and (got[0][1, :, 10] == 0).all()


def test_causal_alignment_is_top_left_like_sdpa():
    q, k, v, _ = _inputs(1, 2, 5, 9, 8, torch.float32, seed=1)
    ours = flash_attention(q, k, v, is_causal=True, precision="fp32", block_q=2, block_k=4)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(ours, sdpa, rtol=1e-5, atol=1e-6)


def test_value_head_dim_may_differ():
    q, k, v, do = _inputs(1, 2, 20, 30, 16, torch.float32, seed=2, dv=24)
    refs = _run(reference_attention, q.double(), k.double(), v.double(), do.double())
    got = _run(flash_attention, q, k, v, do, precision="fp32", block_q=8, block_k=8)
    for a, r in zip(got, refs):
        torch.testing.assert_close(a.double(), r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_propagates_like_sdpa(where):
    # A NaN reaches every output it feeds, as in SDPA. Which *other* outputs a NaN in V also
    # spoils depends on the backend (0 * NaN = NaN inside a PV matmul: torch's math backend
    # spoils every row, tiled kernels the rows of the tiles that meet the key); for V we check
    # the rows that attend to the NaN key.
    q, k, v, _ = _inputs(1, 2, 16, 16, 8, torch.float32, seed=3)
    {"q": q, "k": k, "v": v}[where][0, 1, 5, 2] = float("nan")
    for causal in (False, True):
        ours = flash_attention(q, k, v, is_causal=causal, precision="fp32", block_q=4, block_k=4)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        if where == "v":
            sees = torch.arange(16) >= 5 if causal else torch.ones(16, dtype=torch.bool)
            assert ours[0, 1, sees, 2].isnan().all() and sdpa[0, 1, sees, 2].isnan().all()
            assert torch.isfinite(ours[0, 0]).all()  # the other head never meets the NaN
        else:
            assert ours.isnan().any()
            assert torch.equal(ours.isnan(), sdpa.isnan()), (where, causal)


def test_inf_scores_give_nan_like_sdpa():
    q, k, v, _ = _inputs(1, 1, 8, 8, 4, torch.float32, seed=4)
    q[0, 0, 2, 0] = float("inf")
    ours = flash_attention(q, k, v, precision="fp32", block_q=4, block_k=4)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert torch.equal(ours.isnan(), sdpa.isnan())


def test_delta_sources_agree_in_high_precision_and_differ_in_bf16():
    from flashguard.numerics import get_policy
    q, k, v, do = _inputs(1, 2, 64, 64, 16, torch.float32, seed=7)
    outs = {}
    for src in ("o_lowp", "o_highp", "dp_p"):
        pol64 = get_policy("fp64").replace(delta_source=src)
        outs[src] = _run(flash_attention, q.double(), k.double(), v.double(), do.double(), precision=pol64,
                         is_causal=True, block_q=16, block_k=16)
    for src in ("o_highp", "dp_p"):
        for a, b in zip(outs[src], outs["o_lowp"]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # in the paper's arithmetic the three deltas are genuinely different computations
    qb, kb, vb, dob = (t.bfloat16() for t in (q, k, v, do))
    dqs = [_run(flash_attention, qb, kb, vb, dob, precision=get_policy("paper").replace(delta_source=s),
                is_causal=True, block_q=16, block_k=16)[1] for s in ("o_lowp", "o_highp", "dp_p")]
    assert not torch.equal(dqs[0], dqs[1]) and not torch.equal(dqs[0], dqs[2])


def test_softcap_matches_reference_and_gradchecks():
    q, k, v, do = _inputs(2, 2, 40, 40, 16, torch.float32, seed=9)
    q = q * 4  # large scores, so that the cap bites
    refs = _run(reference_attention, q.double(), k.double(), v.double(), do.double(), is_causal=True, softcap=2.0)
    got = _run(flash_attention, q, k, v, do, is_causal=True, precision="fp32", softcap=2.0, block_q=16, block_k=16)
    plain = _run(flash_attention, q, k, v, do, is_causal=True, precision="fp32", block_q=16, block_k=16)
    for a, r, p in zip(got, refs, plain):
        assert (a.double() - r).abs().max() <= 1e-5 * r.abs().max().clamp(min=1.0)
        assert (p.double() - r).abs().max() > 1e-2  # the cap changed the result
    g = torch.Generator().manual_seed(0)
    leaves = tuple(torch.randn(1, 1, 6, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_attention(q, k, v, precision="fp64", softcap=0.7, block_q=4, block_k=2), leaves)
    with pytest.raises(ValueError, match="softcap"):
        flash_attention(q, k, v, softcap=-1.0)


def test_stochastic_rounding_policy_is_unbiased_and_seeded():
    from flashguard.numerics import get_policy
    coarse = get_policy("fa2").replace(pv="e8m3", o_accum="e8m3", name="coarse")
    sr = coarse.replace(rounding="stochastic", name="coarse-sr")
    q, k, v, _ = _inputs(4, 2, 64, 64, 16, torch.float32, seed=12)
    v = v.abs() + 0.5  # same-sign V: where nearest rounding errs coherently
    ref = reference_attention(*(t.bfloat16().double() for t in (q, k, v)))
    near = flash_attention(q, k, v, precision=coarse, block_k=16).double() - ref
    torch.manual_seed(0)
    a = flash_attention(q, k, v, precision=sr, block_k=16)
    torch.manual_seed(0)
    b = flash_attention(q, k, v, precision=sr, block_k=16)
    assert torch.equal(a, b)  # reproducible from torch's seed
    c = flash_attention(q, k, v, precision=sr, block_k=16)
    assert not torch.equal(a, c)  # and actually random
    stoch = a.double() - ref
    # both are noisy at 3 mantissa bits; the stochastic one is not biased
    assert abs(stoch.mean()) < 3 * stoch.std() / stoch.numel() ** 0.5
    assert stoch.abs().mean() > 0.3 * near.abs().mean()
    with pytest.raises(ValueError, match="rounding"):
        get_policy("fa2").replace(rounding="up")
