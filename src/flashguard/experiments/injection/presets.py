"""The injection experiment's grids: which matched runs `flashguard injection` trains.

An arm is one sign rule at one alpha (``[injection]`` overrides); every arm of a seed starts
from the same config, seed and batch order as the repro preset it builds on, so arms differ in
the injected delta error only. Columns of the phase diagram: ``zero-mean`` (coherent p = 1/2),
``coherent`` at each p > 1/2 of the grid, ``shuffled``, ``real``. ``real`` at alpha = 1 is the
arithmetic itself (bit-identical to no injection, tests/train/test_injection.py): every seed's
baseline. It runs with the injection on, so that [injection] overrides given to every run (e.g.
``injection.layers=[1]``: the one-layer variant) apply to it as well.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..repro.presets import RunSpec, lookup_preset

__all__ = ["InjectionPreset", "INJECTION_PRESETS", "get_injection_preset", "Arm", "arms", "columns"]


@dataclass(frozen=True)
class InjectionPreset:
    name: str
    repro: str                    # the repro preset (config, arithmetic, shared overrides) the runs build on
    alphas: tuple[float, ...]     # sizes of the injected error, in units of the real error |e|
    ps: tuple[float, ...]         # coherent p values; 0.5 is the zero-mean column
    steps: int
    diagnostics_every: int        # probes (W_Q norms, max logit) of every layer every N steps
    # injection.reference of every run (an override may change it). fp32 for the paper arithmetic:
    # its e (bf16-sized) moves by < 1e-3 of mean |e| against fp64 and keeps every sign
    # (tests/train/test_injection.py), at 1.5x a step's cost instead of 2.2x (benchmarks/injection.py)
    reference: str = "fp32"
    overrides: tuple[str, ...] = field(default_factory=tuple)
    about: str = ""
    only: tuple[str, ...] = ()    # arm names to train (empty: the whole grid)


# the micro model's injection set-up, shared by its grid, its one-layer variant and the demo's arms
MICRO_TRAINING = ("optim.lr=3e-3", "optim.schedule=constant", "optim.warmup_steps=20",
                  "train.checkpoint_every=250", "train.keep_last=1")

INJECTION_PRESETS: dict[str, InjectionPreset] = {p.name: p for p in (
    InjectionPreset("tiny-cpu", "tiny-cpu", alphas=(1, 3, 10, 30, 100), ps=(0.5, 0.6, 0.75, 1.0), steps=500,
                    diagnostics_every=25,
                    about="the tiny-cpu repro set-up (4 x 256, T = 256, paper arithmetic, lr 2e-3 constant): "
                          "alpha in {1, 3, 10, 30, 100} x p in {0.5, 0.6, 0.75, 1} plus shuffled and real, "
                          "500 steps"),
    InjectionPreset("tiny-cpu-decisive", "tiny-cpu", alphas=(1, 10, 100), ps=(0.5, 1.0), steps=400,
                    diagnostics_every=25,
                    only=("real-a1", "coherent-p1-a10", "zero-mean-a10", "zero-mean-a100", "shuffled-a10"),
                    about="the decisive points of the tiny-cpu grid: the arithmetic itself, a fully coherent "
                          "error 10x the real one, zero-mean errors 10x and 100x, the real values shuffled "
                          "across rows at 10x; 400 steps"),
    InjectionPreset("micro-grid", "micro", alphas=(1, 3, 10, 30, 100), ps=(0.5, 0.6, 0.75, 1.0), steps=1500,
                    diagnostics_every=25,
                    overrides=MICRO_TRAINING,
                    about="the whole grid on the micro model (2 layers x 64 wide, T = 64, byte-level, paper "
                          "arithmetic, lr 3e-3 constant): alpha in {1, 3, 10, 30, 100} x p in {0.5, 0.6, 0.75, 1} "
                          "plus shuffled and real, 1,500 steps (about a minute a run on one core): the scale at "
                          "which a coherent error runs to the divergence rule within minutes"),
    # the demo's arms were chosen from the micro-grid's measured cells (seeds 1-5,
    # docs/injection/micro-grid): the one diverging at every seed with the smallest error, a lean of
    # p = 0.75 at the real error's own size (coherent component 0.5; diverged at steps 804-968),
    # against a zero-mean error 100x larger (trained on at every seed)
    InjectionPreset("micro-demo", "micro", alphas=(1, 100), ps=(0.5, 0.75), steps=1500, diagnostics_every=25,
                    overrides=MICRO_TRAINING,
                    only=("real-a1", "coherent-p0.75-a1", "zero-mean-a100"),
                    about="`flashguard demo`'s causal comparison, three arms of the micro-grid: the arithmetic "
                          "itself, its delta error at its own size but leaning (sign + with probability 0.75), "
                          "and at 100x its size with no lean (zero-mean)"),
    InjectionPreset("micro-one-layer", "micro", alphas=(1, 10, 100), ps=(0.5, 0.6, 1.0), steps=1500,
                    diagnostics_every=25,
                    overrides=MICRO_TRAINING,
                    only=("real-a1", "coherent-p0.6-a100", "coherent-p1-a10"),
                    about="the one-layer variant on the micro model (run it with injection.layers=[0] or [1]): "
                          "the arithmetic itself, the soonest-diverging cell of the micro-grid (coherent p 0.6 at "
                          "alpha 100) and the fully coherent error at 10x, injected into one layer only"),
    InjectionPreset("micro", "micro", alphas=(1, 10), ps=(0.5, 1.0), steps=30, diagnostics_every=10,
                    about="smoke test: the micro model, alpha in {1, 10} x p in {0.5, 1} plus shuffled and real, "
                          "30 steps (seconds)"),
)}


def get_injection_preset(name: str) -> InjectionPreset:
    return lookup_preset(INJECTION_PRESETS, name, "no injection grid for preset")


@dataclass(frozen=True)
class Arm:
    column: str          # zero-mean | coherent-p<p> | shuffled | real
    rule: str
    p: float | None
    alpha: float

    @property
    def name(self) -> str:
        return f"{self.column}-a{self.alpha:g}"

    @property
    def baseline(self) -> bool:
        return self.rule == "real" and self.alpha == 1

    def run_spec(self, seed: int) -> RunSpec:
        inj = [f'injection.rule="{self.rule}"', f"injection.alpha={float(self.alpha)!r}"]
        if self.rule == "coherent":
            inj.append(f"injection.p={float(self.p)!r}")
        what = (f"sign + with probability {self.p:g}" if self.rule == "coherent" else
                {"zero-mean": "random sign", "shuffled": "the values of e permuted across rows",
                 "real": "e as computed"}[self.rule])
        title = ("the arithmetic's own delta (real at alpha 1: bit-identical to no injection)" if self.baseline
                 else f"delta = delta_ref + {self.alpha:g} x e, {what}")
        return RunSpec(self.name, "injection", title, (*inj, f"train.seed={seed}"))


def columns(ps) -> list[tuple[str, str, float | None]]:
    """(column, rule, p) of the phase diagram, left to right: p ascending, then shuffled and real."""
    out = []
    for p in sorted(set(float(x) for x in ps)):
        if not 0.5 <= p <= 1.0:
            raise ValueError(f"coherent p must lie in [0.5, 1], got {p}")
        out.append(("zero-mean", "zero-mean", None) if p == 0.5 else (f"coherent-p{p:g}", "coherent", p))
    return out + [("shuffled", "shuffled", None), ("real", "real", None)]


def arms(preset: InjectionPreset) -> list[Arm]:
    """Every arm of the grid: the baseline first, then column by column, alpha ascending."""
    out = [Arm(c, r, p, float(a)) for c, r, p in columns(preset.ps) for a in sorted(preset.alphas)]
    if preset.only:
        unknown = set(preset.only) - {a.name for a in out}
        if unknown:
            raise ValueError(f"injection preset {preset.name!r}: no arm named {sorted(unknown)} in its grid")
        out = [a for a in out if a.name in preset.only]
    return sorted(out, key=lambda a: not a.baseline)
