"""The one measurement primitive against independent computations: the fp64 reference with
autograd, flash_attention itself, awkward sizes and masks, ties counted through each
stabilizer's own rule, black-box callables."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashguard.attention import flash_attention, reference_attention
from flashguard.attention.trace import Arithmetic, floor_arithmetic, trace
from flashguard.numerics import get_policy


def _inputs(b, h, tq, tk, d, seed=0, dv=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shapes = [(b, h, tq, d), (b, h, tk, d), (b, h, tk, dv or d), (b, h, tq, dv or d)]
    return tuple(torch.randn(*s, generator=g).to(dtype) for s in shapes)


@pytest.mark.parametrize("size,causal", [((2, 2, 97, 97, 59), True), ((1, 3, 97, 200, 32), False),
                                         ((1, 2, 200, 97, 32), True), ((2, 1, 1, 1, 8), False)])
def test_fp64_arithmetic_has_no_error(size, causal):
    b, h, tq, tk, d = size
    # fp64 inputs: the gradients come back in the inputs' dtype, as training receives them
    q, k, v, do = _inputs(b, h, tq, tk, d, seed=tq, dtype=torch.float64)
    t = trace(q, k, v, do, Arithmetic.of("fp64", block_q=64, block_k=48), causal=causal)
    for name in ("o_err", "lse_err", "delta_err", "dq_err", "dk_err", "dv_err"):
        err = getattr(t, name)
        assert err is not None and err.abs().max() < 1e-10, name


def test_errors_are_those_of_flash_attention_against_autograd_fp64():
    q, k, v, do = _inputs(2, 2, 130, 97, 40, seed=3)
    a = Arithmetic.of("paper", "safe", block_q=64, block_k=32)
    t = trace(q, k, v, do, a, causal=True)
    # independently: the public attention's output and gradients, and the fp64 reference with autograd
    leaves = [x.bfloat16().requires_grad_() for x in (q, k, v)]
    o = flash_attention(*leaves, is_causal=True, precision="paper", stabilizer="safe", block_q=64, block_k=32)
    o.backward(do.bfloat16())
    ref_leaves = [x.bfloat16().double().requires_grad_() for x in (q, k, v)]
    o_ref = reference_attention(*ref_leaves, is_causal=True)
    o_ref.backward(do.bfloat16().double())
    assert torch.equal(t.o, o.detach().double())
    assert torch.allclose(t.o_ref, o_ref.detach(), rtol=0, atol=1e-12)
    for got, leaf, ref in zip((t.dq, t.dk, t.dv), leaves, ref_leaves):
        assert torch.equal(got, leaf.grad.double())
    for got, ref in zip((t.dq_ref, t.dk_ref, t.dv_ref), ref_leaves):
        assert torch.allclose(got, ref.grad, rtol=0, atol=1e-10)
    delta_ref = (do.bfloat16().double() * o_ref.detach()).sum(-1)
    assert torch.allclose(t.delta_ref, delta_ref, atol=1e-12)
    assert t.delta_source == "o_lowp"


def test_masks_and_fully_masked_rows():
    q, k, v, do = _inputs(1, 2, 33, 40, 16, seed=5)
    keep = torch.rand(1, 1, 33, 40, generator=torch.Generator().manual_seed(1)) > 0.3
    keep[..., 4, :] = False  # a fully masked row
    t = trace(q, k, v, do, Arithmetic.of("fp32", block_q=16, block_k=16), attn_mask=keep)
    assert torch.isfinite(t.o_err).all() and t.o_err.abs().max() < 1e-5
    assert (t.o[..., 4, :] == 0).all() and (t.o_ref[..., 4, :] == 0).all()
    assert (t.ties.tiles[..., 4] == 0).all()  # nothing visible: no tile counted for that row
    bias = torch.randn(1, 2, 33, 40, generator=torch.Generator().manual_seed(2))
    t2 = trace(q, k, v, do, Arithmetic.of("fp32", block_q=16, block_k=16), attn_mask=bias)
    assert t2.o_err.abs().max() < 1e-5 and t2.dq_err.abs().max() < 1e-4


def _planted_ties(k_tied: int, t: int = 64, d: int = 16):
    """One head, 4 rows; row i's maximum is shared by k_tied identical keys, the rest far below."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 4, d, generator=g)
    keys = 0.05 * torch.randn(1, 1, t, d, generator=g)
    for i in range(4):
        keys[0, 0, i * k_tied:(i + 1) * k_tied] = 3.0 * q[0, 0, i] / q[0, 0, i].norm()
    v = torch.randn(1, 1, t, d, generator=g)
    return q, keys, v, torch.randn(1, 1, 4, d, generator=g)


def test_ties_through_each_stabilizers_rule():
    q, k, v, do = _planted_ties(3)
    none = trace(q, k, v, do, Arithmetic.of("paper", "none"), grads=False)
    assert none.ties.tiles.tolist() == [[[1.0] * 4]]
    assert none.ties.tied.tolist() == [[[1.0] * 4]]          # an exact repeated maximum
    assert none.ties.multi_one.tolist() == [[[1.0] * 4]]     # three Pbar == 1 in each row
    assert (none.ties.pbar_one == 3).all()
    safe = trace(q, k, v, do, Arithmetic.of("paper", "safe"), grads=False)
    assert (safe.ties.tied == 1).all() and (safe.ties.pbar_one == 0).all()  # shifted: no Pbar is 1
    single = trace(*_planted_ties(1), Arithmetic.of("paper", "none"), grads=False)
    assert (single.ties.tied == 0).all() and (single.ties.multi_one == 0).all()
    # the study's rule counts near-ties within tol; a huge tol sees every row as tied
    wide = trace(*_planted_ties(1), Arithmetic.of("paper", "paper:tol=100"), grads=False)
    assert (wide.ties.tied == 1).all()


def test_black_box_callable_and_floor():
    q, k, v, do = _inputs(1, 2, 50, 50, 32, seed=7, dtype=torch.bfloat16)

    def sdpa_math(q_, k_, v_):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)

    t = trace(q, k, v, do, sdpa_math, causal=True)
    assert t.ties is None and t.lse is None and t.delta_source == "o_lowp"
    assert t.label == "sdpa_math"
    assert 0 < t.o_err.abs().max() < 0.05 and t.dq_err.abs().max() < 0.1
    fl = floor_arithmetic("fa2-e4m3")
    assert str(fl.precision.inputs) == str(get_policy("fa2-e4m3").inputs) and str(fl.precision.output) == "bf16"
    assert str(fl.precision.pv) == "fp32" and str(fl.precision.stats) == "fp32"


def test_bad_arguments_are_named():
    q, k, v, do = _inputs(1, 1, 8, 8, 4)
    with pytest.raises(ValueError, match="do must have shape"):
        trace(q, k, v, do[..., :3], "fa2")
    with pytest.raises(ValueError, match="q must be"):
        trace(q[0], k, v, None, "fa2")
    with pytest.raises(TypeError, match="arithmetic must be"):
        trace(q, k, v, do, 3)
    with pytest.raises(ValueError, match="'cuda'"):
        Arithmetic.of("fa2", kernel="cuda")
    with pytest.raises(ValueError, match="unknown precision"):
        trace(q, k, v, do, "fa3")
    with pytest.raises(ValueError, match=r"softcap=5\.0\b.*\b3\.0"):
        trace(q, k, v, do, Arithmetic.of("fa2", softcap=3.0), softcap=5.0)


def test_arithmetic_holds_flash_options():
    """An Arithmetic is FlashOptions on one kernel: Arithmetic.of builds them from names, auto is
    measured on the PyTorch kernel with its default tiles made explicit, the options' own
    soft-cap is the trace's, and trace takes FlashOptions as they are."""
    from flashguard.attention import FlashOptions

    new = Arithmetic.of("paper", "safe", block_q=16, kernel="pytorch")
    assert new.kernel == "pytorch" and (new.block_q, new.block_k) == (16, 512)
    assert new == Arithmetic(FlashOptions(precision="paper", stabilizer="safe", block_q=16))
    assert Arithmetic.of("fa2") == Arithmetic(FlashOptions(precision=get_policy("fa2")))
    assert new.replace(kernel="triton").kernel == "triton" and new.replace(kernel="triton").block_k == 512
    assert Arithmetic.of("fa2", kernel="triton").block_q is None  # the kernels' own tiles
    assert new.label() == "paper / safe 16x512" and Arithmetic.of("fa2").label() == "fa2 / none"
    with pytest.raises(TypeError, match="FlashOptions"):
        Arithmetic("paper")
    q, k, v, do = _inputs(1, 1, 8, 8, 4)
    opts = FlashOptions(precision="paper", stabilizer="safe", block_q=4, block_k=4, softcap=2.0)
    a, b = trace(q, k, v, do, opts), trace(q, k, v, do, Arithmetic.of("paper", "safe", block_q=4, block_k=4),
                                           softcap=2.0)
    assert torch.equal(a.o, b.o) and torch.equal(a.dq, b.dq) and torch.equal(a.o_ref, b.o_ref)
    assert a.label == "paper / safe 4x4 softcap=2" and b.label == "paper / safe 4x4"


STOCHASTIC = "paper[pv=e8m4,o_accum=e8m4,grad_accum=e8m4,rounding=stochastic]"


@pytest.mark.parametrize("arith", ["paper", "fa2", "fa2-fp16", "fa2-e4m3-pscaled", "torch-cpu", STOCHASTIC,
                                   "black box"])
def test_grads_dq_measures_dq_alone_and_the_same(arith):
    """grads="dq" (what the probes ask): dQ and its reference bit for bit as with all three
    gradients, dK and dV not measured (a flash backward skips them where it rounds to nearest;
    under stochastic rounding it computes them, so that dQ's draws stay those of training); a bad
    value is named."""
    q, k, v, do = _inputs(2, 2, 70, 70, 24, seed=11, dtype=torch.bfloat16)

    def sdpa_math(q_, k_, v_):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)

    a = Arithmetic.of(arith, block_q=32, block_k=32) if arith != "black box" else sdpa_math
    torch.manual_seed(5)
    full = trace(q, k, v, do, a, causal=True)
    torch.manual_seed(5)
    only = trace(q, k, v, do, a, causal=True, grads="dq")
    assert torch.equal(only.dq, full.dq) and torch.equal(only.dq_ref, full.dq_ref)
    assert torch.equal(only.o, full.o) and torch.equal(only.delta_ref, full.delta_ref)
    assert only.dk is None and only.dv is None and only.dk_ref is None and only.dv_ref is None
    assert full.dk_ref is not None and full.dv is not None
    with pytest.raises(ValueError, match="grads must be True, False or 'dq'"):
        trace(q, k, v, do, a, causal=True, grads="dk")


@pytest.mark.parametrize("precision", ["paper", "fa2", "fa2-e4m3"])
def test_run_backward_dq_only_is_dq_bit_for_bit_with_dropout_and_refused_under_stochastic_rounding(precision):
    from flashguard.attention.dropout import TileDropout
    from flashguard.attention.options import FlashOptions, run_backward, run_forward
    q, k, v, do = _inputs(2, 3, 45, 45, 16, seed=4, dtype=torch.bfloat16)
    opts = FlashOptions(precision=precision, block_q=16, block_k=32)
    for dropout in (None, TileDropout((11, 7), 0.25, 2, 3, 45)):
        fwd = run_forward(q, k, v, opts, causal=True, scale=0.3, dropout=dropout, do=do)
        dq, dk, dv = run_backward(fwd, fwd.do, opts, causal=True, scale=0.3, dropout=dropout)
        only = run_backward(fwd, fwd.do, opts, causal=True, scale=0.3, dropout=dropout, dq_only=True)
        assert torch.equal(only[0], dq) and only[1:] == (None, None) and dk is not None and dv is not None
    sr = FlashOptions(precision=STOCHASTIC, block_q=16, block_k=32)
    fwd = run_forward(q, k, v, sr, causal=True, scale=0.3, do=do)
    with pytest.raises(ValueError, match="dq_only.*stochastic"):
        run_backward(fwd, fwd.do, sr, causal=True, scale=0.3, dq_only=True)


def test_scores_of_the_reference_are_the_softmax_input_and_kept_only_when_asked():
    """trace(scores=True) keeps the reference's fp64 scores (scale, soft-cap, masks; hidden = -inf),
    the very ones its softmax read: exp(S - lse) sums to 1 per row; chunked over the batch or not."""
    import flashguard.attention.trace as trace_mod
    q, k, v, do = _inputs(3, 2, 20, 24, 8, seed=2)
    mask = torch.rand(1, 1, 20, 24, generator=torch.Generator().manual_seed(0)) > 0.3
    mask[..., 0] = True
    for softcap in (None, 4.0):
        t = trace(q, k, v, do, "fp32", attn_mask=mask, softcap=softcap, scores=True)
        s = (q.double() @ k.double().transpose(-2, -1)) * (1 / 8 ** 0.5)
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        assert torch.equal(t.s_ref, s.masked_fill(~mask, float("-inf")))
        torch.testing.assert_close(torch.exp(t.s_ref - t.lse_ref.unsqueeze(-1)).sum(-1),
                                   torch.ones(3, 2, 20, dtype=torch.float64))
    assert trace(q, k, v, do, "fp32").s_ref is None
    old = trace_mod._REF_CHUNK_ENTRIES
    try:
        trace_mod._REF_CHUNK_ENTRIES = 20 * 24 * 2   # one batch entry per chunk
        chunked = trace(q, k, v, do, "fp32", causal=True, scores=True)
    finally:
        trace_mod._REF_CHUNK_ENTRIES = old
    assert torch.equal(chunked.s_ref, trace(q, k, v, do, "fp32", causal=True, scores=True).s_ref)
    with pytest.raises(ValueError, match="observe"):
        trace(q, k, v, do, lambda q_, k_, v_: q_, observe=lambda *a, **kw: None)
