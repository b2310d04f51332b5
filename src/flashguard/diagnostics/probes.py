"""Probes: read a model and one batch's attention, return flat dicts of namespaced metrics.

Key names: ``<namespace>/<metric>/L<layer>`` for a layer, ``.../L<layer>H<head>`` for one
head; layers and heads count from 0 (the study's "layer 2" is ``L1``). Every value is a float.

Weights (``weight_probe``, per layer and head):
  weights/wq_spectral_norm/LlHh, weights/wk_spectral_norm/LlHh   largest singular value of the
        head's (head_dim, n_embd) slice of the query / key projection
  weights/wq_growth/LlHh, weights/wk_growth/LlHh   growth rate against the previous probe:
        100 * ln(norm_now / norm_prev) / (steps between them), i.e. log-growth per 100 steps
        (0.1 = +10.5 % per 100 steps); absent at the first probe
  weights/wq_spectral_norm_max/Ll, weights/wq_growth_max/Ll (and wk_): maxima over heads

Attention (``attention_metrics``, from the fp64 attention of the layer's inputs):
  attn/max_logit/LlHh, attn/max_logit/Ll     max |S| over visible entries, S = q k^T * scale
                                               (soft-capped if the model caps)
  attn/sink_mass/LlHh, attn/sink_mass/Ll     mean probability on the first key (rows 1..T-1
                                               under the causal mask)
  attn/sink_top_frac/Ll                      fraction of those rows whose largest score (so largest
                                               weight) is at key 0, ties included

Numerics (``numerics_metrics``; the layer's attention once more in the training policy,
kernel and tiles, next to fp64, measured by ``flashguard.attention.trace``; for layers whose
backend is flash, or with an explicit ``precision``; for a layer that trains through torch's
SDPA, the kernel itself - see "Under the sdpa backend" below):
  numerics/tie_rate/LlHh, numerics/tie_rate/Ll   fraction of (row, key tile) pairs whose maximum
        repeats under the layer's stabilizer's own tie rule (``Stabilizer.tied``): an exact
        repeat for ``none`` and ``safe``; >= 2 scores within ``tol`` of the max, compared in the
        scores format, for ``paper``
  numerics/pbar_one/LlHh, numerics/pbar_one/Ll   fraction of visible Pbar entries exactly 1
  numerics/pbar_one_multi/LlHh, numerics/pbar_one_multi/Ll   fraction of (row, tile) pairs with >= 2 of
        them (the study's trigger: several V rows enter PV with weight exactly 1)
  numerics/o_err_bias/Ll         mean of O_policy - O_fp64 over all outputs (signed)
  numerics/o_err_abs/Ll          mean |O_policy - O_fp64|
  numerics/o_err_bias_absmax/Ll  max over features (head, dim) of |mean error of that feature|
  numerics/o_err_bias_vsign/Ll   mean over features of bias_f * sign(mean V_f): > 0 when O is
        pushed away from zero in the direction V points (the study's mechanism)
  numerics/delta_err_mean/Ll     mean of delta_lp - delta_hp, delta = rowsum(dO * O); delta_lp as
        the policy computes it (its delta_source and formats), delta_hp in fp64 from fp64 O,
        both from the same dO rounded to the policy's input format
  numerics/delta_err_abs/Ll, numerics/delta_err_rel/Ll (= mean / mean |delta_hp|)
  numerics/delta_err_pos_frac/Ll fraction of rows where delta_lp > delta_hp
  numerics/delta_err_cumsum/Ll   running sum of delta_err_mean over the probes so far (ProbeState)
  numerics/o_err_z/Ll, numerics/delta_err_z/Ll   z of the mean error of O / delta over independent
        units, one value per (sequence, head) (attention.error_stats): the rows of a sequence share
        its keys and values; |z| >= 3.29 is a lean at p < 0.001 (against fp64, not the floor)

Under the sdpa backend (a layer whose effective backend is ``sdpa``, no explicit ``precision``):
the probes measure the kernel torch ran, not a model of it. The layer's own SDPA call (the
model's ``attend`` with the layer's spec: is_causal=True, torch's default scale, no mask; the
attention dropout is not replayed, as on the flash path) runs once more on the captured q, k, v
in the dtype the layer gave them (bf16 under autocast) as a black box (``trace`` with a
callable), its backward by autograd against the captured dO, next to fp64 on the same inputs.
On CPU in bf16 that is torch's fused flash kernel; on CUDA whatever kernel torch picks for the
call. Written, with the flash path's keys and meanings: o_err_bias, o_err_abs,
o_err_bias_absmax, o_err_bias_vsign, o_err_z; delta_err_mean, _abs, _rel, _pos_frac, _cumsum,
_z; the census's o_err_z_row, o_err_ratio_row, delta_err_z_row, delta_err_ratio_row; the delta
split's delta_from_o_mean/_z and delta_own_mean/_z; the grad/wq_err_* keys (from the kernel's
dQ). **delta's source is the kernel's O** (``Shadow.delta_source`` = ``"kernel O"``): the
kernel's internal delta is not observable from outside, so delta_lp = rowsum(dO * O_kernel)
with the product and sum in fp32, as production backward passes take it; delta_from_o (O's part,
fully the kernel's) is the kernel's, delta_own is that fp32 sum's, not the kernel's. Left out
(they need the kernel's tiles and its rounded scores, which a black box does not show, and
flashguard's model of the kernel would be counting its own ties, not the kernel's): tie_rate,
pbar_one, pbar_one_multi, exact_tie_rate, tie_at_sink, tie_at_sink_chance, v_sign_agree,
tied_row_frac and the delta split's tied / untied means. A flash arm with the kernel's model
(``precision=torch-cpu``, the same 512-wide key tile) counts those. dK and dV errors are in the
trace but, as on the flash path, not written.

Preconditions census (``census.census_metrics``, with the numerics): numerics/exact_tie_rate,
numerics/tie_at_sink, numerics/v_sign_agree (per layer and head), numerics/o_err_z_row,
numerics/o_err_ratio_row, numerics/delta_err_z_row, numerics/delta_err_ratio_row; meanings there.

Gradient error (``gradient_error_metrics``): E = J^T (dQ_policy - dQ_fp64), the part of the
W_Q gradient error that the attention backward causes, mapped through the query projection
(and the query LayerNorm, if any) in fp64; dQ_policy is the policy's flash backward given the
policy's own O and lse, as training computes it, cast to the dtype training hands on.
  grad/wq_err_sv1..sv4/Ll        top singular values of E as a (n_embd, n_embd) matrix
  grad/wq_err_rank1_frac/Ll      sv1^2 / sum sv^2 (1 = rank one)
  grad/wq_err_norm/Ll, grad/wq_err_rel/Ll (= |E| / |dW_Q with fp64 attention|, Frobenius)
  grad/wq_err_cos_prev/Ll        cosine (Frobenius) with the previous probe's E
  grad/wq_err_cos_sum/Ll         cosine with the sum of all earlier probes' E (accumulation)
  grad/wq_err_align_top/Ll       |u1^T E v1| / |E|, (u1, v1) W_Q's top singular pair
  grad/wq_err_top_push/Ll        -u1^T E v1 / |E|: > 0 when a gradient step W -= lr * E grows
        W_Q's top singular value (first order; plain SGD)
  grad/wq_err_norm/LlHh, grad/wq_err_align_top/LlHh, grad/wq_err_top_push/LlHh: the same per
        head, against the head slice's own top singular pair
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import keys
from ..attention import FlashOptions, choose_kernel, get_stabilizer
from ..attention.error_stats import bias_stats, unit_means
from ..attention.reference import causal_mask, reference_attention
from ..attention.trace import Arithmetic, Trace, trace
from ..attention.triton_flash import forward_tiles
from ..numerics.policy import PrecisionPolicy, get_policy
from .capture import LayerCapture, resolve_layers
from ..model.attention import AttentionSpec, attend
from .census import TiedKeyCounter, TiedKeys, census_metrics
from .state import ProbeState

__all__ = ["weight_probe", "spectral_norms", "Shadow", "shadow", "attention_metrics", "numerics_metrics",
           "gradient_error_metrics", "error_structure", "map_dq_to_wq", "probe_layer", "run_probes",
           "N_SINGULAR", "KERNEL_LABEL", "KERNEL_DELTA_SOURCE", "kernel_call"]

N_SINGULAR = 4          # singular values of the gradient error written to the metrics
# what a layer that trains through SDPA is measured as (the kernel itself, a black box) and where its delta comes from
KERNEL_LABEL = "torch sdpa: the layer's own kernel (black box)"
KERNEL_DELTA_SOURCE = "kernel O"


# --------------------------------------------------------------------------------------------
# weights

def spectral_norms(w: torch.Tensor) -> torch.Tensor:
    """Largest singular value of each (rows, cols) matrix of a (..., rows, cols) tensor, fp64."""
    return torch.linalg.matrix_norm(w.detach().to(torch.float64), ord=2)


def weight_probe(model, layers=None, *, step: int | None = None, state: ProbeState | None = None) -> dict:
    """Spectral norms of the per-head W_Q and W_K slices and their growth since the last probe
    (recorded in ``state``, which this call updates when ``step`` is given)."""
    out: dict[str, float] = {}
    for layer in resolve_layers(model.config.n_layer, layers):
        for name, w in (("wq", model.wq_heads(layer)), ("wk", model.wk_heads(layer))):
            norms = spectral_norms(w).tolist()
            growths = []
            for h, n in enumerate(norms):
                key = keys.SPECTRAL_NORM[name].key(layer, h)
                out[key] = n
                if state is not None and step is not None:
                    prev = state.norms.get(key)
                    if prev is not None and step > prev[0] and prev[1] > 0 and n > 0:
                        g = 100.0 * math.log(n / prev[1]) / (step - prev[0])
                        out[keys.GROWTH[name].key(layer, h)] = g
                        growths.append(g)
                    state.norms[key] = (step, n)
            out[keys.SPECTRAL_NORM_MAX[name].key(layer)] = max(norms)
            if growths:
                out[keys.GROWTH_MAX[name].key(layer)] = max(growths)
    return out


# --------------------------------------------------------------------------------------------
# the shadow computation: the layer's attention in its policy next to fp64, through the one
# measurement (flashguard.attention.trace)

@dataclass
class Shadow:
    """The layer's attention on one batch: the fp64 scores and the one reference's lse for the
    logit and sink metrics, and - for a layer with a policy - the ``Trace`` of the policy's
    arithmetic against fp64 (errors of O, delta, dQ; ties per row) and the census's tied keys,
    counted in the same forward."""

    layer: int
    policy: PrecisionPolicy | None
    stabilizer: object | None
    s: torch.Tensor                    # (B, H, T, T) fp64 scores (after scale and soft-cap), masked = -inf
    lse: torch.Tensor                  # (B, H, T) fp64 log-sum-exp of the reference
    keep: torch.Tensor | None          # (T, T) bool, True where visible (None: all)
    v_in: torch.Tensor                 # V as the arithmetic received it (rounded to its inputs)
    trace: Trace | None = None         # None for a layer without a policy
    arithmetic: Arithmetic | None = None  # the arithmetic the trace ran (None without a policy)
    causal: bool = True
    scale: float = 1.0                 # the attention scale the layer used
    softcap: float | None = None
    kernel: str | None = None          # KERNEL_LABEL when the trace measured the layer's SDPA kernel itself
    tied_keys: TiedKeys | None = None  # the census's counts of the arithmetic's forward (None without one)

    def probabilities(self) -> torch.Tensor:
        """(B, H, T, T) fp64 exp(S - lse): the reference's attention weights (masked entries 0)."""
        return torch.exp(self.s - self.lse.unsqueeze(-1))

    @property
    def delta_source(self) -> str | None:
        """Where delta_lp comes from: the policy's ``delta_source``, or ``"kernel O"`` for the SDPA
        kernel (rowsum(dO * O_kernel) in fp32; the kernel's internal delta is not observable)."""
        if self.trace is None:
            return None
        return KERNEL_DELTA_SOURCE if self.kernel is not None else self.trace.delta_source

    @property
    def o_lp(self):
        return None if self.trace is None else self.trace.o

    @property
    def dq_lp(self):
        return None if self.trace is None else self.trace.dq

    @property
    def dq_hp(self):
        return None if self.trace is None else self.trace.dq_ref


def _resolve(cap: LayerCapture, precision, stabilizer):
    """The policy and stabilizer the layer trains with (or the explicit ones); (None, None)
    for a layer whose backend is not flash and no explicit precision."""
    flash = cap.spec.options if (cap.spec is not None and cap.backend == "flash") else None
    if precision is None:
        if flash is None:
            return None, None
        precision = flash.precision
    if stabilizer is None:
        stabilizer = "none" if flash is None else flash.stabilizer
    return get_policy(precision), get_stabilizer(stabilizer)


def _trained_arithmetic(cap: LayerCapture, policy, stab) -> Arithmetic:
    """The arithmetic as the layer ran it: its policy and stabilizer, its kernel (the spec's
    ``kernel`` resolved on the captured q, k, v as flash_attention resolves it) and that kernel's
    tiles (the spec's, else the kernel's defaults: 512 on the PyTorch path, the Triton forward's own).
    Under the triton kernel, ties and Pbar == 1 are counted on the PyTorch path at the same tiles."""
    spec = cap.spec
    block_q, block_k = getattr(spec, "block_q", None), getattr(spec, "block_k", None)
    opts = FlashOptions(precision=policy, stabilizer=stab, block_q=block_q, block_k=block_k, kernel="pytorch")
    if cap.backend == "flash" and spec is not None and not spec.hooked:
        kernel = choose_kernel(cap.q, cap.k, cap.v, opts.replace(kernel=spec.kernel).capped(cap.softcap))
        if kernel == "triton":
            head_dim = max(cap.q.shape[-1], cap.v.shape[-1])
            block_q, block_k = forward_tiles(head_dim, policy.inputs.torch_dtype, block_q, block_k)
            opts = opts.replace(block_q=block_q, block_k=block_k, kernel="triton")
    return Arithmetic(opts)


def kernel_call(cap: LayerCapture):
    """The SDPA call a layer that trains through SDPA made, as ``fn(q, k, v) -> o``: the model's
    own ``attend`` with the layer's spec (flashguard.model.attention: is_causal=True, torch's
    default scale, no mask), without attention dropout; for a capture without an AttentionSpec
    (an SDPA call captured elsewhere) ``F.scaled_dot_product_attention`` with the capture's causal
    flag and scale."""
    spec = cap.spec
    if isinstance(spec, AttentionSpec):
        if not cap.causal or cap.scale is not None:
            raise ValueError("a layer with an AttentionSpec attends causally at torch's default scale "
                             f"(model.attention.attend); this capture has causal={cap.causal}, scale={cap.scale}")
        return lambda q, k, v: attend(spec, q, k, v, softcap=cap.softcap)
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=cap.causal, scale=cap.scale)


def _policy_trace(cap: LayerCapture, policy, stab, scale: float, grad: bool):
    """The trace of the layer's flash arithmetic (kernel and tiles as it trains), that arithmetic
    and the census's tied keys, counted in the trace's own forward (census.TiedKeyCounter)."""
    arith = _trained_arithmetic(cap, policy, stab)
    census = TiedKeyCounter(cap.q.shape[1], cap.causal, cap.q.device)
    pytorch = arith.kernel == "pytorch"
    t = trace(cap.q, cap.k, cap.v, cap.do, arith, causal=cap.causal, scale=scale, softcap=cap.softcap,
              grads="dq" if grad else False, observe=census if pytorch else None, scores=True)
    counted = t
    if not pytorch:  # the triton kernel does not expose its tiles' maxima: count them on the
        # PyTorch path with the same policy, stabilizer and tiles (forward only)
        counted = trace(cap.q, cap.k, cap.v, None, arith.replace(kernel="pytorch"),
                        causal=cap.causal, scale=scale, softcap=cap.softcap, grads=False, observe=census)
        t = dataclasses.replace(t, ties=counted.ties)
    return t, arith, census.finish(counted.inputs[2])


def shadow(cap: LayerCapture, *, precision=None, stabilizer=None, grad: bool = True) -> Shadow:
    """Run the layer's attention on the captured batch in the training policy (kernel and tiles
    as the layer trains: pytorch or triton, see _trained_arithmetic) and in fp64 (``attention.trace``); with ``grad`` (and a captured dO) also both
    backward passes. A layer that trains through SDPA (no explicit ``precision``) is measured as
    its kernel itself: its own SDPA call (``kernel_call``) as a black box, its gradients by autograd.

    The global RNG (used by stochastic rounding) is forked, so training is not disturbed."""
    policy, stab = _resolve(cap, precision, stabilizer)
    scale = cap.attn_scale
    dev = cap.q.device
    fork = torch.random.fork_rng(devices=[dev.index or 0] if dev.type == "cuda" else [])
    with torch.no_grad(), torch.autocast(dev.type, enabled=False), fork:
        t = arith = kernel = tied = None
        if policy is None and cap.backend == "sdpa":
            kernel = KERNEL_LABEL
            t = trace(cap.q, cap.k, cap.v, cap.do, kernel_call(cap), causal=cap.causal, scale=scale,
                      softcap=cap.softcap, grads="dq" if grad else False, label=kernel, scores=True)
            v_in, lse, s = t.inputs[2], t.lse_ref, t.s_ref
        elif policy is None:
            v_in = cap.v
            _, lse, s = reference_attention(cap.q, cap.k, v_in, is_causal=cap.causal, scale=scale, softcap=cap.softcap,
                                            return_lse=True, return_scores=True)
        else:
            t, arith, tied = _policy_trace(cap, policy, stab, scale, grad)
            v_in, lse, s = t.inputs[2], t.lse_ref, t.s_ref
        # the scores of the one reference (fp64, after scale and soft-cap, hidden = -inf)
        keep = causal_mask(s.shape[-2], s.shape[-1], s.device) if cap.causal else None
        return Shadow(layer=cap.layer, policy=policy, stabilizer=stab, s=s, lse=lse, keep=keep,
                      v_in=v_in, trace=t, arithmetic=arith, causal=cap.causal, scale=scale, softcap=cap.softcap,
                      kernel=kernel, tied_keys=tied)


# --------------------------------------------------------------------------------------------
# metrics from a shadow

def attention_metrics(sh: Shadow) -> dict:
    """Max |logit| and attention-sink indicators (fp64), from the scores and the reference's lse
    alone: the weight on key 0 is exp(S[:, 0] - lse) and a row's largest weight is at key 0 when
    its largest score is (exp is increasing), so the full probability matrix is never formed."""
    layer = sh.layer
    s = sh.s                                                       # (B, H, T, T), hidden = -inf
    row_max = s.amax(dim=-1)                                       # (B, H, T) over the visible keys
    low = s if sh.keep is None else torch.where(sh.keep, s, float("inf"))
    # max |S| over the visible entries: the largest score or minus the smallest
    max_logit = torch.maximum(row_max.amax(dim=(0, 2)), low.amin(dim=(0, 2, 3)).neg_())   # (H,)
    rows = slice(1, None) if sh.keep is not None and s.shape[-2] > 1 else slice(None)   # rows that have a choice
    first = s[..., rows, 0]                                        # (B, H, rows)
    sink = torch.exp(first - sh.lse[..., rows]).mean(dim=(0, 2))   # (H,)
    top_is_first = (first == row_max[..., rows]).to(torch.float64).mean()
    out = {}
    for h in range(max_logit.shape[0]):
        out[keys.MAX_LOGIT.key(layer, h)] = float(max_logit[h])
        out[keys.SINK_MASS.key(layer, h)] = float(sink[h])
    out[keys.MAX_LOGIT.key(layer)] = float(max_logit.max())
    out[keys.SINK_MASS.key(layer)] = float(sink.mean())
    out[keys.SINK_TOP_FRAC.key(layer)] = float(top_is_first)
    return out


def _ratio(a, b):
    return float(a / b) if float(b) > 0 else 0.0


def _tie_metrics(ties, layer: int) -> dict:
    """Tie rate, Pbar == 1 and rows with several Pbar == 1, per head and per layer."""
    per_head = lambda x: x.sum(dim=(0, 2))  # noqa: E731  (B, H, T) -> (H,)
    tiles, tied, entries, one, multi = (per_head(x) for x in (ties.tiles, ties.tied, ties.entries, ties.pbar_one,
                                                                 ties.multi_one))
    out = {}
    for h in range(tiles.shape[0]):
        out[keys.TIE_RATE.key(layer, h)] = _ratio(tied[h], tiles[h])
        out[keys.PBAR_ONE.key(layer, h)] = _ratio(one[h], entries[h])
        out[keys.PBAR_ONE_MULTI.key(layer, h)] = _ratio(multi[h], tiles[h])
    out[keys.TIE_RATE.key(layer)] = _ratio(tied.sum(), tiles.sum())
    out[keys.PBAR_ONE.key(layer)] = _ratio(one.sum(), entries.sum())
    out[keys.PBAR_ONE_MULTI.key(layer)] = _ratio(multi.sum(), tiles.sum())
    return out


def numerics_metrics(sh: Shadow, *, state: ProbeState | None = None, details: dict | None = None) -> dict:
    """Tie rate, Pbar == 1, O error bias and the delta error (empty without a trace: a layer with
    neither a policy nor the SDPA kernel). For the SDPA kernel (a black box: no tiles) the tie
    and Pbar == 1 keys are left out and delta is taken from the kernel's O (module docstring)."""
    if sh.trace is None:
        return {}
    layer, t = sh.layer, sh.trace
    ties = t.ties
    out = {} if ties is None else _tie_metrics(ties, layer)
    if details is not None and sh.kernel is not None:
        details["measured"], details["delta_source"] = sh.kernel, sh.delta_source

    err = t.o_err                                                  # (B, H, T, D)
    bias_f = err.mean(dim=(0, 2))                                  # (H, D) per feature
    v_sign = torch.sign(sh.v_in.to(torch.float64).mean(dim=(0, 2)))
    out[keys.O_ERR_BIAS.key(layer)] = float(err.mean())
    out[keys.O_ERR_ABS.key(layer)] = float(err.abs().mean())
    out[keys.O_ERR_BIAS_ABSMAX.key(layer)] = float(bias_f.abs().max())
    out[keys.O_ERR_BIAS_VSIGN.key(layer)] = float((bias_f * v_sign).mean())
    # the rows of a sequence share its keys and values: one value per (sequence, head)
    out[keys.O_ERR_Z.key(layer)] = bias_stats(unit_means(err, "sequence"), "sequence").z
    if details is not None:
        details["o_err_bias_per_feature"] = bias_f.tolist()
    if t.delta is not None:
        d = t.delta_err                                            # (B, H, T)
        mean = float(d.mean())
        out[keys.DELTA_ERR_MEAN.key(layer)] = mean
        out[keys.DELTA_ERR_ABS.key(layer)] = float(d.abs().mean())
        out[keys.DELTA_ERR_REL.key(layer)] = _ratio(torch.tensor(mean), t.delta_ref.abs().mean())
        out[keys.DELTA_ERR_POS_FRAC.key(layer)] = float((d > 0).to(torch.float64).mean())
        out[keys.DELTA_ERR_Z.key(layer)] = bias_stats(unit_means(d, "sequence", feature_dim=False), "sequence").z
        cum = mean
        if state is not None:
            if math.isfinite(mean):
                state.delta_sum[layer] = state.delta_sum.get(layer, 0.0) + mean
                state.delta_count[layer] = state.delta_count.get(layer, 0) + 1
            cum = state.delta_sum.get(layer, 0.0)
        out[keys.DELTA_ERR_CUMSUM.key(layer)] = cum
        if t.delta_source == "o_lowp" and t.inputs is not None and t.inputs[3] is not None:
            out.update(delta_split_metrics(t, None if ties is None else ties.multi_one > 0, layer))
    return out


def delta_split_metrics(t, tied_rows: torch.Tensor | None, layer: int) -> dict:
    """delta's error (delta_lp - delta_ref, (B, H, T)) split where it is born: ``from_o``, the
    part O's error carries (rowsum(dO * O_lp) in fp64 - delta_ref, dO as the backward rounded it)
    and ``own``, the part delta's own product and sum add (delta_lp - rowsum(dO * O_lp) in fp64);
    the two add up to the error. Each part's mean and z over (sequence, head) units (the unit of
    DELTA_ERR_Z), and its mean over the rows with several Pbar == 1 in one tile (``tied_rows``,
    (B, H, T) bool) and over the others (each left out when it has no rows: no value, not a
    made-up one). ``tied_rows`` None (a black box shows no tiles): the tied / untied means and
    the tied-row share are left out."""
    do = t.inputs[3].to(torch.float64)
    exact_of_lp = (do * t.o).sum(dim=-1)                           # (B, H, T)
    parts = {"from_o": exact_of_lp - t.delta_ref, "own": t.delta - exact_of_lp}
    names = {"from_o": (keys.DELTA_FROM_O_MEAN, keys.DELTA_FROM_O_Z, keys.DELTA_FROM_O_TIED, keys.DELTA_FROM_O_UNTIED),
             "own": (keys.DELTA_OWN_MEAN, keys.DELTA_OWN_Z, keys.DELTA_OWN_TIED, keys.DELTA_OWN_UNTIED)}
    out = {} if tied_rows is None else {keys.TIED_ROW_FRAC.key(layer): float(tied_rows.to(torch.float64).mean())}
    for part, x in parts.items():
        mean_k, z_k, tied_k, untied_k = names[part]
        out[mean_k.key(layer)] = float(x.mean())
        out[z_k.key(layer)] = bias_stats(unit_means(x, "sequence", feature_dim=False), "sequence").z
        if tied_rows is None:
            continue
        for key, rows in ((tied_k, tied_rows), (untied_k, ~tied_rows)):
            if rows.any():
                out[key.key(layer)] = float(x[rows].mean())
    return out


def map_dq_to_wq(dq: torch.Tensor, x: torch.Tensor, w_q: torch.Tensor, q_ln=None) -> torch.Tensor:
    """The W_Q gradient (H, D, C) that a gradient ``dq`` (B, H, T, D) at the attention's query
    input gives, for queries q_h = LN?(x @ w_q[h].T); in fp64. Leading dims before B are kept
    (several gradients mapped at once)."""
    dq = dq.to(torch.float64)
    x64 = x.detach().to(torch.float64)
    if q_ln is None:
        return torch.einsum("...bhtd,btc->...hdc", dq, x64)
    if dq.dim() > 4:  # one backward through the LayerNorm per leading index: autograd would sum them
        lead = dq.shape[:-4]
        flat = dq.reshape(-1, *dq.shape[-4:])
        return torch.stack([map_dq_to_wq(g, x, w_q, q_ln) for g in flat]).reshape(*lead, *w_q.shape)
    weight, bias, eps = q_ln
    with torch.enable_grad():
        w = w_q.detach().to(torch.float64).requires_grad_(True)
        q_raw = torch.einsum("btc,hdc->bhtd", x64, w)
        qn = F.layer_norm(q_raw, (q_raw.shape[-1],),
                          None if weight is None else weight.to(torch.float64),
                          None if bias is None else bias.to(torch.float64), eps)
        (g,) = torch.autograd.grad(qn, w, dq)
    return g


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    na, nb = float(a.norm()), float(b.norm())
    if na == 0 or nb == 0 or a.shape != b.shape:
        return 0.0
    return float((a * b).sum()) / (na * nb)


def error_structure(err: torch.Tensor, w: torch.Tensor, *, prev: torch.Tensor | None = None,
                    running: torch.Tensor | None = None, k: int = N_SINGULAR) -> dict:
    """Structure of a weight-gradient error ``err`` against the weight ``w`` (both (H, D, C) or
    (R, C)): unprefixed metric names (``sv1``.., ``rank1_frac``, ``norm``, ``cos_prev``,
    ``cos_sum``, ``align_top``, ``top_push`` and per head ``norm/H<h>``, ...) plus
    ``spectrum`` (all singular values, a list). A zero error gives zeros."""
    e3 = err.to(torch.float64)
    w3 = w.detach().to(torch.float64)
    if e3.dim() == 2:
        e3, w3 = e3.unsqueeze(0), w3.unsqueeze(0)
    e = e3.reshape(-1, e3.shape[-1])
    wm = w3.reshape(-1, w3.shape[-1])
    out: dict = {}
    if not bool(torch.isfinite(e).all()):
        out["norm"] = float("nan")
        return out
    sv = torch.linalg.svdvals(e)
    total = float((sv * sv).sum())
    norm = math.sqrt(total)
    for i in range(k):
        out[f"sv{i + 1}"] = float(sv[i]) if i < sv.numel() else 0.0
    out["spectrum"] = sv.tolist()
    out["norm"] = norm
    out["rank1_frac"] = float(sv[0] ** 2) / total if total > 0 else 0.0
    if prev is not None:
        out["cos_prev"] = _cos(e, prev.to(device=e.device, dtype=torch.float64))
    if running is not None:
        out["cos_sum"] = _cos(e, running.to(device=e.device, dtype=torch.float64))

    def top_pair(m):
        u, _, vh = torch.linalg.svd(m, full_matrices=False)
        return u[:, 0], vh[0]

    u1, v1 = top_pair(wm)
    a = float(u1 @ e @ v1)
    out["align_top"] = abs(a) / norm if norm > 0 else 0.0
    out["top_push"] = -a / norm if norm > 0 else 0.0
    for h in range(e3.shape[0]):
        eh = e3[h]
        nh = float(eh.norm())
        uh, vh1 = top_pair(w3[h])
        ah = float(uh @ eh @ vh1)
        out[f"norm/H{h}"] = nh
        out[f"align_top/H{h}"] = abs(ah) / nh if nh > 0 else 0.0
        out[f"top_push/H{h}"] = -ah / nh if nh > 0 else 0.0
    return out


def gradient_error_metrics(sh: Shadow, cap: LayerCapture, *, state: ProbeState | None = None,
                           details: dict | None = None) -> dict:
    """Structure of dW_Q(policy attention) - dW_Q(fp64 attention) (empty without dq / x / w_q)."""
    if sh.dq_lp is None or cap.x is None or cap.w_q is None:
        return {}
    layer = sh.layer
    both = map_dq_to_wq(torch.stack((sh.dq_lp - sh.dq_hp, sh.dq_hp)), cap.x, cap.w_q, cap.q_ln)
    err, full = both[0], both[1]                                               # (H, D, C) each
    prev = running = None
    if state is not None:
        prev, running = state.grad_err_prev.get(layer), state.grad_err_sum.get(layer)
    st = error_structure(err, cap.w_q, prev=prev, running=running)
    out = {}
    for name, value in st.items():
        if name == "spectrum":
            continue
        head = None
        if "/H" in name:
            name, h = name.split("/H")
            head = int(h)
        out[keys.wq_err(name).key(layer, head)] = value
    fn = float(full.norm())
    out[keys.WQ_ERR_REL.key(layer)] = st["norm"] / fn if fn > 0 else 0.0
    if details is not None and "spectrum" in st:
        details["wq_err_spectrum"] = st["spectrum"]
    if state is not None and bool(torch.isfinite(err).all()):
        e2 = err.reshape(-1, err.shape[-1]).to(torch.float32).cpu()
        state.grad_err_prev[layer] = e2
        old = state.grad_err_sum.get(layer)
        state.grad_err_sum[layer] = e2.clone() if old is None or old.shape != e2.shape else old + e2
        state.grad_err_count[layer] = state.grad_err_count.get(layer, 0) + 1
    return out


# --------------------------------------------------------------------------------------------
# all probes of a layer / of a model

def probe_layer(cap: LayerCapture, *, state: ProbeState | None = None, precision=None, stabilizer=None,
                grad: bool = True, details: dict | None = None) -> dict:
    """attention_metrics + numerics_metrics + census_metrics + gradient_error_metrics of one captured layer."""
    sh = shadow(cap, precision=precision, stabilizer=stabilizer, grad=grad)
    out = attention_metrics(sh)
    out.update(numerics_metrics(sh, state=state, details=details))
    out.update(census_metrics(sh))
    if grad:
        out.update(gradient_error_metrics(sh, cap, state=state, details=details))
    return out


def run_probes(model, captures: dict[int, LayerCapture], *, state: ProbeState | None = None,
               step: int | None = None, grad: bool = True, precision=None, stabilizer=None,
               details: dict | None = None) -> dict:
    """Every probe on ``model`` and the captured layers; updates ``state`` (if given).

    ``details`` (optional dict) receives per-layer arrays that do not fit a metrics record:
    ``details[layer]["o_err_bias_per_feature"]`` (H x D) and ``["wq_err_spectrum"]``."""
    layers = sorted(captures)
    out = weight_probe(model, layers, step=step, state=state)
    for layer in layers:
        d = None
        if details is not None:
            d = details.setdefault(layer, {})
        out.update(probe_layer(captures[layer], state=state, precision=precision, stabilizer=stabilizer,
                               grad=grad, details=d))
    if state is not None and step is not None:
        state.step = step
    return out
