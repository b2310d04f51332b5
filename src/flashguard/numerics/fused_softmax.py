"""The softmax passes of the emulated flash attention, each one fused pass, with torch's bits.

Every step of a tile's softmax in attention/flash.py is one torch op over the whole tile:
S * scale, the masked fill, S - m, exp, and in the backward dP - delta, P * scale,
P * (dP - delta). Each reads and writes the tile (12 MiB in bf16 at T = 1024, 24 in fp32), and
on CPU these passes were most of ``paper``'s time and a quarter of ``fa2``'s.
``csrc/fused_softmax.c`` runs each chain in one pass with the same operations in the same order,
so the bits are torch's:

* ``scale_fill_(s, scale, hidden, fill)``: S * scale, hidden entries then ``fill`` (and, asked for,
  the row max the forward's next step takes);
* ``p_from_max_(s, m, hidden, fill)``: the forward's P = exp(S - m) (hidden entries: +0 with a
  finite fill, as torch's exp of -inf - m with the -inf fill);
* ``p_from_lse_(s, lse, scale, hidden)``: the backward's P = exp(S * scale - lse), hidden scores
  -inf;
* ``ds_(p, dp, delta, scale)``: dS = (P * scale) * (dP - delta), into p;
* ``add_(a, b)``: a bf16 accumulator's a + b, into a (the backward's dQ, dK and dV in the study's
  arithmetic);
* ``count_cmp(s, thr, op)``: per row, how many entries are >= (or ==) the row's value: the tie
  rules' count (attention/stabilizers.py), without a boolean tile.

For bf16 tiles (scores, P and dP in bf16: the study's arithmetic) each step widens to fp32, does
one fp32 operation and rounds to bf16, as torch's bf16 ops do, and the exponential is torch's
own vector one (``Sleef_expf16_u10``, taken from torch's library). torch applies it to every
element of a loop whose length is a whole number of its 64-element steps and runs the rest in
scalar code (``std::exp``), which is not modelled; the bf16 passes run on CPUs where torch runs its
AVX-512 kernels. For fp32 tiles (fa2 and its kin) each step is one IEEE operation, and the
exponential is torch's own for fp32, MKL's ``vsExp`` (the same bits for an element whatever array
it is in); torch's scalar tail differs from its vector loop only in which NaN x - m keeps when both
are NaN, and in the bits a NaN converts to in bf16. Both take only tiles whose rows are whole
64-element steps of torch's loops and whose thread chunks start on a row. A hidden mask must be one
(n, w) mask shared by every batch entry and head (the causal mask).

With fp32 tiles the passes can also give the next step's matmul operand: ``p_from_max_`` and
``p_from_lse_`` with ``pbar=out`` write P rounded to bf16 and held in fp32 (``P.to(bf16).to(fp32)``:
fa2's P-bar operand of PV and of dV = P-bar^T dO), and ``ds_(..., round_bf16=True)`` leaves dS so
rounded (the operand of dQ and dK): a cast and a widening copy of the tile fewer each.

Each function returns None where its pass does not apply, the tile untouched, and the caller runs
its torch ops. Never under a Python dispatch mode (torch.compile's tracing, the golden tests'
certificate): there torch's ops run, so that the mode sees them. ``verified(dtype)`` checks every
pass against torch's ops before the first use (bf16: over all 65,536 bit patterns; fp32: over
random bit patterns and the special values); tests/numerics/test_fused_softmax.py pins them.
``FLASHGUARD_NATIVE=0`` turns them off.
"""
from __future__ import annotations

import ctypes
import functools
import os
import platform

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import native
from .bf16_gemm import _pool

__all__ = ["scale_fill_", "p_from_max_", "p_from_lse_", "ds_", "add_", "count_cmp", "active", "verified", "applies"]

_GRAIN = 32768   # at::internal::GRAIN_SIZE: torch's elementwise loops split into chunks of at least this
# torch's vector loop on AVX-512 takes 2 vectors a step (bf16: 2 x 32 lanes, fp32: 2 x 16; a conversion
# from fp32 to bf16 steps as bf16), then runs a scalar tail: bf16 exp there is std::exp, not Sleef,
# fp32 x - m takes the other NaN of two, and a NaN converts to other bf16 bits. 64 covers them all.
_STEP = 64
_MIN_PARALLEL = 1 << 18   # elements below which one thread does the pass
_DTYPES = (torch.bfloat16, torch.float32)


def _torch_symbol(name: str) -> "int | None":
    """The address of ``name`` in torch's CPU library (libtorch_cpu), or None."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        return ctypes.cast(getattr(ctypes.CDLL(path), name), ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


@functools.lru_cache(maxsize=None)
def _exp_pointer(dtype: torch.dtype) -> "int | None":
    """torch's own exponential for ``dtype`` tiles: Sleef's 16-lane one (bf16), MKL's vsExp (fp32)."""
    return _torch_symbol("Sleef_expf16_u10" if dtype == torch.bfloat16 else "vsExp")


def _library(dtype: torch.dtype):
    """The C library with ``dtype``'s exponential set, where this process can run its passes."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    if dtype == torch.bfloat16 and torch.backends.cpu.get_cpu_capability() != "AVX512":
        return None
    lib = native.library()
    if lib is None or not hasattr(lib, "fg_bf16_p_from_lse"):
        return None
    ptr = _exp_pointer(dtype)
    setter = lib.fg_bf16_softmax_set_exp if dtype == torch.bfloat16 else lib.fg_f32_softmax_set_exp
    if ptr is None or not setter(ptr):
        return None
    return lib


def _aligned(numel: int, w: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether torch's elementwise loops over a contiguous (numel // w, w) tile of ``dtype`` run every
    element in their vector body: rows of whole steps, and thread chunks (at::parallel_for: as many
    as there are threads, each at least a grain) that start on a row."""
    if w % _STEP or numel % w:
        return False
    tasks = min(torch.get_num_threads(), -(-numel // _GRAIN))
    return tasks <= 1 or (-(-numel // tasks)) % w == 0


def _mask(hidden, shape) -> "torch.Tensor | None | bool":
    """The hidden mask as one contiguous (n, w) uint8 tensor (None: nothing hidden), or False where
    it is not one mask shared by every batch entry and head."""
    if hidden is None:
        return None
    m = hidden.mask
    n, w = shape[-2:]
    if m.dtype != torch.bool or m.shape[-2:] != (n, w) or any(d != 1 for d in m.shape[:-2]):
        return False
    return m.reshape(n, w).contiguous().view(torch.uint8)


def applies(x: torch.Tensor, hidden=None) -> bool:
    """Whether the C passes stand in for torch's ops on tile ``x`` (see the module docstring)."""
    if _get_current_dispatch_mode() is not None or torch.compiler.is_compiling():
        return False
    return (x.dtype in _DTYPES and x.device.type == "cpu" and x.dim() >= 2 and x.is_contiguous()
            and not x.requires_grad and x.numel() > 0
            and _aligned(x.numel(), x.shape[-1], x.dtype)
            and _mask(hidden, x.shape) is not False and active(x.dtype))


def _rows(shift: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The per-row value (..., n, 1) as one contiguous value per row of x."""
    return shift.expand(*x.shape[:-1], 1).contiguous()


def _row_shift(shift, x: torch.Tensor) -> bool:
    """Whether ``shift`` is a per-row value of x's own dtype (another dtype would make torch compute
    x - shift in the promoted type)."""
    return (isinstance(shift, torch.Tensor) and shift.dtype == x.dtype and shift.device == x.device
            and shift.dim() == x.dim() and shift.shape[-1] == 1)


def _run(call, x: torch.Tensor) -> None:
    """call(r0, r1) over the rows of x, split across torch's intra-op threads (rows are
    independent, so the split leaves every bit where it is; ctypes releases the GIL)."""
    rows = x.numel() // x.shape[-1]
    threads = min(torch.get_num_threads(), rows) if x.numel() >= _MIN_PARALLEL else 1
    if threads <= 1:
        call(0, rows)
        return
    edges = [rows * t // threads for t in range(threads + 1)]
    list(_pool(threads).map(lambda t: call(edges[t], edges[t + 1]), range(threads)))


def _ptr(t: "torch.Tensor | None") -> "int | None":
    return None if t is None else t.data_ptr()


def _fill_bits(fill: float) -> int:
    """The bf16 bits of ``fill`` as masked_fill_ writes them."""
    return int(torch.tensor([fill], dtype=torch.bfloat16).view(torch.int16).item()) & 0xFFFF


def scale_fill_(s: torch.Tensor, scale: float, hidden, fill: float, with_max: bool = False):
    """In place: s <- s * scale (rounded to s's dtype), hidden entries then ``fill``. Returns s, or
    None where the pass does not apply; ``with_max``: (s, its row max (..., n, 1) as torch's
    ``s.amax(-1, keepdim=True)`` gives it), the max None where a row's max is zero or NaN (which
    zero or NaN torch's amax returns depends on its reduction order: the caller takes amax)."""
    if not applies(s, hidden):
        return None
    lib, mask, w = _library(s.dtype), _mask(hidden, s.shape), s.shape[-1]
    period = 1 if mask is None else mask.shape[0]
    m = torch.empty((*s.shape[:-1], 1), dtype=s.dtype) if with_max else None
    if s.dtype == torch.bfloat16:
        f, bits = lib.fg_bf16_scale_fill, _fill_bits(fill)
        _run(lambda r0, r1: f(s.data_ptr(), _ptr(mask), period, float(scale), bits, _ptr(m), w, r0, r1), s)
    else:
        f = lib.fg_f32_scale_fill
        _run(lambda r0, r1: f(s.data_ptr(), _ptr(mask), period, float(scale), float(fill), _ptr(m), w, r0, r1), s)
    if not with_max:
        return s
    return s, (None if bool(((m == 0) | m.isnan()).any()) else m)


def _pbar_ok(pbar, s: torch.Tensor) -> bool:
    return pbar is None or (s.dtype == torch.float32 and pbar.dtype == torch.float32 and pbar.shape == s.shape
                            and pbar.is_contiguous() and pbar.device == s.device)


def p_from_max_(s: torch.Tensor, m: torch.Tensor, hidden, fill: float, pbar=None) -> "torch.Tensor | None":
    """In place: s <- exp(s - m), each step rounded to s's dtype. Hidden entries (holding ``fill``):
    +0 with a finite fill; with the -inf fill, torch's exp of -inf - m (+0 where m > -inf).
    ``pbar`` (fp32 tiles): None, or an fp32 tensor like s that receives P.to(bf16).to(fp32)."""
    if not (_row_shift(m, s) and _pbar_ok(pbar, s) and applies(s, hidden)):
        return None
    lib, mask, w = _library(s.dtype), _mask(hidden, s.shape), s.shape[-1]
    shift, period = _rows(m, s), 1 if mask is None else mask.shape[0]
    neg_inf = fill == float("-inf")
    if s.dtype == torch.bfloat16:  # with -inf in the hidden entries the exponential gives what torch's does
        mask = None if neg_inf else mask
        f = lib.fg_bf16_p_from_max
        _run(lambda r0, r1: f(s.data_ptr(), shift.data_ptr(), _ptr(mask), period, w, r0, r1), s)
    else:
        f = lib.fg_f32_p
        _run(lambda r0, r1: f(s.data_ptr(), shift.data_ptr(), _ptr(mask), period, 1.0, 0, 0, 2 if neg_inf else 1,
                              _ptr(pbar), w, r0, r1), s)
    return s


def p_from_lse_(s: torch.Tensor, lse: torch.Tensor, scale: "float | None", hidden=None,
                pbar=None) -> "torch.Tensor | None":
    """In place: s <- exp(S' - lse), S' = s * scale (``scale`` None: S' = s) with hidden entries
    -inf, each step rounded to s's dtype. ``pbar`` as in ``p_from_max_``."""
    if not (_row_shift(lse, s) and _pbar_ok(pbar, s) and applies(s, hidden)):
        return None
    lib, mask, w = _library(s.dtype), _mask(hidden, s.shape), s.shape[-1]
    shift, period = _rows(lse, s), 1 if mask is None else mask.shape[0]
    sc, do_scale = float(scale or 1.0), int(scale is not None)
    if s.dtype == torch.bfloat16:
        f = lib.fg_bf16_p_from_lse
        _run(lambda r0, r1: f(s.data_ptr(), shift.data_ptr(), _ptr(mask), period, sc, do_scale, w, r0, r1), s)
    else:
        f = lib.fg_f32_p
        _run(lambda r0, r1: f(s.data_ptr(), shift.data_ptr(), _ptr(mask), period, sc, do_scale, 1, 2, _ptr(pbar),
                              w, r0, r1), s)
    return s


def ds_(p: torch.Tensor, dp: torch.Tensor, delta: torch.Tensor, scale: "float | None",
        round_bf16: bool = False) -> "torch.Tensor | None":
    """In place: p <- P' * (dp - delta), P' = p * scale (``scale`` None: P' = p), each step rounded
    to p's dtype; dp is left as it is. ``round_bf16`` (fp32 tiles): the result then rounded to bf16
    and held in fp32 (dS.to(bf16).to(fp32))."""
    if not (_row_shift(delta, p) and dp.dtype == p.dtype and dp.shape == p.shape and dp.is_contiguous()
            and dp.device.type == "cpu" and (not round_bf16 or p.dtype == torch.float32) and applies(p)):
        return None
    lib, w = _library(p.dtype), p.shape[-1]
    shift = _rows(delta, p)
    sc, do_scale = float(scale or 1.0), int(scale is not None)
    if p.dtype == torch.bfloat16:
        f = lib.fg_bf16_ds
        _run(lambda r0, r1: f(p.data_ptr(), dp.data_ptr(), shift.data_ptr(), sc, do_scale, w, r0, r1), p)
    else:
        f = lib.fg_f32_ds
        _run(lambda r0, r1: f(p.data_ptr(), dp.data_ptr(), shift.data_ptr(), sc, do_scale, int(round_bf16),
                              w, r0, r1), p)
    return p


def add_(a: torch.Tensor, b: torch.Tensor) -> "torch.Tensor | None":
    """In place: a <- a + b rounded to bf16, both bf16 tiles of one shape (an accumulator's add_)."""
    if not (a.dtype == torch.bfloat16 and b.dtype == a.dtype and b.shape == a.shape and b.is_contiguous()
            and b.device.type == "cpu" and applies(a)):
        return None
    f, w = _library(a.dtype).fg_bf16_add, a.shape[-1]
    _run(lambda r0, r1: f(a.data_ptr(), b.data_ptr(), w, r0, r1), a)
    return a


def count_cmp(s: torch.Tensor, thr: torch.Tensor, op: str) -> "torch.Tensor | None":
    """Per row of ``s`` (..., n, w), how many entries are ``>=`` (op "ge") or ``==`` (op "eq") the
    row's value in ``thr`` (..., n, 1), as int32 (..., n, 1): ``torch_count_cmp``'s counts. A compare
    rounds nothing, so any CPU with the library gives torch's answer; tiles must be contiguous rows
    of whole 16-lane vectors."""
    if op not in ("ge", "eq"):
        raise ValueError(f"count_cmp: op must be 'ge' or 'eq', got {op!r}")
    if not (s.dtype in _DTYPES and thr.dtype == s.dtype and s.device.type == "cpu" and s.dim() >= 2
            and s.is_contiguous() and s.numel() > 0 and s.shape[-1] % 16 == 0 and _row_shift(thr, s)
            and _get_current_dispatch_mode() is None and not torch.compiler.is_compiling() and active(s.dtype)):
        return None
    lib, w = _library(s.dtype), s.shape[-1]
    f = lib.fg_bf16_count_cmp if s.dtype == torch.bfloat16 else lib.fg_f32_count_cmp
    rows, out = _rows(thr, s), torch.empty((*s.shape[:-1], 1), dtype=torch.int32)
    ge = int(op == "ge")
    _run(lambda r0, r1: f(s.data_ptr(), rows.data_ptr(), ge, out.data_ptr(), w, r0, r1), s)
    return out


# --- the torch ops each pass stands for: the check's reference, and attention/flash.py's steps
# where a pass declines (native bf16 / fp32 formats, where rounding to the format is the op's own)

def torch_scale_fill_(s, scale, hidden, fill):
    s.mul_(scale)
    return s if hidden is None else hidden.fill_(s, fill)


def torch_p_from_max_(s, m, hidden, fill):
    from ..attention.cpu_fastpaths import _exp_hidden_, _slow_exp
    fmt = _native_format(s.dtype)
    x = s.sub_(m)
    if hidden is None or fill == float("-inf"):
        return _exp_hidden_(x, hidden, m, fmt)
    if _slow_exp(x, fmt):
        hidden.fill_(x, 0.0)
    return hidden.fill_(x.exp_(), 0.0)


def torch_p_from_lse_(s, lse, scale, hidden):
    from ..attention.cpu_fastpaths import _exp_hidden_
    if scale is not None:
        s.mul_(scale)
    if hidden is not None:
        hidden.fill_(s, float("-inf"))
    return _exp_hidden_(s.sub_(lse), hidden, lse, _native_format(s.dtype))


def torch_ds_(p, dp, delta, scale):
    dpm = dp.clone().sub_(delta)
    if scale is not None:
        p.mul_(scale)
    return p.mul_(dpm)


def torch_add_(a, b):
    return a.add_(b)


def torch_count_cmp(s, thr, op):
    return ((s >= thr) if op == "ge" else (s == thr)).sum(dim=-1, keepdim=True, dtype=torch.int32)


def _native_format(dtype):
    from .formats import BF16, FP32
    return BF16 if dtype == torch.bfloat16 else FP32


def _probe(g: torch.Generator, dtype: torch.dtype):
    """A (2, 1, 64, 512) tile of ``dtype`` (bf16: every bit pattern once; fp32: random bit patterns,
    ordinary values and the special ones), per-row shifts with the special values among them, a
    tile of ordinary values, and a causal-like mask."""
    if dtype == torch.bfloat16:
        every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        s = every[torch.randperm(65536, generator=g)]
    else:
        bits = torch.randint(-2 ** 31, 2 ** 31, (65536,), generator=g, dtype=torch.int64).to(torch.int32)
        s = bits.view(torch.float32).clone()
        s[: 32768] = torch.randn(32768, generator=g) * 30
        s[:8] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-45, 3e38])
        s = s[torch.randperm(65536, generator=g)]
    s = s.reshape(2, 1, 64, 512).contiguous()
    rows = torch.randn(2, 1, 64, 1, generator=g) * 8
    rows.view(-1)[:6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3e38])
    other = (torch.randn(2, 1, 64, 512, generator=g) * 4).to(dtype)
    cols = torch.arange(512)[None, :]
    mask = (cols > torch.arange(64)[:, None] * 8) | (torch.rand(64, 512, generator=g) < 0.05)
    return s, rows.to(dtype), other, mask


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))


@functools.lru_cache(maxsize=None)
def verified(dtype: torch.dtype) -> bool:
    """Whether every C pass on ``dtype`` tiles gives torch's bits here: each against its torch
    ops (the ``torch_*`` functions above) on the probe (``_probe``) as the tile and as dP, with and
    without the scale and the mask, with the finite and the -inf fill. Run once per process and
    dtype (under torch's thread count at that time; ``applies`` checks the bf16 loops' alignment at
    every call)."""
    if _library(dtype) is None:
        return False
    from ..attention.cpu_fastpaths import _Hidden
    s, rows, other, mask = _probe(torch.Generator().manual_seed(20261207), dtype)
    finite = -torch.finfo(dtype).max
    for h in (None, _Hidden(mask)):
        for tile in (s, other):
            for fill in (finite, float("-inf")):
                if not _same(_unchecked(p_from_max_, tile.clone(), rows, h, fill),
                             torch_p_from_max_(tile.clone(), rows, h, fill)):
                    return False
            for scale in (None, 0.125, 0.14433756729740643):
                if not _same(_unchecked(p_from_lse_, tile.clone(), rows, scale, h),
                             torch_p_from_lse_(tile.clone(), rows, scale, h)):
                    return False
                if scale is not None and not all(
                        _same(_unchecked(scale_fill_, tile.clone(), scale, h, fill),
                              torch_scale_fill_(tile.clone(), scale, h, fill)) for fill in (finite, float("-inf"))):
                    return False
                if scale is not None and not all(_max_agrees(tile, scale, h, fill) for fill in (finite, float("-inf"))):
                    return False
    for scale in (None, 0.125, 0.14433756729740643):
        for p, dp in ((s, other), (other, s)):
            if not _same(_unchecked(ds_, p.clone(), dp, rows, scale), torch_ds_(p.clone(), dp, rows, scale)):
                return False
            if dtype == torch.float32 and not _same(
                    _unchecked(ds_, p.clone(), dp, rows, scale, True),
                    torch_ds_(p.clone(), dp, rows, scale).to(torch.bfloat16).to(torch.float32)):
                return False
    for tile in (s, other):   # the tie rules' counts, at and below each row's max
        top = tile.amax(dim=-1, keepdim=True)
        for thr, op in ((top, "eq"), (top, "ge"), (rows, "ge"), (rows, "eq"), (tile[..., :1].contiguous(), "eq")):
            if not torch.equal(_unchecked(count_cmp, tile, thr, op), torch_count_cmp(tile, thr, op)):
                return False
    if dtype == torch.bfloat16:  # the accumulators' add: every bit pattern against two others
        flipped = s.flip(-1).contiguous()
        for a, b in ((s, other), (other, s), (s, flipped), (s, s)):
            if not _same(_unchecked(add_, a.clone(), b), torch_add_(a.clone(), b)):
                return False
    if dtype == torch.float32:  # P rounded to bf16 beside P
        for h in (None, _Hidden(mask)):
            for tile in (s, other):
                want = torch_p_from_lse_(tile.clone(), rows, 0.125, h).to(torch.bfloat16).to(torch.float32)
                got = torch.empty_like(tile)
                _unchecked(p_from_lse_, tile.clone(), rows, 0.125, h, got)
                want_fwd = torch_p_from_max_(tile.clone(), rows, h, float("-inf")).to(torch.bfloat16).float()
                got_fwd = torch.empty_like(tile)
                _unchecked(p_from_max_, tile.clone(), rows, h, float("-inf"), got_fwd)
                if not (_same(got, want) and _same(got_fwd, want_fwd)):
                    return False
    return True


def _max_agrees(tile, scale, hidden, fill) -> bool:
    """scale_fill_'s row max against torch's amax of torch's steps, on ``tile`` and on it with its
    NaNs and zeros replaced (rows that the pass declines to give a max for, then ones it gives)."""
    for t in (tile, torch.where(tile.isnan() | (tile == 0), 1.5, tile)):
        want = torch_scale_fill_(t.clone(), scale, hidden, fill)
        got, m = _unchecked(scale_fill_, t.clone(), scale, hidden, fill, True)
        if not _same(got, want):
            return False
        if m is not None and not _same(m, want.amax(dim=-1, keepdim=True)):
            return False
        if m is None and not bool(((want.amax(dim=-1) == 0) | want.amax(dim=-1).isnan()).any()):
            return False   # declined a tile with no zero or NaN row max
    return True


_checking = False


def _unchecked(fn, *args):
    """``fn(*args)`` inside ``verified()`` (which ``active()`` would otherwise ask again)."""
    global _checking
    _checking = True
    try:
        out = fn(*args)
    finally:
        _checking = False
    if out is None:
        raise RuntimeError(f"fused_softmax.verified: {fn.__name__} did not apply to its probe")
    return out


def active(dtype: torch.dtype) -> bool:
    """The C passes on ``dtype`` tiles are on: the library loads now (``FLASHGUARD_NATIVE=0`` turns
    them off at any time) and ``verified(dtype)`` held."""
    return _checking or (native.library() is not None and verified(dtype))
