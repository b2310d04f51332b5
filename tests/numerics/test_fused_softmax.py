"""numerics/fused_softmax.py: the softmax passes of flash attention fused in C, with torch's bits.

Each pass against the torch ops it stands for (bf16: over all 65,536 bit patterns; fp32: random
bit patterns, the special values and ordinary ones), with and without the scale and a causal
mask, with the finite and the -inf fill; so are the bf16 accumulators' add and the forward's row
max (given where torch's amax has one answer: not for a row whose max is zero or NaN) and the tie
rules' per-row counts; the check that turns the passes on is shown to fail on a wrong exponential,
add or row max; tiles the passes
do not cover (rows that are not whole steps of torch's vector loop, masks that differ per head,
per-row values of another dtype, fp64) are declined and left untouched; and the emulated attention
(``paper``: bf16 passes; ``fa2``, ``fp32``, ``paper-fp32fwd``: fp32 ones) gives the same bits with
the passes on and off, on awkward sizes.
"""
from __future__ import annotations

import ctypes
import os

import pytest
import torch

from flashguard.attention import flash_attention
from flashguard.attention.cpu_fastpaths import _Hidden
from flashguard.numerics import fused_softmax as fs

DTYPES = [pytest.param(dt, marks=pytest.mark.skipif(not fs.active(dt), reason=f"the fused {dt} passes are off here "
                                                    "(no C compiler, or torch's kernels are not the modelled ones)"))
          for dt in (torch.bfloat16, torch.float32)]
SCALES = [None, 0.125, 0.1767766952966369]


def _same(a, b):
    return fs._same(a, b)


@pytest.fixture(scope="module", params=DTYPES, ids=["bf16", "fp32"])
def probe(request):
    return request.param, fs._probe(torch.Generator().manual_seed(3), request.param)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("masked", [False, True])
def test_the_backward_p_is_torchs(probe, scale, masked):
    dtype, (s, rows, other, mask) = probe
    h = _Hidden(mask) if masked else None
    for tile in (s, other):
        got = fs.p_from_lse_(tile.clone(), rows, scale, h)
        assert got is not None
        assert _same(got, fs.torch_p_from_lse_(tile.clone(), rows, scale, h))


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("fill", ["finite", "-inf"])
def test_the_forward_p_and_the_scaled_scores_are_torchs(probe, masked, fill):
    dtype, (s, rows, other, mask) = probe
    h = _Hidden(mask) if masked else None
    fill = -torch.finfo(dtype).max if fill == "finite" else float("-inf")
    for tile in (s, other):
        assert _same(fs.p_from_max_(tile.clone(), rows, h, fill), fs.torch_p_from_max_(tile.clone(), rows, h, fill))
        assert _same(fs.scale_fill_(tile.clone(), 0.125, h, fill), fs.torch_scale_fill_(tile.clone(), 0.125, h, fill))


@pytest.mark.parametrize("scale", SCALES)
def test_ds_is_torchs_and_leaves_dp_alone(probe, scale):
    dtype, (s, rows, other, _) = probe
    for p, dp in ((s, other), (other, s)):
        dp_before = dp.clone()
        assert _same(fs.ds_(p.clone(), dp, rows, scale), fs.torch_ds_(p.clone(), dp, rows, scale))
        assert _same(dp, dp_before)


def test_the_fp32_passes_also_give_the_bf16_operands(probe):
    dtype, (s, rows, other, mask) = probe
    if dtype != torch.float32:
        assert fs.ds_(s.clone(), other, rows, 0.125, round_bf16=True) is None   # bf16 tiles: nothing to round
        return
    for tile in (s, other):
        want = fs.torch_ds_(tile.clone(), other, rows, 0.125).to(torch.bfloat16).to(torch.float32)
        assert _same(fs.ds_(tile.clone(), other, rows, 0.125, round_bf16=True), want)
        pbar = torch.empty_like(tile)
        p = fs.p_from_lse_(tile.clone(), rows, 0.125, _Hidden(mask), pbar)
        assert _same(p, fs.torch_p_from_lse_(tile.clone(), rows, 0.125, _Hidden(mask)))
        assert _same(pbar, p.to(torch.bfloat16).to(torch.float32))


def test_the_accumulators_add_is_torchs(probe):
    dtype, (s, _, other, _) = probe
    if dtype != torch.bfloat16:
        assert fs.add_(other.clone(), other) is None   # fp32 accumulators: torch's own add_ stays
        return
    for a, b in ((s, other), (other, s), (s, s.flip(-1).contiguous()), (s, s)):   # every bit pattern as a and b
        b_before = b.clone()
        assert _same(fs.add_(a.clone(), b), fs.torch_add_(a.clone(), b))
        assert _same(b, b_before)
    assert fs.add_(other.clone(), other[..., :32].contiguous()) is None   # shapes differ


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("fill", ["finite", "-inf"])
def test_the_row_max_is_amaxs_or_left_to_it(probe, masked, fill):
    """Where scale_fill_ gives a row max it is torch's amax of the scaled tile, bit for bit; where
    a row's max is zero (+0 or -0: which one amax returns depends on its order) or NaN it gives none."""
    dtype, (s, _, other, mask) = probe
    h = _Hidden(mask) if masked else None
    fill = -torch.finfo(dtype).max if fill == "finite" else float("-inf")
    tile, m = fs.scale_fill_(other.clone(), 0.125, h, fill, with_max=True)
    assert m is not None and m.shape == (*other.shape[:-1], 1)
    assert _same(m, tile.amax(dim=-1, keepdim=True))
    assert _same(tile, fs.torch_scale_fill_(other.clone(), 0.125, h, fill))
    for zero in (0.0, -0.0):
        t = -other.abs()
        t[0, 0, 3, 1] = zero
        t[0, 0, 3, 2] = -zero
        assert fs.scale_fill_(t, 0.125, None, fill, with_max=True)[1] is None
    assert fs.scale_fill_(s.clone(), 0.125, h, fill, with_max=True)[1] is None   # rows hold NaNs


@pytest.mark.parametrize("op", ["ge", "eq"])
def test_the_tie_counts_are_torchs(probe, op):
    """count_cmp against a boolean tile counted: thresholds at the row max (NaN rows included), at
    per-row values with the special ones, and at an entry of the row; a tile of rows of 48 (whole
    vectors, no 64-element step) too. Rows of 40 or another dtype's thresholds are declined."""
    dtype, (s, rows, other, _) = probe
    for tile in (s, other, other[..., :48].contiguous()):
        for thr in (tile.amax(dim=-1, keepdim=True), rows, tile[..., 5:6].contiguous()):
            got = fs.count_cmp(tile, thr, op)
            assert got is not None and got.dtype == torch.int32
            assert torch.equal(got, fs.torch_count_cmp(tile, thr, op))
    assert fs.count_cmp(other[..., :40].contiguous(), rows, op) is None
    wrong = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    assert fs.count_cmp(other, rows.to(wrong), op) is None
    with pytest.raises(ValueError, match="op must be"):
        fs.count_cmp(other, rows, "gt")


def test_the_check_fails_on_a_wrong_add_row_max_or_count(monkeypatch):
    """verified() checks the add, the row max and the tie counts too: one off by a bit in the last place
    (or a count off by one) fails it."""
    if not fs.active(torch.bfloat16):
        pytest.skip("the fused bf16 passes are off here")
    right_add, right_fill = fs.add_, fs.scale_fill_

    def add_then_nudge(a, b):
        out = right_add(a, b)
        a.view(torch.int16)[0, 0, 0, 0] += 1
        return out

    def max_nudged(s, scale, hidden, fill, with_max=False):
        out = right_fill(s, scale, hidden, fill, with_max)
        if with_max and out is not None and out[1] is not None:
            out[1].view(torch.int16 if s.dtype == torch.bfloat16 else torch.int32)[0, 0, 0, 0] += 1
        return out

    right_count = fs.count_cmp

    def count_off_by_one(s, thr, op):
        out = right_count(s, thr, op)
        out[0, 0, 0, 0] += 1
        return out

    for name, wrong in (("add_", add_then_nudge), ("scale_fill_", max_nudged), ("count_cmp", count_off_by_one)):
        monkeypatch.setattr(fs, name, wrong)
        fs.verified.cache_clear()
        try:
            assert not fs.verified(torch.bfloat16)
        finally:
            monkeypatch.undo()
            fs.verified.cache_clear()
    assert fs.verified(torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_the_check_fails_on_a_wrong_exponential(dtype, monkeypatch):
    """verified() is not a formality: with another exponential of torch's in place of the one
    torch uses for the dtype, it says no."""
    wrong = {torch.bfloat16: "Sleef_exp2f16_u10", torch.float32: "vsTanh"}[dtype]
    ptr = fs._torch_symbol(wrong)
    if ptr is None:
        pytest.skip(f"{wrong} is not in this torch build")
    monkeypatch.setattr(fs, "_exp_pointer", lambda dt: ptr)
    fs.verified.cache_clear()
    try:
        assert not fs.verified(dtype)
    finally:
        monkeypatch.undo()
        fs.verified.cache_clear()
    assert fs.verified(dtype)   # the right exponential set again by the check itself


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_tiles_it_does_not_cover_are_declined_and_left_alone(dtype):
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 3, 8, 1, generator=g).to(dtype)
    for tile in (torch.randn(2, 3, 8, 100, generator=g).to(dtype),                 # rows of 100: a scalar tail
                 torch.randn(2, 3, 8, 128, generator=g, dtype=torch.float64),        # fp64
                 torch.randn(2, 3, 128, 8, generator=g).to(dtype).transpose(-2, -1)):  # not contiguous
        before = tile.clone()
        assert fs.p_from_lse_(tile, rows.to(tile.dtype), 0.125, None) is None
        assert torch.equal(tile, before)
    tile = torch.randn(2, 3, 8, 128, generator=g).to(dtype)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    assert fs.p_from_max_(tile.clone(), rows.to(other), None, float("-inf")) is None   # x - m would promote
    per_head = _Hidden(torch.rand(3, 8, 128, generator=g) < 0.5)                         # differs by head
    assert fs.p_from_max_(tile.clone(), rows, per_head, float("-inf")) is None
    assert fs.p_from_max_(tile.clone(), rows, None, float("-inf")) is not None


def test_nothing_runs_under_a_dispatch_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    tile = torch.randn(1, 1, 64, 128).bfloat16()
    with Seen():
        assert not fs.applies(tile)


def test_alignment_rule_follows_torchs_loops(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert fs._aligned(64 * 100, 64) and not fs._aligned(100 * 100, 100)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert fs._aligned(2 * 4 * 256 * 256, 256)       # two chunks of whole rows
    assert not fs._aligned(192 * 999, 192)            # two chunks of 95,904 elements: the first ends mid-row
    assert fs._aligned(64 * 500, 64)                  # under one grain: no split


def _attention(precision, T, causal, block, stab, native_on, monkeypatch):
    monkeypatch.setenv("FLASHGUARD_NATIVE", "1" if native_on else "0")
    g = torch.Generator().manual_seed(T)
    q, k, v, do = [(torch.randn(2, 3, T, 64, generator=g) * s).bfloat16() for s in (3, 3, 1, 1e-2)]
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    kw = {} if block is None else dict(block_q=block, block_k=block)
    o = flash_attention(*leaves, is_causal=causal, precision=precision, stabilizer=stab, **kw)
    o.backward(do)
    return [t.detach() for t in (o, *(x.grad for x in leaves))]


@pytest.mark.parametrize("precision", ["paper", "fa2", "fp32", "paper-fp32fwd"])
@pytest.mark.parametrize("T,causal,block,stab", [(256, True, None, "none"), (256, False, None, "paper"),
                                                 (320, True, 64, "paper"), (200, True, None, "none"),
                                                 (128, True, 64, "none")])
def test_attention_is_bit_identical_with_the_passes(precision, T, causal, block, stab, monkeypatch):
    on = _attention(precision, T, causal, block, stab, True, monkeypatch)
    off = _attention(precision, T, causal, block, stab, False, monkeypatch)
    for a, b in zip(on, off):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
