"""The bf16 softmax passes of the emulated flash attention, each one fused pass, with torch's bits.

In the study's arithmetic (``paper``: scores, P and dP all bf16) every step of a tile's softmax is
one torch op over the whole tile: S * scale, the masked fill, S - m, exp, and in the backward
dP - delta, P * scale, P * (dP - delta). Each widens bf16 to fp32, does one fp32 operation and
rounds back, and each reads and writes the tile (12 MiB at T = 1024): on CPU these passes were
most of ``paper``'s time. ``csrc/bf16_softmax.c`` runs each chain in one pass with the same
roundings between steps and torch's own vector exponential (``Sleef_expf16_u10``, taken from
torch's library), so the bits are torch's:

* ``p_from_lse_(s, lse, scale, hidden)``: the backward's P = exp(bf16(bf16(S * scale) - lse)),
  hidden entries of the scaled S at -inf;
* ``p_from_max_(s, m, hidden)``: the forward's P = exp(bf16(S - m)), hidden entries then +0;
* ``ds_(p, dp, delta, scale)``: dS = bf16(bf16(P * scale) * bf16(dP - delta)), into p;
* ``scale_fill_(s, scale, hidden, fill)``: bf16(S * scale), hidden entries then ``fill``.

Each returns None where the C pass does not apply, and the caller runs its torch ops. It applies
on the CPU with torch's AVX-512 kernels (``get_cpu_capability()``; elsewhere torch's exponential
is another routine), to contiguous bf16 tiles whose rows are whole 64-element steps of torch's
vector loop and whose thread chunks start on a row: torch runs a loop's last partial step with
scalar code (``std::exp``, not Sleef), which the C pass does not model. A hidden mask must be
one (n, w) mask shared by every batch entry and head (the causal mask). Under a Python dispatch
mode (torch.compile's tracing, the golden tests' certificate) torch's ops run. ``verified()`` checks
every kernel against torch's ops over all 65,536 bf16 bit patterns before the first use
(tests/numerics/test_bf16_softmax.py pins it); ``FLASHGUARD_NATIVE=0`` turns it off.
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

__all__ = ["p_from_lse_", "p_from_max_", "ds_", "scale_fill_", "active", "verified", "applies"]

_GRAIN = 32768   # at::internal::GRAIN_SIZE: torch's elementwise loops split into chunks of at least this
_STEP = 64       # torch's vector loop over bf16 on AVX-512: 2 x 32 lanes a step, then a scalar tail
_MIN_PARALLEL = 1 << 18   # elements below which one thread does the pass


@functools.lru_cache(maxsize=None)
def _exp_pointer() -> "int | None":
    """The address of torch's own ``Sleef_expf16_u10`` (libtorch_cpu), or None."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        return ctypes.cast(ctypes.CDLL(path).Sleef_expf16_u10, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def _library():
    """The C library with the exponential set, where this process can run the passes, else None."""
    if platform.machine() not in ("x86_64", "AMD64") or torch.backends.cpu.get_cpu_capability() != "AVX512":
        return None
    lib = native.library()
    if lib is None or not hasattr(lib, "fg_bf16_p_from_lse"):
        return None
    ptr = _exp_pointer()
    if ptr is None or not lib.fg_bf16_softmax_set_exp(ptr):
        return None
    return lib


def _aligned(numel: int, w: int) -> bool:
    """Whether torch's elementwise loops over a contiguous (numel // w, w) tile run every element in
    their vector body: rows of whole 64-element steps, and thread chunks (at::parallel_for: as many
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
    """Whether the C passes stand in for torch's ops on tile ``x`` (see the module docstring).
    Never under a Python dispatch mode (FakeTensor tracing in torch.compile, the golden tests'
    certificate of exactness): there torch's own ops run, so that the mode sees them."""
    if _get_current_dispatch_mode() is not None or torch.compiler.is_compiling():
        return False
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() >= 2 and x.is_contiguous()
            and not x.requires_grad and _aligned(x.numel(), x.shape[-1]) and _mask(hidden, x.shape) is not False
            and active())


def _rows(shift: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The per-row value (..., n, 1) as one contiguous bf16 value per row of x."""
    return shift.to(torch.bfloat16).expand(*x.shape[:-1], 1).contiguous()


def _run(call, rows: int, numel: int) -> None:
    """call(r0, r1) over the rows, split across torch's intra-op threads (rows are independent,
    so the split leaves every bit where it is; ctypes releases the GIL)."""
    threads = min(torch.get_num_threads(), rows) if numel >= _MIN_PARALLEL else 1
    if threads <= 1:
        call(0, rows)
        return
    edges = [rows * t // threads for t in range(threads + 1)]
    list(_pool(threads).map(lambda t: call(edges[t], edges[t + 1]), range(threads)))


def _ptr(t: "torch.Tensor | None") -> "int | None":
    return None if t is None else t.data_ptr()


def p_from_lse_(s: torch.Tensor, lse: torch.Tensor, scale: "float | None", hidden=None) -> "torch.Tensor | None":
    """In place: s <- exp(bf16(S' - lse)) rounded to bf16, S' = bf16(s * scale) (``scale`` None:
    S' = s) with hidden entries -inf. None (s untouched) where the C pass does not apply."""
    if not applies(s, hidden):
        return None
    lib, mask, w = _library(), _mask(hidden, s.shape), s.shape[-1]
    shift = _rows(lse, s)
    period = 1 if mask is None else mask.shape[0]
    f = lib.fg_bf16_p_from_lse
    _run(lambda r0, r1: f(s.data_ptr(), shift.data_ptr(), _ptr(mask), period, float(scale or 1.0),
                          int(scale is not None), w, r0, r1), s.numel() // w, s.numel())
    return s


def p_from_max_(s: torch.Tensor, m: torch.Tensor, hidden=None) -> "torch.Tensor | None":
    """In place: s <- exp(bf16(s - m)) rounded to bf16, hidden entries then +0. None (s untouched)
    where the C pass does not apply."""
    if not applies(s, hidden):
        return None
    lib, mask, w = _library(), _mask(hidden, s.shape), s.shape[-1]
    shift = _rows(m, s)
    period = 1 if mask is None else mask.shape[0]
    f = lib.fg_bf16_p_from_max
    _run(lambda r0, r1: f(s.data_ptr(), shift.data_ptr(), _ptr(mask), period, w, r0, r1), s.numel() // w, s.numel())
    return s


def ds_(p: torch.Tensor, dp: torch.Tensor, delta: torch.Tensor, scale: "float | None") -> "torch.Tensor | None":
    """In place: p <- bf16(P' * bf16(dp - delta)), P' = bf16(p * scale) (``scale`` None: P' = p); dp
    is left as it is. None (p untouched) where the C pass does not apply."""
    if not (applies(p) and dp.dtype == torch.bfloat16 and dp.shape == p.shape and dp.is_contiguous()
            and dp.device.type == "cpu"):
        return None
    lib, w = _library(), p.shape[-1]
    shift = _rows(delta, p)
    f = lib.fg_bf16_ds
    _run(lambda r0, r1: f(p.data_ptr(), dp.data_ptr(), shift.data_ptr(), float(scale or 1.0), int(scale is not None),
                          w, r0, r1), p.numel() // w, p.numel())
    return p


def scale_fill_(s: torch.Tensor, scale: float, hidden, fill: float) -> "torch.Tensor | None":
    """In place: s <- bf16(s * scale), hidden entries then ``fill`` (as masked_fill_ converts it).
    None (s untouched) where the C pass does not apply."""
    if not applies(s, hidden):
        return None
    lib, mask, w = _library(), _mask(hidden, s.shape), s.shape[-1]
    bits = int(torch.tensor([fill], dtype=torch.bfloat16).view(torch.int16).item()) & 0xFFFF
    period = 1 if mask is None else mask.shape[0]
    f = lib.fg_bf16_scale_fill
    _run(lambda r0, r1: f(s.data_ptr(), _ptr(mask), period, float(scale), bits, w, r0, r1), s.numel() // w, s.numel())
    return s


# --- the torch ops each pass stands for (the verification's reference, and tests/numerics')

def torch_p_from_lse_(s, lse, scale, hidden):
    if scale is not None:
        s.mul_(scale)
    if hidden is not None:
        hidden.fill_(s, float("-inf"))
    return s.sub_(lse).exp_()


def torch_p_from_max_(s, m, hidden):
    p = s.sub_(m).exp_()
    return p if hidden is None else hidden.fill_(p, 0.0)


def torch_ds_(p, dp, delta, scale):
    dpm = dp.clone().sub_(delta)
    if scale is not None:
        p.mul_(scale)
    return p.mul_(dpm)


def torch_scale_fill_(s, scale, hidden, fill):
    s.mul_(scale)
    return s if hidden is None else hidden.fill_(s, fill)


def _probe(g: torch.Generator):
    """A (2, 1, 64, 512) bf16 tile holding every bf16 bit pattern once, per-row shifts with the
    special values among them, a second tile of ordinary values, and a causal-like mask."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    s = every[torch.randperm(65536, generator=g)].reshape(2, 1, 64, 512).contiguous()
    rows = torch.randn(2, 1, 64, 1, generator=g) * 8
    rows.view(-1)[:6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3e38])
    other = (torch.randn(2, 1, 64, 512, generator=g) * 4).bfloat16()
    cols = torch.arange(512)[None, :]
    mask = (cols > torch.arange(64)[:, None] * 8) | (torch.rand(64, 512, generator=g) < 0.05)
    return s, rows.bfloat16(), other, mask


@functools.lru_cache(maxsize=None)
def verified() -> bool:
    """Whether every C pass gives torch's bits here: each against its torch ops, over all 65,536
    bf16 patterns as the tile (and as dP), with and without the scale and the mask. Run once per
    process (under torch's thread count at that time; ``applies`` checks the loops' alignment at
    every call)."""
    if _library() is None:
        return False
    from ..attention.cpu_fastpaths import _Hidden
    g = torch.Generator().manual_seed(20261207)
    s, rows, other, mask = _probe(g)
    hidden = _Hidden(mask)
    same = lambda a, b: torch.equal(a.view(torch.int16), b.view(torch.int16))  # noqa: E731
    for scale in (None, 0.125, 0.14433756729740643):
        for h in (None, hidden):
            for tile in (s, other):
                if not same(_unchecked(p_from_lse_, tile.clone(), rows, scale, h),
                            torch_p_from_lse_(tile.clone(), rows, scale, h)):
                    return False
                if scale is None and not same(_unchecked(p_from_max_, tile.clone(), rows, h),
                                              torch_p_from_max_(tile.clone(), rows, h)):
                    return False
                if scale is not None and not same(_unchecked(scale_fill_, tile.clone(), scale, h, -3.3895e38),
                                                  torch_scale_fill_(tile.clone(), scale, h, -3.3895e38)):
                    return False
        for p, dp in ((s, other), (other, s)):
            if not same(_unchecked(ds_, p.clone(), dp, rows, scale), torch_ds_(p.clone(), dp, rows, scale)):
                return False
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
        raise RuntimeError(f"bf16_softmax.verified: {fn.__name__} did not apply to its probe")
    return out


def active() -> bool:
    """The C passes are on: the library loads now (``FLASHGUARD_NATIVE=0`` turns them off at any
    time) and ``verified()`` held."""
    return _checking or (native.library() is not None and verified())
