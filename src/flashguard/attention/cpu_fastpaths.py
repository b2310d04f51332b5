"""The CPU fast paths of the emulated flash attention (attention/flash.py): the same bits as the
plain tensor ops they replace, in less time. Each is pinned bit for bit against the plain form by
tests/attention/test_flash_fastpaths.py.

* ``_Operands``: a call's matmul operands converted and laid out once, not once per tile pair;
  its ``mm`` is ``numerics.arith.matmul`` (the one matmul rule) on tensors and tiles.
* ``_Hidden.fill_``: a masked fill as bitwise ops on the tile's bits (masked_fill_ is a scalar
  loop on CPU).
* ``_exp_hidden_``: exp of a tile whose hidden entries are -inf without handing -inf to MKL's
  vector exp (5-15x slower on such tiles).
"""
from __future__ import annotations

import torch

from ..numerics import bf16_gemm
from ..numerics.arith import accumulation_dtype, cast, emulate, matmul_conversion

__all__: list[str] = []  # private to attention/flash.py and its tests


def _rounded(x: torch.Tensor, fmt) -> torch.Tensor:
    """After an in-place op on a tensor held in ``fmt``'s storage: native formats are already
    rounded by the op itself, emulated ones are rounded now."""
    return x if fmt.is_native else emulate(x, fmt)


def _operand_dtype(x: torch.Tensor, out_fmt) -> torch.dtype:
    """The dtype a matmul producing ``out_fmt`` consumes ``x`` in (see numerics.arith.matmul):
    its own when that is the format's dtype, else the wide accumulation dtype."""
    dt = out_fmt.torch_dtype
    if dt is not None and x.dtype == dt:
        return dt
    return accumulation_dtype(out_fmt)


def _operand(x: torch.Tensor, out_fmt) -> torch.Tensor:
    return x.to(_operand_dtype(x, out_fmt))


def _bmm_layout(x: torch.Tensor) -> torch.Tensor:
    """``x`` (..., r, c) laid out as torch.matmul hands an operand to bmm: matmul reshapes it to
    (batch, r, c), a view where the batch dims fold and a contiguous copy where they do not (a
    head-split view of a fused qkv projection, a transposed slice of one). Done here it gives
    the very tensor matmul would build, and matmul's own reshape of it is then a view."""
    return x.reshape(-1, *x.shape[-2:]).view(x.shape)


def _folds(x: torch.Tensor) -> bool:
    """Whether matmul's reshape of ``x`` (..., r, c) to (batch, r, c) is a view (else a copy)."""
    try:
        x.view(-1, *x.shape[-2:])
    except RuntimeError:
        return False
    return True


def _to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``_bmm_layout(x.to(dtype))`` in one copy: ``x.to(dtype)`` keeps x's layout (dense x) or its
    stride order, as ``empty_like`` does; where matmul would then copy that, the conversion
    writes the contiguous copy itself (the same values, the layout of matmul's copy)."""
    if _folds(torch.empty_like(x, dtype=dtype, device="meta")):  # the strides x.to(dtype) gets
        return x.to(dtype)
    return x.to(dtype, memory_format=torch.contiguous_format)


class _Tile:
    """A tile of a whole input, ``x[..., r0:r1, :]`` (``transpose``: its last two dims swapped),
    converted first to ``want`` as ``_Operands(x, out_fmt)`` converts the whole input: an operand
    of ``_Operands.mm``, built when a matmul first uses it."""

    __slots__ = ("x", "want", "r0", "r1", "transpose")

    def __init__(self, x, want, r0, r1, transpose):
        self.x, self.want, self.r0, self.r1, self.transpose = x, want, r0, r1, transpose

    def cut(self, t: torch.Tensor) -> torch.Tensor:
        t = t[..., self.r0:self.r1, :]
        return t.transpose(-2, -1) if self.transpose else t


class _Operands:
    """The matmul operands of one call, each built once instead of once per tile pair.

    ``ops(x, out_fmt)`` is ``_operand`` for a whole input (converted once, and each (tensor, dtype)
    once). ``ops.tile(x, r0, r1, transpose, out_fmt)`` names a tile of ``ops(x, out_fmt)`` and
    ``ops.mm(a, b, fmt)`` is ``numerics.arith.matmul(a, b, fmt)`` on tensors and such tiles: the
    tensor it hands torch.matmul for a tile - the slice of the converted input, converted again
    where arith.matmul converts it, laid out as matmul's reshape lays it out for bmm - is made at
    the first use and kept for the call, and each of those steps that would copy is folded into
    one copy (``_to``). The values and the layout bmm receives are the ones the plain slices give
    (tests/attention/test_flash_fastpaths.py): without this, a tile of a non-contiguous input (the
    model's q, k, v and dO are views of one qkv projection) was copied for every matmul that used
    it, and the fp32 inputs of ``fa2`` were converted whole and then copied again."""

    def __init__(self):
        self._cache = {}

    def __call__(self, x: torch.Tensor, out_fmt) -> torch.Tensor:
        return self._whole(x, _operand_dtype(x, out_fmt))

    def _whole(self, x: torch.Tensor, want: torch.dtype) -> torch.Tensor:
        if x.dtype == want:
            return x
        key = (id(x), want)
        if key not in self._cache:
            self._cache[key] = (x, x.to(want))  # x kept alive so that its id stays unique
        return self._cache[key][1]

    def tile(self, x: torch.Tensor, r0: int, r1: int, transpose: bool = False, out_fmt=None) -> _Tile:
        """The tile ``ops(x, out_fmt)[..., r0:r1, :]`` (out_fmt None: x as it is)."""
        return _Tile(x, x.dtype if out_fmt is None else _operand_dtype(x, out_fmt), r0, r1, transpose)

    def mm(self, a, b, fmt) -> torch.Tensor:
        """``numerics.arith.matmul(a, b, fmt)``; ``a`` and ``b`` are tensors or ``_Tile``s."""
        conv = matmul_conversion(*(t.want if isinstance(t, _Tile) else t.dtype for t in (a, b)), fmt)
        if conv is None:
            return bf16_gemm.matmul(self._operand(a, None), self._operand(b, None))
        return cast(self._operand(a, conv) @ self._operand(b, conv), fmt)

    def _operand(self, t, conv: "torch.dtype | None") -> torch.Tensor:
        """What arith.matmul hands torch.matmul for ``t``: ``t.to(conv)`` (conv None: t)."""
        if not isinstance(t, _Tile):
            return t if conv is None else t.to(conv)
        key = (id(t.x), t.want, t.r0, t.r1, t.transpose, conv)
        hit = self._cache.get(key)
        if hit is None:
            x, want = t.x, t.want
            conv = None if conv in (None, want) else conv
            if want == x.dtype:  # matmul(x_tile.to(conv)): the tile, converted here if at all
                out = _bmm_layout(t.cut(x)) if conv is None else _to(t.cut(x), conv)
            elif conv is None:  # the tile of the whole conversion: a view of it, or a converted copy
                whole = torch.empty_like(x, dtype=want, device="meta")  # the strides x.to(want) gets
                out = _bmm_layout(t.cut(self._whole(x, want))) if _folds(t.cut(whole)) else \
                    t.cut(x).to(want, memory_format=torch.contiguous_format)
            else:  # converted twice (no call does this): as arith.matmul does it
                out = t.cut(self._whole(x, want)).to(conv)
            hit = self._cache[key] = (t.x, out)  # x kept alive so that its id stays unique
        return hit[1]


# A masked fill as bitwise ops on the tile's bits, viewed as the integer type of the same width.
_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
         torch.float64: torch.int64}
_FILL_BITS: dict = {}


def _and_(bits: torch.Tensor, mask: torch.Tensor) -> None:
    """``bits &= mask`` in place, written with ``out=``: aten's ``bitwise_and``, which the golden
    tests' certificate of platform independence (tests/attention/exact_arith.py) lists as exact."""
    torch.bitwise_and(bits, mask, out=bits)


def _or_(bits: torch.Tensor, mask: torch.Tensor) -> None:
    """``bits |= mask`` in place (``bitwise_or``, as ``_and_``)."""
    torch.bitwise_or(bits, mask, out=bits)


def _fill_bits(dtype: torch.dtype, value: float) -> int:
    """The bits masked_fill_ writes for ``value`` into a ``dtype`` tensor, as a signed integer
    (taken from masked_fill_ itself, so the value is converted exactly as it converts it)."""
    key = (dtype, float(value).hex())
    if key not in _FILL_BITS:
        one = torch.zeros(1, dtype=dtype).masked_fill_(torch.ones(1, dtype=torch.bool), value)
        _FILL_BITS[key] = int(one.view(_BITS[dtype]).item())
    return _FILL_BITS[key]


class _Hidden:
    """The entries of one tile hidden from its queries: ``mask`` (bool, broadcastable to the
    tile, True = hidden), and ``fill_``, which writes a value there bit for bit as
    ``masked_fill_(mask, value)`` does but as bitwise ops: ``x &= keep`` (all ones where
    visible, 0 where hidden), then ``x |= hidden * bits(value)``, on x's bits viewed as integers.
    On CPU masked_fill_ is a scalar loop: about 20 ms on a 16 x 4 x 256 x 256 bf16 tile, where
    a bitwise op takes 1.5 ms (the fills were 10 % of a tiny-cpu training step). The integer
    masks are built once per dtype and fill value."""

    __slots__ = ("mask", "_ints")

    def __init__(self, mask: torch.Tensor):
        self.mask = mask
        self._ints = {}

    def _int_mask(self, idt: torch.dtype, value: int) -> torch.Tensor:
        """``mask`` as ``idt``: ``value`` where hidden, 0 elsewhere."""
        key = (idt, value)
        if key not in self._ints:
            self._ints[key] = self.mask.to(idt).mul_(value)
        return self._ints[key]

    def keep_bits(self, dtype: torch.dtype) -> torch.Tensor:
        """All ones where visible, 0 where hidden, in the integer type of ``dtype``'s width."""
        key = (_BITS[dtype], "keep")
        if key not in self._ints:
            self._ints[key] = self.mask.to(_BITS[dtype]).sub_(1)  # hidden: 1 - 1 = 0; visible: 0 - 1 = all ones
        return self._ints[key]

    def fill_(self, x: torch.Tensor, value: float) -> torch.Tensor:
        """``x.masked_fill_(mask, value)``, the same bits."""
        if x.dtype not in _BITS or x.requires_grad:
            return x.masked_fill_(self.mask, value)
        bits = x.view(_BITS[x.dtype])
        _and_(bits, self.keep_bits(x.dtype))
        fill = _fill_bits(x.dtype, value)
        if fill:
            _or_(bits, self._int_mask(bits.dtype, fill))
        return x


def _slow_exp(x: torch.Tensor, fmt) -> bool:
    """torch's fp32 / fp64 exp on CPU (MKL's vector exp) is 5-15x slower on a tile with -inf or
    huge negative entries than on one without (measured: 35 ms against 6 ms on a 16 x 4 x 256 x
    256 causal fp32 tile); bf16 / fp16 exp (computed in fp32 by another routine) is not."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and fmt.is_native \
        and not x.requires_grad


def _exp_hidden_(x: torch.Tensor, hidden: "_Hidden | None", rows: torch.Tensor, fmt) -> torch.Tensor:
    """``_rounded(x.exp_(), fmt)`` for x = S - rows (rows: (..., n, 1)) whose hidden entries had
    S = -inf, bit for bit. Where a row's ``rows`` is finite or +inf, its hidden entries are
    exactly -inf - rows = -inf and exp gives +0 there: they are set to +0 before exp (which then
    meets no -inf, see ``_slow_exp``) and to +0 after it. Rows whose ``rows`` is NaN or -inf
    (x is NaN there) are left to exp as they are."""
    if hidden is None or not _slow_exp(x, fmt):
        return _rounded(x.exp_(), fmt)
    idt = _BITS[x.dtype]
    # all ones where x keeps its value: visible entries, and every entry of a NaN / -inf row
    keep = hidden.keep_bits(x.dtype)
    good = rows > float("-inf")
    if not bool(good.all()):  # a CPU tensor (_slow_exp): no device sync
        keep = keep | good.to(idt).sub_(1)
    _and_(x.view(idt), keep)  # hidden entries of the other rows: +0
    p = _rounded(x.exp_(), fmt)
    _and_(p.view(idt), keep)  # exp(+0) = 1 back to exp(-inf) = +0
    return p
