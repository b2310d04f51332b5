"""Precision policies: the numeric format of every intermediate of flash attention.

A ``PrecisionPolicy`` names, for each value the FA2 algorithm produces, the format it is
stored in. The attention in ``flashguard.attention.flash`` rounds each intermediate to its
field's format right where the algorithm produces it. Formats torch can compute in (fp64,
fp32, bf16, fp16) are computed natively - an op on bf16 tensors rounds once, exactly as a
kernel storing a bf16 result does. Every other format (fp8, any ExMy) is held in fp32 and
rounded with ``round_to`` after each op.

Presets (``get_policy(name)``):

* ``fp32``   every intermediate fp32: the high-precision baseline of every experiment.
* ``paper``  the arithmetic of the study's reference code (pure-PyTorch FA2, everything a
             bf16 tensor, bf16 running O / m / l, bf16 dq/dk/dv accumulators, 1e-10 floor
             on tile row sums, every key tile visited).
* ``fa2``    production kernels: fp32 scores, statistics and accumulators, Pbar rounded to
             bf16 only as the PV matmul operand, O rounded to bf16 once.
* ``fa2-fp16``, ``fa2-e4m3``, ``fa2-e5m2``: the same structure with that input / Pbar format.
* ``torch-cpu`` PyTorch's fused CPU flash kernel (what ``scaled_dot_product_attention`` runs on
             bf16 CPU tensors): ``fa2``'s structure with the kernel's fast exponential
             (``exp="fexp_u20"``, numerics.fast_exp), whose value at 0 is 1 - 5.3e-5, summed
             unrounded into l while P̄ rounds to 1 for P̄·V, and O = acc * (1 / l). Pinned against
             the kernel by tests/attention/test_torch_cpu.py (docs/audit/torch-cpu.md: what
             matches bit for bit, and the one step that does not).
* ``fa2-cuda``, ``torch-flash-cuda``, ``fa3-cuda``, ``mem-efficient``, ``cudnn``: the production GPU kernels
             (flash-attention's FA2 and FA3, PyTorch's FA2 build, PyTorch's memory-efficient kernel,
             cuDNN as far as documented), modelled from their source, step by step
             (docs/kernels.md); unvalidated on a GPU. ``GPU_PRESETS`` lists them.
* ``paper-fp32fwd``  the reference arithmetic with its forward raised to fp32 except the Pbar
             operand: scores, the PV product, the running O and the statistics m, l, lse
             (inputs, Pbar, the output and the whole backward stay bf16). The cheapest change the lab measured to bring the
             reference arithmetic's tie bias to the noise floor; no shift of m does it
             (docs/lab/lab.md: with a bf16 PV sum and row sum, every stabilizer leaves a lean).
* ``fa2-e4m3-pscaled``, ``fa2-e5m2-pscaled``  the fp8 arithmetics' fix: Pbar in e4m3, scaled
             into its range before its rounding (``pbar_scale=8``), and the row sum taken from
             that rounded Pbar (``row_sum_rounded``). The plain e4m3 rounding flushes small
             probabilities to zero in the numerator only, and e5m2's two mantissa bits leave a
             lean whatever the scale; on real inputs both lean O.

The study's backward ablations are single fields: ``delta_source`` ("o_lowp": delta from
the stored low-precision O; "o_highp": from an fp32 copy of O accumulated beside it;
"dp_p": delta = rowsum(dP * P)), and ``pv`` = fp32 for the PV product.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .fast_exp import EXP_IMPLEMENTATIONS
from .formats import FloatFormat, get_format
from .gpu_exp import EXP2_IMPLEMENTATIONS

__all__ = ["PrecisionPolicy", "POLICIES", "get_policy", "DELTA_SOURCES", "EXPS", "DS_SCALES", "GPU_PRESETS",
           "largest_pbar_scale"]

DELTA_SOURCES = ("o_lowp", "o_highp", "dp_p")
_MASKED_SCORES = ("inf", "finite")
_NORMALIZE = ("divide", "reciprocal")
# the forward's exponential: exact, torch's CPU fast exp, or a GPU kernel's exp2 form (numerics.gpu_exp)
EXPS = EXP_IMPLEMENTATIONS + EXP2_IMPLEMENTATIONS
# where the backward applies the softmax scale: into dS before its rounding, or to the fp32 dQ / dK at the end
DS_SCALES = ("operand", "accumulator")

_FORMAT_FIELDS = (
    "inputs", "scores", "stats", "pbar", "pv", "o_accum", "output", "lse",
    "p", "dp", "ds", "delta_product", "delta", "grad_partial", "grad_accum",
)


@dataclass(frozen=True)
class PrecisionPolicy:
    """Format of each attention intermediate. Strings are accepted and resolved to formats.

    Forward, per (query tile, key tile):
      S = round_scores(round_scores(q k^T) * scale)          ``scores``
      m_new = max(m, stabilizer shift)                        ``stats``
      Pbar = exp(S - m_new) computed in ``scores`` (by ``exp``), rounded to ``pbar`` for the PV matmul
             (as Pbar * 2^pbar_scale: see below)
      l = f*l + rowsum(Pbar)  (rounded or unrounded Pbar:    ``row_sum_rounded``), ``stats``
      PV = Pbar @ v                                           ``pv``
      O = O*f + PV                                            ``o_accum``
      final O = O / l (``normalize``: or O * (1 / l))          ``output``; lse = log l + m: ``lse``
    Backward, per tile pair (dO is rounded to ``inputs``):
      P = exp(S - lse)                                        ``p``
      dV += P^T dO   (P enters as ``pbar``, scaled alike; product ``grad_partial``, sum ``grad_accum``)
      dP = dO v^T                                             ``dp``
      delta = rowsum(dO * O)   (product ``delta_product``, sum ``delta``; see delta_source)
      dS = (P*scale) * (dP - delta)                           ``ds`` (computed in ``p``'s
                                                               format when that is wider)
      dQ += dS k, dK += dS^T q  (dS enters as ``ds``)         ``grad_partial``, ``grad_accum``
      (``ds_scale="accumulator"``: dS = P * (dP - delta), and the finished dQ, dK times scale)

    ``exp`` names how the forward computes Pbar: "exact" (exp(S - m) in the scores format),
    "fexp_u20" (torch's CPU kernel, numerics.fast_exp), or a GPU kernel's exp2 form
    (numerics.gpu_exp; each also fixes that kernel's rescale factor, its lse formula and, for the
    FA2 / FA3 forms, the backward's recomputation of P): "exp2_fma" (FA2 / FA3 as flash-attention
    builds them: exp2(fma(r, c, -fp32(m c))) on the raw scores r with c = fp32(scale log2 e)),
    "exp2_unfused" (FA2 as PyTorch builds it, UNFUSE_FMA: exp2(fp32(r c) - fp32(m c))) and
    "exp2_log2e" (torch's memory-efficient kernel: exp2(fp32(S log2 e) - max)). Every form other
    than "exact" is an fp32 routine (``scores="fp32"``) and the GPU forms mask with -inf
    (``masked_scores="inf"``). The GPU's approximate exp2 / log / reciprocal are modelled as
    correctly rounded (docs/kernels.md).

    ``pbar_scale`` = s: Pbar is rounded to ``pbar`` as Pbar * 2^s and the matmul's result taken
    back by 2^-s (exact: a power of two): P scaled into the format's range. Every
    Pbar is <= 1, so in e4m3 (smallest subnormal 2^-9) an unscaled Pbar below 2^-10 is flushed to
    zero: the tail of every row loses its weight one-sidedly, which leans O on real inputs
    (docs/lab/captured.md). ``2^s`` must stay below the format's largest finite value: at most 8
    for e4m3 (448), 15 for e5m2 (57344); 0 (the default) is the plain rounding.
    """

    name: str = "custom"
    # forward
    inputs: FloatFormat | str = "bf16"
    scores: FloatFormat | str = "fp32"
    stats: FloatFormat | str = "fp32"
    pbar: FloatFormat | str = "bf16"
    pv: FloatFormat | str = "fp32"
    o_accum: FloatFormat | str = "fp32"
    output: FloatFormat | str = "bf16"
    lse: FloatFormat | str = "fp32"
    row_sum_rounded: bool = False      # l sums Pbar after rounding to ``pbar`` (fix of FA PR #2721)
    pbar_scale: int = 0                # Pbar rounded to ``pbar`` as Pbar * 2^pbar_scale (into fp8's range)
    row_sum_floor: float | None = None  # clamp each tile's row sum from below (reference: 1e-10)
    visit_masked_tiles: bool = False   # also process key tiles the causal mask hides completely
    masked_scores: str = "inf"         # forward value of masked scores: -inf or -max finite
    rounding: str = "nearest"          # emulated formats: "nearest" or "stochastic" (native: nearest)
    exp: str = "exact"                 # the forward's exp(S - m): "exact", "fexp_u20" (torch's CPU kernel), or a
    #                                    GPU kernel's exp2 form ("exp2_fma", "exp2_unfused", "exp2_log2e")
    normalize: str = "divide"          # final O = acc / l ("divide") or acc * (1 / l) ("reciprocal")
    # backward
    p: FloatFormat | str = "fp32"
    dp: FloatFormat | str = "fp32"
    ds: FloatFormat | str = "bf16"
    delta_product: FloatFormat | str = "fp32"
    delta: FloatFormat | str = "fp32"
    delta_source: str = "o_lowp"
    grad_partial: FloatFormat | str = "fp32"
    grad_accum: FloatFormat | str = "fp32"
    ds_scale: str = "operand"          # softmax scale into dS before its rounding, or on the finished dQ / dK

    def __post_init__(self):
        for f in _FORMAT_FIELDS:
            value = getattr(self, f)
            try:
                object.__setattr__(self, f, get_format(value))
            except (ValueError, TypeError) as e:
                raise ValueError(f"PrecisionPolicy.{f}: {e}") from None
        if self.delta_source not in DELTA_SOURCES:
            raise ValueError(
                f"PrecisionPolicy.delta_source must be one of {DELTA_SOURCES}, got {self.delta_source!r}")
        if self.rounding not in ("nearest", "stochastic"):
            raise ValueError(f"PrecisionPolicy.rounding must be 'nearest' or 'stochastic', got {self.rounding!r}")
        if self.exp not in EXPS:
            raise ValueError(f"PrecisionPolicy.exp must be one of {EXPS}, got {self.exp!r}")
        if self.exp != "exact" and self.scores.name != "fp32":
            raise ValueError(f"PrecisionPolicy.exp={self.exp!r} is an fp32 routine: it needs scores='fp32', "
                             f"got scores={self.scores.name!r}")
        if self.exp in EXP2_IMPLEMENTATIONS and self.masked_scores != "inf":
            raise ValueError(f"PrecisionPolicy.exp={self.exp!r} models a GPU kernel, which masks scores with -inf: "
                             f"it needs masked_scores='inf', got {self.masked_scores!r}")
        if self.ds_scale not in DS_SCALES:
            raise ValueError(f"PrecisionPolicy.ds_scale must be one of {DS_SCALES}, got {self.ds_scale!r}")
        if self.normalize not in _NORMALIZE:
            raise ValueError(f"PrecisionPolicy.normalize must be one of {_NORMALIZE}, got {self.normalize!r}")
        if self.masked_scores not in _MASKED_SCORES:
            raise ValueError(
                f"PrecisionPolicy.masked_scores must be one of {_MASKED_SCORES}, got {self.masked_scores!r}")
        if isinstance(self.pbar_scale, bool) or not isinstance(self.pbar_scale, int) or self.pbar_scale < 0:
            raise ValueError(f"PrecisionPolicy.pbar_scale must be an int >= 0, got {self.pbar_scale!r}")
        if self.pbar_scale and self.pbar_scale > largest_pbar_scale(self.pbar):
            raise ValueError(
                f"PrecisionPolicy.pbar_scale={self.pbar_scale}: 2^{self.pbar_scale} times a Pbar of 1 overflows "
                f"pbar={self.pbar.name} (largest finite {self.pbar.max_finite:g}); at most "
                f"{largest_pbar_scale(self.pbar)}")
        if self.row_sum_floor is not None and not self.row_sum_floor > 0:
            raise ValueError(f"PrecisionPolicy.row_sum_floor must be > 0 or None, got {self.row_sum_floor!r}")

    def replace(self, **changes) -> "PrecisionPolicy":
        """A copy with some fields changed (named ``<name>+custom`` unless ``name`` is given)."""
        if "name" not in changes:
            changes["name"] = self.name if self.name.endswith("+custom") else f"{self.name}+custom"
        return dataclasses.replace(self, **changes)

    def short_str(self) -> str:
        """Compact description for run names: the name plus the fields that differ from it."""
        base = POLICIES.get(self.name.removesuffix("+custom"))
        if base is None:
            base = PrecisionPolicy()
        diffs = []
        for f in dataclasses.fields(self):
            if f.name == "name":
                continue
            a, b = getattr(self, f.name), getattr(base, f.name)
            if a != b:
                diffs.append(f"{f.name}={a}")
        return self.name.removesuffix("+custom") + ("[" + ",".join(diffs) + "]" if diffs else "")

    def to_dict(self) -> dict:
        return {f.name: (str(v) if isinstance(v := getattr(self, f.name), FloatFormat) else v)
                for f in dataclasses.fields(self)}


def largest_pbar_scale(fmt: FloatFormat) -> int:
    """The largest s with 2^s below ``fmt``'s largest finite value: Pbar <= 1 scaled by 2^s
    stays finite (e4m3: 8, e5m2: 15, fp16: 15, bf16: 127)."""
    mant, exp = math.frexp(fmt.max_finite)  # max_finite = mant * 2^exp, mant in [1/2, 1)
    return exp - 1 if mant > 0.5 else exp - 2


def _fa2(name: str, fmt: str) -> PrecisionPolicy:
    # Production FlashAttention-2: inputs and the Pbar / dS matmul operands in the low format,
    # everything else fp32; O rounded once at the end (to the input format, as kernels return).
    out = fmt if fmt in ("bf16", "fp16") else "bf16"
    return PrecisionPolicy(name=name, inputs=fmt, pbar=fmt, ds=fmt, output=out)


POLICIES: dict[str, PrecisionPolicy] = {
    "fp32": PrecisionPolicy(
        name="fp32", inputs="fp32", scores="fp32", stats="fp32", pbar="fp32", pv="fp32",
        o_accum="fp32", output="fp32", lse="fp32", p="fp32", dp="fp32", ds="fp32",
        delta_product="fp32", delta="fp32", grad_partial="fp32", grad_accum="fp32"),
    # every intermediate fp64: for gradcheck and exactness tests, not for speed
    "fp64": PrecisionPolicy(
        name="fp64", inputs="fp64", scores="fp64", stats="fp64", pbar="fp64", pv="fp64",
        o_accum="fp64", output="fp64", lse="fp64", p="fp64", dp="fp64", ds="fp64",
        delta_product="fp64", delta="fp64", grad_partial="fp64", grad_accum="fp64"),
    "paper": PrecisionPolicy(
        name="paper", inputs="bf16", scores="bf16", stats="bf16", pbar="bf16", pv="bf16",
        o_accum="bf16", output="bf16", lse="bf16", row_sum_rounded=True, row_sum_floor=1e-10,
        visit_masked_tiles=True, masked_scores="finite", p="bf16", dp="bf16", ds="bf16",
        delta_product="bf16", delta="bf16", grad_partial="bf16", grad_accum="bf16"),
    "fa2": _fa2("fa2", "bf16"),
    "fa2-fp16": _fa2("fa2-fp16", "fp16"),
    "fa2-e4m3": _fa2("fa2-e4m3", "e4m3"),
    "fa2-e5m2": _fa2("fa2-e5m2", "e5m2"),
}
# The fp8 arithmetics' fix (docs/lab/lab.md, captured.md): Pbar in e4m3 scaled into its range (x 2^8),
# so that small probabilities keep their weight, and the row sum taken from that same rounded Pbar
# (FA PR #2721), so that numerator and denominator weigh every key alike. With e5m2 inputs Pbar is
# e4m3 as well: e5m2's range needs no scale, but its two mantissa bits leave O leaning on real inputs
# (a noisy denominator is a biased one) with the row sum consistent and the scale or not.
for _fp8 in ("e4m3", "e5m2"):
    POLICIES[f"fa2-{_fp8}-pscaled"] = POLICIES[f"fa2-{_fp8}"].replace(
        name=f"fa2-{_fp8}-pscaled", pbar="e4m3", row_sum_rounded=True, pbar_scale=largest_pbar_scale(get_format("e4m3")))
# PyTorch's fused CPU flash kernel (ATen FlashAttentionKernel.cpp): fa2's structure, with the fast
# exponential on each key tile's vectorised columns (exact exp on the last n % 16 with AVX-512, n % 8 with
# AVX2: numerics.fast_exp.fexp_lanes) and O = acc * (1/l).
# Its key tile is 512 wide (the default block); its query split (32 / 64 / 256 rows) does not change
# a row's arithmetic.
POLICIES["torch-cpu"] = POLICIES["fa2"].replace(name="torch-cpu", exp="fexp_u20", normalize="reciprocal")
# The production GPU kernels, modelled from their source (docs/kernels.md maps every step to the file and
# line it models; none is validated on a GPU yet). All keep fa2's formats: fp32 scores, statistics and
# accumulators, the row sum from the unrounded P̄, P̄ rounded to bf16 for P̄·V, O = acc * (1 / l) rounded
# once, delta from the bf16 O in fp32. They differ in the exponent's form (numerics.gpu_exp) and in
# where the backward applies the softmax scale.
GPU_PRESETS = ("fa2-cuda", "torch-flash-cuda", "fa3-cuda", "mem-efficient", "cudnn")
# FlashAttention-2 as flash-attention builds it (flash_attn.flash_attn_func): exp2 through one FMA on the
# raw scores; dS = P (dP - delta), the scale on the finished fp32 dQ / dK
POLICIES["fa2-cuda"] = POLICIES["fa2"].replace(name="fa2-cuda", exp="exp2_fma", normalize="reciprocal",
                                               ds_scale="accumulator")
# the same kernel as PyTorch builds it for SDPA's FLASH_ATTENTION backend: UNFUSE_FMA (a rounded product,
# then the subtraction)
POLICIES["torch-flash-cuda"] = POLICIES["fa2-cuda"].replace(name="torch-flash-cuda", exp="exp2_unfused")
# FlashAttention-3 (Hopper, bf16): fa2-cuda's steps (its own tile sizes and lse factor are not fields)
POLICIES["fa3-cuda"] = POLICIES["fa2-cuda"].replace(name="fa3-cuda")
# torch's memory-efficient kernel (SDPA's EFFICIENT_ATTENTION): scores scaled first, exp2 of the
# log2(e)-scaled scores minus their max; dS scaled before its bf16 rounding (the operand form)
POLICIES["mem-efficient"] = POLICIES["fa2"].replace(name="mem-efficient", exp="exp2_log2e", normalize="reciprocal")
# cuDNN's SDPA (CUDNN_ATTENTION): documented only as the FlashAttention-2 algorithm with an fp32 compute
# type, bf16 inputs and output, and fp32 softmax stats; no step beyond fa2's is documented
POLICIES["cudnn"] = POLICIES["fa2"].replace(name="cudnn")
# lse is a statistic too: in bf16 a fully masked row's lse (log of the 1e-10 floor + m = -fp32 max)
# overflows to -inf and the backward's exp(S - lse) becomes NaN (found by tests/attention/test_fuzz.py)
POLICIES["paper-fp32fwd"] = POLICIES["paper"].replace(name="paper-fp32fwd", scores="fp32", pv="fp32", o_accum="fp32",
                                                   stats="fp32", lse="fp32")


_BOOL_FIELDS = ("row_sum_rounded", "visit_masked_tiles")


def _parse_field(name: str, text: str):
    if name in _BOOL_FIELDS:
        if text.lower() not in ("true", "false"):
            raise ValueError(f"PrecisionPolicy.{name} must be true or false, got {text!r}")
        return text.lower() == "true"
    if name == "pbar_scale":
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"PrecisionPolicy.pbar_scale must be an integer, got {text!r}") from None
    if name == "row_sum_floor":
        if text.lower() == "none":
            return None
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"PrecisionPolicy.row_sum_floor must be a number or none, got {text!r}") from None
    return text


def get_policy(policy: "PrecisionPolicy | str") -> PrecisionPolicy:
    """Resolve a preset name, or a preset with changed fields written as ``short_str`` writes
    them - ``"paper[pv=e8m4,o_accum=e8m4,rounding=stochastic]"`` - or pass a policy through."""
    if isinstance(policy, PrecisionPolicy):
        return policy
    if isinstance(policy, str) and policy in POLICIES:
        return POLICIES[policy]
    if isinstance(policy, str) and policy.endswith("]") and "[" in policy:
        base, _, body = policy[:-1].partition("[")
        if base in POLICIES:
            fields = {f.name for f in dataclasses.fields(PrecisionPolicy)} - {"name"}
            changes = {}
            for item in filter(None, (x.strip() for x in body.split(","))):
                key, eq, value = item.partition("=")
                key = key.strip()
                if not eq or key not in fields:
                    # worded for a config key's value as much as for a Python argument: no class names
                    raise ValueError(f"precision {policy!r}: {item!r} is not field=value with a policy "
                                     f"field ({', '.join(sorted(fields))})")
                changes[key] = _parse_field(key, value.strip())
            return POLICIES[base].replace(**changes)
    raise ValueError(f"unknown precision policy {policy!r}; presets: {', '.join(POLICIES)}"
                     " (or a preset with changed fields, 'preset[field=value,...]', e.g. 'paper[pv=fp32]')")
