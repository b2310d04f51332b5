"""Pytest helpers for attention-kernel authors: does your kernel *lean*?

    import torch
    from flashguard.testing import assert_unbiased

    def test_my_kernel_does_not_lean():
        assert_unbiased(my_attention, dtype=torch.bfloat16)   # AssertionError naming each lean

A lean is a consistent one-signed mean error of a kernel's output, beyond what rounding the
output to its format costs. A max-abs tolerance (max|out - ref| <= 2 x max|out_baseline - ref|,
flash-attention's rule) cannot see one: torch's fused CPU flash kernel passes that rule in bf16
and still leans by about -55e-6 in O under tied maxima, at z about -47 (docs/testing.md).

What is measured (nothing here is new; it is the kernel audit's measurement, ``flashguard audit``):

* problems: the lab's independent rows (``flashguard.experiments.lab.problems``), per named
  condition in ``CONDITIONS``: rows with k tied maxima (V mostly negative, dO mostly negative),
  and rows without ties whose tail mass runs from one dominant key to a diffuse row;
* the kernel is a black box ``attention_fn(q, k, v) -> o`` with the signature of
  ``torch.nn.functional.scaled_dot_product_attention`` (only q, k, v are passed: non-causal, no
  mask, default scale), fed q, k, v in ``dtype``; its O and its delta = rowsum(dO * O) (fp32, from
  the returned O, as production backward passes take it; no backward is run, so a kernel without
  autograd is tested too, and its own dQ, dK, dV are not) against fp64 on the same rounded inputs
  (``flashguard.attention.trace``);
* the rule: ``flashguard.attention.error_stats.leans_beyond_floor``, per condition and quantity.
  **Unit: one independent row** (the error averaged over the row's features). A lean needs
  both: the kernel's own error against fp64 is a bias (|z| >= 3.29, two-sided p < 1e-3, and
  |bias ratio| >= 0.02, ratio = mean / mean |row error|), and the paired difference from the
  noise floor on the same rows is a bias of the same sign. The noise floor is fp32 attention
  with the kernel's input and output formats (inputs in ``dtype``, every intermediate fp32, O
  rounded once to ``dtype``): what any kernel returning ``dtype`` must at least err.

Cost (one CPU core, torch 2.13, the fp64 reference and the floor included; torch's CPU flash
kernel in bf16): the default 8 conditions at 4,096 rows each took 4-5 s, ``conditions="full"``
(16 conditions) 8-9 s, on a lightly loaded 2-core machine (about twice that on a busy one). Time
grows linearly with ``rows``.

Deterministic: the problems are drawn from ``seed`` (the global torch RNG is left as it was), so
a kernel that passes once passes every time on the same inputs. Several conditions and two
quantities are tested per call, each at p < 1e-3, so a kernel without a lean fails at most
16 x 1e-3 = 1.6 % of seeds on the default set; a lean like torch's CPU flash kernel's sits at
|z| 20-50 beyond the floor. At float32 the rule judges fp32-sized errors (it has no absolute
threshold): torch's math path leans by about +1e-8 in O in k16-T1024 on some seeds (docs/testing.md).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from .attention.error_stats import BIAS_RATIO_MIN, Z_CRIT, BiasStats
from .experiments.lab.measure import Bench, BlackBox, Measurement
from .experiments.lab.problems import Problem, half_ulp_bf16

__all__ = ["assert_unbiased", "measure_unbiased", "UnbiasedResult", "ConditionResult", "Lean", "CONDITIONS",
           "DEFAULT_CONDITIONS", "FULL_CONDITIONS", "QUANTITIES"]

QUANTITIES = ("o", "delta")
_QUANTITY_NAMES = {"o": "O", "delta": "delta = rowsum(dO * O)"}

# name -> the lab Problem's fields (rows per instance 32, d = head_dim, V ~ N(-1, 0.5^2), dO ~ N(-0.5, 1)).
# tail: the row's tail mass tau = sum of exp(s - max) over its other keys, in half-ulps of k in bf16
# (below 1 a bf16 row sum rounds tau away); for k = 1 a half-ulp is 2^-8, so tail 256 is tau ~ 1.
CONDITIONS: dict[str, dict] = {
    # tied maxima (the kernel audit's conditions)
    "k2-tail0.25": dict(ties=2, tail=0.25),
    "k2-tail4": dict(ties=2, tail=4.0),
    "k8-tail0.25": dict(ties=8, tail=0.25),
    "k8-tail4": dict(ties=8, tail=4.0),
    "k16-T1024": dict(ties=16, t=1024, tail=0.25),                  # two 512-key tiles
    # no ties: one dominant key (tau ~ 0.001), the top key half the row (tau ~ 1), a diffuse row (tau ~ 30)
    "k1-tail0.25": dict(ties=1, tail=0.25),
    "k1-tail256": dict(ties=1, tail=256.0),
    "k1-tail8192": dict(ties=1, tail=8192.0),
    # conditions="full" adds:
    "k3-tail0.25": dict(ties=3, tail=0.25),
    "k3-tail4": dict(ties=3, tail=4.0),
    "k4-tail1": dict(ties=4, tail=1.0),
    "k16-T1024-tail4": dict(ties=16, t=1024, tail=4.0),
    "k2-vpos": dict(ties=2, tail=0.25, v_mean=1.0, do_mean=0.5),   # V mostly positive: the signs flip
    "k2-offset100": dict(ties=2, tail=0.25, offset=100.0),         # large logits: coarse bf16 scores
    "k1-tail26": dict(ties=1, tail=26.0),                          # tau ~ 0.1
    "k1-tail1024": dict(ties=1, tail=1024.0),                      # tau ~ 4
}
DEFAULT_CONDITIONS = ("k2-tail0.25", "k2-tail4", "k8-tail0.25", "k8-tail4", "k16-T1024",
                      "k1-tail0.25", "k1-tail256", "k1-tail8192")
FULL_CONDITIONS = tuple(CONDITIONS)
_SETS = {"default": DEFAULT_CONDITIONS, "full": FULL_CONDITIONS}

# the noise floor's policy per input dtype: floor_arithmetic keeps only its input and output formats
_FLOOR_POLICY = {torch.bfloat16: "fa2", torch.float16: "fa2-fp16", torch.float32: "fp32"}
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _n_conditions(n: int) -> str:
    return f"{n} condition" + ("" if n == 1 else "s")


def _e6(x: float) -> str:
    return f"{x * 1e6:+.1f}e-6"


@dataclass(frozen=True)
class Lean:
    """One quantity leaning in one condition."""

    condition: str
    quantity: str            # "o" or "delta"
    vs_floor: BiasStats      # the paired difference from the floor (what leans beyond it)
    own: BiasStats           # the kernel's own error against fp64

    def line(self) -> str:
        v, o = self.vs_floor, self.own
        return (f"{self.condition}: {_QUANTITY_NAMES[self.quantity]} leans {_e6(v.mean)} beyond the floor "
                f"(z {v.z:+.1f}, bias ratio {v.bias_ratio:+.2f}; own error against fp64 {_e6(o.mean)}, "
                f"z {o.z:+.1f}, ratio {o.bias_ratio:+.2f})")


@dataclass
class ConditionResult:
    """One condition: its lab problem and the audit's measurement of the kernel on it."""

    name: str
    problem: Problem
    measurement: Measurement   # .o, .delta (own, against fp64), .o_vs_floor, .delta_vs_floor, .o_floor, ...
    quantities: tuple

    def leans(self) -> list[Lean]:
        m, out = self.measurement, []
        for q in self.quantities:
            if getattr(m, f"{q}_leans"):
                out.append(Lean(self.name, q, getattr(m, f"{q}_vs_floor"), getattr(m, q)))
        return out

    @property
    def bad_rows(self) -> int:
        return self.measurement.bad_rows

    def to_dict(self) -> dict:
        return {"name": self.name, "leans": [lean.quantity for lean in self.leans()],
                **self.measurement.to_dict()}


@dataclass
class UnbiasedResult:
    """What ``measure_unbiased`` / ``assert_unbiased`` measured; ``str(result)`` is a table to log."""

    kernel: str
    dtype: str
    device: str
    rows: int
    seed: int
    head_dim: int
    quantities: tuple
    conditions: list = field(default_factory=list)   # ConditionResult per condition, in order
    runtime_s: float = 0.0
    unit: str = "one independent row"

    @property
    def leans(self) -> list[Lean]:
        return [lean for c in self.conditions for lean in c.leans()]

    @property
    def bad_rows(self) -> dict:
        """{condition: rows with a non-finite O, or O zeroed where the exact O is not}."""
        return {c.name: c.bad_rows for c in self.conditions if c.bad_rows}

    @property
    def passed(self) -> bool:
        return not self.leans and not self.bad_rows

    def summary(self) -> str:
        n = len(self.conditions)
        n_lean = len({lean.condition for lean in self.leans} | set(self.bad_rows))
        head = (f"{self.kernel} ({self.dtype}, {self.device}): "
                + (f"no lean beyond the fp32 noise floor in {_n_conditions(n)}" if self.passed
                   else f"FAILS in {n_lean} of {_n_conditions(n)}")
                + f"; {self.rows} rows each, unit {self.unit}, seed {self.seed}, d {self.head_dim}; "
                  f"{self.runtime_s:.1f} s")
        lines = [head]
        for c in self.conditions:
            m = c.measurement
            cells = []
            for q in self.quantities:
                v, own = getattr(m, f"{q}_vs_floor"), getattr(m, q)
                mark = " LEANS" if getattr(m, f"{q}_leans") else ""
                cells.append(f"{q} {_e6(v.mean)} beyond floor (z {v.z:+.1f}, r {v.bias_ratio:+.2f}; "
                             f"own z {own.z:+.1f}){mark}")
            bad = f"; {c.bad_rows} bad rows" if c.bad_rows else ""
            lines.append(f"  {c.name}: " + "; ".join(cells) + bad)
        return "\n".join(lines)

    __str__ = summary

    def to_dict(self) -> dict:
        return {"kernel": self.kernel, "dtype": self.dtype, "device": self.device, "rows": self.rows,
                "seed": self.seed, "head_dim": self.head_dim, "quantities": list(self.quantities),
                "unit": self.unit, "runtime_s": self.runtime_s, "passed": self.passed,
                "versions": {"torch": torch.__version__}, "conditions": [c.to_dict() for c in self.conditions]}

    def failure_message(self) -> str:
        n_lean = len({lean.condition for lean in self.leans})
        lines = [f"flashguard.testing.assert_unbiased: {self.kernel} ({self.dtype}, {self.device}) "
                 f"leans beyond the fp32 noise floor in {n_lean} of {_n_conditions(len(self.conditions))}"]
        lines += ["  " + lean.line() for lean in self.leans]
        lines += [f"  {name}: {n} of {self.rows} rows have a non-finite O, or O zeroed where the exact O is not"
                  for name, n in self.bad_rows.items()]
        lines += [f"Rule: the own error against fp64 is a bias (|z| >= {Z_CRIT:.2f}, |bias ratio| >= "
                  f"{BIAS_RATIO_MIN}) and the paired difference from the floor (fp32 attention, inputs and O "
                  f"in {self.dtype}) on the same rows is a bias of the same sign. Unit: one independent row; "
                  f"{self.rows} rows per condition, seed {self.seed}. Conditions: flashguard.testing.CONDITIONS."]
        return "\n".join(lines)


def _resolve_conditions(conditions) -> tuple:
    if isinstance(conditions, str):
        names = _SETS.get(conditions, (conditions,))
    else:
        try:
            names = tuple(conditions)
        except TypeError:
            raise TypeError(f"assert_unbiased: conditions must be 'default', 'full' or a sequence of condition "
                            f"names, got {type(conditions).__name__}") from None
    if not names:
        raise ValueError("assert_unbiased: conditions is empty; give 'default', 'full' or condition names")
    for n in names:
        if not isinstance(n, str) or n not in CONDITIONS:
            raise ValueError(f"assert_unbiased: unknown condition {n!r}; known: {', '.join(CONDITIONS)} "
                             f"(or 'default', 'full')")
    return tuple(dict.fromkeys(names))


def _resolve_quantities(quantities) -> tuple:
    qs = (quantities,) if isinstance(quantities, str) else tuple(quantities)
    bad = [q for q in qs if q not in QUANTITIES]
    if not qs or bad:
        raise ValueError(f"assert_unbiased: quantities must be a non-empty subset of {QUANTITIES}, got {quantities!r}")
    return tuple(dict.fromkeys(qs))


def _int_at_least(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"assert_unbiased: {name} must be an integer >= {low}, got {value!r}")
    return value


def _kernel_name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _checked(attention_fn, device: torch.device, name: str):
    """The kernel as the audit's black box sees it: CPU inputs moved to ``device``, the output
    checked for the SDPA shape and brought back."""
    def run(q, k, v):
        o = attention_fn(q.to(device), k.to(device), v.to(device))
        want = (*q.shape[:-1], v.shape[-1])
        if not isinstance(o, torch.Tensor) or tuple(o.shape) != want or not o.is_floating_point():
            got = (f"a {o.dtype} tensor of shape {tuple(o.shape)}" if isinstance(o, torch.Tensor)
                   else f"a {type(o).__name__}")
            raise ValueError(f"assert_unbiased: {name} must return a floating tensor of shape (B, H, T_q, D_v) = "
                             f"{want} for q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (the output "
                             f"of scaled_dot_product_attention), but returned {got}")
        return o.detach().to("cpu")
    return run


def measure_unbiased(attention_fn, *, dtype: torch.dtype = torch.bfloat16, device="cpu", conditions="default",
                     rows: int = 4096, seed: int = 0, quantities=QUANTITIES, head_dim: int = 64,
                     name: str | None = None) -> UnbiasedResult:
    """Measure ``attention_fn`` as ``assert_unbiased`` does and return the result without raising
    (``result.passed``, ``result.leans``, ``str(result)``). Arguments as in ``assert_unbiased``."""
    if not callable(attention_fn):
        raise TypeError(f"assert_unbiased: attention_fn must be callable like "
                        f"scaled_dot_product_attention(q, k, v), got {type(attention_fn).__name__}")
    if dtype not in _FLOOR_POLICY:
        raise ValueError(f"assert_unbiased: dtype must be one of torch.bfloat16, torch.float16, torch.float32, "
                         f"got {dtype!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"assert_unbiased: device {device!r} is not a torch device ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"assert_unbiased: device {device!r} asked for, but CUDA is not available")
    names = _resolve_conditions(conditions)
    qs = _resolve_quantities(quantities)
    rows = _int_at_least("rows", rows, 32)
    seed = _int_at_least("seed", seed, 0)
    head_dim = _int_at_least("head_dim", head_dim, 32)
    label = name or _kernel_name(attention_fn)

    t0 = time.perf_counter()
    box = BlackBox(label, _checked(attention_fn, dev, label), dtype=dtype, floor_policy=_FLOOR_POLICY[dtype])
    bench = Bench()
    base = Problem(n_rows=rows, seed=seed, d=head_dim)
    result = UnbiasedResult(kernel=label, dtype=_DTYPE_NAMES[dtype], device=str(dev), rows=rows, seed=seed,
                            head_dim=head_dim, quantities=qs)
    rng_devices = [dev.index or 0] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices):   # the lab seeds the global RNG per problem
        for n in names:
            try:
                problem = replace(base, **CONDITIONS[n])
                problem.max_logit  # noqa: B018 - a head dim too small for the condition says so here
            except ValueError as e:
                raise ValueError(f"assert_unbiased: condition {n!r} cannot be built with head_dim={head_dim}: {e}") \
                    from None
            result.conditions.append(ConditionResult(n, problem, bench.measure(problem, box), qs))
    result.runtime_s = time.perf_counter() - t0
    return result


def assert_unbiased(attention_fn, *, dtype: torch.dtype = torch.bfloat16, device="cpu", conditions="default",
                    rows: int = 4096, seed: int = 0, quantities=QUANTITIES, head_dim: int = 64,
                    name: str | None = None) -> UnbiasedResult:
    """Fail (AssertionError) if ``attention_fn`` leans beyond the fp32 noise floor in any condition.

    attention_fn: ``fn(q, k, v) -> o`` with the signature of ``scaled_dot_product_attention``
        (called with q, k, v only: non-causal, no mask, scale 1/sqrt(d)); q, k, v are
        (B, H, T, head_dim) tensors in ``dtype`` on ``device``; o must be (B, H, T_q, head_dim).
    dtype: the inputs' format, torch.bfloat16 (default), torch.float16 or torch.float32; the
        noise floor takes the same input format and rounds O to it.
    device: where the kernel runs ("cpu", "cuda", ...); the problems and the fp64 reference
        stay on the CPU, O is copied back.
    conditions: "default" (``DEFAULT_CONDITIONS``: 5 tie conditions, 3 without ties, 4-5 s on one
        CPU core at 4,096 rows), "full" (all 16 of ``CONDITIONS``, 8-9 s) or a sequence of names.
    rows: independent rows per condition (the unit of the statistics); seed: draws the problems.
    quantities: ("o", "delta") by default; delta = rowsum(dO * O) in fp32 from the returned O.
    head_dim: d of q, k, v (default 64; every condition builds for d >= 32).
    name: the kernel's name in messages (default: the function's name).

    Returns the ``UnbiasedResult`` (log ``str(result)``) when nothing leans. The AssertionError
    names each leaning condition and quantity with its mean error beyond the floor, z and bias
    ratio. Bad arguments raise TypeError / ValueError naming the argument; a kernel output of
    the wrong shape raises ValueError.
    """
    result = measure_unbiased(attention_fn, dtype=dtype, device=device, conditions=conditions, rows=rows,
                              seed=seed, quantities=quantities, head_dim=head_dim, name=name)
    if not result.passed:
        raise AssertionError(result.failure_message())
    return result
