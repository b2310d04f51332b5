"""The one measurement: an attention arithmetic on q, k, v (and dO) against fp64 on the same inputs.

Everything flashguard says about rounding error rests on this function. The lab, the
diagnostics probes and the kernel audit call it; none of them computes its own reference.

    from flashguard.attention.trace import Arithmetic, trace
    t = trace(q, k, v, do, Arithmetic.of("paper", "safe"))
    t.o_err          # (B, H, T_q, D_v) O - O_fp64, fp64
    t.delta_err      # (B, H, T_q)      delta - delta_fp64
    t.dq_err         # (B, H, T_q, D)   dQ - dQ_fp64 (and dk_err, dv_err)
    t.ties.tied      # (B, H, T_q)      key tiles whose row maximum is tied (the stabilizer's rule)

What is compared. The arithmetic first rounds q, k, v and dO to its input format; the
reference is ``reference_attention`` in fp64 *on those rounded values*, with autograd for
dQ, dK, dV, so the error is the arithmetic's own, not the input rounding's. delta_fp64 =
rowsum(dO * O_fp64).

The subject is either an ``Arithmetic`` (``FlashOptions`` - a precision policy, a stabilizer,
tile sizes, a soft-cap - and the kernel that runs them, run through ``options.run_forward`` as
flash_attention runs them: every intermediate is visible, delta is the one the backward pass
uses, ties are counted per visited tile) or any attention callable ``fn(q, k, v) -> o``
treated as a black box: q, k, v are passed in the dtype given, gradients come from its
autograd, and delta is taken as production kernels take it, rowsum(dO * O) in fp32 from the
stored O (``Trace.delta_source`` says which).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..numerics.arith import cast
from ..numerics.policy import PrecisionPolicy, get_policy
from .flash import delta_preprocess
from .options import (DEFAULT_BLOCK, DEFAULT_PRECISION, DEFAULT_STABILIZER, FlashOptions, arithmetic_context,
                      cast_inputs, flash_options, run_backward, run_forward, split_mask)
from .reference import reference_attention
from .stabilizers import Stabilizer, count_true

__all__ = ["Arithmetic", "Trace", "TieCounts", "trace", "floor_arithmetic", "ARITH_KERNELS"]

# the kernels an Arithmetic runs on: flash_attention's KERNELS resolved ("auto" is a choice per call)
ARITH_KERNELS = ("pytorch", "triton")
# rows of the fp64 reference computed at once: bounds its (rows x T_k) score and probability
# matrices and their autograd buffers to a few hundred MB
_REF_CHUNK_ENTRIES = 1 << 24


@dataclass(frozen=True)
class Arithmetic:
    """A flash-attention arithmetic: ``FlashOptions`` on one kernel, ``pytorch`` or ``triton``.

    Made from options (``Arithmetic(options)``) or from a precision and a stabilizer
    (``Arithmetic.of("paper", "safe", block_q=64)``). Options whose kernel is ``auto`` are
    measured on the PyTorch kernel, the one whose every intermediate trace sees (``auto`` is
    flash_attention's choice per call), and its unset tiles are DEFAULT_BLOCK; on Triton unset
    tiles are the kernels' own. ``precision``, ``stabilizer``, ``block_q``, ``block_k``,
    ``kernel`` and ``softcap`` read the options."""

    options: FlashOptions

    def __post_init__(self):
        opts = self.options
        if not isinstance(opts, FlashOptions):
            raise TypeError(f"Arithmetic(options) takes a FlashOptions, got {type(opts).__name__} "
                            "(Arithmetic.of(precision, stabilizer, ...) makes one from names)")
        if opts.kernel == "auto":
            opts = opts.replace(kernel="pytorch")
        if opts.kernel == "pytorch" and (opts.block_q is None or opts.block_k is None):
            opts = opts.replace(block_q=opts.tiles()[0], block_k=opts.tiles()[1])
        object.__setattr__(self, "options", opts)

    @classmethod
    def of(cls, precision: "str | PrecisionPolicy" = DEFAULT_PRECISION,
           stabilizer: "str | Stabilizer" = DEFAULT_STABILIZER, **fields) -> "Arithmetic":
        """``Arithmetic`` from a precision (a preset name or PrecisionPolicy) and a stabilizer (a
        name or Stabilizer); ``fields``: the other FlashOptions (block_q, block_k, kernel, softcap)."""
        return cls(flash_options(None, {"precision": precision, "stabilizer": stabilizer, **fields},
                                 where="Arithmetic.of()"))

    def replace(self, **fields) -> "Arithmetic":
        """This arithmetic with some options changed (``kernel="pytorch"``, ...)."""
        return Arithmetic(self.options.replace(**fields))

    @property
    def precision(self) -> PrecisionPolicy:
        return self.options.precision

    @property
    def stabilizer(self) -> Stabilizer:
        return self.options.stabilizer

    @property
    def block_q(self) -> int | None:
        return self.options.block_q

    @property
    def block_k(self) -> int | None:
        return self.options.block_k

    @property
    def kernel(self) -> str:
        return self.options.kernel

    @property
    def softcap(self) -> float | None:
        return self.options.softcap

    def label(self) -> str:
        tiles = "" if {self.block_q, self.block_k} <= {None, DEFAULT_BLOCK} else f" {self.block_q}x{self.block_k}"
        kernel = "" if self.kernel == "pytorch" else f" [{self.kernel}]"
        cap = "" if self.softcap is None else f" softcap={self.softcap:g}"
        return f"{self.precision.short_str()} / {self.stabilizer}{tiles}{cap}{kernel}"


def floor_arithmetic(precision: "PrecisionPolicy | str") -> Arithmetic:
    """The noise floor of ``precision``: every intermediate fp32, the same input and output formats.
    Its error is the rounding of O (and of the gradients) to the output format and nothing
    else, so a bias above it belongs to the arithmetic."""
    p = get_policy(precision)
    fp32 = get_policy("fp32")
    return Arithmetic.of(fp32.replace(name="floor", inputs=p.inputs, output=p.output))


@dataclass
class TieCounts:
    """Per row (B, H, T_q), summed over the key tiles the arithmetic visited (tiles the causal
    mask hides completely are not counted)."""

    tiles: torch.Tensor      # visited tiles in which the row has a visible key
    tied: torch.Tensor       # of those, tiles whose row maximum is tied (the stabilizer's tie rule)
    entries: torch.Tensor    # visible Pbar entries
    pbar_one: torch.Tensor   # of those, exactly 1
    multi_one: torch.Tensor  # tiles with >= 2 visible Pbar == 1 (several V rows enter PV exactly)


def _error(name: str) -> property:
    """A Trace's error in ``name``: ``name`` - ``name``_ref, None where either is None."""
    def error(self):
        a, b = getattr(self, name), getattr(self, f"{name}_ref")
        return None if a is None or b is None else a - b
    return property(error, doc=f"{name} - {name}_ref (None where either is None)")


@dataclass
class Trace:
    """An arithmetic's results and the fp64 reference's, all fp64 (see the module docstring)."""

    label: str
    o: torch.Tensor                       # (B, H, T_q, D_v)
    o_ref: torch.Tensor
    lse: torch.Tensor | None = None       # (B, H, T_q); None for a black box
    lse_ref: torch.Tensor | None = None
    delta: torch.Tensor | None = None     # (B, H, T_q); None without dO
    delta_ref: torch.Tensor | None = None
    delta_source: str | None = None       # the policy's delta_source, or "o_lowp" for a black box
    dq: torch.Tensor | None = None        # gradients; None without dO or with grads=False
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None
    dq_ref: torch.Tensor | None = None
    dk_ref: torch.Tensor | None = None
    dv_ref: torch.Tensor | None = None
    ties: TieCounts | None = None         # None for a black box
    inputs: tuple | None = None           # (q, k, v, dO) as the arithmetic received them (rounded)
    s_ref: torch.Tensor | None = None     # (B, H, T_q, T_k) fp64 scores of the reference (trace(scores=True))

    @property
    def o_err(self):
        return self.o - self.o_ref

    lse_err = _error("lse")
    delta_err = _error("delta")
    dq_err = _error("dq")
    dk_err = _error("dk")
    dv_err = _error("dv")


class _TieCounter:
    """``observe`` callback of flash_forward: per-row tie and Pbar == 1 counts."""

    def __init__(self, shape, causal: bool, policy: PrecisionPolicy, stabilizer: Stabilizer, device):
        self.causal, self.policy, self.stabilizer = causal, policy, stabilizer
        z = lambda: torch.zeros(shape, dtype=torch.float64, device=device)  # noqa: E731
        self.counts = TieCounts(z(), z(), z(), z(), z())

    def __call__(self, tile, *, s, hidden, row_max, m_new, pbar, pv):
        q0, q1, k0, k1 = tile
        if self.causal and k0 > q1 - 1:
            return  # hidden from every query of the tile (visited by the reference arithmetic only)
        c = self.counts
        tied = self.stabilizer.tied(s, row_max, self.policy).squeeze(-1)     # (B, H, n)
        one = pbar == 1
        if hidden is None:
            vis_rows = torch.ones_like(tied)
            entries = torch.full(tied.shape, float(s.shape[-1]), dtype=torch.float64, device=s.device)
        else:
            # counted on the mask as small as it comes (the causal one is (n, bk)), then broadcast
            vis = ~hidden
            one = one & vis
            vis_rows = vis.any(dim=-1).expand(tied.shape)
            entries = count_true(vis.contiguous()).squeeze(-1).to(torch.float64).expand(tied.shape)
            # a row with nothing visible has no maximum to repeat (its fill values are all equal)
            tied = tied & vis_rows
        n_one = count_true(one.contiguous()).squeeze(-1)
        rows = slice(q0, q1)
        c.tiles[..., rows] += vis_rows
        c.tied[..., rows] += tied
        c.entries[..., rows] += entries
        c.pbar_one[..., rows] += n_one
        c.multi_one[..., rows] += n_one >= 2


class _Both:
    """Two ``observe`` callbacks of one forward, called in order with the same tile."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __call__(self, tile, **values):
        self.first(tile, **values)
        self.second(tile, **values)


_GRADS = {True: ("dq", "dk", "dv"), "dq": ("dq",), False: ()}


def _wanted_grads(grads) -> tuple:
    """The gradients ``grads`` asks for: True all three, "dq" dQ only, False none."""
    try:
        return _GRADS[grads]
    except (KeyError, TypeError):
        raise ValueError(f"trace: grads must be True, False or 'dq', got {grads!r}") from None


def _reference(q, k, v, do, *, attn_mask, causal, scale, softcap, grads, scores=False):
    """fp64 O, lse, delta and (with grads) dQ, dK, dV of reference_attention (only dQ for
    grads="dq"), chunked over the batch so that the score matrices stay bounded; with ``scores``
    also the fp64 scores (B, H, T_q, T_k)."""
    B = q.shape[0]
    per_batch = max(1, q[0].numel() // q.shape[-1] * k.shape[-2])
    step = max(1, _REF_CHUNK_ENTRIES // per_batch)
    outs = {n: [] for n in ("o", "lse", "delta", "dq", "dk", "dv", "s")}
    wanted = _wanted_grads(grads)
    for b0 in range(0, B, step):
        sl = slice(b0, b0 + step)
        # only the leaves whose gradient is wanted require one: autograd then skips the others'
        # products (dK = dS^T Q and dV = P^T dO for grads="dq")
        leaves = [t[sl].detach().to(torch.float64).requires_grad_(n in wanted)
                  for n, t in zip(("dq", "dk", "dv"), (q, k, v))]
        mask = None
        if attn_mask is not None:
            mask = attn_mask if attn_mask.shape[0] == 1 else attn_mask[sl]
        with torch.enable_grad() if grads else torch.no_grad():
            o, lse, *s = reference_attention(*leaves, attn_mask=mask, is_causal=causal, scale=scale,
                                             return_lse=True, softcap=softcap, return_scores=scores)
            outs["s"] += s
            if do is not None:
                do64 = do[sl].to(torch.float64)
                outs["delta"].append((do64 * o.detach()).sum(-1))
                if wanted:
                    needed = [t for t in leaves if t.requires_grad]
                    for name, g in zip(wanted, torch.autograd.grad(o, needed, do64)):
                        outs[name].append(g)
        outs["o"].append(o.detach())
        outs["lse"].append(lse.detach())
    return {n: (torch.cat(x) if x else None) for n, x in outs.items()}


def _run_arithmetic(a: Arithmetic, q, k, v, do, *, attn_mask, causal, scale, grads, observe=None):
    opts = a.options
    policy = opts.precision
    keep, bias = split_mask(attn_mask)
    block_q, block_k = opts.tiles()
    delta_args = dict(keep=keep, bias=bias, causal=causal, scale=scale, policy=policy, block_q=block_q,
                      block_k=block_k, softcap=opts.softcap)
    with torch.no_grad():
        if a.kernel == "triton":
            if observe is not None:
                raise ValueError("trace: observe reads the PyTorch kernel's tiles; the triton kernel shows none")
            from .triton_flash import triton_flash_attention
            with arithmetic_context(policy, q.device):
                qc, kc, vc, doc = cast_inputs(policy, q.detach(), k.detach(), v.detach(),
                                              None if do is None else do.detach())
                fn = lambda q_, k_, v_: triton_flash_attention(  # noqa: E731
                    q_, k_, v_, is_causal=causal, scale=scale, stabilizer=opts.stabilizer, precision=policy,
                    attn_mask=attn_mask, softcap=opts.softcap, block_m=a.block_q, block_n=a.block_k)
                o, grads_ = _black_box(fn, qc, kc, vc, doc, grads)
                out = {"inputs": (qc, kc, vc, doc), "o": o, "dq": grads_[0], "dk": grads_[1], "dv": grads_[2],
                       "delta_source": policy.delta_source}
                if doc is not None:
                    out["delta"] = delta_preprocess(qc, kc, vc, cast(o, policy.output), None, doc, None, **delta_args)
            return out
        counter = _TieCounter(q.shape[:-1], causal, policy, opts.stabilizer, q.device)
        observers = counter if observe is None else _Both(counter, observe)
        fwd = run_forward(q.detach(), k.detach(), v.detach(), opts, keep=keep, bias=bias, causal=causal, scale=scale,
                          observe=observers, do=None if do is None else do.detach())
        out = {"inputs": (fwd.q, fwd.k, fwd.v, fwd.do), "o": fwd.o, "lse": fwd.lse.squeeze(-1), "ties": counter.counts,
               "delta_source": policy.delta_source}
        if fwd.do is not None:
            with arithmetic_context(policy, q.device):
                out["delta"] = delta_preprocess(fwd.q, fwd.k, fwd.v, fwd.o, fwd.lse, fwd.do, fwd.o_highp, **delta_args)
            if grads:
                # what training hands on: the gradients in the dtype the inputs had
                # dQ alone where that leaves its bits as they are (rounding to nearest: no draws to move)
                dq_only = grads == "dq" and policy.rounding == "nearest"
                dq, dk, dv = run_backward(fwd, fwd.do, opts, keep=keep, bias=bias, causal=causal, scale=scale,
                                          dtypes=(q.dtype, k.dtype, v.dtype), dq_only=dq_only)
                out.update(dq=dq, **({} if grads == "dq" else dict(dk=dk, dv=dv)))
    return out


def _black_box(fn, q, k, v, do, grads):
    wanted = _wanted_grads(grads) if do is not None else ()
    leaves = [t.detach().requires_grad_(n in wanted) for n, t in zip(("dq", "dk", "dv"), (q, k, v))]
    with torch.enable_grad() if wanted else torch.no_grad():
        o = fn(*leaves)
        if not isinstance(o, torch.Tensor) or o.shape[:-1] != q.shape[:-1]:
            raise ValueError(f"the attention callable must return a tensor of shape (B, H, T_q, D_v) = "
                             f"{tuple(q.shape[:-1])} + (D_v,), got {getattr(o, 'shape', type(o).__name__)}")
        g = {}
        if wanted:
            g = dict(zip(wanted, torch.autograd.grad(o, [t for t in leaves if t.requires_grad], do.to(o.dtype))))
    return o.detach(), tuple(g.get(n) for n in ("dq", "dk", "dv"))


def trace(q, k, v, do=None, arithmetic: "Arithmetic | FlashOptions | str | object" = DEFAULT_PRECISION, *,
          causal: bool = False, scale: float | None = None, attn_mask: torch.Tensor | None = None,
          softcap: float | None = None, grads: "bool | str" = True, label: str | None = None,
          observe=None, scores: bool = False) -> Trace:
    """Run ``arithmetic`` on (q, k, v) and, given ``do``, its backward; compare with fp64.

    q: (B, H, T_q, D), k: (B, H, T_k, D), v: (B, H, T_k, D_v), do: (B, H, T_q, D_v) or None.
    ``arithmetic``: an ``Arithmetic``, ``FlashOptions`` (``Arithmetic(options)``), a precision
    (a preset name or PrecisionPolicy: no stabilizer, 512-tiles) or a callable ``fn(q, k, v) -> o``
    (a black box; ``causal``, ``attn_mask``, ``scale`` and ``softcap`` are then only given to the
    reference, so the callable must apply the same ones). ``softcap``: None = the arithmetic's
    own; given, it is the arithmetic's (ValueError where the arithmetic has another).
    ``grads=False`` skips the gradients (delta is still measured given ``do``); ``grads="dq"``
    measures dQ only (the fp64 reference and a black box then skip dK and dV; a flash
    arithmetic's backward too, unless it rounds stochastically: then it computes all three, so that
    dQ's draws are those of training, and dK, dV are left out of the trace).
    ``observe``: a further ``flash_forward`` observer, called on every tile of the arithmetic's
    forward after trace's own tie counter (the census rides the same forward: one run, the same
    roundings); only an Arithmetic on the PyTorch kernel shows its tiles (ValueError otherwise).
    ``scores``: keep the reference's fp64 scores as ``Trace.s_ref`` (B, H, T_q, T_k; after scale,
    soft-cap and masks, hidden = -inf): a T_q x T_k matrix per head, so only when asked.
    """
    _wanted_grads(grads)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_floating_point():
            raise ValueError(f"trace: {name} must be a floating (B, H, T, D) tensor, got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if do is not None and (not isinstance(do, torch.Tensor) or do.shape != (*q.shape[:-1], v.shape[-1])):
        raise ValueError(f"trace: do must have shape (B, H, T_q, D_v) = {(*q.shape[:-1], v.shape[-1])}, "
                         f"got {getattr(do, 'shape', type(do).__name__)}")
    if isinstance(arithmetic, (str, PrecisionPolicy)):
        arithmetic = Arithmetic.of(arithmetic)
    elif isinstance(arithmetic, FlashOptions):
        arithmetic = Arithmetic(arithmetic)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if isinstance(arithmetic, Arithmetic):
        if softcap is None:
            softcap = arithmetic.softcap
        elif arithmetic.softcap not in (None, softcap):
            raise ValueError(f"trace: softcap={softcap!r}, but the arithmetic's is {arithmetic.softcap!r}")
        name = label or arithmetic.label()
        got = _run_arithmetic(Arithmetic(arithmetic.options.capped(softcap)), q, k, v, do, attn_mask=attn_mask,
                              causal=causal, scale=scale, grads=grads, observe=observe)
    elif callable(arithmetic):
        if observe is not None:
            raise ValueError("trace: observe reads an Arithmetic's tiles; a callable (a black box) shows none")
        o, g = _black_box(arithmetic, q, k, v, do, grads)
        got = {"o": o, "dq": g[0], "dk": g[1], "dv": g[2], "inputs": (q, k, v, do)}
        if do is not None:
            # production kernels' delta: dO and the stored O, product and sum in fp32
            got["delta"] = (do.float() * o.float()).sum(-1)
            got["delta_source"] = "o_lowp"
        name = label or getattr(arithmetic, "__name__", type(arithmetic).__name__)
    else:
        raise TypeError(f"trace: arithmetic must be an Arithmetic, a policy name or a callable, "
                        f"got {type(arithmetic).__name__}")
    qi, ki, vi, doi = got["inputs"]
    ref = _reference(qi, ki, vi, doi, attn_mask=attn_mask, causal=causal, scale=scale, softcap=softcap,
                     grads=grads if do is not None else False, scores=scores)

    def f64(x, squeeze=False):
        if x is None:
            return None
        x = x.detach().to(torch.float64)
        return x.squeeze(-1) if squeeze and x.dim() == 4 else x

    return Trace(label=name, o=f64(got["o"]), o_ref=ref["o"], lse=f64(got.get("lse")), lse_ref=ref["lse"],
                 delta=f64(got.get("delta"), squeeze=True), delta_ref=ref["delta"],
                 delta_source=got.get("delta_source"), dq=f64(got.get("dq")), dk=f64(got.get("dk")),
                 dv=f64(got.get("dv")), dq_ref=ref["dq"], dk_ref=ref["dk"], dv_ref=ref["dv"],
                 ties=got.get("ties"), inputs=got["inputs"], s_ref=ref["s"])
