"""numerics/bf16_softmax.py: the bf16 softmax passes of flash attention fused in C, with torch's bits.

Each pass against the torch ops it stands for, over all 65,536 bf16 bit patterns, with and
without the scale and a causal mask; the check that turns the passes on is shown to fail on a
wrong exponential; tiles the passes do not cover (rows that are not whole steps of torch's vector
loop, masks that differ per head, other dtypes) are declined and left untouched; and the emulated
``paper`` attention gives the same bits with the passes on and off, on awkward sizes.
"""
from __future__ import annotations

import ctypes
import os

import pytest
import torch

from flashguard.attention import flash_attention
from flashguard.attention.cpu_fastpaths import _Hidden
from flashguard.numerics import bf16_softmax as bs

on = pytest.mark.skipif(not bs.active(), reason="the fused bf16 passes are off here (no C compiler, "
                                                "or torch's CPU kernels are not its AVX-512 ones)")


def _bits(x):
    return x.contiguous().view(torch.int16)


@pytest.fixture(scope="module")
def probe():
    return bs._probe(torch.Generator().manual_seed(3))


@on
@pytest.mark.parametrize("scale", [None, 0.125, 0.1767766952966369])
@pytest.mark.parametrize("masked", [False, True])
def test_the_backward_p_is_torchs_over_every_bf16_pattern(probe, scale, masked):
    s, rows, other, mask = probe
    h = _Hidden(mask) if masked else None
    for tile in (s, other):
        got = bs.p_from_lse_(tile.clone(), rows, scale, h)
        assert got is not None
        assert torch.equal(_bits(got), _bits(bs.torch_p_from_lse_(tile.clone(), rows, scale, h)))


@on
@pytest.mark.parametrize("masked", [False, True])
def test_the_forward_p_and_the_scaled_scores_are_torchs(probe, masked):
    s, rows, other, mask = probe
    h = _Hidden(mask) if masked else None
    for tile in (s, other):
        assert torch.equal(_bits(bs.p_from_max_(tile.clone(), rows, h)), _bits(bs.torch_p_from_max_(tile.clone(), rows, h)))
        fill = -3.3895313892515355e38   # the reference arithmetic's fill: minus the largest bf16
        assert torch.equal(_bits(bs.scale_fill_(tile.clone(), 0.125, h, fill)),
                           _bits(bs.torch_scale_fill_(tile.clone(), 0.125, h, fill)))


@on
@pytest.mark.parametrize("scale", [None, 0.125, 0.1767766952966369])
def test_ds_is_torchs_and_leaves_dp_alone(probe, scale):
    s, rows, other, _ = probe
    for p, dp in ((s, other), (other, s)):
        dp_before = dp.clone()
        got = bs.ds_(p.clone(), dp, rows, scale)
        assert torch.equal(_bits(got), _bits(bs.torch_ds_(p.clone(), dp, rows, scale)))
        assert torch.equal(_bits(dp), _bits(dp_before))


@on
def test_the_check_fails_on_a_wrong_exponential(monkeypatch):
    """verified() is not a formality: with exp2 in place of exp it says no."""
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    wrong = ctypes.cast(lib.Sleef_exp2f16_u10, ctypes.c_void_p).value
    monkeypatch.setattr(bs, "_exp_pointer", lambda: wrong)
    bs.verified.cache_clear()
    try:
        assert not bs.verified()
    finally:
        monkeypatch.undo()
        bs.verified.cache_clear()
        bs._library()   # the right exponential back in the library
    assert bs.verified()


@on
def test_tiles_it_does_not_cover_are_declined_and_left_alone():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 3, 8, 1, generator=g).bfloat16()
    for tile in (torch.randn(2, 3, 8, 100, generator=g).bfloat16(),            # rows of 100: a scalar tail
                 torch.randn(2, 3, 8, 128, generator=g),                        # fp32
                 torch.randn(2, 3, 128, 8, generator=g).bfloat16().transpose(-2, -1)):  # not contiguous
        before = tile.clone()
        assert bs.p_from_lse_(tile, rows, 0.125, None) is None
        assert torch.equal(tile, before)
    per_head = _Hidden(torch.rand(3, 8, 128, generator=g) < 0.5)   # a mask that differs by head
    tile = torch.randn(2, 3, 8, 128, generator=g).bfloat16()
    assert bs.p_from_max_(tile.clone(), rows, per_head) is None
    assert bs.p_from_max_(tile.clone(), rows, None) is not None


def test_alignment_rule_follows_torchs_loops(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert bs._aligned(64 * 100, 64) and not bs._aligned(100 * 100, 100)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert bs._aligned(2 * 4 * 256 * 256, 256)       # two chunks of whole rows
    assert not bs._aligned(192 * 999, 192)            # two chunks of 95,904 elements: the first ends mid-row
    assert bs._aligned(64 * 500, 64)                 # one grain: no split


def _paper(T, causal, block, stab, native_on, monkeypatch):
    monkeypatch.setenv("FLASHGUARD_NATIVE", "1" if native_on else "0")
    g = torch.Generator().manual_seed(T)
    q, k, v, do = [(torch.randn(2, 3, T, 64, generator=g) * s).bfloat16() for s in (3, 3, 1, 1e-2)]
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    kw = {} if block is None else dict(block_q=block, block_k=block)
    o = flash_attention(*leaves, is_causal=causal, precision="paper", stabilizer=stab, **kw)
    o.backward(do)
    return [_bits(t.detach()) for t in (o, *(x.grad for x in leaves))]


@on
@pytest.mark.parametrize("T,causal,block,stab", [(256, True, None, "none"), (256, False, None, "paper"),
                                                 (320, True, 64, "paper"), (200, True, None, "none"),
                                                 (128, True, 64, "none")])
def test_paper_attention_is_bit_identical_with_the_passes(T, causal, block, stab, monkeypatch):
    on_ = _paper(T, causal, block, stab, True, monkeypatch)
    off = _paper(T, causal, block, stab, False, monkeypatch)
    for a, b in zip(on_, off):
        assert torch.equal(a, b)
