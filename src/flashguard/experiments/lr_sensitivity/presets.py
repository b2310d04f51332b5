"""The LR-sensitivity experiment's grids: which runs `flashguard lr-sensitivity` trains.

A preset is a log grid of peak learning rates times a few attention arithmetics, on one repro
preset's config (model, data, seed, batch order). Every run of a seed starts from the same
weights and sees the same batches; runs differ in the peak lr (and min_lr = lr / 10, the cosine
schedule's floor) and in the arithmetic only. The roles name the arithmetics the verdicts
compare: ``reference`` (fp32 attention), ``harmed`` (the bf16 reference arithmetic, no fix) and
``fixes`` (each judged separately against the reference).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..repro.presets import RunSpec, lookup_preset

__all__ = ["Arithmetic", "LRPreset", "LR_PRESETS", "get_lr_preset", "log_grid", "lr_name", "run_spec",
           "GRID_KEYS", "MIN_LR_FRACTION", "WARMUP_FRACTION"]

# the schedule every run shares: linear warm-up over the first 5% of the steps, then cosine
# decay to lr / 10 at the last step (the usual small-scale recipe; Wortsman et al. decay to 1e-5
# absolute, which at our 3e-4 end of the grid would be no decay at all)
WARMUP_FRACTION = 0.05
MIN_LR_FRACTION = 0.1

# keys the grid sets per run: a user override of one would be silently replaced, so it is refused
GRID_KEYS = ("optim.lr", "optim.min_lr", "train.seed", "train.steps", "attention.precision",
             "attention.stabilizer")

_SLUG = re.compile(r"^[a-z0-9][a-z0-9.+-]*$")


@dataclass(frozen=True)
class Arithmetic:
    name: str                      # folder name under runs/s<SEED>/ (a slug)
    label: str                     # as tables and the figure show it
    overrides: tuple[str, ...]     # [attention] keys that make this arithmetic


FP32 = Arithmetic("fp32", "fp32", ("attention.precision=fp32",))
PAPER = Arithmetic("paper", "paper", ("attention.precision=paper",))
PAPER_FIX = Arithmetic("paper-fix", "paper + study's fix", ("attention.precision=paper", "attention.stabilizer=paper"))
PAPER_FP32FWD = Arithmetic("paper-fp32fwd", "paper-fp32fwd", ("attention.precision=paper-fp32fwd",))


# the backward raised to fp32 (P, dP, dS, delta's product and sum, the dQ/dK/dV partials and
# accumulators), the forward left as it is: which half of the arithmetic holds the edge down
_BWD32 = "p=fp32,dp=fp32,ds=fp32,delta_product=fp32,delta=fp32,grad_partial=fp32,grad_accum=fp32"
PAPER_BWD32 = Arithmetic("paper-bwd32", "paper, backward fp32", (f"attention.precision=paper[{_BWD32}]",))
FA2 = Arithmetic("fa2", "fa2 (production kernels)", ("attention.precision=fa2",))
PAPER_FP32FWD_BWD32 = Arithmetic("paper-fp32fwd-bwd32", "paper-fp32fwd, backward fp32",
                                 (f"attention.precision=paper-fp32fwd[{_BWD32}]",))


def log_grid(lo: float, hi: float, n: int) -> tuple[float, ...]:
    """n learning rates log-spaced from lo to hi, rounded to 3 significant digits (so that the
    folder names and the configs carry the same number)."""
    if not (0 < lo < hi) or n < 2:
        raise ValueError(f"log_grid needs 0 < lo < hi and n >= 2, got lo={lo}, hi={hi}, n={n}")
    return tuple(float(f"{lo * (hi / lo) ** (i / (n - 1)):.3g}") for i in range(n))


def lr_name(lr: float) -> str:
    """The run folder of one learning rate: lr0.003, lr0.000646."""
    return f"lr{lr:.3g}"


@dataclass(frozen=True)
class LRPreset:
    name: str
    repro: str                          # the repro preset (shipped config, shared overrides) the runs build on
    lrs: tuple[float, ...]              # peak learning rates, ascending
    arithmetics: tuple[Arithmetic, ...]
    steps: int
    reference: str = "fp32"             # the arithmetic the others are compared with (Arithmetic.name)
    harmed: str = "paper"               # the arithmetic the claim says is harmed
    fixes: tuple[str, ...] = ()         # arithmetics the claim says restore the reference's behaviour
    eval_batches: int = 20              # validation batches at the last step (reported, not judged)
    checkpoint_every: int = 250
    overrides: tuple[str, ...] = field(default_factory=tuple)  # shared by every run, after the repro preset's
    about: str = ""

    def __post_init__(self):
        if len(self.lrs) < 2:
            raise ValueError(f"lr preset {self.name!r}: needs at least 2 learning rates, got {self.lrs}")
        if any(not lr > 0 for lr in self.lrs) or list(self.lrs) != sorted(set(self.lrs)):
            raise ValueError(f"lr preset {self.name!r}: learning rates must be positive, distinct and ascending, "
                             f"got {self.lrs}")
        if len({lr_name(lr) for lr in self.lrs}) != len(self.lrs):
            raise ValueError(f"lr preset {self.name!r}: learning rates {self.lrs} are not distinct at 3 digits")
        names = [a.name for a in self.arithmetics]
        if len(set(names)) != len(names) or len({a.label for a in self.arithmetics}) != len(names):
            raise ValueError(f"lr preset {self.name!r}: repeated arithmetic name or label in {names}")
        bad = [n for n in names if not _SLUG.match(n)]
        if bad:
            raise ValueError(f"lr preset {self.name!r}: arithmetic names must be folder slugs "
                             f"(a-z, 0-9, '.', '+', '-'), got {bad}")
        for role, want in (("reference", (self.reference,)), ("harmed", (self.harmed,)), ("fixes", self.fixes)):
            missing = [n for n in want if n not in names]
            if missing:
                raise ValueError(f"lr preset {self.name!r}: {role} {missing} is not one of its arithmetics {names}")
        if self.steps < 1:
            raise ValueError(f"lr preset {self.name!r}: steps must be >= 1, got {self.steps}")

    def arithmetic(self, name: str) -> Arithmetic:
        return next(a for a in self.arithmetics if a.name == name)


def run_spec(arith: Arithmetic, lr: float, seed: int) -> RunSpec:
    """One run of the grid: the arithmetic, the peak lr, its cosine floor, the seed."""
    return RunSpec(f"{arith.name}/{lr_name(lr)}", "lr-sensitivity", f"{arith.label} at peak lr {lr:.3g}",
                   (*arith.overrides, f"optim.lr={lr!r}", f"optim.min_lr={lr * MIN_LR_FRACTION!r}",
                    f"train.seed={seed}"))


GRID = log_grid(3e-4, 3e-2, 7)   # 3e-4, 6.46e-4, 1.39e-3, 3e-3, 6.46e-3, 1.39e-2, 3e-2
ALL = (FP32, PAPER, PAPER_FIX, PAPER_FP32FWD)
FIXES = (PAPER_FP32FWD.name, PAPER_FIX.name)

LR_PRESETS: dict[str, LRPreset] = {p.name: p for p in (
    LRPreset("micro-lr", "micro", lrs=GRID, arithmetics=ALL, steps=1000, fixes=FIXES,
             about="the micro model (2 layers x 64 wide, T = 64, byte-level, 8 sequences a step), peak lr on a "
                   "log grid of 7 from 3e-4 to 3e-2, fp32 / paper / paper + the study's fix / paper-fp32fwd, "
                   "1,000 steps (warm-up 5%, cosine to lr/10); measured 23-36 s a run at lr 3e-3 on one core "
                   "(OMP_NUM_THREADS=1, the 2-core machine shared: fp32 29 s, paper 23 s, the study's fix 23 s, "
                   "paper-fp32fwd 36 s; 21-24 ms a step when the core was free), about 14 minutes a seed"),
    # the same grid carried up a decade (the same factor 10^(1/3) a step, so its first 7 lrs are micro-lr's and
    # their runs are reused when both write to one folder): micro-lr's 3e-2 end trained in every arithmetic
    LRPreset("micro-lr-wide", "micro", lrs=log_grid(3e-4, 3e-1, 10), arithmetics=ALL, steps=1000, fixes=FIXES,
             about="micro-lr's grid carried up to 3e-1 (10 lrs, 3 a decade), to find the lr at which each arithmetic "
                   "stops training; micro-lr's runs are its first 7 lrs (rerun into micro-lr's folder to reuse them)"),
    # the top of micro-lr-wide, where the arithmetics part, with the backward raised to fp32 as well: its first
    # four arithmetics' runs are micro-lr-wide's (reused in one folder)
    LRPreset("micro-lr-edge", "micro", lrs=log_grid(3e-4, 3e-1, 10)[6:],
             arithmetics=(*ALL, PAPER_BWD32, PAPER_FP32FWD_BWD32, FA2), steps=1000,
             fixes=(*FIXES, PAPER_BWD32.name, PAPER_FP32FWD_BWD32.name, FA2.name),
             about="the top of micro-lr-wide (0.03 to 0.3), where the arithmetics part, plus paper and paper-fp32fwd "
                   "with the backward raised to fp32, and production fa2: which half of the arithmetic holds the edge down; its first "
                   "four arithmetics are micro-lr-wide's runs (rerun into that folder to reuse them)"),
    LRPreset("tiny-cpu-lr", "tiny-cpu", lrs=GRID, arithmetics=ALL, steps=300, fixes=FIXES, checkpoint_every=50,
             eval_batches=10,
             about="the tiny-cpu model (4 layers x 256 wide, T = 256, 16 sequences a step), the micro-lr grid, "
                   "300 steps (warm-up 5%, cosine to lr/10); measured 1.8-2.8 s a step on one shared core "
                   "(OMP_NUM_THREADS=1), so 9-14 minutes a run and hours a seed: for more cores or a GPU"),
    LRPreset("micro-lr-smoke", "micro", lrs=(1e-3, 3e-2), arithmetics=(FP32, PAPER), steps=20,
             eval_batches=2, checkpoint_every=10,
             about="smoke test: the micro model, peak lr 1e-3 and 3e-2, fp32 and paper, 20 steps (seconds)"),
)}


def get_lr_preset(name: str) -> LRPreset:
    return lookup_preset(LR_PRESETS, name, "no lr-sensitivity grid for preset")
