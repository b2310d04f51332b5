"""torch's bf16 matrix product, bit for bit, on CPUs where oneDNN has no bf16 kernel (AVX2).

There torch multiplies bf16 matrices in ATen's portable gemm (aten/src/ATen/native/cpu/
BlasKernel.cpp): every output is a sum of exact fp32 products in a fixed order, rounded once to
bf16, one output at a time - 3-40x slower than an fp32 product of the same operands, and 97 % of
the ``paper`` preset's time on such a CPU (benchmarks/results/README.md). The order depends only on the operands' layouts
(row-major: the last dim contiguous; column-major: the one before it), in torch's column-major
gemm terms:

* both row-major or both column-major: ``ilp4``, four interleaved partial sums
  (gemm_notrans_ / gemm_transab_ through ATen's ``sum``);
* a row-major first operand and a column-major second (q k^T): ``dot8``, the vectorised dot
  product of 8 registers of 8 fp32 lanes, a ninth for the tail and a scalar rest (gemm_transa_
  through ATen's reduced-precision dot; csrc/bf16_gemm.c spells the order out);
* a column-major first and a row-major second (P^T dO): ``seq``, one fp32 sum in order of the
  contraction (gemm_transb_ through an fp32 buffer).

``csrc/bf16_gemm.c`` sums in those orders, vectorised across the outputs (an output's own order
is untouched). ``matmul(a, b)`` is ``a @ b``, through the C kernels only where they hold: an
AVX2 process (torch's ``get_cpu_capability()``) whose own matmul they reproduced bit for bit on
a probe of every layout at the first call (``verified()``: operands on which the three orders
disagree in ~80 % of the outputs); everywhere else, and for shapes the rules do not cover,
torch's matmul itself. Found on an AMD EPYC with AVX2 only (torch 2.13), where the orders were
read off torch's results (tests/numerics/test_bf16_gemm.py pins them).
"""
from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import native

__all__ = ["matmul", "autocast_linear", "autocast_linear_applies", "active", "verified", "ORDERS"]

ORDERS = ("ilp4", "seq", "dot8")
# below this many products torch takes other routes (bmm's naive kernel below 400), and a C
# call saves nothing
_MIN_WORK = 1 << 15
# below this many products one thread does it (a thread hand-off costs tens of microseconds)
_MIN_PARALLEL = 1 << 22


def _layout(x: torch.Tensor) -> "str | None":
    """'row' (the last dim contiguous), 'col' (the one before it), None if neither or ambiguous."""
    r, c = x.shape[-2:]
    sr, sc = x.stride()[-2:]
    if sc == 1 and sr >= c:
        return "row"
    if sr == 1 and sc >= r:
        return "col"
    return None


def order(a3: torch.Tensor, b3: torch.Tensor) -> "str | None":
    """The summation order torch's portable gemm gives the product of (batch, m, k) ``a3`` and
    (batch, k, n) ``b3`` as laid out, or None where the rule is not known to hold."""
    if min(a3.shape[-2:]) < 2 or min(b3.shape[-2:]) < 2:
        return None  # a dim of 1 makes the layout ambiguous
    la, lb = _layout(a3), _layout(b3)
    if la is None or lb is None:
        return None
    return "ilp4" if la == lb else ("dot8" if la == "row" else "seq")


_POOL: "ThreadPoolExecutor | None" = None


def _pool(threads: int) -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None or _POOL._max_workers != threads:
        _POOL = ThreadPoolExecutor(threads, thread_name_prefix="flashguard-bf16-gemm")
    return _POOL


def _pieces(batch: int, m: int, threads: int) -> list:
    """(b0, b1, i0, i1) blocks of the output for ``threads`` workers: whole batch entries where
    there are enough, else rows of each entry. Every output is summed whole by one call, so the
    split leaves each output's order - and its bits - as they are."""
    if threads <= 1:
        return [(0, batch, 0, m)]
    if batch >= threads:
        edges = [batch * t // threads for t in range(threads + 1)]
        return [(edges[t], edges[t + 1], 0, m) for t in range(threads) if edges[t] < edges[t + 1]]
    edges = [m * t // threads for t in range(threads + 1)]
    return [(b, b + 1, edges[t], edges[t + 1]) for b in range(batch) for t in range(threads) if edges[t] < edges[t + 1]]


def product(a3: torch.Tensor, b3: torch.Tensor, how: str) -> torch.Tensor:
    """The bf16 product of (batch, m, k) ``a3`` and (batch, k, n) ``b3`` summed in order ``how``
    by the C kernel, a new contiguous (batch, m, n) bf16 tensor; on torch's intra-op threads
    (ctypes releases the GIL during the call)."""
    lib = native.library()
    batch, m, k = a3.shape
    n = b3.shape[-1]
    a = a3.to(torch.float32, memory_format=torch.contiguous_format)
    b = b3.to(torch.float32, memory_format=torch.contiguous_format)
    out = torch.empty((batch, m, n), dtype=torch.bfloat16)
    fn = getattr(lib, f"fg_bf16_gemm_{how}")
    pa, pb, pc = a.data_ptr(), b.data_ptr(), out.data_ptr()

    def run(piece):  # fp32 operands: 4 bytes an element; the bf16 output: 2
        b0, b1, i0, i1 = piece
        return fn(pa + 4 * (b0 * m + i0) * k, pb + 4 * b0 * k * n, pc + 2 * (b0 * m + i0) * n, b1 - b0, i1 - i0, n, k)

    threads = min(torch.get_num_threads(), batch * m) if batch * m * n * k >= _MIN_PARALLEL else 1
    pieces = _pieces(batch, m, threads)
    codes = [run(pieces[0])] if len(pieces) == 1 else list(_pool(threads).map(run, pieces))
    if any(codes):
        raise MemoryError(f"bf16_gemm: no memory for a {k} x 8 packed block of the second operand")
    return out


def _probe_operands(g: torch.Generator, batch: int, m: int, k: int, n: int):
    """bf16 operands on which summation orders disagree in most outputs: normal draws, plus pairs
    of products +-L * b_p that cancel exactly (rows p and q of b equal, a = +L at p and -L at q).
    While a partial sum holds L * b_p (L up to 2^20) the small products added to it lose their
    low bits, how many depending on the order; random operands alone differ in ~1e-4 of them."""
    a = torch.randn(batch, m, k, generator=g)
    b = torch.randn(batch, k, n, generator=g)
    pairs = min(3, k // 2)
    pos = torch.randperm(k, generator=g)[:2 * pairs].view(pairs, 2)
    for (p, q), big in zip(pos.tolist(), (2.0 ** 16, 2.0 ** 18, 2.0 ** 20)):
        a[..., p], a[..., q] = big, -big
        b[..., q, :] = b[..., p, :]
    return a.bfloat16(), b.bfloat16()


def _laid_out(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x if layout == "row" else x.transpose(-2, -1).contiguous().transpose(-2, -1)


# (batch, m, k, n): several 64-chunks and tails of k % 4 and k % 16 (130), one chunk (64), a chunk,
# a tail register and a scalar tail (100), no chunk (59); odd m and n
PROBE_SHAPES = ((3, 37, 130, 45), (2, 40, 64, 70), (2, 21, 100, 35), (1, 30, 59, 33))


@functools.lru_cache(maxsize=None)
def verified() -> bool:
    """Whether the C kernels reproduce this process's torch bf16 matmul bit for bit on the probe,
    in all four layouts (torch's matmul on AVX2; with oneDNN's bf16 kernels they differ, and
    are not used). Run once per process."""
    if torch.backends.cpu.get_cpu_capability() != "AVX2" or native.library() is None:
        return False
    g = torch.Generator().manual_seed(20261202)
    for batch, m, k, n in PROBE_SHAPES:
        a, b = _probe_operands(g, batch, m, k, n)
        for la in ("row", "col"):
            for lb in ("row", "col"):
                a3, b3 = _laid_out(a, la), _laid_out(b, lb)
                want = torch.matmul(a3, b3)
                got = product(a3, b3, order(a3, b3))
                if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                    return False
    return True


def active() -> bool:
    """The C path is on: the library loads now (``FLASHGUARD_NATIVE=0`` turns it off at any time)
    and ``verified()`` held."""
    return native.library() is not None and verified()


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for two tensors: the very bits torch's matmul gives here, through the C kernels
    where they are verified to give them (bf16 CPU operands of one batch shape, nothing for
    autograd to record), else torch's.
    Under a Python dispatch mode (FakeTensor tracing in torch.compile, the golden tests'
    certificate of exactness) torch's own op runs, so that the mode sees the product."""
    if _get_current_dispatch_mode() is not None:
        return a @ b
    if (a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16 or a.device.type != "cpu"
            or b.device.type != "cpu" or a.dim() < 2 or a.dim() != b.dim() or a.shape[:-2] != b.shape[:-2]
            or a.shape[-1] != b.shape[-2] or (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))
            or a.shape[-2] * a.shape[-1] * b.shape[-1] < _MIN_WORK or not active()):
        return a @ b
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    # torch.matmul folds the batch dims with reshape (a view where they fold, else a copy)
    a3, b3 = a.reshape(-1, m, k), b.reshape(-1, k, n)
    how = order(a3, b3)
    if how is None:
        return a @ b
    return product(a3, b3, how).view(*a.shape[:-2], m, n)


def autocast_linear_applies(x: torch.Tensor, weight: torch.Tensor, bias) -> bool:
    """Whether ``autocast_linear`` may stand in for ``F.linear(x, weight)`` here: under CPU bf16
    autocast, eager (not compiled, no dispatch mode), no bias (torch adds one inside the gemm,
    an order not modelled), fp32 or bf16 operands on the CPU, a contiguous x (which torch's
    matmul folds to one matrix whatever the weight; a strided x with a frozen weight goes to bmm,
    whose small products take another loop), and the C kernels verified."""
    return (bias is None and x.device.type == "cpu" and weight.device.type == "cpu" and x.dim() >= 2
            and x.is_contiguous()
            and x.dtype in (torch.float32, torch.bfloat16) and weight.dtype in (torch.float32, torch.bfloat16)
            and weight.dim() == 2 and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") == torch.bfloat16 and not torch.compiler.is_compiling()
            and _get_current_dispatch_mode() is None and active())


class _AutocastLinear(torch.autograd.Function):
    """``F.linear(x, weight)`` under CPU bf16 autocast, with torch's own products: autocast casts
    x and the weight to bf16 and matmul folds x to (N, C), so forward is mm(x2, W^T) (dot8), and
    mm's backward takes grad_x = grad @ W (ilp4) and, W^T being column-major, grad_W = grad^T @ x2
    (seq); the casts' backward converts the grads back. Run outside autocast (every operand is
    already bf16), through ``matmul``: the same bits as torch's graph, each product in C."""

    @staticmethod
    def forward(ctx, x, weight):
        with torch.autocast("cpu", enabled=False):
            x2 = x.to(torch.bfloat16).reshape(-1, x.shape[-1])          # (N, C)
            w = weight.to(torch.bfloat16)                                  # (out, C)
            out = matmul(x2, w.t())                                        # (N, out)
        ctx.save_for_backward(x2, w)
        ctx.x_meta, ctx.w_dtype = (x.shape, x.dtype), weight.dtype
        return out.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x2, w = ctx.saved_tensors
        (x_shape, x_dtype), w_dtype = ctx.x_meta, ctx.w_dtype
        g = grad.reshape(-1, grad.shape[-1])                               # (N, out), as mm's grad
        gx = gw = None
        with torch.autocast("cpu", enabled=False):
            if ctx.needs_input_grad[0]:
                gx = matmul(g, w).to(x_dtype).view(x_shape)
            if ctx.needs_input_grad[1]:
                gw = matmul(g.t(), x2).to(w_dtype)
        return gx, gw


def autocast_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` under CPU bf16 autocast, bit for bit, its products in C (see
    ``autocast_linear_applies``)."""
    return _AutocastLinear.apply(x, weight)
