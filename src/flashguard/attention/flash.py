"""FlashAttention-2 forward and backward, every intermediate rounded per a PrecisionPolicy.

Forward (FA2 Algorithm 1): for each query tile, stream over key tiles with an online softmax
(running max m, running sum l, unnormalised O) and save only O and the row log-sum-exp.
Backward (FA2 Algorithm 2): a delta = rowsum(dO * O) preprocess, then an outer loop over key
tiles that owns dK/dV and an inner loop over query tiles that recomputes P from lse and adds
into dQ. Run sequentially, each dQ tile receives the key tiles in ascending order and each
dK/dV tile the query tiles in ascending order: the same accumulation order as the study's
reference code, so bf16 accumulators reproduce it bit for bit.

Tensors are (B, H, T, D). ``q, k, v`` arrive already rounded to ``policy.inputs``.
Masks: ``keep`` is a boolean tensor broadcastable to (B, H, T_q, T_k), True where a key takes
part; ``bias`` a float tensor added to the scores; ``causal`` is top-left aligned as in torch
SDPA (query i sees keys j <= i).

Dropout (``dropout``, a ``.dropout.TileDropout``; None = none): O = dropout(softmax(S)) V. Each
tile's keep mask is regenerated from the call's seed (forward and backward compute the same
bits). Forward: the dropped Pbar entries are zeroed before the PV product (the row sum l takes
the undropped ones: the softmax is normalised before dropout), and O is scaled by 1 / (1 - p)
once, after the division by l, as FA2 folds the scale into 1 / l. Backward, with Z = keep / (1 - p):
dV = (P * Z)^T dO, dP = Z * (dO V^T) and dS = P * (dP - delta), where delta = rowsum(dO * O) of
the dropped O equals rowsum(P * dP) as the softmax derivative needs (sum_j P_ij Z_ij
(dO V^T)_ij = sum_d dO_id O_id), so the preprocess is unchanged. dV's 1 / (1 - p) is applied
once to the finished accumulator, as O's is.
"""
from __future__ import annotations

import functools

import torch

from ..numerics import fused_softmax
from ..numerics.arith import cast, rowsum, storage_dtype
from ..numerics.fast_exp import fexp_lanes, fexp_u20
from ..numerics.formats import FP32, FP64, FloatFormat
from ..numerics.gpu_exp import EXP2_IMPLEMENTATIONS, Exp2Steps
from ..numerics.policy import PrecisionPolicy
from .cpu_fastpaths import _exp_hidden_, _Hidden, _operand, _Operands, _rounded, _slow_exp
from .dropout import TileDropout
from .stabilizers import Stabilizer

__all__ = ["flash_forward", "flash_backward", "delta_preprocess", "tile_ranges", "pbar_operand"]


def tile_ranges(n: int, block: int) -> list[tuple[int, int]]:
    return [(i, min(i + block, n)) for i in range(0, n, block)]


def _masked_value(policy: PrecisionPolicy) -> float:
    if policy.masked_scores == "finite":
        # the reference code fills with minus the largest finite number of the scores dtype
        return -policy.scores.max_finite
    return float("-inf")


def _fast_exp_columns(x: torch.Tensor, policy: PrecisionPolicy) -> "torch.Tensor | None":
    """With ``policy.exp == "fexp_u20"``: a copy of the tile's vectorised columns of x = S - m
    (the first multiple of the kernel's SIMD width here, ``fexp_lanes()``), which take the kernel's
    fast exponential; the rest of the tile keeps the exact exp (the kernel's scalar tail). None for
    the exact exp, or where no column is vectorised."""
    if policy.exp != "fexp_u20":
        return None
    lanes = fexp_lanes()
    n = x.shape[-1] - x.shape[-1] % lanes if lanes else 0
    return x[..., :n].clone() if n else None


def _tile_hidden(hide, causal, q0, q1, k0, k1, device) -> "_Hidden | None":
    """The keys of one tile hidden from its queries (``_Hidden``: ``.mask`` is True where a key
    is hidden from a query); None if none is."""
    tile = None
    if hide is not None:
        tile = hide[..., q0:q1, k0:k1]
    if causal and k1 - 1 > q0:  # some key of the tile lies after some query of the tile
        rows = torch.arange(q0, q1, device=device)[:, None]
        cols = torch.arange(k0, k1, device=device)[None, :]
        c = cols > rows
        tile = c if tile is None else tile | c
    return None if tile is None else _Hidden(tile)


def _exp2_steps(policy: PrecisionPolicy, scale: float, bias, softcap) -> "Exp2Steps | None":
    """The GPU kernel's exponent steps of ``policy.exp`` (numerics.gpu_exp), or None for the CPU
    forms. The raw scores q k^T feed them unless a bias or soft-cap sits between (see Exp2Steps)."""
    if policy.exp not in EXP2_IMPLEMENTATIONS:
        return None
    return Exp2Steps(policy.exp, scale, raw=bias is None and softcap is None)


def _scores(ops, q, k, bias, q0, q1, k0, k1, scale, policy, softcap=None, want_tanh=False, want_raw=False):
    """S = round(round(q k^T) * scale) of the tile (q rows q0:q1, k rows k0:k1), soft-capped to
    cap * tanh(S / cap) if ``softcap``, plus ``bias``; in the scores format, a fresh tensor.
    ``ops``: the call's _Operands. With ``want_tanh`` also returns the tanh (for the soft-cap's
    derivative in backward), else None. With ``want_raw`` returns (s, t, raw): raw = round(q k^T)
    before the scale (the input of the GPU kernels' exp2 forms)."""
    fmt = policy.scores
    s = _qk(ops, q, k, q0, q1, k0, k1, fmt)
    raw = s.clone() if want_raw else None
    s = _rounded(s.mul_(scale), fmt)
    t = None
    if softcap is not None:
        t = _rounded(_rounded(s.div_(softcap), fmt).tanh_(), fmt)
        s = _rounded(t * softcap, fmt)
        if not want_tanh:
            t = None
    if bias is not None:
        s = _rounded(s.add_(bias[..., q0:q1, k0:k1].to(s.dtype)), fmt)
    if want_raw:
        return s, t, raw
    return s, t


def _qk(ops, q, k, q0, q1, k0, k1, fmt):
    """round(q k^T) of the tile in ``fmt``, a fresh tensor (B, H, n, bk)."""
    return ops.mm(ops.tile(q, q0, q1, out_fmt=fmt), ops.tile(k, k0, k1, transpose=True, out_fmt=fmt), fmt)


def _fused_chain(policy: PrecisionPolicy, bias, softcap, *formats) -> bool:
    """Whether a tile's softmax steps may run as numerics.fused_softmax's passes: the named formats
    of the policy one native dtype (bf16 or fp32), the exact exponential, no bias or soft-cap
    between the scale and the softmax. The pass itself still declines tiles it does not cover."""
    dtypes = {getattr(policy, f).torch_dtype for f in formats}
    return (bias is None and softcap is None and policy.exp == "exact" and len(dtypes) == 1
            and dtypes <= {torch.bfloat16, torch.float32} and all(getattr(policy, f).is_native for f in formats))


@functools.lru_cache(maxsize=None)
def _scaled_down(fmt: FloatFormat, s: int) -> FloatFormat:
    """``fmt`` with every value multiplied by 2^-s (the same bits, bias + s)."""
    return FloatFormat(f"{fmt.name}*2^-{s}", fmt.exponent_bits, fmt.mantissa_bits, fmt.bias + s, fmt.has_inf,
                       fmt.nan, fmt.overflow)


def pbar_operand(p: torch.Tensor, policy: PrecisionPolicy) -> torch.Tensor:
    """P (every entry <= 1) as the PV / dV matmul operand: rounded to ``policy.pbar``, at
    P * 2^pbar_scale when the policy scales it into the format's range, and held scaled back
    (multiplying by a power of two is exact, so the matmul sees what a kernel that scales P and
    divides its fp32 result sees)."""
    s = policy.pbar_scale
    if not s:
        return cast(p, policy.pbar)
    if not policy.pbar.is_native:
        # emulated (fp8): P rounded to the format's grid moved down by 2^s - its bias raised by s - is,
        # bit for bit, P * 2^s rounded to the format and multiplied back, in one pass instead of three
        return cast(p, _scaled_down(policy.pbar, s))
    out = cast(p * 2.0 ** s, policy.pbar)
    if torch.finfo(out.dtype).max < torch.finfo(torch.float32).max:
        out = out.float()  # fp16: scaled back in fp16 its small values would flush again
    return out.mul_(2.0 ** -s)


def _initial_rows(shape, m_init: float, policy: PrecisionPolicy, gpu: bool, hp_fmt, device):
    """A query tile's starting state for ``shape`` = (B, H, n, D_v): the running max m, a GPU exp2
    form's own running shift m_u in its exponent's input units (fp32; None without one), the row
    sum l, the O accumulator and its high-precision copy (None unless ``hp_fmt``)."""
    B, H, n, Dv = shape
    m = torch.full((B, H, n, 1), m_init, dtype=storage_dtype(policy.stats), device=device)
    m_u = torch.full((B, H, n, 1), float("-inf"), device=device) if gpu else None
    l = torch.zeros((B, H, n, 1), dtype=storage_dtype(policy.stats), device=device)
    acc = torch.zeros((B, H, n, Dv), dtype=storage_dtype(policy.o_accum), device=device)
    acc_hp = torch.zeros((B, H, n, Dv), dtype=hp_fmt.torch_dtype, device=device) if hp_fmt is not None else None
    return m, m_u, l, acc, acc_hp


def _tile_exp_gpu(gpu, u, row_max, m, m_new, m_u):
    """P of a visible tile in a GPU exp2 form, from its scores ``u`` (raw where the form reads
    them): (P, the rescale of the old state, the new m_u). The kernel shifts by its own row max,
    unless a stabilizer moved m_new above the plain max."""
    plain = m_new == torch.maximum(row_max, m)
    m_u_new = torch.where(plain, torch.maximum(m_u, u.amax(dim=-1, keepdim=True)), gpu.units(m_new))
    m_u_safe = torch.where(torch.isneginf(m_u_new), torch.zeros_like(m_u_new), m_u_new)
    return gpu.p(u, m_u_safe), gpu.rescale(m_u, m_u_safe), m_u_new


def _visible_scores(ops, q, k, bias, tile, scale: float, policy: PrecisionPolicy, softcap, gpu, th, fill):
    """A tile's scores S (B, H, n, bk), its hidden entries set to ``fill``, the raw scores a GPU
    exp2 form reads (None unless ``gpu.raw``), likewise filled, and S's row max (B, H, n, 1)."""
    q0, q1, k0, k1 = tile
    raw = None
    if gpu is not None and gpu.raw:
        s, _, raw = _scores(ops, q, k, bias, q0, q1, k0, k1, scale, policy, softcap, want_raw=True)
    elif _fused_chain(policy, bias, softcap, "scores"):
        # round(q k^T * scale), then the fill, and the row max: one pass where numerics.fused_softmax
        # covers the tile (it leaves the max to amax where torch's would depend on its order)
        s = _qk(ops, q, k, q0, q1, k0, k1, policy.scores)
        fused = fused_softmax.scale_fill_(s, scale, th, fill, with_max=True)
        if fused is None:
            fused_softmax.torch_scale_fill_(s, scale, th, fill)  # the same steps as torch ops
        row_max = None if fused is None else fused[1]
        return s, None, s.amax(dim=-1, keepdim=True) if row_max is None else row_max
    else:
        s, _ = _scores(ops, q, k, bias, q0, q1, k0, k1, scale, policy, softcap)  # (B, H, n, bk)
    if th is not None:
        th.fill_(s, fill)
        if raw is not None:
            th.fill_(raw, fill)
    return s, raw, s.amax(dim=-1, keepdim=True)


def _tile_exp_(s, m_safe, th, fill, policy: PrecisionPolicy, pbar: bool = False):
    """P = exp(S - m) of a visible tile in the policy's exp (hidden entries 0); consumes ``s``.
    Returns (P, P rounded to bf16 and held in fp32 or None): with ``pbar`` a fused fp32 pass
    (numerics.fused_softmax) gives that PV operand too, where it runs."""
    if _fused_chain(policy, None, None, "scores"):
        # exp(S - m) and the hidden entries as below: one pass where numerics.fused_softmax covers the tile
        out = torch.empty_like(s) if pbar else None
        p = fused_softmax.p_from_max_(s, m_safe, th, fill, out)
        if p is not None:
            return p, out
    x = _rounded(s.sub_(m_safe), policy.scores)
    x_fast = _fast_exp_columns(x, policy)
    if th is None or fill == float("-inf"):
        p_full = _exp_hidden_(x, th, m_safe, policy.scores)
    else:
        # a finite fill gives exp(0) = 1 in fully masked rows: the hidden entries are set
        # to 0 after exp, so what exp gives there does not matter (0 in: no slow path)
        if _slow_exp(x, policy.scores):
            th.fill_(x, 0.0)
        p_full = th.fill_(_rounded(x.exp_(), policy.scores), 0.0)
    if x_fast is not None:
        p_full[..., :x_fast.shape[-1]] = fexp_u20(x_fast)
        if th is not None:
            th.fill_(p_full, 0.0)
    return p_full, None


def _tile_row_sum(pbar, p_full, policy: PrecisionPolicy):
    """A tile's row sum of P in the statistics format: of Pbar where the policy sums the rounded
    operand (row_sum_rounded), with the policy's floor (row_sum_floor) if it has one."""
    tile_sum = rowsum(pbar if policy.row_sum_rounded else p_full, policy.stats)
    if policy.row_sum_floor is not None:
        tile_sum = _rounded(tile_sum.clamp_(min=policy.row_sum_floor), policy.stats)
    return tile_sum


def _finish_rows(acc, l, m, m_u, acc_hp, policy: PrecisionPolicy, gpu, dropout):
    """A query tile's (O in policy.output, lse in policy.lse, the high-precision O or None) from its
    final state: O = acc / l (rows with every key masked: O = 0, lse = +inf, so that backward P = 0)."""
    stats, acc_fmt = policy.stats, policy.o_accum
    empty = l == 0
    l_safe = torch.where(empty, torch.ones_like(l), l)
    if policy.normalize == "reciprocal":  # one rounding of 1 / l, then one of the product
        o = cast(acc * cast(l_safe.reciprocal(), stats), acc_fmt)
    else:
        o = cast(acc / l_safe, acc_fmt)
    if dropout is not None:
        o = cast(o * dropout.scale, acc_fmt)
    o = _Hidden(empty).fill_(o, 0.0)  # o is a fresh tensor
    if gpu is not None:
        lse = cast(gpu.lse(m_u, l), policy.lse)
    else:
        lse = cast(cast(torch.log(l), policy.lse) + m, policy.lse)
    o_hp = None
    if acc_hp is not None:
        lw = l.to(acc_hp.dtype)
        o_hp = acc_hp / torch.where(empty, torch.ones_like(lw), lw)
        if dropout is not None:
            o_hp = o_hp * dropout.scale
        o_hp = _Hidden(empty).fill_(o_hp, 0.0)  # a fresh tensor
    return cast(o, policy.output), lse.masked_fill(empty, float("inf")), o_hp


def flash_forward(q, k, v, *, keep, bias, causal: bool, scale: float, policy: PrecisionPolicy,
                  stabilizer: Stabilizer, block_q: int, block_k: int, keep_highp_o: bool = False,
                  softcap: float | None = None, observe=None, dropout: TileDropout | None = None):
    """Returns (o, lse, o_highp): O in ``policy.output`` storage (B, H, T_q, D_v), lse in
    ``policy.lse`` storage (B, H, T_q, 1), and a high-precision (fp32, or fp64) copy of O (or None).

    ``observe``, if given, is called once per visited tile as ``observe(tile, **values)`` with
    tile = (q0, q1, k0, k1) and the tile's ``s``, ``hidden``, ``row_max``, ``m_new``, ``pbar``
    and ``pv``: the hook the diagnostics and the tests read the intermediates through (with
    ``dropout``, ``pbar`` is the dropped one that enters PV)."""
    B, H, Tq, _ = q.shape
    Tk, Dv = k.shape[-2], v.shape[-1]
    stats, acc_fmt = policy.stats, policy.o_accum
    fill = _masked_value(policy)
    m_init = float("-inf") if policy.masked_scores == "inf" else -stats.max_finite
    hide = None if keep is None else ~keep
    # the high-precision copy of O: fp32, or fp64 when the policy itself accumulates in fp64
    hp_fmt = FP64 if storage_dtype(acc_fmt) == torch.float64 else FP32
    ops = _Operands()
    gpu = _exp2_steps(policy, scale, bias, softcap)
    fold_pbar = observe is None and dropout is None and _fold_pbar(policy)
    rows = []   # per query tile: (O, lse, high-precision O or None)
    for q0, q1 in tile_ranges(Tq, block_q):
        n = q1 - q0
        m, m_u, l, acc, acc_hp = _initial_rows((B, H, n, Dv), m_init, policy, gpu is not None,
                                               hp_fmt if keep_highp_o else None, q.device)
        for k0, k1 in tile_ranges(Tk, block_k):
            fully_hidden = causal and k0 > q1 - 1
            if fully_hidden and not policy.visit_masked_tiles:
                break  # this and every later key tile is hidden from the whole query tile
            if fully_hidden:
                # Visited only for the reference arithmetic, where such a tile still moves the
                # statistics: its block max is the fill value, its tie rule sees a row of equal
                # values (at least two if the tile has two keys), and it adds the row-sum floor.
                # A tile of min(2, keys) fill values makes every stabilizer decide the same and
                # costs nothing; its Pbar is all zero, so PV is zero.
                th = raw = None
                s = torch.full((B, H, n, min(2, k1 - k0)), fill, dtype=storage_dtype(policy.scores),
                               device=q.device)
                row_max = s.amax(dim=-1, keepdim=True)
            else:
                th = _tile_hidden(hide, causal, q0, q1, k0, k1, q.device)
                s, raw, row_max = _visible_scores(ops, q, k, bias, (q0, q1, k0, k1), scale, policy, softcap, gpu,
                                                  th, fill)
            m_new = torch.maximum(stabilizer.shift(s, row_max, policy), m)
            # rows with nothing visible yet (all -inf) shift by 0 so that exp gives 0, not NaN
            m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
            if observe is not None:
                s_seen = s.clone()
            f_gpu = pbar = None
            if fully_hidden:
                p_full = torch.zeros_like(s)  # exp(fill - m) underflows, or is masked, everywhere
            elif gpu is not None:
                p_full, f_gpu, m_u = _tile_exp_gpu(gpu, raw if raw is not None else s, row_max, m, m_new, m_u)
            else:
                p_full, pbar = _tile_exp_(s, m_safe, th, fill, policy, fold_pbar)  # consumes s
            if pbar is None:
                pbar = pbar_operand(p_full, policy)
            tile_sum = _tile_row_sum(pbar, p_full, policy)
            if dropout is not None and not fully_hidden:  # after l took the undropped row sum
                pbar = torch.where(dropout.keep(q0, q1, k0, k1), pbar, 0.0)  # zeroing is exact in any format
            if fully_hidden:
                pv = torch.zeros((B, H, n, Dv), dtype=storage_dtype(policy.pv), device=q.device)
            else:
                v_tile = ops.tile(v, k0, k1)
                pv = ops.mm(pbar, v_tile, policy.pv)
            if observe is not None:
                observe((q0, q1, k0, k1), s=s_seen, hidden=None if th is None else th.mask, row_max=row_max,
                        m_new=m_new, pbar=pbar, pv=pv)
            f = cast(torch.exp(cast(m - m_safe, stats)), stats) if f_gpu is None else f_gpu  # rescale of the old state
            l = cast(cast(f * l, stats) + tile_sum, stats)
            acc = cast(cast(acc * f, acc_fmt) + pv, acc_fmt)
            if acc_hp is not None:
                acc_hp = acc_hp * f.to(acc_hp.dtype)
                if not fully_hidden:
                    acc_hp = acc_hp + ops.mm(pbar, v_tile, hp_fmt)
            m = m_new
        rows.append(_finish_rows(acc, l, m, m_u, acc_hp, policy, gpu, dropout))
    o_tiles, lse_tiles, hp_tiles = zip(*rows)
    return _cat(o_tiles), _cat(lse_tiles), _cat(hp_tiles) if keep_highp_o else None


def _cat(tiles) -> torch.Tensor:
    """The tiles joined along the rows; one tile is returned as it is (torch.cat would copy it)."""
    return tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=-2)


def _p_tile(ops, q, k, lse_i, hide, bias, causal, q0, q1, k0, k1, scale, policy, softcap=None, pbar=False):
    """Recompute P = exp(S - lse) for one tile in the ``p`` format (masked entries 0: they
    are -inf before exp; lse is never -inf, empty rows carry +inf). Returns (P, the soft-cap
    derivative 1 - tanh^2 in the ``p`` format or None without soft-capping, P rounded to bf16 and
    held in fp32 or None): with ``pbar`` a fused fp32 pass (numerics.fused_softmax) gives that dV
    operand too, where it runs. A GPU exp2 form (FA2 / FA3) recomputes P in its own form:
    exp2(u c - fp32(lse log2 e)), then rounded to ``p``."""
    gpu = _exp2_steps(policy, scale, bias, softcap)
    if gpu is not None and gpu.backward_exp2:
        s, t, raw = _scores(ops, q, k, bias, q0, q1, k0, k1, scale, policy, softcap, want_tanh=True, want_raw=True)
        dcap = None if t is None else cast(1.0 - cast(t * t, policy.p), policy.p)
        u = raw if gpu.raw else s
        th = _tile_hidden(hide, causal, q0, q1, k0, k1, q.device)
        if th is not None:
            th.fill_(u, float("-inf"))
        return cast(gpu.p_from_lse(u, lse_i), policy.p), dcap, None
    if _fused_chain(policy, bias, softcap, "scores", "p"):
        # exp(round(q k^T * scale) - lse), hidden scores -inf: one pass where
        # numerics.fused_softmax covers the tile, else the same steps as torch ops
        s = _qk(ops, q, k, q0, q1, k0, k1, policy.scores)
        th = _tile_hidden(hide, causal, q0, q1, k0, k1, q.device)
        out = torch.empty_like(s) if pbar else None
        if fused_softmax.p_from_lse_(s, lse_i, scale, th, out) is not None:
            return s, None, out
        return fused_softmax.torch_p_from_lse_(s, lse_i, scale, th), None, None
    s, t = _scores(ops, q, k, bias, q0, q1, k0, k1, scale, policy, softcap, want_tanh=True)
    dcap = None if t is None else cast(1.0 - cast(t * t, policy.p), policy.p)
    th = _tile_hidden(hide, causal, q0, q1, k0, k1, q.device)
    if th is not None:
        th.fill_(s, float("-inf"))
    if s.dtype == storage_dtype(policy.p):
        p = _exp_hidden_(_rounded(s.sub_(lse_i), policy.p), th, lse_i, policy.p)
    elif policy.p.is_native:
        p = _exp_hidden_(cast(s - lse_i, policy.p), th, lse_i, policy.p)  # a fresh tensor
    else:
        p = cast(torch.exp(cast(s - lse_i, policy.p)), policy.p)
    return p, dcap, None


def _fold_bf16(fmt, partial, p_fmt) -> bool:
    """Whether a fused fp32 pass may also round its result to ``fmt`` for the next matmul: ``fmt``
    bf16 (native), taken by the matmul in fp32 (``partial``), from fp32 P (numerics.fused_softmax:
    P.to(bf16).to(fp32) in the same pass)."""
    return (fmt.torch_dtype == torch.bfloat16 and fmt.is_native and partial.torch_dtype == torch.float32
            and p_fmt.torch_dtype == torch.float32)


def _ds_operand(p, dp, delta_rows, dcap, scale, fold: bool, policy: PrecisionPolicy) -> torch.Tensor:
    """dS = (P * scale) * (dP - delta) of a tile, each op rounded to the p format, in place in p
    (``scale`` None: ds_scale="accumulator", dS = P * (dP - delta), the scale goes on the finished
    dQ / dK), times the soft-cap derivative ``dcap`` if any; returned as the dQ / dK matmul
    operand (rounded to ``policy.ds``, in the grad_partial dtype). One fused pass where
    numerics.fused_softmax covers the tile (``fold``: it also rounds to bf16)."""
    if dcap is None and _fused_chain(policy, None, None, "dp", "p"):
        ds = fused_softmax.ds_(p, dp, delta_rows, scale, round_bf16=fold)
        if ds is not None:
            return ds if fold else _operand(cast(ds, policy.ds), policy.grad_partial)
    dp_minus = cast(_rounded(dp.sub_(delta_rows), policy.dp), policy.p)
    if scale is not None:
        p = _rounded(p.mul_(scale), policy.p)
    ds = _rounded(p.mul_(dp_minus), policy.p)
    if dcap is not None:  # through the soft-cap: d(cap * tanh(x / cap)) / dx = 1 - tanh^2
        ds = _rounded(ds.mul_(dcap), policy.p)
    return _operand(cast(ds, policy.ds), policy.grad_partial)


def _fold_pbar(policy: PrecisionPolicy) -> bool:
    """Whether the forward's fused fp32 pass may give the PV operand P-bar itself, bf16 held in
    fp32 (fa2): unscaled, and a row sum of P-bar, if the policy takes one, is the same in fp32."""
    return (policy.pbar_scale == 0 and _fold_bf16(policy.pbar, policy.pv, policy.p)
            and (not policy.row_sum_rounded or storage_dtype(policy.stats) == torch.float32))


def _rowsum_product(a, b, policy):
    """rowsum(a * b): the product rounded to ``delta_product``, the sum to ``delta``."""
    fmt = policy.delta_product
    return rowsum(cast(cast(a, fmt) * cast(b, fmt), fmt), policy.delta)


def _dropped_dp(dp, keep, scale, policy):
    """dP = Z * (dO V^T), Z = keep / (1 - p): the gradient reaching P through the dropout."""
    return _rounded(torch.where(keep, dp * scale, 0.0), policy.dp)


def delta_preprocess(q, k, v, o, lse, do, o_highp, *, keep, bias, causal: bool, scale: float,
                     policy: PrecisionPolicy, block_q: int, block_k: int, softcap: float | None = None,
                     operand: "_Operands | None" = None, dropout: TileDropout | None = None):
    """FA2's backward preprocess, delta (B, H, T_q, 1) in the delta format, from the source the
    policy names: rowsum(dO * O) of the stored O ("o_lowp") or of the high-precision copy
    ("o_highp"), or rowsum(dP * P) over the key tiles ("dp_p"; equal in exact arithmetic).
    ``do`` must already be rounded to ``policy.inputs``. The diagnostics and the lab call this
    to see the delta the backward pass uses."""
    if policy.delta_source == "o_lowp":
        return _rowsum_product(do, o, policy)
    if policy.delta_source == "o_highp":
        return _rowsum_product(do, o_highp, policy)
    ops = operand or _Operands()
    hide = None if keep is None else ~keep
    parts = []
    for q0, q1 in tile_ranges(q.shape[-2], block_q):
        d = None
        for k0, k1 in tile_ranges(k.shape[-2], block_k):
            if causal and k0 > q1 - 1:
                break  # hidden tiles contribute exactly zero
            p, _, _ = _p_tile(ops, q, k, lse[..., q0:q1, :], hide, bias, causal, q0, q1, k0, k1, scale, policy,
                           softcap)
            dp = ops.mm(ops.tile(do, q0, q1, out_fmt=policy.dp), ops.tile(v, k0, k1, transpose=True, out_fmt=policy.dp),
                        policy.dp)
            if dropout is not None:
                dp = _dropped_dp(dp, dropout.keep(q0, q1, k0, k1), dropout.scale, policy)
            part = _rowsum_product(dp, p, policy)
            d = part if d is None else cast(d + part, policy.delta)
        parts.append(d)
    return _cat(parts)


def _dv_part(ops, p, p_mm, do, q0, q1, kt, policy: PrecisionPolicy):
    """A tile's P^T dO, its part of dV_j: P as the PV operand (``p_mm`` where a fused pass already
    rounded it), zero where dropout (``kt``) dropped it; 1 / (1 - p) goes on the finished dV_j."""
    if p_mm is None:
        p_mm = _operand(pbar_operand(p, policy), policy.grad_partial)
    if kt is not None:
        p_mm = torch.where(kt, p_mm, 0.0)
    gp = policy.grad_partial
    return ops.mm(p_mm.transpose(-2, -1), ops.tile(do, q0, q1, out_fmt=gp), gp)


def flash_backward(q, k, v, o, lse, do, o_highp, *, keep, bias, causal: bool, scale: float,
                   policy: PrecisionPolicy, block_q: int, block_k: int, softcap: float | None = None,
                   delta_hook=None, dropout: TileDropout | None = None, dq_only: bool = False):
    """Gradients (dq, dk, dv) in ``policy.grad_accum`` storage. ``do`` is rounded to inputs.

    ``dq_only``: dK and dV are not computed (returned as None), which leaves dQ's bits as they
    are only where no rounding draws random numbers (the caller's to check: under stochastic
    rounding the skipped roundings would move dQ's draws).

    ``delta_hook``, if given, replaces the preprocess's delta before dS uses it: called as
    ``delta_hook(delta, q=, k=, v=, do=, keep=, bias=, causal=, scale=, softcap=)`` with the
    rounded inputs, it returns the delta to use, (B, H, T_q, 1) (the error-injection experiment:
    flashguard.attention.injection.DeltaHook)."""
    do = cast(do, policy.inputs)
    Tq, Tk = q.shape[-2], k.shape[-2]
    acc = policy.grad_accum
    hide = None if keep is None else ~keep
    q_tiles, k_tiles = tile_ranges(Tq, block_q), tile_ranges(Tk, block_k)
    # matmul operands, converted once: S = q k^T, dP = dO v^T, dV = P^T dO, dQ = dS k, dK = dS^T q
    ops = _Operands()
    gp = policy.grad_partial
    scale_ds = policy.ds_scale == "operand"
    # fp32 P and dS whose matmul operands are bf16 values held in fp32 (fa2): the fused passes round them
    fold_pbar = not dq_only and dropout is None and policy.pbar_scale == 0 and _fold_bf16(policy.pbar, gp, policy.p)
    fold_ds = _fold_bf16(policy.ds, gp, policy.p)

    def hidden(q0, q1, k0, k1):
        return causal and k0 > q1 - 1  # contributes exactly zero: skipped

    # --- preprocess: delta, (B, H, T_q, 1) in the delta format
    delta = delta_preprocess(q, k, v, o, lse, do, o_highp, keep=keep, bias=bias, causal=causal, scale=scale,
                             policy=policy, block_q=block_q, block_k=block_k, softcap=softcap, operand=ops,
                             dropout=dropout)
    if delta_hook is not None:
        delta = delta_hook(delta, q=q, k=k, v=v, do=do, keep=keep, bias=bias, causal=causal, scale=scale,
                           softcap=softcap)

    # Accumulators start at +0 and are always added to, as the reference code's are (this also
    # keeps the sign of zero: +0 + -0 = +0).
    def zeros(n, d):
        return torch.zeros((*q.shape[:-2], n, d), dtype=storage_dtype(acc), device=q.device)

    def accumulate(total, part):
        if total.dtype == part.dtype:
            if fused_softmax.add_(total, part) is not None:  # bf16 accumulators: one C pass, torch's bits
                return total
            return _rounded(total.add_(part), acc)
        return cast(total + part, acc)

    dq_tiles = [zeros(q1 - q0, q.shape[-1]) for q0, q1 in q_tiles]
    dk_tiles, dv_tiles = [], []
    # --- outer loop over key tiles: dK_j, dV_j stay local; dQ_i accumulates across j
    for k0, k1 in k_tiles:
        dk_j, dv_j = zeros(k1 - k0, k.shape[-1]), zeros(k1 - k0, v.shape[-1])
        for i, (q0, q1) in enumerate(q_tiles):
            if hidden(q0, q1, k0, k1):
                continue
            p, dcap, p_mm = _p_tile(ops, q, k, lse[..., q0:q1, :], hide, bias, causal, q0, q1, k0, k1, scale,
                                    policy, softcap, pbar=fold_pbar)
            kt = None if dropout is None else dropout.keep(q0, q1, k0, k1)
            if not dq_only:
                dv_j = accumulate(dv_j, _dv_part(ops, p, p_mm, do, q0, q1, kt, policy))
            dp = ops.mm(ops.tile(do, q0, q1, out_fmt=policy.dp), ops.tile(v, k0, k1, transpose=True, out_fmt=policy.dp),
                        policy.dp)
            if dropout is not None:
                dp = _dropped_dp(dp, kt, dropout.scale, policy)
            ds = _ds_operand(p, dp, delta[..., q0:q1, :], dcap, scale if scale_ds else None, fold_ds, policy)
            dq_tiles[i] = accumulate(dq_tiles[i], ops.mm(ds, ops.tile(k, k0, k1, out_fmt=gp), gp))
            if not dq_only:
                dk_j = accumulate(dk_j, ops.mm(ds.transpose(-2, -1), ops.tile(q, q0, q1, out_fmt=gp), gp))
        if not dq_only:  # FA2 / FA3: the softmax scale on the finished fp32 accumulator; dropout's 1 / (1 - p)
            dk_tiles.append(dk_j if scale_ds else cast(dk_j * scale, acc))
            dv_tiles.append(dv_j if dropout is None else cast(dv_j * dropout.scale, acc))
    if not scale_ds:
        dq_tiles = [cast(t * scale, acc) for t in dq_tiles]
    if dq_only:
        return _cat(dq_tiles), None, None
    return _cat(dq_tiles), _cat(dk_tiles), _cat(dv_tiles)
