"""A certificate that a computation gives the same bits on every platform.

A floating-point result depends on the platform only through (a) the order in which a
reduction (matmul, sum) adds its terms and the kernel's blocking of it, (b) the
implementation of transcendental functions (exp, log), and (c) the handling of subnormal
numbers (flush-to-zero). Everything else torch does on bf16 / fp32 tensors is either exact
(max, comparisons, where, masked_fill, copies, views) or one IEEE operation computed in fp32
and rounded once to the tensor's dtype (add, sub, mul, div, sqrt, dtype conversion), which
gives the same bits everywhere.

``OrderIndependence`` is a TorchDispatchMode that watches every aten op run inside it and
checks, on the actual arguments, that none of (a)-(c) can change a bit:

* a reduction (matmul, sum) is certified result by result, when either
  (1) every partial sum in *any* order is exact in fp32: every product a_ik * b_kj is a
      multiple of 2^g (g the lowest set bit of any of them) and sum_k |a_ik b_kj| < 2^(g + 24).
      Any accumulation order, blocking or split-K in fp32 or wider then gives the exact sum,
      rounded once to the output dtype; or
  (2) the exact sum s is so far from a rounding boundary of the output dtype that all of
      [s - E, s + E] rounds to one value, E = 2 n 2^-24 sum_k |a_ik b_kj| (n nonzero products)
      bounding the error of any fp32 summation order.
  Reductions over integer / bool tensors are exact. Each result is also checked against what
  this platform computed (the exact sum rounded once).
* a transcendental is certified when its exact value (computed in fp64) is so far from a
  rounding boundary of the output dtype that any implementation within ``ULPS`` fp32 ulps of
  it rounds to the same value - the value observed here.
* no floating op produces a nonzero value below the fp32 normal range (so FTZ / DAZ cannot
  matter).

An op the mode does not know is reported as uncertified, so a change in the code under test
cannot silently step outside what is certified. The assumptions the certificate rests on:
reductions accumulate in fp32 or wider and round once; elementwise bf16 / fp16 ops compute
in fp32 (torch's "opmath") and round once to nearest-even; exp / log are within ``ULPS``
fp32 ulps (torch's CPU Sleef u10 and CUDA libdevice kernels are within 2). On CUDA, torch's
``allow_bf16_reduced_precision_reduction`` (bf16 split-K partial sums) must be off.
"""
from __future__ import annotations

import math
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OrderIndependence", "lowest_bit_exponent", "ULPS"]

ULPS = 4  # error budget of a transcendental implementation, in fp32 ulps (before rounding to bf16)
_FP32_TINY = 2.0 ** -126
_NONE = 1 << 20  # "no set bit" (zero entries)

# exact results or one correctly rounded IEEE operation per element
_ELEMENTWISE = {
    "add", "add_", "sub", "sub_", "rsub", "mul", "mul_", "div", "div_", "neg", "neg_", "abs", "abs_",
    "sqrt", "sqrt_", "maximum", "minimum", "clamp", "clamp_", "clamp_min", "clamp_min_", "clamp_max",
    "clamp_max_", "where", "masked_fill", "masked_fill_", "eq", "ne", "lt", "le", "gt", "ge", "isinf",
    "isneginf", "isposinf", "isnan", "isfinite", "logical_and", "logical_or", "logical_not", "logical_xor",
    "bitwise_and", "bitwise_or", "bitwise_not", "bitwise_xor", "sign", "floor", "ceil", "trunc", "round",
    "nextafter", "copysign", "reciprocal", "reciprocal_",
}
# no arithmetic: data movement, views, constants, order-independent selections
_MOVEMENT = {
    "_to_copy", "to", "copy_", "clone", "detach", "alias", "view", "_unsafe_view", "reshape", "expand",
    "transpose", "t", "permute", "slice", "select", "unsqueeze", "squeeze", "cat", "stack", "split",
    "split_with_sizes", "chunk", "unbind", "narrow", "index", "index_select", "zeros", "zeros_like",
    "ones", "ones_like", "full", "full_like", "empty", "empty_like", "empty_strided", "new_zeros",
    "new_ones", "new_empty", "new_empty_strided", "new_full", "fill", "fill_", "zero_", "arange", "tril",
    "triu", "contiguous", "lift_fresh", "lift_fresh_copy", "_local_scalar_dense", "as_strided",
    "_reshape_alias", "amax", "amin", "max", "min", "any", "all", "argmax", "argmin", "is_nonzero",
    "scalar_tensor", "_unsafe_index", "expand_copy", "view_copy", "detach_", "set_", "resize_",
    "_has_compatible_shallow_copy_type", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
    "is_same_size", "copy", "select_backward", "slice_backward", "new_empty_strided",
}
_MATMUL = {"mm", "bmm"}
_SUM = {"sum"}
_TRANSCENDENTAL = {"exp": torch.exp, "exp_": torch.exp, "log": torch.log, "log_": torch.log}


def lowest_bit_exponent(x: torch.Tensor) -> torch.Tensor:
    """int64 tensor: e with x = odd * 2^e for each nonzero entry, ``_NONE`` for zeros (and
    non-finite entries, which the caller rejects separately)."""
    x64 = x.detach().to(torch.float64)
    mant, exp = torch.frexp(x64)
    ints = (mant.abs() * 2.0 ** 53).to(torch.int64)  # exact: |mant| in [0.5, 1)
    low = ints & -ints  # lowest set bit
    tz = torch.log2(low.clamp(min=1).to(torch.float64)).round().to(torch.int64)
    e = exp.to(torch.int64) - 53 + tz
    return torch.where((x64 != 0) & torch.isfinite(x64), e, torch.full_like(e, _NONE))


def _min_plus(la: torch.Tensor, lb: torch.Tensor) -> torch.Tensor:
    """min_k (la[..., i, k] + lb[..., k, j]): the lowest set bit of any product of a matmul."""

    rows = max(1, (1 << 22) // max(1, la.shape[-1] * lb.shape[-1]))
    parts = []
    for i in range(0, la.shape[-2], rows):
        chunk = la[..., i:i + rows, :, None] + lb[..., None, :, :]  # (..., r, k, m)
        parts.append(chunk.amin(dim=-2))
    return torch.cat(parts, dim=-2).clamp(max=_NONE)


def _floatlike(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


class OrderIndependence(TorchDispatchMode):
    """Watch the ops run inside; ``problems`` lists every one that could depend on the platform."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self._problems: list[str] = []
        self._pending: dict = {}
        self.min_transcendental_margin = math.inf  # in fp32 ulps, over all certified calls
        self.n_outputs = 0  # reduction results checked
        self.n_robust = 0  # of which not exact in fp32 but rounded alike by every order

    # -- reductions
    def _reduction(self, name, a, b, out):
        """Record A (..., n, k) @ B (..., k, m) = out, to be checked in batches (``_flush``)."""
        if not (a.is_floating_point() and b.is_floating_point()):
            return
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        a3 = a.detach().expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:]).clone()
        b3 = b.detach().expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:]).clone()
        o3 = out.detach().reshape(a3.shape[0], a3.shape[1], b3.shape[2]).clone()
        key = (name, a3.dtype, b3.dtype, o3.dtype, a3.device, tuple(a3.shape[1:]), tuple(b3.shape[1:]))
        self._pending.setdefault(key, []).append((a3, b3, o3))

    def _flush(self):
        pending, self._pending = self._pending, {}
        for (name, *_), items in pending.items():
            self._check_reduction(name, torch.cat([x[0] for x in items]), torch.cat([x[1] for x in items]),
                                  torch.cat([x[2] for x in items]), len(items))

    @property
    def problems(self) -> list[str]:
        self._flush()
        return self._problems

    def _check_reduction(self, name, a, b, out, calls):
        """A (B, n, k) @ B (B, k, m) = out (``calls`` ops batched): the same bits in every summation order?"""
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            self._problems.append(f"aten.{name}: non-finite operand")
            return
        a64, b64 = a.to(torch.float64), b.to(torch.float64)
        s = a64 @ b64            # exact: bf16 / fp16 products have <= 22 bits, sums stay far below 53
        s_abs = a64.abs() @ b64.abs()
        # (1) every partial sum exact in fp32: with g_ij the lowest set bit of any product
        # a_ik * b_kj, every partial sum is a multiple of 2^g_ij below sum_k |a_ik b_kj|
        la, lb = lowest_bit_exponent(a), lowest_bit_exponent(b)
        bits = torch.log2(s_abs.clamp(min=1e-300))
        # first with the row / column minima (a lower bound of the grain, cheap), then, for the
        # rows where that does not suffice, with the grain of each result
        coarse = (la.amin(dim=-1, keepdim=True) + lb.amin(dim=-2, keepdim=True)).clamp(max=_NONE)
        exact = (s_abs == 0) | (bits - coarse.to(torch.float64) < 24)
        if not bool(exact.all()):
            batch = exact.shape[:-2]
            la3 = la.expand(*batch, *la.shape[-2:]).reshape(-1, *la.shape[-2:])
            lb3 = lb.expand(*batch, *lb.shape[-2:]).reshape(-1, *lb.shape[-2:])
            ex3, bits3 = exact.view(-1, *exact.shape[-2:]), bits.view(-1, *bits.shape[-2:])
            for bi, ri in (~ex3).any(dim=-1).nonzero().tolist():
                fine = _min_plus(la3[bi, ri:ri + 1], lb3[bi])[0].to(torch.float64)
                ex3[bi, ri] |= bits3[bi, ri] - fine < 24
        # (2) otherwise: any order in fp32 (or wider) lands within E = 2 n u sum|a b| of s (n the
        # number of nonzero products), and all of [s - E, s + E] rounds to one value of the output dtype
        terms = (a64 != 0).to(torch.float64) @ (b64 != 0).to(torch.float64)
        err = torch.where(exact, torch.zeros_like(s), s_abs * terms * (2.0 ** -23 + 2.0 ** -52))
        dt = out.dtype
        cands = [(s - err).to(torch.float32).to(dt), (s + err).to(torch.float32).to(dt),
                 (s - err).to(dt), (s + err).to(dt)]
        ok = (cands[0] == cands[1]) & (cands[0] == cands[2]) & (cands[0] == cands[3])
        self.n_outputs += s.numel()
        self.n_robust += int((~exact & ok).sum())
        if not bool(ok.all()):
            self._problems.append(f"aten.{name} ({calls} calls of {tuple(a.shape[1:])} x {tuple(b.shape[1:])}): "
                                  f"{int((~ok).sum())} of {ok.numel()} results depend on the summation order")
            return
        if not torch.equal(cands[0].reshape(-1), out.detach().reshape(-1)):
            self._problems.append(f"aten.{name}: this platform's result is not the sum rounded once")

    def _sum(self, args, kwargs, out):
        x = args[0]
        if not x.is_floating_point():
            return
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        if isinstance(dims, int):
            dims = [dims]
        if not isinstance(dims, (list, tuple)) or len(dims) == 0:  # sum.default(self, dtype): every dim
            dims = list(range(x.dim()))
        dims = sorted(d % max(x.dim(), 1) for d in dims)
        # the reduced dims last and flattened: a (..., 1, k) @ (k, 1) product with ones
        rest = [d for d in range(x.dim()) if d not in dims]
        flat = x.permute(*rest, *dims).reshape(*[x.shape[d] for d in rest], 1, -1)
        ones = torch.ones(flat.shape[-1], 1, dtype=flat.dtype, device=flat.device)
        self._reduction("sum", flat, ones, out)

    # -- transcendentals
    def _transcendental(self, name, fn, x, out):
        dt = out.dtype
        if dt == torch.float64:
            self._problems.append(f"aten.{name}: fp64 results are not certified")
            return
        xs, inverse = torch.unique(x.detach().to(torch.float64), return_inverse=True)
        y = fn(xs)  # fp64: within an fp64 ulp or two, far below an fp32 ulp
        expect = y.to(torch.float32).to(dt)
        bad = torch.isnan(xs)
        fin = torch.isfinite(y) & (y != 0) & ~bad
        tiny = fin & (y.abs() < _FP32_TINY)
        # subnormal in fp32: an FTZ platform gives 0, so certified only where it rounds to 0 anyway
        bad |= tiny & ((y * 1.001).to(torch.float32).to(dt) != 0)
        normal = fin & ~tiny
        _, e = torch.frexp(y.abs())
        ulp32 = torch.ldexp(torch.ones_like(y), e.to(torch.int32) - 24)
        lo = (y - ULPS * ulp32).to(torch.float32).to(dt)
        hi = (y + ULPS * ulp32).to(torch.float32).to(dt)
        bad |= normal & ((lo != hi) | (lo != expect))
        if dt in (torch.bfloat16, torch.float16) and normal.any():
            p = 8 if dt == torch.bfloat16 else 11
            step = torch.ldexp(torch.ones_like(y), e.to(torch.int32) - p)
            frac = torch.remainder(y.abs() / step, 1.0)
            margin = ((frac - 0.5).abs() * step / ulp32)[normal & ~bad]
            if margin.numel():
                self.min_transcendental_margin = min(self.min_transcendental_margin, float(margin.min()))
        if bad.any():
            self._problems.append(f"aten.{name}: {int(bad.sum())} of {xs.numel()} distinct inputs lie within "
                                 f"{ULPS} fp32 ulps of a {dt} rounding boundary (implementation-dependent)")
            return
        got = out.detach().reshape(-1)
        want = expect[inverse.reshape(-1)]
        same = (got == want) | (torch.isnan(got) & torch.isnan(want))
        if not bool(same.all()):
            self._problems.append(f"aten.{name}: this platform's result is more than {ULPS} fp32 ulps off")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.counts[name] += 1
        before = None
        if name in _TRANSCENDENTAL and name.endswith("_"):
            before = args[0].detach().clone()  # in place: keep the input
        out = func(*args, **kwargs)
        if name in _MATMUL:
            self._reduction(name, args[0], args[1], out)
        elif name in _SUM:
            self._sum(args, kwargs, out)
        elif name in _TRANSCENDENTAL:
            self._transcendental(name, _TRANSCENDENTAL[name], before if before is not None else args[0], out)
        elif name not in _ELEMENTWISE and name not in _MOVEMENT:
            self._problems.append(f"uncertified op aten.{name}")
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if _floatlike(t) and t.numel() and t.dtype != torch.float64:
                a = t.detach().abs()
                if ((a > 0) & (a < _FP32_TINY)).any():
                    self._problems.append(f"aten.{name}: subnormal result (flush-to-zero dependent)")
        return out

    def report(self) -> str:
        self._flush()
        n_red = sum(self.counts[k] for k in _MATMUL | _SUM)
        n_tr = sum(self.counts[k] for k in _TRANSCENDENTAL)
        return (f"{sum(self.counts.values())} ops, {n_red} reductions ({self.n_outputs} results, "
                f"{self.n_outputs - self.n_robust} exact in fp32, {self.n_robust} inexact but far from a rounding "
                f"boundary), {n_tr} exp/log (closest {self.min_transcendental_margin:.0f} fp32 ulps from a "
                f"rounding boundary, {ULPS} allowed)")
