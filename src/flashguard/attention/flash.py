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

import torch

from ..numerics.arith import cast, emulate, matmul, rowsum, storage_dtype
from ..numerics.formats import FP32, FP64
from ..numerics.policy import PrecisionPolicy
from .dropout import TileDropout
from .stabilizers import Stabilizer

__all__ = ["flash_forward", "flash_backward", "delta_preprocess", "tile_ranges"]


def tile_ranges(n: int, block: int) -> list[tuple[int, int]]:
    return [(i, min(i + block, n)) for i in range(0, n, block)]


def _masked_value(policy: PrecisionPolicy) -> float:
    if policy.masked_scores == "finite":
        # the reference code fills with minus the largest finite number of the scores dtype
        return -policy.scores.max_finite
    return float("-inf")


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
    return torch.float64 if dt == torch.float64 else torch.float32


def _operand(x: torch.Tensor, out_fmt) -> torch.Tensor:
    return x.to(_operand_dtype(x, out_fmt))


class _Operands:
    """``_operand`` for whole inputs: converted once per call instead of once per tile, and
    each (tensor, dtype) once, so that q feeding two fp32-output matmuls has one fp32 copy."""

    def __init__(self):
        self._cache = {}

    def __call__(self, x: torch.Tensor, out_fmt) -> torch.Tensor:
        want = _operand_dtype(x, out_fmt)
        if x.dtype == want:
            return x
        key = (id(x), want)
        if key not in self._cache:
            self._cache[key] = (x, x.to(want))  # x kept alive so that its id stays unique
        return self._cache[key][1]


def _tile_hidden(hide, causal, q0, q1, k0, k1, device):
    """Boolean mask of one tile, True where a key is hidden from a query; None if none is."""
    tile = None
    if hide is not None:
        tile = hide[..., q0:q1, k0:k1]
    if causal and k1 - 1 > q0:  # some key of the tile lies after some query of the tile
        rows = torch.arange(q0, q1, device=device)[:, None]
        cols = torch.arange(k0, k1, device=device)[None, :]
        c = cols > rows
        tile = c if tile is None else tile | c
    return tile


def _scores(qi, kj, bias, q0, q1, k0, k1, scale, policy, softcap=None, want_tanh=False):
    """S = round(round(q k^T) * scale), soft-capped to cap * tanh(S / cap) if ``softcap``,
    plus ``bias``; in the scores format, a fresh tensor. With ``want_tanh`` also returns the
    tanh (for the soft-cap's derivative in backward), else None."""
    fmt = policy.scores
    s = matmul(qi, kj.transpose(-2, -1), fmt)
    s = _rounded(s.mul_(scale), fmt)
    t = None
    if softcap is not None:
        t = _rounded(_rounded(s.div_(softcap), fmt).tanh_(), fmt)
        s = _rounded(t * softcap, fmt)
        if not want_tanh:
            t = None
    if bias is not None:
        s = _rounded(s.add_(bias[..., q0:q1, k0:k1].to(s.dtype)), fmt)
    return s, t


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
    operand = _Operands()
    q_mm, k_mm = operand(q, policy.scores), operand(k, policy.scores)
    o_tiles, lse_tiles, hp_tiles = [], [], []
    for q0, q1 in tile_ranges(Tq, block_q):
        qi = q_mm[..., q0:q1, :]
        n = q1 - q0
        m = torch.full((B, H, n, 1), m_init, dtype=storage_dtype(stats), device=q.device)
        l = torch.zeros((B, H, n, 1), dtype=storage_dtype(stats), device=q.device)
        acc = torch.zeros((B, H, n, Dv), dtype=storage_dtype(acc_fmt), device=q.device)
        acc_hp = torch.zeros((B, H, n, Dv), dtype=hp_fmt.torch_dtype, device=q.device) if keep_highp_o else None
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
                th = None
                s = torch.full((B, H, n, min(2, k1 - k0)), fill, dtype=storage_dtype(policy.scores),
                               device=q.device)
            else:
                th = _tile_hidden(hide, causal, q0, q1, k0, k1, q.device)
                s, _ = _scores(qi, k_mm[..., k0:k1, :], bias, q0, q1, k0, k1, scale, policy, softcap)  # (B, H, n, bk)
                if th is not None:
                    s.masked_fill_(th, fill)
            row_max = s.amax(dim=-1, keepdim=True)
            m_new = torch.maximum(stabilizer.shift(s, row_max, policy), m)
            # rows with nothing visible yet (all -inf) shift by 0 so that exp gives 0, not NaN
            m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
            if observe is not None:
                s_seen = s.clone()
            if fully_hidden:
                p_full = torch.zeros_like(s)  # exp(fill - m) underflows, or is masked, everywhere
            else:
                p_full = _rounded(_rounded(s.sub_(m_safe), policy.scores).exp_(), policy.scores)  # consumes s
                if th is not None and fill != float("-inf"):
                    p_full.masked_fill_(th, 0.0)  # a finite fill gives exp(0) = 1 in fully masked rows
            pbar = cast(p_full, policy.pbar)
            tile_sum = rowsum(pbar if policy.row_sum_rounded else p_full, stats)
            if policy.row_sum_floor is not None:
                tile_sum = _rounded(tile_sum.clamp_(min=policy.row_sum_floor), stats)
            if dropout is not None and not fully_hidden:  # after l took the undropped row sum
                pbar = torch.where(dropout.keep(q0, q1, k0, k1), pbar, 0.0)  # zeroing is exact in any format
            v_tile = v[..., k0:k1, :]
            if fully_hidden:
                pv = torch.zeros((B, H, n, Dv), dtype=storage_dtype(policy.pv), device=q.device)
            else:
                pv = matmul(pbar, v_tile, policy.pv)
            if observe is not None:
                observe((q0, q1, k0, k1), s=s_seen, hidden=th, row_max=row_max, m_new=m_new, pbar=pbar, pv=pv)
            f = cast(torch.exp(cast(m - m_safe, stats)), stats)  # rescale of the old state
            l = cast(cast(f * l, stats) + tile_sum, stats)
            acc = cast(cast(acc * f, acc_fmt) + pv, acc_fmt)
            if acc_hp is not None:
                acc_hp = acc_hp * f.to(acc_hp.dtype)
                if not fully_hidden:
                    acc_hp = acc_hp + matmul(pbar, v_tile, hp_fmt)
            m = m_new
        empty = l == 0  # every key masked: output 0 and lse = +inf (so that backward P = 0)
        o = cast(acc / torch.where(empty, torch.ones_like(l), l), acc_fmt)
        if dropout is not None:
            o = cast(o * dropout.scale, acc_fmt)
        o = o.masked_fill(empty, 0.0)
        o_tiles.append(cast(o, policy.output))
        lse = cast(cast(torch.log(l), policy.lse) + m, policy.lse)
        lse_tiles.append(lse.masked_fill(empty, float("inf")))
        if acc_hp is not None:
            lw = l.to(acc_hp.dtype)
            o_hp_i = acc_hp / torch.where(empty, torch.ones_like(lw), lw)
            if dropout is not None:
                o_hp_i = o_hp_i * dropout.scale
            hp_tiles.append(o_hp_i.masked_fill(empty, 0.0))
    o_hp = torch.cat(hp_tiles, dim=-2) if keep_highp_o else None
    return torch.cat(o_tiles, dim=-2), torch.cat(lse_tiles, dim=-2), o_hp


def _p_tile(qi, kj, lse_i, hide, bias, causal, q0, q1, k0, k1, scale, policy, softcap=None):
    """Recompute P = exp(S - lse) for one tile in the ``p`` format (masked entries 0: they
    are -inf before exp; lse is never -inf, empty rows carry +inf). Also returns the soft-cap
    derivative 1 - tanh^2 in the ``p`` format (None without soft-capping)."""
    s, t = _scores(qi, kj, bias, q0, q1, k0, k1, scale, policy, softcap, want_tanh=True)
    dcap = None if t is None else cast(1.0 - cast(t * t, policy.p), policy.p)
    th = _tile_hidden(hide, causal, q0, q1, k0, k1, qi.device)
    if th is not None:
        s.masked_fill_(th, float("-inf"))
    if s.dtype == storage_dtype(policy.p):
        p = _rounded(_rounded(s.sub_(lse_i), policy.p).exp_(), policy.p)
    else:
        p = cast(torch.exp(cast(s - lse_i, policy.p)), policy.p)
    return p, dcap


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
    operand = operand or _Operands()
    q_s, k_s = operand(q, policy.scores), operand(k, policy.scores)
    do_dp, v_dp = operand(do, policy.dp), operand(v, policy.dp)
    hide = None if keep is None else ~keep
    parts = []
    for q0, q1 in tile_ranges(q.shape[-2], block_q):
        d = None
        for k0, k1 in tile_ranges(k.shape[-2], block_k):
            if causal and k0 > q1 - 1:
                break  # hidden tiles contribute exactly zero
            p, _ = _p_tile(q_s[..., q0:q1, :], k_s[..., k0:k1, :], lse[..., q0:q1, :], hide, bias,
                           causal, q0, q1, k0, k1, scale, policy, softcap)
            dp = matmul(do_dp[..., q0:q1, :], v_dp[..., k0:k1, :].transpose(-2, -1), policy.dp)
            if dropout is not None:
                dp = _dropped_dp(dp, dropout.keep(q0, q1, k0, k1), dropout.scale, policy)
            part = _rowsum_product(dp, p, policy)
            d = part if d is None else cast(d + part, policy.delta)
        parts.append(d)
    return torch.cat(parts, dim=-2)


def flash_backward(q, k, v, o, lse, do, o_highp, *, keep, bias, causal: bool, scale: float,
                   policy: PrecisionPolicy, block_q: int, block_k: int, softcap: float | None = None,
                   delta_hook=None, dropout: TileDropout | None = None):
    """Gradients (dq, dk, dv) in ``policy.grad_accum`` storage. ``do`` is rounded to inputs.

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
    operand = _Operands()
    q_s, k_s = operand(q, policy.scores), operand(k, policy.scores)
    do_dp, v_dp = operand(do, policy.dp), operand(v, policy.dp)
    do_g, k_g, q_g = (operand(t, policy.grad_partial) for t in (do, k, q))

    def hidden(q0, q1, k0, k1):
        return causal and k0 > q1 - 1  # contributes exactly zero: skipped

    # --- preprocess: delta, (B, H, T_q, 1) in the delta format
    delta = delta_preprocess(q, k, v, o, lse, do, o_highp, keep=keep, bias=bias, causal=causal, scale=scale,
                             policy=policy, block_q=block_q, block_k=block_k, softcap=softcap, operand=operand,
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
            p, dcap = _p_tile(q_s[..., q0:q1, :], k_s[..., k0:k1, :], lse[..., q0:q1, :], hide, bias, causal,
                              q0, q1, k0, k1, scale, policy, softcap)
            p_mm = _operand(cast(p, policy.pbar), policy.grad_partial)
            if dropout is not None:
                kt = dropout.keep(q0, q1, k0, k1)
                p_mm = torch.where(kt, p_mm, 0.0)  # 1 / (1 - p) applied to the finished dV_j
            dv_j = accumulate(dv_j, matmul(p_mm.transpose(-2, -1), do_g[..., q0:q1, :], policy.grad_partial))
            dp = matmul(do_dp[..., q0:q1, :], v_dp[..., k0:k1, :].transpose(-2, -1), policy.dp)
            if dropout is not None:
                dp = _dropped_dp(dp, kt, dropout.scale, policy)
            # dS = (P * scale) * (dP - delta), each op rounded to the p format, in place
            dp_minus = cast(_rounded(dp.sub_(delta[..., q0:q1, :]), policy.dp), policy.p)
            ds = _rounded(_rounded(p.mul_(scale), policy.p).mul_(dp_minus), policy.p)
            if dcap is not None:  # through the soft-cap: d(cap * tanh(x / cap)) / dx = 1 - tanh^2
                ds = _rounded(ds.mul_(dcap), policy.p)
            ds = _operand(cast(ds, policy.ds), policy.grad_partial)  # the matmul operand
            dq_tiles[i] = accumulate(dq_tiles[i], matmul(ds, k_g[..., k0:k1, :], policy.grad_partial))
            dk_j = accumulate(dk_j, matmul(ds.transpose(-2, -1), q_g[..., q0:q1, :], policy.grad_partial))
        dk_tiles.append(dk_j)
        if dropout is not None:
            dv_j = cast(dv_j * dropout.scale, acc)
        dv_tiles.append(dv_j)
    return torch.cat(dq_tiles, dim=-2), torch.cat(dk_tiles, dim=-2), torch.cat(dv_tiles, dim=-2)
