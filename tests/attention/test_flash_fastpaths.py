"""The PyTorch flash kernel's fast paths compute the bits of the plain ops they replace.

* ``_Hidden.fill_`` (a masked fill as bitwise ops) == ``masked_fill_``, for every float dtype,
  the fill values the kernel uses, NaN / inf / -0 in the tile and broadcast masks;
* ``_exp_hidden_`` (no exp of -inf on CPU fp32 / fp64) == exp, with NaN, +inf and -inf rows;
* ``_Operands.mm`` on tiles (each operand converted and laid out for bmm once per call) ==
  ``arith.matmul`` on the plain slices, for contiguous inputs and head-split views of a fused
  projection, transposed or not, converted or not;
* the whole kernel with these paths == the kernel with them switched off (``plain_kernel``: the
  code as it was), forward and backward, bit for bit, per arithmetic, layout, tiles and masks.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flashguard.attention import flash_attention
from flashguard.attention.cpu_fastpaths import _exp_hidden_, _Hidden, _Operands, _Tile
from flashguard.attention.flash import _tile_hidden
from flashguard.numerics.arith import matmul
from flashguard.numerics.formats import get_format

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
FMT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def _bits(t):
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _tile(dtype, shape=(2, 3, 24, 40), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    x.view(-1)[::7] = float("nan")
    x.view(-1)[3::11] = float("inf")
    x.view(-1)[5::13] = float("-inf")
    x.view(-1)[1::17] = -0.0
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [0.0, float("-inf"), float("inf"), "-max", -3.0])
@pytest.mark.parametrize("mask_shape", ["causal", "full", "rows"])
def test_hidden_fill_is_masked_fill(dtype, value, mask_shape):
    if value == "-max":
        value = -torch.finfo(dtype).max
    x = _tile(dtype)
    g = torch.Generator().manual_seed(1)
    if mask_shape == "causal":
        mask = _tile_hidden(None, True, 0, 24, 8, 48 - 8, "cpu").mask  # (24, 32): q 0..24, k 8..40
        x = x[..., :32].contiguous()
    elif mask_shape == "full":
        mask = torch.rand(x.shape, generator=g) > 0.5
    else:
        mask = torch.rand(2, 1, 24, 1, generator=g) > 0.5  # broadcast over heads and keys
    want = x.clone().masked_fill_(mask, value)
    got = _Hidden(mask).fill_(x.clone(), value)
    assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shift", ["finite", "nan", "+inf", "-inf"])
def test_exp_hidden_is_exp(dtype, shift):
    g = torch.Generator().manual_seed(2)
    s = (torch.randn(2, 2, 16, 16, generator=g) * 3).to(dtype)
    hidden = _tile_hidden(None, True, 0, 16, 0, 16, "cpu")
    hidden.fill_(s, float("-inf"))
    rows = s.amax(dim=-1, keepdim=True)
    special = {"finite": 1.5, "nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}[shift]
    rows[0, 1, 3] = special
    rows[1, 0, 0] = special
    x = s - rows
    fmt = get_format(FMT[dtype])
    want = torch.exp(x)
    got = _exp_hidden_(x.clone(), hidden, rows, fmt)
    assert torch.equal(_bits(got), _bits(want))
    assert torch.equal(_bits(_exp_hidden_(x.clone(), None, rows, fmt)), _bits(want))


def _inputs(layout, B=2, H=2, T=48, D=16, seed=4, nan=False):
    g = torch.Generator().manual_seed(seed)
    if layout == "model":  # q, k, v: head-split views of one fused projection; dO transposed, as in GPT
        qkv = torch.randn(B, T, 3 * H * D, generator=g).bfloat16()
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=2))
        do = torch.randn(B, T, H, D, generator=g).bfloat16().transpose(1, 2)
    else:
        q, k, v, do = (torch.randn(B, H, T, D, generator=g).bfloat16() for _ in range(4))
    if nan:
        q = q.clone()
        q[0, 1, 5, 2] = float("nan")
        k = k.clone()
        k[1, 0, 7, 3] = float("inf")
    return q, k, v, do


@pytest.mark.parametrize("layout", ["contiguous", "model"])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("case", ["native", "converted whole", "converted as a tile"])
def test_operand_tiles_give_matmul_the_same_result(layout, transpose, case):
    """ops.mm on tiles == arith.matmul on the plain slices of the whole conversion, as the kernel
    computed before; each tile's operand is made once. Cases: bf16 operands into a bf16 result
    (native gemm); bf16 into fp32 (the tile of the input converted whole to fp32, as fa2's scores);
    a bf16 tile against an fp32 operand into bf16 (arith.matmul converts the tile itself)."""
    _, k, _, _ = _inputs(layout, T=40)
    fmt = get_format("fp32" if case == "converted whole" else "bf16")
    other_dtype = torch.float32 if case == "converted as a tile" else torch.bfloat16
    ops = _Operands()
    for r0, r1 in [(0, 40), (0, 16), (16, 32), (32, 40)]:
        other = torch.randn(2, 2, 24, 16 if transpose else r1 - r0,
                            generator=torch.Generator().manual_seed(r0)).to(other_dtype)
        tile = ops.tile(k, r0, r1, transpose=transpose, out_fmt=fmt)
        plain = ops(k, fmt)[..., r0:r1, :]
        plain = plain.transpose(-2, -1) if transpose else plain
        assert torch.equal(_bits(ops.mm(other, tile, fmt)), _bits(matmul(other, plain, fmt)))
        conv = None if case == "native" else torch.float32
        again = ops.tile(k, r0, r1, transpose=transpose, out_fmt=fmt)
        assert ops._operand(again, conv) is ops._operand(tile, conv)  # made once per call


@pytest.fixture
def plain_kernel(monkeypatch):
    """Switch the fast paths off: the kernel as it was before them (plain slices for matmul,
    masked_fill_, exp of -inf, torch.cat of every tile list)."""
    import flashguard.attention.flash as flash

    def mm(self, a, b, fmt):  # slices of the whole conversions, into arith.matmul
        def plain(t):
            return t.cut(self._whole(t.x, t.want)) if isinstance(t, _Tile) else t
        return matmul(plain(a), plain(b), fmt)

    def switch():
        monkeypatch.setattr(flash._Operands, "mm", mm)
        monkeypatch.setattr(flash._Hidden, "fill_", lambda self, x, value: x.masked_fill_(self.mask, value))
        monkeypatch.setattr(flash, "_exp_hidden_", lambda x, hidden, rows, fmt: flash._rounded(x.exp_(), fmt))
        monkeypatch.setattr(flash, "_slow_exp", lambda x, fmt: False)
        monkeypatch.setattr(flash, "_cat", lambda tiles: torch.cat(tiles, dim=-2))
    return switch


class _BmmLayouts(TorchDispatchMode):
    """Records the dtype, shape and strides of every bmm operand."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("bmm", "mm"):
            self.seen.append([(t.dtype, tuple(t.shape), t.stride()) for t in args[:2]])
        return func(*args, **(kwargs or {}))


def _run(layout, precision, block, causal, mask, nan, dropout_p=0.0):
    q, k, v, do = _inputs(layout, nan=nan)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(0)
    with _BmmLayouts() as layouts:
        o = flash_attention(*leaves, is_causal=causal, attn_mask=mask, precision=precision, block_q=block,
                            block_k=block, dropout_p=dropout_p, kernel="pytorch")
        o.backward(do)
    return [o.detach()] + [t.grad for t in leaves], layouts.seen


@pytest.mark.parametrize("precision", ["paper", "fa2", "fp32", "paper-fp32fwd", "fa2-e4m3", "fa2[delta_source=dp_p]",
                                       "paper[delta_source=o_highp]"])
@pytest.mark.parametrize("layout", ["contiguous", "model"])
@pytest.mark.parametrize("block", [None, 16])
@pytest.mark.parametrize("case", ["causal", "causal+nan", "mask", "dropout"])
def test_kernel_with_fast_paths_equals_kernel_without(plain_kernel, precision, layout, block, case):
    mask = None
    if case == "mask":
        mask = torch.rand(2, 1, 48, 48, generator=torch.Generator().manual_seed(6)) > 0.4
        mask[0, 0, 9] = False  # a fully masked row
    args = (layout, precision, block, case != "mask", mask, case == "causal+nan", 0.2 if case == "dropout" else 0.0)
    fast, fast_layouts = _run(*args)
    plain_kernel()
    plain, plain_layouts = _run(*args)
    for a, b in zip(fast, plain):
        assert torch.equal(_bits(a), _bits(b))
    # every gemm got its operands in the same dtype, shape and strides
    assert fast_layouts and fast_layouts == plain_layouts
