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

The subject is either an ``Arithmetic`` (a precision policy, a stabilizer, tile sizes and
the kernel that runs it: every intermediate is visible, delta is the one the backward pass
uses, ties are counted per visited tile) or any attention callable ``fn(q, k, v) -> o``
treated as a black box: q, k, v are passed in the dtype given, gradients come from its
autograd, and delta is taken as production kernels take it, rowsum(dO * O) in fp32 from the
stored O (``Trace.delta_source`` says which).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch

from ..numerics.arith import cast, rounding
from ..numerics.policy import PrecisionPolicy, get_policy
from .flash import delta_preprocess, flash_backward, flash_forward
from .reference import reference_attention
from .stabilizers import Stabilizer, count_true, get_stabilizer

__all__ = ["Arithmetic", "Trace", "TieCounts", "trace", "floor_arithmetic", "ARITH_KERNELS"]

# the kernels an Arithmetic runs on: flash_attention's KERNELS resolved ("auto" is a choice per call)
ARITH_KERNELS = ("pytorch", "triton")


def __getattr__(name):  # ARITH_BACKENDS, the old name of ARITH_KERNELS
    if name == "ARITH_BACKENDS":
        warnings.warn("flashguard.attention.trace.ARITH_BACKENDS is now called ARITH_KERNELS", DeprecationWarning,
                      stacklevel=2)
        return ARITH_KERNELS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _kernel_arg(where: str, kernel, backend, stacklevel: int) -> str:
    """``kernel`` (None: not given, "pytorch"), or its old name ``backend`` with a DeprecationWarning;
    both given is a TypeError."""
    if backend is None:
        return "pytorch" if kernel is None else kernel
    if kernel is not None:
        raise TypeError(f"{where} got both kernel={kernel!r} and backend={backend!r}; backend= is the old name "
                        "of kernel=: pass kernel= only")
    warnings.warn(f"{where}: backend= is now called kernel= (pytorch | triton): write kernel={backend!r}",
                  DeprecationWarning, stacklevel=stacklevel + 1)
    return backend
# rows of the fp64 reference computed at once: bounds its (rows x T_k) score and probability
# matrices and their autograd buffers to a few hundred MB
_REF_CHUNK_ENTRIES = 1 << 24


@dataclass(frozen=True, init=False)
class Arithmetic:
    """A flash-attention arithmetic: precision policy, stabilizer, tiles and the kernel that runs it
    (``pytorch`` or ``triton``). ``backend=`` is the old name of ``kernel=`` (a DeprecationWarning;
    both at once is a TypeError), and ``.backend`` of ``.kernel``."""

    policy: PrecisionPolicy
    stabilizer: Stabilizer = field(default_factory=lambda: get_stabilizer("none"))
    block_q: int = 512
    block_k: int = 512
    kernel: str = "pytorch"

    def __init__(self, policy, stabilizer=None, block_q: int = 512, block_k: int = 512, kernel: str | None = None,
                 *, backend: str | None = None):
        # the dataclass's own __init__, written out for the old keyword backend= (frozen: object.__setattr__)
        kernel = _kernel_arg("Arithmetic()", kernel, backend, stacklevel=2)
        stabilizer = get_stabilizer("none") if stabilizer is None else stabilizer
        for name, value in (("policy", policy), ("stabilizer", stabilizer), ("block_q", block_q),
                            ("block_k", block_k), ("kernel", kernel)):
            object.__setattr__(self, name, value)
        self.__post_init__()

    @property
    def backend(self) -> str:
        """Deprecated: the old name of ``kernel``."""
        warnings.warn("Arithmetic.backend is now called Arithmetic.kernel", DeprecationWarning, stacklevel=2)
        return self.kernel

    def __post_init__(self):
        if not isinstance(self.policy, PrecisionPolicy):
            object.__setattr__(self, "policy", get_policy(self.policy))
        if not isinstance(self.stabilizer, Stabilizer):
            object.__setattr__(self, "stabilizer", get_stabilizer(self.stabilizer))
        for name in ("block_q", "block_k"):
            b = getattr(self, name)
            if isinstance(b, bool) or not isinstance(b, int) or b < 1:
                raise ValueError(f"Arithmetic.{name} must be an integer >= 1, got {b!r}")
        if self.kernel not in ARITH_KERNELS:
            raise ValueError(f"Arithmetic.kernel must be one of {ARITH_KERNELS}, got {self.kernel!r}")

    @classmethod
    def of(cls, precision="fa2", stabilizer="none", *, block_q: int = 512, block_k: int = 512,
           kernel: str | None = None, backend: str | None = None) -> "Arithmetic":
        """``Arithmetic`` from a preset name (or policy) and a stabilizer name (or Stabilizer);
        ``kernel`` "pytorch" (default) or "triton" (``backend=``: its old name, deprecated)."""
        kernel = _kernel_arg("Arithmetic.of()", kernel, backend, stacklevel=2)
        return cls(get_policy(precision), get_stabilizer(stabilizer), block_q, block_k, kernel)

    def label(self) -> str:
        tiles = "" if (self.block_q, self.block_k) == (512, 512) else f" {self.block_q}x{self.block_k}"
        kernel = "" if self.kernel == "pytorch" else f" [{self.kernel}]"
        return f"{self.policy.short_str()} / {self.stabilizer}{tiles}{kernel}"


def floor_arithmetic(policy: "PrecisionPolicy | str") -> Arithmetic:
    """The noise floor of ``policy``: every intermediate fp32, the same input and output formats.
    Its error is the rounding of O (and of the gradients) to the output format and nothing
    else, so a bias above it belongs to the arithmetic."""
    p = get_policy(policy)
    fp32 = get_policy("fp32")
    return Arithmetic(fp32.replace(name="floor", inputs=p.inputs, output=p.output), get_stabilizer("none"))


@dataclass
class TieCounts:
    """Per row (B, H, T_q), summed over the key tiles the arithmetic visited (tiles the causal
    mask hides completely are not counted)."""

    tiles: torch.Tensor      # visited tiles in which the row has a visible key
    tied: torch.Tensor       # of those, tiles whose row maximum is tied (the stabilizer's tie rule)
    entries: torch.Tensor    # visible Pbar entries
    pbar_one: torch.Tensor   # of those, exactly 1
    multi_one: torch.Tensor  # tiles with >= 2 visible Pbar == 1 (several V rows enter PV exactly)


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

    def _err(self, a, b):
        return None if a is None or b is None else a - b

    @property
    def o_err(self):
        return self.o - self.o_ref

    @property
    def lse_err(self):
        return self._err(self.lse, self.lse_ref)

    @property
    def delta_err(self):
        return self._err(self.delta, self.delta_ref)

    @property
    def dq_err(self):
        return self._err(self.dq, self.dq_ref)

    @property
    def dk_err(self):
        return self._err(self.dk, self.dk_ref)

    @property
    def dv_err(self):
        return self._err(self.dv, self.dv_ref)


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
            vis = ~hidden.expand(s.shape)
            one = one & vis
            vis_rows = vis.any(dim=-1)
            entries = count_true(vis.contiguous()).squeeze(-1).to(torch.float64)
            # a row with nothing visible has no maximum to repeat (its fill values are all equal)
            tied = tied & vis_rows
        n_one = count_true(one.contiguous()).squeeze(-1)
        rows = slice(q0, q1)
        c.tiles[..., rows] += vis_rows
        c.tied[..., rows] += tied
        c.entries[..., rows] += entries
        c.pbar_one[..., rows] += n_one
        c.multi_one[..., rows] += n_one >= 2


def _reference(q, k, v, do, *, attn_mask, causal, scale, softcap, grads):
    """fp64 O, lse, delta and (with grads) dQ, dK, dV of reference_attention, chunked over the
    batch so that the score matrices stay bounded."""
    B = q.shape[0]
    per_batch = max(1, q[0].numel() // q.shape[-1] * k.shape[-2])
    step = max(1, _REF_CHUNK_ENTRIES // per_batch)
    outs = {n: [] for n in ("o", "lse", "delta", "dq", "dk", "dv")}
    for b0 in range(0, B, step):
        sl = slice(b0, b0 + step)
        leaves = [t[sl].detach().to(torch.float64).requires_grad_(grads) for t in (q, k, v)]
        mask = None
        if attn_mask is not None:
            mask = attn_mask if attn_mask.shape[0] == 1 else attn_mask[sl]
        with torch.enable_grad() if grads else torch.no_grad():
            o, lse = reference_attention(*leaves, attn_mask=mask, is_causal=causal, scale=scale,
                                         return_lse=True, softcap=softcap)
            if do is not None:
                do64 = do[sl].to(torch.float64)
                outs["delta"].append((do64 * o.detach()).sum(-1))
                if grads:
                    for name, g in zip(("dq", "dk", "dv"), torch.autograd.grad(o, leaves, do64)):
                        outs[name].append(g)
        outs["o"].append(o.detach())
        outs["lse"].append(lse.detach())
    return {n: (torch.cat(x) if x else None) for n, x in outs.items()}


def _split_mask(attn_mask):
    if attn_mask is None:
        return None, None
    return (attn_mask, None) if attn_mask.dtype == torch.bool else (None, attn_mask)


def _run_arithmetic(a: Arithmetic, q, k, v, do, *, attn_mask, causal, scale, softcap, grads):
    policy = a.policy
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False), rounding(policy.rounding):
        qc, kc, vc = (cast(t.detach(), policy.inputs) for t in (q, k, v))
        doc = None if do is None else cast(do.detach(), policy.inputs)
        keep, bias = _split_mask(attn_mask)
        out = {"inputs": (qc, kc, vc, doc)}
        if a.kernel == "triton":
            from .triton_flash import triton_flash_attention
            fn = lambda q_, k_, v_: triton_flash_attention(  # noqa: E731
                q_, k_, v_, is_causal=causal, scale=scale, stabilizer=a.stabilizer, precision=policy,
                attn_mask=attn_mask, softcap=softcap, block_m=a.block_q, block_n=a.block_k)
            o, grads_ = _black_box(fn, qc, kc, vc, doc, grads)
            out.update(o=o, dq=grads_[0], dk=grads_[1], dv=grads_[2], delta_source=policy.delta_source)
            if doc is not None:
                out["delta"] = delta_preprocess(qc, kc, vc, cast(o, policy.output), None, doc, None, keep=keep,
                                                bias=bias, causal=causal, scale=scale, policy=policy,
                                                block_q=a.block_q, block_k=a.block_k, softcap=softcap)
            return out
        counter = _TieCounter(q.shape[:-1], causal, policy, a.stabilizer, q.device)
        keep_hp = policy.delta_source == "o_highp"
        o, lse, o_hp = flash_forward(qc, kc, vc, keep=keep, bias=bias, causal=causal, scale=scale, policy=policy,
                                     stabilizer=a.stabilizer, block_q=a.block_q, block_k=a.block_k,
                                     keep_highp_o=keep_hp, softcap=softcap, observe=counter)
        out.update(o=o, lse=lse.squeeze(-1), ties=counter.counts, delta_source=policy.delta_source)
        if doc is not None:
            out["delta"] = delta_preprocess(qc, kc, vc, o, lse, doc, o_hp, keep=keep, bias=bias, causal=causal,
                                            scale=scale, policy=policy, block_q=a.block_q, block_k=a.block_k,
                                            softcap=softcap)
            if grads:
                dq, dk, dv = flash_backward(qc, kc, vc, o, lse, doc, o_hp, keep=keep, bias=bias, causal=causal,
                                            scale=scale, policy=policy, block_q=a.block_q, block_k=a.block_k,
                                            softcap=softcap)
                # what training hands on: the gradients in the dtype the inputs had
                out.update(dq=dq.to(q.dtype), dk=dk.to(k.dtype), dv=dv.to(v.dtype))
    return out


def _black_box(fn, q, k, v, do, grads):
    leaves = [t.detach().requires_grad_(grads and do is not None) for t in (q, k, v)]
    with torch.enable_grad() if grads and do is not None else torch.no_grad():
        o = fn(*leaves)
        if not isinstance(o, torch.Tensor) or o.shape[:-1] != q.shape[:-1]:
            raise ValueError(f"the attention callable must return a tensor of shape (B, H, T_q, D_v) = "
                             f"{tuple(q.shape[:-1])} + (D_v,), got {getattr(o, 'shape', type(o).__name__)}")
        g = (None, None, None)
        if grads and do is not None:
            g = torch.autograd.grad(o, leaves, do.to(o.dtype))
    return o.detach(), g


def trace(q, k, v, do=None, arithmetic: "Arithmetic | str | object" = "fa2", *, causal: bool = False,
          scale: float | None = None, attn_mask: torch.Tensor | None = None, softcap: float | None = None,
          grads: bool = True, label: str | None = None) -> Trace:
    """Run ``arithmetic`` on (q, k, v) and, given ``do``, its backward; compare with fp64.

    q: (B, H, T_q, D), k: (B, H, T_k, D), v: (B, H, T_k, D_v), do: (B, H, T_q, D_v) or None.
    ``arithmetic``: an ``Arithmetic``, a precision preset name (no stabilizer, 512-tiles) or a
    callable ``fn(q, k, v) -> o`` (a black box; ``causal``, ``attn_mask`` and ``scale`` are then
    only given to the reference, so the callable must apply the same ones). ``grads=False``
    skips the gradients (delta is still measured given ``do``).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_floating_point():
            raise ValueError(f"trace: {name} must be a floating (B, H, T, D) tensor, got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if do is not None and (not isinstance(do, torch.Tensor) or do.shape != (*q.shape[:-1], v.shape[-1])):
        raise ValueError(f"trace: do must have shape (B, H, T_q, D_v) = {(*q.shape[:-1], v.shape[-1])}, "
                         f"got {getattr(do, 'shape', type(do).__name__)}")
    if isinstance(arithmetic, str):
        arithmetic = Arithmetic.of(arithmetic)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if isinstance(arithmetic, Arithmetic):
        got = _run_arithmetic(arithmetic, q, k, v, do, attn_mask=attn_mask, causal=causal, scale=scale,
                              softcap=softcap, grads=grads)
        name = label or arithmetic.label()
    elif callable(arithmetic):
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
                     grads=grads and do is not None)

    def f64(x, squeeze=False):
        if x is None:
            return None
        x = x.detach().to(torch.float64)
        return x.squeeze(-1) if squeeze and x.dim() == 4 else x

    return Trace(label=name, o=f64(got["o"]), o_ref=ref["o"], lse=f64(got.get("lse")), lse_ref=ref["lse"],
                 delta=f64(got.get("delta"), squeeze=True), delta_ref=ref["delta"],
                 delta_source=got.get("delta_source"), dq=f64(got.get("dq")), dk=f64(got.get("dk")),
                 dv=f64(got.get("dv")), dq_ref=ref["dq"], dk_ref=ref["dk"], dv_ref=ref["dv"],
                 ties=got.get("ties"), inputs=got["inputs"])
