"""The attention fuzzer's cases and its one check (used by tests/attention/test_fuzz.py).

A case is drawn from (seed, index) alone, so any case can be rebuilt from its id:
shapes (T_q != T_k, T = 1 ... 1100, head dims 1 ... 160 with odd ones, D_v != D), causal
or not, no mask / a boolean mask / an additive mask (with -inf, large finite negatives and
fully masked rows, in several broadcast shapes), input dtype fp32 / bf16 / fp16, every preset
of ``flashguard.numerics.POLICIES`` x stabilizer none / paper / safe, tile sizes, the PyTorch
path or - where ``triton_unsupported`` accepts the call - the Triton path (interpreter on
CPU), and a share of cases with a NaN planted in q, k or v.

``check(case)`` runs it and returns what it measured. The oracle:

* output and dQ, dK, dV against the fp64 reference (``reference_attention`` with autograd) on
  the inputs as flashguard sees them (q, k, v and dO rounded to the policy's input format);
* tolerance as in test_flash.py / test_triton.py: error <= k x the error of plain PyTorch math
  attention (``reference_attention(dtype=...)``) in the same dtype on the same inputs (k = 2;
  3 for the paper presets, whose reference-code backward measures 2.0-2.3x) plus a floor of
  one eps of that dtype relative to the tensor's size (FLOOR, _natural_sizes). The same dtype
  is the coarser of the policy's working format and the input dtype (results come back in the
  input dtype). The fp8 presets have no torch counterpart: eps/2 of the format relative to the
  tensor's size (test_flash's fp8 bound). The Triton path: 2 x the PyTorch path with the same
  policy and tiles plus the floor (test_triton's rule). Gradients get one more term, the
  rounding of the stored lse that FA2's backward recomputes P from (ulp(|lse|)/2 per P);
* documented limitations, compared in part and counted in the report's notes: the study's bf16
  lse once |lse| >= LSE_LIMIT (gradients not compared), and the paper stabilizer's underflow
  for large |r| (README) in the rows it can reach (O and dQ compared on the other rows);
* NaN exactly where the arithmetic puts it: an output row is NaN iff a score it sees is NaN
  (a NaN in q, or a NaN key it may attend; bool / causal masking hides a key, an additive
  mask - even -inf - does not), O[i, c] is NaN if row i gives weight to a key whose v[:, c] is
  NaN (and may be NaN where another row of its tile meets that key: 0 * NaN in the tile's PV
  matmul, as test_flash documents), and nowhere else. Against torch SDPA's math backend (its
  default CPU kernel drops a NaN of q in short rows): where no mask hides a NaN score and V
  has none, the maps must be equal; elsewhere SDPA spreads NaNs further (it adds masks as
  -inf, NaN - inf = NaN; 0 * NaN in its one PV matmul spoils every row) and ours must lie
  inside its map. Where this platform's bf16 gemm itself spreads a NaN row (torch 2.13's
  oneDNN AMX kernels: BF16_GEMM_SPREADS_NAN), presets with bf16 matmuls may also have NaN in
  the query tile of a NaN row. Gradients of NaN cases are not compared;
* fully masked rows (no key visible) give exactly 0 output and add nothing to the gradients
  (flashguard's documented behaviour; torch 2.13's SDPA also gives 0 there - an SDPA that
  gives NaN there is the documented difference, not held against flashguard);
* every result finite, in the input dtype and shape.

The one bug it found so far (``paper-fp32fwd`` with a bf16 lse: NaN gradients on fully masked
rows) is fixed in the preset (lse in fp32); its cases now pass like any other.
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashguard.attention import flash_attention, get_stabilizer, reference_attention
from flashguard.attention.function import choose_kernel
from flashguard.attention.triton_flash import triton_available, triton_unsupported
from flashguard.numerics import POLICIES, get_policy
from flashguard.numerics.arith import cast

NAMES = ("O", "dQ", "dK", "dV")
STABILIZERS = ("none", "paper", "safe")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Floors, relative to a tensor's size: one unit roundoff (eps) of the working dtype (fp32:
# test_triton's 2e-6). A result rounded once to a format already errs by up to half an ulp of
# its largest entry, so in degenerate cases where plain torch happens to be exact (one key,
# head dim 1, dQ = 0) the bound cannot be a multiple of its error alone.
FLOOR = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
# the study's arithmetic (paper presets): its reference-code backward measures 2.0-2.3x plain
# torch bf16 (test_flash.py), so 3x; others 2x
FACTOR = {"paper": 3.0, "paper-fp32fwd": 3.0}
# Documented limitation of the study's arithmetic (bf16 lse, as the reference code keeps it):
# backward recomputes P = exp(S - lse), so lse's rounding, up to ulp(|lse|) / 2, is a relative
# error of every P of the row. Once |lse| >= LSE_LIMIT (bf16 ulp 0.25: P off by up to 13 %,
# e.g. scores shifted by a -1e4 "padding" bias, where the ulp is 64) the gradients are garbage
# in the reference code too; there only O is compared (and gradients must be finite).
LSE_LIMIT = 32.0
_MANTISSA = {torch.float64: 52, torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


@dataclass(frozen=True)
class Case:
    seed: int
    index: int
    path: str            # "pytorch" or "triton"
    preset: str
    stabilizer: str
    dtype: str
    b: int
    h: int
    tq: int
    tk: int
    d: int
    dv: int
    causal: bool
    mask: str            # "none", "bool", "additive"
    mask_shape: str      # "full", "b1", "11", "2d"
    masked_rows: int     # rows made fully masked
    keep: float          # share of keys a mask keeps
    amp: float           # size of q and k (logits ~ amp^2)
    block_q: int | None
    block_k: int | None
    nan: str             # "", "q", "k", "v"

    @property
    def id(self) -> str:
        shape = f"B{self.b}H{self.h}q{self.tq}k{self.tk}d{self.d}" + (f"v{self.dv}" if self.dv != self.d else "")
        mask = "" if self.mask == "none" else f"-{self.mask}{self.mask_shape}" + (f"x{self.masked_rows}" if self.masked_rows else "")
        tiles = f"-t{self.block_q}x{self.block_k}"
        return (f"{self.index}-{self.path}-{self.preset}-{self.stabilizer}-{self.dtype}-{shape}"
                f"{'-causal' if self.causal else ''}{mask}{tiles}{'-amp%g' % self.amp if self.amp != 1 else ''}"
                f"{'-nan' + self.nan if self.nan else ''}")


def _log_uniform(r: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(r.uniform(math.log(lo), math.log(hi + 0.999)) - 0.499))) if hi > lo else lo


def _length(r: random.Random, large_share: float) -> int:
    u = r.random()
    if u < large_share:
        return r.randint(513, 1100)
    if u < 4 * large_share + 0.06:
        return r.randint(129, 512)
    return _log_uniform(r, 1, 128)


def _head_dim(r: random.Random) -> int:
    u = r.random()
    if u < 0.35:
        return r.randint(1, 16)
    if u < 0.6:
        return r.choice([17, 31, 32, 33, 59, 63, 64, 65, 96, 127, 128, 129, 159, 160])
    return r.randint(1, 160)


_BLOCKS = [1, 2, 3, 5, 7, 8, 13, 16, 17, 32, 37, 48, 64, 100, 128, 256, 512, None]


def _tiles(r: random.Random, tq: int, tk: int, max_pairs: int) -> tuple[int | None, int | None]:
    for _ in range(100):
        bq, bk = r.choice(_BLOCKS), r.choice(_BLOCKS)
        pairs = math.ceil(tq / (bq or 512)) * math.ceil(tk / (bk or 512))
        if pairs <= max_pairs:
            return bq, bk
    return None, None


def draw(seed: int, index: int, *, triton_share: float = 0.05, large_share: float = 0.01,
         max_pairs: int = 12) -> Case:
    """Case ``index`` of the fuzz run ``seed``."""
    r = random.Random(seed * 1_000_003 + index)
    preset = r.choice(sorted(POLICIES))
    stabilizer = r.choice(STABILIZERS)
    dtype = r.choice(sorted(DTYPES))
    want_triton = r.random() < triton_share
    if want_triton:  # the interpreter runs every kernel instance in Python: keep it small
        preset = r.choice(["fa2", "fa2-fp16", "fp32"])
        tq, tk = _log_uniform(r, 1, 80), _log_uniform(r, 1, 80)
        d, dv = r.choice([1, 7, 16, 33, 59, 64]), None
        b, h = 1, r.randint(1, 2)
    else:
        tq = _length(r, large_share)
        tk = tq if r.random() < 0.3 else _length(r, large_share)
        d, dv = _head_dim(r), None
        big = tq * tk > 512 * 512
        b, h = (1, 1) if big else (r.randint(1, 2), r.randint(1, 3))
    dv = d if r.random() < 0.8 else _head_dim(r)
    causal = r.random() < 0.5
    mask = "none" if want_triton else r.choice(["none", "none", "bool", "additive"])
    mask_shape = r.choice(["full", "b1", "11", "2d"])
    masked_rows = r.choice([0, 0, 1, 2, 5]) if mask != "none" else 0
    keep = r.choice([0.1, 0.5, 0.9, 1.0])
    amp = r.choice([0.5, 1.0, 1.0, 1.0, 2.0])
    nan = r.choice(["q", "k", "v"]) if r.random() < 0.05 else ""
    if want_triton:
        bq, bk = r.choice([16, 32, None]), r.choice([16, 32, None])
    else:
        bq, bk = _tiles(r, tq, tk, max_pairs)
    case = Case(seed, index, "pytorch", preset, stabilizer, dtype, b, h, tq, tk, d, dv, causal, mask, mask_shape,
                masked_rows, keep, amp, bq, bk, nan)
    if want_triton and triton_available():
        q = torch.empty(b, h, tq, d, dtype=DTYPES[dtype])
        k = torch.empty(b, h, tk, d, dtype=DTYPES[dtype])
        v = torch.empty(b, h, tk, dv, dtype=DTYPES[dtype])
        if triton_unsupported(q, k, v, precision=preset, stabilizer=stabilizer, block_q=bq, block_k=bk) is None:
            case = Case(**{**asdict(case), "path": "triton"})
    return case


# --------------------------------------------------------------------------- inputs

def make_inputs(case: Case):
    g = torch.Generator().manual_seed(case.seed * 7919 + case.index)
    dt = DTYPES[case.dtype]
    b, h = case.b, case.h
    q = torch.randn(b, h, case.tq, case.d, generator=g) * case.amp
    k = torch.randn(b, h, case.tk, case.d, generator=g) * case.amp
    v = torch.randn(b, h, case.tk, case.dv, generator=g)
    do = torch.randn(b, h, case.tq, case.dv, generator=g)
    if case.nan:
        t = {"q": q, "k": k, "v": v}[case.nan]
        idx = tuple(int(torch.randint(0, n, (1,), generator=g)) for n in t.shape)
        t[idx] = float("nan")
    mask = None
    if case.mask != "none":
        shape = {"full": (b, h, case.tq, case.tk), "b1": (b, 1, case.tq, case.tk), "11": (1, 1, case.tq, case.tk),
                 "2d": (case.tq, case.tk)}[case.mask_shape]
        keep = torch.rand(shape, generator=g) < case.keep
        for _ in range(case.masked_rows):
            keep[..., int(torch.randint(0, case.tq, (1,), generator=g)), :] = False
        if case.mask == "bool":
            mask = keep
        else:
            bias = torch.randn(shape, generator=g)
            hidden = -1e4 if torch.rand((), generator=g) < 0.3 else float("-inf")
            mask = bias.masked_fill(~keep, hidden).to(dt)
    return q.to(dt), k.to(dt), v.to(dt), do.to(dt), mask


# --------------------------------------------------------------------------- oracle pieces

def _hidden(case: Case, mask, shape):
    """(B, H, T_q, T_k) bool: keys excluded from a row (causal, bool mask); additive masks hide nothing."""
    hid = torch.zeros(shape, dtype=torch.bool)
    if case.causal:
        hid |= torch.ones(case.tq, case.tk, dtype=torch.bool).triu(1)
    if mask is not None and mask.dtype == torch.bool:
        hid |= ~mask
    return hid


def _bf16_gemm_spreads_nan() -> bool:
    """Whether this platform's bf16 matmul puts NaN into an output row whose inputs are finite.
    torch 2.13's oneDNN AMX kernels do: with a NaN in row 16 of a 17 x 42 bf16 operand, row 15
    of the product is NaN too (the AVX512 / AVX2 kernels keep it to row 16)."""
    a = torch.ones(17, 42, dtype=torch.bfloat16)
    a[16] = float("nan")
    return bool(torch.isnan((a @ torch.ones(42, 145, dtype=torch.bfloat16))[:16]).any())


BF16_GEMM_SPREADS_NAN = _bf16_gemm_spreads_nan()


def _native_bf16_matmuls(policy) -> bool:
    return any(getattr(policy, f).torch_dtype == torch.bfloat16 for f in ("scores", "pv"))


def _expected_nan(case: Case, q64, k64, v64, mask, policy=None):
    """(required, allowed, exact) NaN maps of the output, from the arithmetic; ``exact``: no
    NaN score is hidden by a mask and V has none, so SDPA's math backend (which adds masks as
    -inf, NaN + -inf = NaN) must give the same map."""
    b, h = case.b, case.h
    shape = (b, h, case.tq, case.tk)
    hid = _hidden(case, mask, shape)
    s = q64 @ k64.transpose(-2, -1)
    if mask is not None and mask.dtype != torch.bool:
        s = s + mask.double()
    row = (torch.isnan(s) & ~hid).any(dim=-1, keepdim=True)              # (B, H, T_q, 1)
    vnan = torch.isnan(v64)                                              # (B, H, T_k, D_v)
    weight = ~hid                                                        # keys with P > 0 possible
    if mask is not None and mask.dtype != torch.bool:
        weight = weight & ~torch.isneginf(mask.double())
    sees = weight.double() @ vnan.double() > 0                           # row attends a NaN in column c
    required = row.expand(b, h, case.tq, case.dv) | sees
    allowed = required | vnan.any(dim=-2, keepdim=True).expand_as(required)  # tile spoiling in V's column
    exact = not bool((torch.isnan(s) & hid).any()) and not bool(vnan.any())
    if BF16_GEMM_SPREADS_NAN and policy is not None and _native_bf16_matmuls(policy):
        # the platform's bf16 gemm spreads a NaN row to others of the same operand: allow every
        # row of a query tile that holds a NaN row, and its neighbours
        bq = case.block_q or 512
        bad = required.any(dim=-1)                                       # (B, H, T_q)
        near = bad | torch.roll(bad, 1, -1) | torch.roll(bad, -1, -1)
        tiles = near.reshape(b, h, -1).new_zeros(b, h, math.ceil(case.tq / bq) * bq)
        tiles[..., :case.tq] = near
        tiles = tiles.view(b, h, -1, bq).any(dim=-1, keepdim=True).expand(-1, -1, -1, bq).reshape(b, h, -1)
        allowed = allowed | (tiles[..., :case.tq] | near)[..., None].expand_as(allowed)
        exact = False
    return required, allowed, exact


def _sdpa(case: Case, q64, k64, v64, mask):
    """torch SDPA's math backend (its default CPU kernel drops a NaN of q for short rows: with
    T = 6 the row comes out finite, with T = 37 NaN; the math backend is consistent)."""
    kw = dict(scale=1.0 / math.sqrt(case.d))
    with sdpa_kernel(SDPBackend.MATH):
        if mask is None:
            return F.scaled_dot_product_attention(q64, k64, v64, is_causal=case.causal, **kw)
        m = mask if mask.dtype == torch.bool else mask.double()
        if case.causal:
            c = torch.ones(case.tq, case.tk, dtype=torch.bool).tril()
            m = (m & c) if m.dtype == torch.bool else m.masked_fill(~c, float("-inf"))
        return F.scaled_dot_product_attention(q64, k64, v64, attn_mask=m, **kw)


def _run(fn, q, k, v, do):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = fn(*leaves)
    grads = torch.autograd.grad(o, leaves, do.to(o.dtype))
    return [o.detach(), *grads]


def _working_dtype(preset: str, in_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype plain torch attention is measured in: the coarser of the policy's and the
    input's (None for the fp8 presets: no torch counterpart)."""
    pol = get_policy(preset)
    work = {"fp64": torch.float64, "fp32": torch.float32, "fa2-fp16": torch.float16}.get(preset, torch.bfloat16)
    if pol.inputs.torch_dtype is None:
        return None
    return min((work, in_dtype), key=lambda dt: _MANTISSA[dt])


def _max_err(a, ref):
    d = (a.double() - ref).abs()
    return float(d.max()) if d.numel() else 0.0


def _size(ref):
    return float(ref.abs().max()) if ref.numel() else 0.0


def _natural_sizes(case, q64, k64, v64, do64, p64):
    """The size of one term of each result: O mixes rows of V; dQ sums over keys
    scale * P * (dP - delta) * K with dP = dO V^T (the P of a row add up to 1); dK and dV sum
    over queries, whose P of a key add up to a column sum c (up to T_q). Floors are relative to
    the larger of this and the result's own size, so that a result that cancels to ~0 (one key:
    dQ = 0) still has the tolerance of the terms it is made of."""
    dp = _size(torch.nan_to_num(do64) @ torch.nan_to_num(v64).transpose(-2, -1))
    col = max(1.0, _size(p64.sum(dim=-2)))
    scale = 1.0 / math.sqrt(case.d)
    return [_size(v64), scale * _size(k64) * dp, scale * _size(q64) * dp * col, _size(do64) * col]


def _scores64(case, q64, k64, mask):
    """fp64 scores with the bias added and hidden keys at -inf, and P = softmax (0 in empty rows)."""
    s = (q64 @ k64.transpose(-2, -1)) / math.sqrt(case.d)
    if mask is not None and mask.dtype != torch.bool:
        s = s + mask.double()
    s = s.masked_fill(_hidden(case, mask, s.shape), float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    p = e / e.sum(dim=-1, keepdim=True).clamp(min=1e-300)
    lse = torch.log(e.sum(dim=-1)) + m.squeeze(-1)
    return s, p, lse


def fully_masked_rows(case: Case, mask) -> int:
    """Rows of the case that see no key (bool / causal masks and -inf biases)."""
    hid = _hidden(case, mask, (case.b, case.h, case.tq, case.tk))
    if mask is not None and mask.dtype != torch.bool:
        hid = hid | torch.isneginf(mask.double()).expand_as(hid)
    return int(hid.all(dim=-1).sum())


def check(case: Case) -> dict:
    """Run one case; returns {"ok", "problems", "ratio" (worst error / tolerance), "errors" (per
    tensor: err, yardstick, tol, ratio, size), "notes"}."""
    q, k, v, do, mask = make_inputs(case)
    policy = get_policy(case.preset)
    in_dt = DTYPES[case.dtype]
    problems = []
    # the inputs as flashguard sees them, exactly, in fp64
    q64, k64, v64, do64 = (cast(t, policy.inputs).double() for t in (q, k, v, do))  # dO too: backward rounds it
    kw = dict(attn_mask=mask, is_causal=case.causal, precision=case.preset, stabilizer=case.stabilizer,
              block_q=case.block_q, block_k=case.block_k)
    if case.path == "triton":
        assert choose_kernel(q, k, v, attn_mask=mask, precision=case.preset, stabilizer=case.stabilizer,
                             block_q=case.block_q, block_k=case.block_k, kernel="triton") == "triton"
    ours = _run(lambda a, b, c: flash_attention(a, b, c, kernel=case.path, **kw), q, k, v, do)
    for name, t, like in zip(NAMES, ours, (q, q, k, v)):
        want = (case.b, case.h, case.tq, case.dv) if name == "O" else tuple(like.shape)
        if t.dtype != in_dt or tuple(t.shape) != want:
            problems.append(f"{name}: {t.dtype} {tuple(t.shape)}, expected {in_dt} {want}")

    # ---- NaN map
    required, allowed, exact = _expected_nan(case, q64, k64, v64, mask, policy)
    got_nan = torch.isnan(ours[0])
    if bool((got_nan & ~allowed).any()) or bool((required & ~got_nan).any()):
        problems.append(f"O NaN map: {int((got_nan & ~allowed).sum())} unexpected NaN, "
                        f"{int((required & ~got_nan).sum())} missing")
    sdpa_nan = torch.isnan(_sdpa(case, q64, k64, v64, mask))
    hid = _hidden(case, mask, (case.b, case.h, case.tq, case.tk))
    if mask is not None and mask.dtype != torch.bool:
        hid = hid | torch.isneginf(mask.double()).expand_as(hid)
    empty = hid.all(dim=-1, keepdim=True).expand(*hid.shape[:-1], case.dv)
    sdpa_nan_rows = sdpa_nan & ~(empty & ~allowed)  # an SDPA giving NaN in fully masked rows: the documented difference
    if exact:
        if not torch.equal(got_nan, sdpa_nan_rows):
            problems.append(f"O NaN map differs from SDPA's ({int((got_nan ^ sdpa_nan_rows).sum())} entries)")
    elif bool((got_nan & ~sdpa_nan & ~allowed).any()):
        problems.append(f"O NaN where SDPA has none ({int((got_nan & ~sdpa_nan & ~allowed).sum())} entries)")
    # fully masked rows: exactly 0 (where no NaN of V's column may reach them)
    if bool((ours[0][empty & ~allowed] != 0).any()):
        problems.append("fully masked rows are not exactly 0")

    errors, ratio, notes = {}, 0.0, []
    if case.nan:  # gradients of NaN inputs are not compared
        if bool(torch.isnan(ours[0][~allowed]).any()):
            problems.append("NaN outside the expected map")
        return dict(ok=not problems, problems=problems, ratio=ratio, errors=errors, notes=notes)

    ref_mask = None if mask is None else (mask if mask.dtype == torch.bool else mask.double())
    ref = _run(lambda a, b, c: reference_attention(a, b, c, attn_mask=ref_mask, is_causal=case.causal),
               q64, k64, v64, do64)
    for name, t in zip(NAMES, ours):
        if not bool(torch.isfinite(t).all()):
            problems.append(f"{name} has {int((~torch.isfinite(t)).sum())} non-finite entries")
    compared = NAMES
    scores, p64, lse = _scores64(case, q64, k64, mask)
    nat = _natural_sizes(case, q64, k64, v64, do64, p64)
    lse_max = float(lse[torch.isfinite(lse)].abs().max()) if bool(torch.isfinite(lse).any()) else 0.0
    if policy.lse.torch_dtype == torch.bfloat16 and lse_max >= LSE_LIMIT:
        compared = ("O",)
        notes.append(f"bf16 lse, |lse| up to {lse_max:.3g}: gradients not compared (LSE_LIMIT)")
    rows = None  # rows of O and dQ to compare (None: all)
    if case.stabilizer == "paper":
        # documented: the study's fix shifts a tied row by beta * r (r > 0) or to 0 (r < 0), so its
        # largest Pbar is exp(-(beta - 1) r) or exp(r); below the Pbar format's normal range the row
        # underflows (README: "underflows for large |r|"). Such rows (tied or not: the tie rule
        # acts per key tile) are not compared in O and dQ, and dK, dV, which mix rows, not at all.
        beta, tiny = get_stabilizer(case.stabilizer).beta, math.log(policy.pbar.min_normal)
        r = scores.amax(dim=-1, keepdim=True)                              # (B, H, T_q, 1)
        under = torch.isfinite(r) & ((r < tiny) | ((beta - 1) * r > -tiny))
        if bool(under.any()):
            rows = ~under
            compared = tuple(n for n in compared if n in ("O", "dQ"))
            notes.append(f"paper stabilizer: {int(under.sum())} rows whose largest Pbar can fall below "
                         f"{policy.pbar.name}'s normal range; O and dQ compared on the others, dK, dV not")
    # FA2's backward recomputes P = exp(S - lse) from the stored lse, whose rounding (ulp(|lse|)/2
    # in the lse format) is a relative error of every P that plain autograd softmax does not
    # have: with an fp32 lse negligible unless a large bias shifts the scores; with the study's
    # bf16 lse it is the larger part of its backward's error where plain torch is exact (a single
    # query row, or one key: P = exp(s - bf16(s)) != 1 beside paper-fp32fwd's fp32 scores)
    lse_eps = 2.0 ** (math.frexp(lse_max)[1] - 1 - policy.lse.mantissa_bits) / 2 if lse_max > 0 else 0.0
    work = _working_dtype(case.preset, in_dt)
    if case.path == "triton":
        pt = _run(lambda a, b, c: flash_attention(a, b, c, kernel="pytorch", **kw), q, k, v, do)
        yard, factor = [_max_err(a, r) for a, r in zip(pt, ref)], 2.0
        floors = [FLOOR[work] * max(_size(r), n) for r, n in zip(ref, nat)]
    elif work is None:  # fp8: eps/2 of the format, relative to the tensor's size
        eps = policy.inputs.eps
        yard, factor = [0.0] * 4, 0.0
        floors = [eps / 2 * max(_size(r), n) for r, n in zip(ref, nat)]
    else:
        m = None if mask is None else (mask if mask.dtype == torch.bool else mask.to(work))
        plain = _run(lambda a, b, c: reference_attention(a, b, c, attn_mask=m, is_causal=case.causal, dtype=work),
                     q64.to(work), k64.to(work), v64.to(work), do64.to(work))
        yard, factor = [_max_err(a, r) for a, r in zip(plain, ref)], FACTOR.get(case.preset, 2.0)
        floors = [FLOOR[work] * max(_size(r), n) for r, n in zip(ref, nat)]
    floors = [fl + (2 * lse_eps * n if name != "O" else 0.0) for name, fl, n in zip(NAMES, floors, nat)]
    if rows is not None:  # restrict O and dQ (and their yardsticks) to the compared rows
        def keep(t, rows=rows):
            return t[rows.expand(*t.shape[:-1], 1).expand_as(t)]
        ours = [keep(t) if n in ("O", "dQ") else t for n, t in zip(NAMES, ours)]
        ref_rows = [keep(t) if n in ("O", "dQ") else t for n, t in zip(NAMES, ref)]
        if case.path != "triton" and work is not None:
            yard = [_max_err(keep(a), keep(b)) if n in ("O", "dQ") else y
                    for n, a, b, y in zip(NAMES, plain, ref, yard)]
        elif case.path == "triton":
            yard = [_max_err(keep(a), keep(b)) if n in ("O", "dQ") else y for n, a, b, y in zip(NAMES, pt, ref, yard)]
        ref = ref_rows
    for name, t, r, y, fl in zip(NAMES, ours, ref, yard, floors):
        if name not in compared:
            continue
        e = _max_err(t, r)
        tol = factor * y + fl
        x = e / tol if tol > 0 else (0.0 if e == 0 else math.inf)
        errors[name] = dict(err=e, yardstick=y, tol=tol, ratio=x, size=_size(r))
        ratio = max(ratio, x)
        if x > 1:
            problems.append(f"{name}: error {e:.3g} > tolerance {tol:.3g} ({factor:g} x plain {y:.3g} + floor {fl:.3g})")
    return dict(ok=not problems, problems=problems, ratio=ratio, errors=errors, notes=notes)
