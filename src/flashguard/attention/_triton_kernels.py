"""Triton kernels of flashguard's fused flash attention (imported lazily: needs ``triton``).

FA2 structure with the ``fa2`` arithmetic of ``flashguard.numerics.policy``: inputs in one
low format (bf16 / fp16) or fp32, fp32 scores, statistics and accumulators, Pbar and dS rounded
to the input format as matmul operands, O rounded once at the end, lse saved in fp32.

* ``_fwd_kernel``        one program per (query block, batch * head): online softmax over the
                         key blocks, the shift chosen by the stabilizer (a constexpr):
                         0 none, 1 paper (beta, tol), 2 safe (dithered margin, rounded up).
* ``_bwd_delta_kernel``  delta = rowsum(dO * O) in fp32.
* ``_bwd_dkdv_kernel``   one program per key block: loops over the query blocks, owns dK, dV.
* ``_bwd_dq_kernel``     one program per query block: loops over the key blocks, owns dQ.
                         (The atomic-free two-kernel backward: S and P are recomputed twice.)

Tensors are (B, H, T, D) with any strides; lse / delta are contiguous (B * H, T_q) fp32;
gradients are written in fp32. Head dims are padded to the power of two ``D_PAD`` with masked
loads (zeros), so padding adds nothing to any dot product.

The environment variable ``TRITON_INTERPRET=1`` must be set before triton is first imported
(``triton.jit`` reads it when it decorates a kernel, and triton's own library functions such
as ``tl.sum`` are decorated at ``import triton``): the kernels then run on CPU tensors
through Triton's numpy interpreter, whose ``tl.dot`` does not support bf16 operands (it
multiplies their bit patterns, triton-lang/triton#11584). ``F32_DOT`` works around it: the
operands are converted to fp32 (exactly) before the dot, the products being exact in fp32
either way; the wrapper sets it for bf16 under the interpreter, and for fp32 inputs (where it
asks for IEEE fp32 products instead of the GPU's default tf32). The interpreter's fp32 -> bf16
conversion also truncates instead of rounding to nearest; ``BF16_RNE`` (set for bf16 under the
interpreter) rounds on the bits first (``_rne``; then every conversion matches torch's except
of fp32 subnormals, below 1.2e-38, which the interpreter converts wrongly). fp16 and fp32 need
no workaround there.

Dropout (constexpr ``DROPOUT``): the keep bit of (b, h, i, j) is flashguard.attention.dropout's
hash, here in uint32 arithmetic (``_mix32``; the PyTorch tiles compute it on int64 words reduced
mod 2^32, so both give the same bits): the forward zeroes dropped Pbar entries and scales O by
1 / (1 - p); the backward zeroes them in P for dV, multiplies dP by keep / (1 - p), and scales
the finished dV by 1 / (1 - p); delta = rowsum(dO * O) of the dropped O needs no change.
"""
from __future__ import annotations

import triton
import triton.language as tl

try:  # how the kernels were built: compiled for a GPU, or run by the numpy interpreter
    from triton.runtime.interpreter import InterpretedFunction as _Interpreted
except ImportError:  # pragma: no cover - very old triton
    _Interpreted = ()


@triton.jit
def _mm(a, b, F32_DOT: tl.constexpr):
    """a @ b with fp32 accumulation; F32_DOT: exact fp32 operands and IEEE fp32 products."""
    if F32_DOT:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _rne(x, BF16_RNE: tl.constexpr):
    """fp32 x, pre-rounded to the nearest bf16 (ties to even) when BF16_RNE: the interpreter's
    fp32 -> bf16 conversion truncates, so there the rounding is done on the bits, after which
    the conversion is exact. Off (the identity) on GPUs, whose conversion rounds to nearest."""
    if BF16_RNE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x


@triton.jit
def _mix32(x):
    """flashguard.attention.dropout.mix32 on uint32 words (the multiplies wrap mod 2^32)."""
    x = x ^ (x >> 16)
    x = x * 0x6E237517
    x = x ^ (x >> 15)
    x = x * 0x61A6A55B
    x = x ^ (x >> 13)
    x = x * 0x590BBF03
    return x ^ (x >> 16)


@triton.jit
def _seed_words(SEED, bh, T_Q, offs_m, offs_n):
    """The row words (of the queries offs_m) and column words (of the keys offs_n) of the
    dropout hash, as TileDropout.keep makes them: r = mix(row counter ^ s0), c = mix(j ^ s1)."""
    s0 = tl.load(SEED).to(tl.uint32)
    s1 = tl.load(SEED + 1).to(tl.uint32)
    r = _mix32((bh.to(tl.int64) * T_Q + offs_m).to(tl.uint32) ^ s0)
    c = _mix32(offs_n.to(tl.uint32) ^ s1)
    return r, c


@triton.jit
def _kept(a, b, drop_thr):
    """(len(a), len(b)) bool: mix(a_i ^ b_j) >= threshold (compared in int64: the threshold of
    p = 1 is 2^32). XOR is symmetric, so (r, c) gives the keep tile, (c, r) its transpose."""
    return _mix32(a[:, None] ^ b[None, :]).to(tl.int64) >= drop_thr


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, M_OUT, CONSTS, SEED,
                sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sob, soh, sot, sod,
                H, T_Q, T_K, D, DV, scale, beta, tol, drop_thr, drop_scale,
                CAUSAL: tl.constexpr, STAB: tl.constexpr, ROW_SUM_ROUNDED: tl.constexpr,
                STORE_M: tl.constexpr, F32_DOT: tl.constexpr, BF16_RNE: tl.constexpr, DROPOUT: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    start_m = pid_m * BLOCK_M
    rows = tl.arange(0, BLOCK_M)
    offs_m = start_m + rows
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    q_base = Q + b * sqb + h * sqh
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh

    q = tl.load(q_base + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
                mask=(offs_m[:, None] < T_Q) & (offs_d[None, :] < D), other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    if STAB == 2:
        # SafeStabilizer's margin, per row: delta = min + span * frac(0.5 + i * golden), i the
        # row's flat index in the (B, H, rows of this tile) statistics, all in fp64 (the three
        # constants are read from CONSTS so that they stay fp64: literals would be fp32)
        n_rows = tl.minimum(T_Q - start_m, BLOCK_M)
        idx = (bh * n_rows + rows).to(tl.float64)
        x = idx * tl.load(CONSTS + 2) + 0.5
        safe_delta = tl.load(CONSTS) + tl.load(CONSTS + 1) * (x - tl.floor(x))

    if CAUSAL:  # top-left aligned: the last real row of this block sees keys < min(start_m + BLOCK_M, T_Q)
        hi = tl.minimum(T_K, tl.minimum(start_m + BLOCK_M, T_Q))
    else:
        hi = T_K
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        key_ok = offs_n[None, :] < T_K
        kt = tl.load(k_base + offs_n[None, :] * skt + offs_d[:, None] * skd,
                     mask=key_ok & (offs_d[:, None] < D), other=0.0)              # (D_PAD, BLOCK_N)
        s = _mm(q, kt, F32_DOT) * scale                                           # fp32 scores
        visible = key_ok
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(visible, s, float("-inf"))
        r = tl.max(s, 1)                                                           # tile row max
        if STAB == 1:
            # paper: the tile row's max is tied (>= 2 real keys within tol of it) -> beta * r if
            # r > 0, 0 if r < 0. Causally hidden keys count (they are -inf, tied when r = -inf),
            # padding keys beyond T_K do not: as flashguard.attention.stabilizers.PaperStabilizer
            near = (s >= (r - tol)[:, None]) & key_ok
            tied = tl.sum(near.to(tl.int32), 1) > 1
            cand = tl.where(tied & (r > 0), beta * r, r)
            cand = tl.where(tied & (r < 0), 0.0, cand)
        elif STAB == 2:
            # safe: r + delta computed in fp64, rounded *up* to fp32 (so m - r >= delta exactly)
            x64 = r.to(tl.float64) + safe_delta
            y = x64.to(tl.float32)
            bits = y.to(tl.int32, bitcast=True)
            nxt = tl.where(y > 0, bits + 1, tl.where(y < 0, bits - 1, 1))       # next fp32 upward
            cand = tl.where(y.to(tl.float64) < x64, nxt.to(tl.float32, bitcast=True), y)
        else:
            cand = r
        m_new = tl.maximum(cand, m_i)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # nothing visible yet: exp -> 0, not NaN
        p = tl.exp(s - m_safe[:, None])                          # fp32
        pbar = _rne(p, BF16_RNE).to(V.dtype.element_ty)                           # the PV matmul operand
        if ROW_SUM_ROUNDED:
            tile_sum = tl.sum(pbar.to(tl.float32), 1)
        else:
            tile_sum = tl.sum(p, 1)
        if DROPOUT:  # after the row sum took the undropped Pbar
            r_w, c_w = _seed_words(SEED, bh, T_Q, offs_m, offs_n)
            pbar = tl.where(_kept(r_w, c_w, drop_thr), pbar, tl.zeros_like(pbar))
        v = tl.load(v_base + offs_n[:, None] * svt + offs_dv[None, :] * svd,
                    mask=(offs_n[:, None] < T_K) & (offs_dv[None, :] < DV), other=0.0)  # (BLOCK_N, DV_PAD)
        pv = _mm(pbar, v, F32_DOT)
        f = tl.exp(m_i - m_safe)                                  # rescale of the old state
        l_i = l_i * f + tile_sum
        acc = acc * f[:, None] + pv
        m_i = m_new

    empty = l_i == 0.0  # every key hidden: O = 0, lse = +inf (so that backward's P is 0)
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    if DROPOUT:
        o = o * drop_scale
    o = tl.where(empty[:, None], 0.0, o)
    lse = tl.where(empty, float("inf"), tl.log(l_i) + m_i)
    row_ok = offs_m < T_Q
    o_ptrs = O + b * sob + h * soh + offs_m[:, None] * sot + offs_dv[None, :] * sod
    tl.store(o_ptrs, _rne(o, BF16_RNE).to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(LSE + bh.to(tl.int64) * T_Q + offs_m, lse, mask=row_ok)
    if STORE_M:
        tl.store(M_OUT + bh.to(tl.int64) * T_Q + offs_m, m_i, mask=row_ok)


@triton.jit
def _bwd_delta_kernel(O, DO, DELTA, sob, soh, sot, sod, sdb, sdh, sdt, sdd, H, T_Q, DV,
                      BLOCK_M: tl.constexpr, DV_PAD: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, DV_PAD)
    mask = (offs_m[:, None] < T_Q) & (offs_dv[None, :] < DV)
    o = tl.load(O + b * sob + h * soh + offs_m[:, None] * sot + offs_dv[None, :] * sod, mask=mask, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdt + offs_dv[None, :] * sdd, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * T_Q + offs_m, delta, mask=offs_m < T_Q)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, SEED,
                     sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sdb, sdh, sdt, sdd,
                     sgkb, sgkh, sgkt, sgkd, sgvb, sgvh, sgvt, sgvd,
                     H, T_Q, T_K, D, DVD, scale, drop_thr, drop_scale,
                     CAUSAL: tl.constexpr, F32_DOT: tl.constexpr, BF16_RNE: tl.constexpr, DROPOUT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr):
    """Works on the transposed tile (keys x queries): S^T = K Q^T, so that dV = P^T dO and
    dK = dS^T Q are plain dots."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    q_base = Q + b * sqb + h * sqh
    do_base = DO + b * sdb + h * sdh
    row_base = bh.to(tl.int64) * T_Q
    key_ok = offs_n < T_K
    k = tl.load(K + b * skb + h * skh + offs_n[:, None] * skt + offs_d[None, :] * skd,
                mask=key_ok[:, None] & (offs_d[None, :] < D), other=0.0)          # (BLOCK_N, D_PAD)
    v = tl.load(V + b * svb + h * svh + offs_n[:, None] * svt + offs_dv[None, :] * svd,
                mask=key_ok[:, None] & (offs_dv[None, :] < DVD), other=0.0)      # (BLOCK_N, DV_PAD)
    dk = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, DV_PAD], dtype=tl.float32)
    if CAUSAL:  # queries before start_n see none of these keys
        lo = (start_n // BLOCK_M) * BLOCK_M
    else:
        lo = 0
    for start_m in range(lo, T_Q, BLOCK_M):
        offs_m = start_m + offs_m0
        row_ok = offs_m < T_Q
        qt = tl.load(q_base + offs_m[None, :] * sqt + offs_d[:, None] * sqd,
                     mask=row_ok[None, :] & (offs_d[:, None] < D), other=0.0)     # (D_PAD, BLOCK_M)
        do = tl.load(do_base + offs_m[:, None] * sdt + offs_dv[None, :] * sdd,
                     mask=row_ok[:, None] & (offs_dv[None, :] < DVD), other=0.0)  # (BLOCK_M, DV_PAD)
        lse = tl.load(LSE + row_base + offs_m, mask=row_ok, other=float("inf"))
        delta = tl.load(DELTA + row_base + offs_m, mask=row_ok, other=0.0)
        st = _mm(k, qt, F32_DOT) * scale                                          # (BLOCK_N, BLOCK_M)
        visible = key_ok[:, None] & row_ok[None, :]
        if CAUSAL:
            visible = visible & (offs_n[:, None] <= offs_m[None, :])
        st = tl.where(visible, st, float("-inf"))
        pt = tl.exp(st - lse[None, :])                                            # P^T, fp32
        pt_op = _rne(pt, BF16_RNE).to(DO.dtype.element_ty)
        if DROPOUT:
            r_w, c_w = _seed_words(SEED, bh, T_Q, offs_m, offs_n)
            keep_t = _kept(c_w, r_w, drop_thr)                                    # (BLOCK_N, BLOCK_M)
            pt_op = tl.where(keep_t, pt_op, tl.zeros_like(pt_op))
        dv += _mm(pt_op, do, F32_DOT)
        dpt = _mm(v, tl.trans(do), F32_DOT)                                       # dP^T = V dO^T
        if DROPOUT:
            dpt = tl.where(keep_t, dpt * drop_scale, 0.0)
        dst = (pt * scale) * (dpt - delta[None, :])                               # dS^T, fp32
        dk += _mm(_rne(dst, BF16_RNE).to(Q.dtype.element_ty), tl.trans(qt), F32_DOT)
    if DROPOUT:
        dv = dv * drop_scale
    tl.store(DK + b * sgkb + h * sgkh + offs_n[:, None] * sgkt + offs_d[None, :] * sgkd, dk,
             mask=key_ok[:, None] & (offs_d[None, :] < D))
    tl.store(DV + b * sgvb + h * sgvh + offs_n[:, None] * sgvt + offs_dv[None, :] * sgvd, dv,
             mask=key_ok[:, None] & (offs_dv[None, :] < DVD))


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, SEED,
                   sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sdb, sdh, sdt, sdd,
                   sgqb, sgqh, sgqt, sgqd,
                   H, T_Q, T_K, D, DVD, scale, drop_thr, drop_scale,
                   CAUSAL: tl.constexpr, F32_DOT: tl.constexpr, BF16_RNE: tl.constexpr, DROPOUT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    row_ok = offs_m < T_Q
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)           # (BLOCK_M, D_PAD)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdt + offs_dv[None, :] * sdd,
                 mask=row_ok[:, None] & (offs_dv[None, :] < DVD), other=0.0)      # (BLOCK_M, DV_PAD)
    lse = tl.load(LSE + bh.to(tl.int64) * T_Q + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + bh.to(tl.int64) * T_Q + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    if CAUSAL:
        hi = tl.minimum(T_K, tl.minimum(start_m + BLOCK_M, T_Q))
    else:
        hi = T_K
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        key_ok = offs_n < T_K
        kt = tl.load(k_base + offs_n[None, :] * skt + offs_d[:, None] * skd,
                     mask=key_ok[None, :] & (offs_d[:, None] < D), other=0.0)     # (D_PAD, BLOCK_N)
        vt = tl.load(v_base + offs_n[None, :] * svt + offs_dv[:, None] * svd,
                     mask=key_ok[None, :] & (offs_dv[:, None] < DVD), other=0.0)  # (DV_PAD, BLOCK_N)
        s = _mm(q, kt, F32_DOT) * scale
        visible = row_ok[:, None] & key_ok[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(visible, s, float("-inf"))
        p = tl.exp(s - lse[:, None])
        dp = _mm(do, vt, F32_DOT)
        if DROPOUT:
            r_w, c_w = _seed_words(SEED, bh, T_Q, offs_m, offs_n)
            dp = tl.where(_kept(r_w, c_w, drop_thr), dp * drop_scale, 0.0)
        ds = (p * scale) * (dp - delta[:, None])
        dq += _mm(_rne(ds, BF16_RNE).to(Q.dtype.element_ty), tl.trans(kt), F32_DOT)
    tl.store(DQ + b * sgqb + h * sgqh + offs_m[:, None] * sgqt + offs_d[None, :] * sgqd, dq,
             mask=row_ok[:, None] & (offs_d[None, :] < D))


INTERPRETED = bool(_Interpreted) and isinstance(_fwd_kernel, _Interpreted)
if bool(_Interpreted) and isinstance(tl.sum, _Interpreted) != INTERPRETED:
    raise ImportError(
        "flashguard's triton kernels: TRITON_INTERPRET changed after triton was imported (triton's own "
        f"library is {'interpreted' if isinstance(tl.sum, _Interpreted) else 'compiled'}, these kernels would be "
        f"{'interpreted' if INTERPRETED else 'compiled'}); set it before the first `import triton`")
