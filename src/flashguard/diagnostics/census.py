"""The preconditions census: does a layer's attention set up the study's mechanism?

The study's mechanism (Qiu & Yao 2025, arXiv 2510.04212) needs, one after the other: rows whose
maximum score repeats (ties, common at attention sinks), so that several softmax numerators
Pbar are exactly 1 and their V rows enter the PV sum exactly; V features of one sign at those
tied keys, so that the sum of two same-signed, same-exponent bf16 values overflows the
significand and rounds away from zero every time; an O error of one sign, therefore; and a
delta = rowsum(dO * O) error that leans positive. The probes already write the tie rate
(the stabilizer's own rule), the rows with >= 2 Pbar == 1 and the sink mass
(``numerics_metrics``, ``attention_metrics``); ``census_metrics`` adds what they do not:

  numerics/exact_tie_rate/Ll(Hh)  share of (row, key tile) pairs whose maximum score occurs at
        least twice bit for bit, in the arithmetic's scores format. For the stabilizers none and
        safe this is the tie rate itself; the paper stabilizer's tie rule is wider (>= 2 scores
        within tol), so its tie rate can be larger. It weighs the next two when pooling layers.
  numerics/tie_at_sink/Ll(Hh)     of those pairs, the share whose tied keys include key 0, the
        sink position (0 where no pair is tied, as exact_tie_rate = 0 says)
  numerics/tie_at_sink_chance/Ll(Hh)  the same share if each pair's k tied keys were any k of its
        n visible keys (k / n per pair in the first key tile): short causal rows tie at key 0 by chance
  numerics/v_sign_agree/Ll(Hh)    of those pairs, the mean share of V's features in which the V
        values of all tied keys have one sign (all > 0 or all < 0; a zero breaks it); 0 where
        no pair is tied. Independent random signs give 2^(1-k) for k tied keys (0.5 for a pair).
  numerics/o_err_z_row/Ll, numerics/o_err_ratio_row/Ll   z and bias ratio of O's error with one
        value per row (the error averaged over the row's features; attention.error_stats)
  numerics/delta_err_z_row/Ll, numerics/delta_err_ratio_row/Ll   the same for delta's error

Why the row unit here when numerics_metrics uses (sequence, head): the study reasons about the
rounding of each row's own PV sum, and the census asks whether *rows* lean; the rows of one
sequence share its keys, so the row z is the optimistic one and ``o_err_z`` / ``delta_err_z``
(sequence units) stay the conservative reading next to it.

Which keys are tied needs the scores as the arithmetic rounded them, which ``trace`` does not
return (it counts ties per row only). So the census reads every tile of the arithmetic's forward
through flash_forward's ``observe`` hook (``TiedKeyCounter``), the hook trace counts ties through:
the probes hand it to ``trace`` (its ``observe``), so that one forward counts both, with the same
roundings under a stochastic-rounding policy; ``tied_keys`` runs a forward of its own
(``options.run_forward`` on inputs already rounded: PyTorch kernel, same policy, stabilizer and
tiles; no backward).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import keys
from ..attention.error_stats import BiasStats, bias_stats, unit_means
from ..attention.options import run_forward
from ..attention.stabilizers import count_true
from ..attention.trace import Arithmetic

__all__ = ["TiedKeys", "TiedKeyCounter", "tied_keys", "row_bias", "census_metrics"]


@dataclass
class TiedKeys:
    """Per head (H,), summed over batch, rows and visited key tiles (fp64 counts)."""

    pairs: torch.Tensor      # (row, key tile) pairs with a visible key
    tied: torch.Tensor       # of those, pairs whose maximum score occurs >= 2 times bit for bit
    at_sink: torch.Tensor    # of the tied, pairs whose tied keys include key 0
    at_sink_chance: torch.Tensor  # expected at_sink if the tied keys were drawn at random among the visible
    agree: torch.Tensor      # sum over the tied pairs of their share of one-signed V features


class TiedKeyCounter:
    """``observe`` callback of flash_forward: which keys hold each tile row's maximum. Rides any
    forward of the arithmetic (``tied_keys`` runs its own; the probes pass it to ``trace``, whose
    forward then counts both). The V-sign step needs V as the arithmetic rounded it, which the
    forward's caller knows only once it ran: the tied rows' keys are kept per tile and
    ``finish(v)`` counts their signs."""

    def __init__(self, heads: int, causal: bool, device=None):
        self.causal = causal
        z = lambda: torch.zeros(heads, dtype=torch.float64, device=device)  # noqa: E731
        self.counts = TiedKeys(z(), z(), z(), z(), z())
        self._tied = []   # per tile with a tied row: (k0, k1, (b, h, row) of those rows, their at_max, n_max)

    def __call__(self, tile, *, s, hidden, row_max, **_):
        q0, q1, k0, k1 = tile
        if self.causal and k0 > q1 - 1:
            return  # hidden from every query of the tile: trace does not count it either
        at_max = s == row_max                                        # (B, H, n, bk)
        B, H, n, bk = s.shape
        if hidden is None:
            n_visible = torch.full((n,), bk, dtype=torch.int32, device=s.device)
        else:
            # the mask of the tile, as small as it comes (the causal one is (n, bk)): counted once
            visible = ~hidden
            at_max &= visible
            n_visible = visible.sum(dim=-1, dtype=torch.int32)
        n_visible = n_visible.expand(B, H, n)
        n_max = count_true(at_max).squeeze(-1)                       # (B, H, n)
        tied = n_max >= 2
        c = self.counts
        per_head = lambda x: x.to(torch.float64).sum(dim=(0, 2))    # noqa: E731  (B, H, n) -> (H,)
        c.pairs += per_head(n_visible > 0)
        c.tied += per_head(tied)
        if not bool(tied.any()):
            return
        if k0 == 0:
            c.at_sink += per_head(tied & at_max[..., 0])
            chance = n_max.to(torch.float64) / n_visible.clamp(min=1).to(torch.float64)
            c.at_sink_chance += per_head(torch.where(tied, chance, torch.zeros_like(chance)))
        where = tied.nonzero(as_tuple=True)                          # ties are usually a few rows in a hundred
        self._tied.append((k0, k1, where, at_max[where], n_max[where]))

    def finish(self, v: torch.Tensor) -> TiedKeys:
        """The counts, with ``agree`` from ``v`` (B, H, T_k, D_v) as the forward received it (rounded)."""
        c = self.counts
        heads, d_v = v.shape[1], v.shape[-1]
        agreeing = torch.zeros(heads, dtype=torch.float64, device=v.device)   # one-signed features, a count
        for k0, k1, (b, h, _), at_max, n_max in self._tied:
            # sum of sign(V) over the tied keys, per feature: |sum| == k exactly when all k tied keys
            # have one (non-zero) sign. An fp32 matmul (the counts, <= the tile's keys, are exact) of
            # the tied rows of one (batch, head) at a time; nonzero() listed them grouped that way.
            signs = torch.sign(v[..., k0:k1, :].to(torch.float32))            # (B, H, bk, D)
            unit = b * heads + h
            units, sizes = torch.unique_consecutive(unit, return_counts=True)
            for u, rows in zip(units.tolist(), torch.arange(unit.numel(), device=v.device).split(sizes.tolist())):
                summed = at_max[rows].to(torch.float32) @ signs[u // heads, u % heads]   # (rows, D)
                k = n_max[rows].unsqueeze(-1).to(torch.float32)
                agreeing[u % heads] += (summed.abs_() == k).sum()
        # counts are exact; one division per head: the sum over the tied pairs of their share
        c.agree += agreeing / d_v
        self._tied = []
        return c


def tied_keys(q, k, v, arithmetic: Arithmetic, *, causal: bool, scale: float, softcap: float | None = None) -> TiedKeys:
    """The tied keys of every (row, key tile) pair of ``arithmetic`` on (q, k, v), already rounded to
    its input format (``Trace.inputs``); the forward pass only, on the PyTorch kernel (``softcap``:
    None = the arithmetic's own)."""
    a = arithmetic if arithmetic.kernel == "pytorch" else arithmetic.replace(kernel="pytorch")
    counter = TiedKeyCounter(v.shape[1], causal, v.device)
    with torch.no_grad():
        run_forward(q, k, v, a.options.capped(softcap), causal=causal, scale=scale, observe=counter, rounded=True)
    return counter.finish(v)


def row_bias(err: torch.Tensor, *, feature_dim: bool = True) -> BiasStats:
    """The lean of an error with one value per row (its mean over the row's features), tested
    across rows (``attention.error_stats``)."""
    return bias_stats(unit_means(err, "row", feature_dim=feature_dim), "row")


def _share(num, den) -> float:
    # 0 over no pair, as the probes' other shares: a probe value is never NaN for finite inputs
    # (numerics/exact_tie_rate = 0 tells a reader that there was nothing to measure)
    return float(num / den) if float(den) > 0 else 0.0


def census_metrics(sh) -> dict:
    """The census keys of one layer's ``probes.Shadow`` (empty for a layer without a trace). For
    the SDPA kernel measured as a black box (``sh.arithmetic`` None: no tiles, no rounded scores)
    only the row-unit keys (o_err_z_row, o_err_ratio_row, delta_err_z_row, delta_err_ratio_row)."""
    if sh.trace is None:
        return {}
    out = {} if sh.arithmetic is None else _tied_key_metrics(sh)
    t = sh.trace
    o = row_bias(t.o_err)
    out[keys.O_ERR_Z_ROW.key(sh.layer)], out[keys.O_ERR_RATIO_ROW.key(sh.layer)] = o.z, o.bias_ratio
    if t.delta is not None:
        d = row_bias(t.delta_err, feature_dim=False)
        out[keys.DELTA_ERR_Z_ROW.key(sh.layer)], out[keys.DELTA_ERR_RATIO_ROW.key(sh.layer)] = d.z, d.bias_ratio
    return out


def _tied_key_metrics(sh) -> dict:
    """exact_tie_rate, tie_at_sink(_chance) and v_sign_agree of the shadow's arithmetic, per head and layer."""
    layer, c = sh.layer, sh.tied_keys   # counted in the trace's own forward (probes.shadow)
    out = {}
    for h in range(c.pairs.shape[0]):
        out[keys.EXACT_TIE_RATE.key(layer, h)] = _share(c.tied[h], c.pairs[h])
        out[keys.TIE_AT_SINK.key(layer, h)] = _share(c.at_sink[h], c.tied[h])
        out[keys.TIE_AT_SINK_CHANCE.key(layer, h)] = _share(c.at_sink_chance[h], c.tied[h])
        out[keys.V_SIGN_AGREE.key(layer, h)] = _share(c.agree[h], c.tied[h])
    tied = c.tied.sum()
    out[keys.EXACT_TIE_RATE.key(layer)] = _share(tied, c.pairs.sum())
    out[keys.TIE_AT_SINK.key(layer)] = _share(c.at_sink.sum(), tied)
    out[keys.TIE_AT_SINK_CHANCE.key(layer)] = _share(c.at_sink_chance.sum(), tied)
    out[keys.V_SIGN_AGREE.key(layer)] = _share(c.agree.sum(), tied)
    return out
