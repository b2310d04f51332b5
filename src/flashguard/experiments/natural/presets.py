"""The natural-preconditions experiment's arms: which runs `flashguard natural` trains.

A preset is one shipped config (model, data, seed, batch order) and a few arms that differ in
the attention arithmetic only: every arm starts from the same weights and sees the same batches.
The roles name the arms the claims read (analysis.py): ``reference`` (fp32 attention, the
control), ``harmed`` (the arithmetic asked about: the study's reference arithmetic, no fix; in
``nat512-kernels`` torch's real kernel) and the two fixes, each judged separately on the layers
where ``harmed`` leans. A preset without a fix arm sets its role to None: its claim is then
"not applicable".
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ...train.shipped import shipped_configs
from ..repro.presets import lookup_preset

__all__ = ["Arm", "NaturalPreset", "NATURAL_PRESETS", "get_natural_preset", "ARM_KEYS", "FP32", "PAPER",
           "PAPER_FIX", "PAPER_FP32FWD", "SDPA", "TORCH_CPU", "FA2", "KERNEL_ARMS"]

# keys an arm sets (and train.steps, set by the preset or --steps): a user override of one would
# silently make the arms something else, so it is refused
ARM_KEYS = ("attention.backend", "attention.precision", "attention.stabilizer", "train.steps")

_SLUG = re.compile(r"^[a-z0-9][a-z0-9.+-]*$")


@dataclass(frozen=True)
class Arm:
    name: str                      # folder name under OUT/runs/ and the name --runs uses (a slug)
    label: str                     # as the tables show it
    overrides: tuple[str, ...]     # the [attention] keys that make this arm


FP32 = Arm("fp32", "fp32 attention (the control)", ("attention.precision=fp32",))
PAPER = Arm("paper", "paper (the study's reference arithmetic, no fix)", ("attention.precision=paper",))
PAPER_FIX = Arm("paper-fix", "paper + the study's fix", ("attention.precision=paper", "attention.stabilizer=paper"))
PAPER_FP32FWD = Arm("paper-fp32fwd", "paper-fp32fwd (the lab's fix)", ("attention.precision=paper-fp32fwd",))
# the kernels' arms: torch's real kernel (bf16 under autocast; its probes measure the kernel itself,
# flashguard.diagnostics.probes), flashguard's faithful model of torch's CPU flash kernel, and production FA2
SDPA = Arm("sdpa", "torch sdpa (torch's real kernel, bf16)", ("attention.backend=sdpa",))
TORCH_CPU = Arm("torch-cpu", "torch-cpu (flashguard's model of torch's CPU flash kernel)",
                ("attention.precision=torch-cpu",))
FA2 = Arm("fa2", "fa2 (production FA2 arithmetic)", ("attention.precision=fa2",))
KERNEL_ARMS = (SDPA, FP32, FA2, TORCH_CPU)  # the question first, the slowest (the emulated torch-cpu) last


@dataclass(frozen=True)
class NaturalPreset:
    name: str
    config: str                          # a shipped config's name (configs/*.toml)
    steps: int
    diagnostics_every: int               # the probes that write numerics/delta_err_z/L* (lean_across_probes)
    arms: tuple[Arm, ...] = (FP32, PAPER, PAPER_FIX, PAPER_FP32FWD)
    reference: str = FP32.name           # the control (N2, N5)
    harmed: str = PAPER.name             # where the lean should arise (N1, N5)
    lab_fix: str | None = PAPER_FP32FWD.name   # N3 (None: no such arm, N3 not applicable)
    study_fix: str | None = PAPER_FIX.name     # N4 (None: no such arm, N4 not applicable)
    overrides: tuple[str, ...] = field(default_factory=tuple)  # shared by every arm, before the user's
    about: str = ""

    def __post_init__(self):
        names = [a.name for a in self.arms]
        if len(set(names)) != len(names):
            raise ValueError(f"natural preset {self.name!r}: repeated arm name in {names}")
        bad = [n for n in names if not _SLUG.match(n)]
        if bad:
            raise ValueError(f"natural preset {self.name!r}: arm names must be folder slugs, got {bad}")
        for role in ("reference", "harmed", "lab_fix", "study_fix"):
            if role in ("lab_fix", "study_fix") and getattr(self, role) is None:
                continue
            if getattr(self, role) not in names:
                raise ValueError(f"natural preset {self.name!r}: {role} {getattr(self, role)!r} is not one of its "
                                 f"arms {names}")
        if self.steps < 1 or self.diagnostics_every < 1:
            raise ValueError(f"natural preset {self.name!r}: steps and diagnostics_every must be >= 1")

    def arm(self, name: str) -> Arm:
        return next(a for a in self.arms if a.name == name)

    def config_path(self) -> Path:
        """The preset's TOML, a shipped config found by name in the installed package."""
        shipped = shipped_configs()
        if self.config not in shipped:
            raise FileNotFoundError(f"natural preset {self.name!r} needs the shipped config {self.config!r}, not "
                                    f"found (shipped: {', '.join(shipped) or 'none'}); reinstall flashguard")
        return shipped[self.config]


NATURAL_PRESETS: dict[str, NaturalPreset] = {p.name: p for p in (
    # docs/natural/README.md: `flashguard train tiny-cpu-512-docs --out runs/nat512-ARM ATTENTION-KEYS
    # train.steps=1000 train.diagnostics_every=50 train.divergence_factor=2`, one arm after another
    NaturalPreset("nat512", "tiny-cpu-512-docs", steps=1000, diagnostics_every=50,
                  about="the tiny-cpu model at T = 512 on short documents (data/embedded-docs, data.doc_starts: "
                        "a median of 2 separators a window, the study's window structure), seed 1337, 1,000 steps, "
                        "probes every 50 steps on every layer; on one core of a Sapphire Rapids about 0.9 s a step, 17 "
                        "min an arm (paper; sdpa 18, fa2 28: benchmarks/natural_arm.py), 2.0-3.5 s and 38-60 min "
                        "before the C kernels on the machines of the first runs"),
    NaturalPreset("natural-smoke", "micro", steps=12, diagnostics_every=2,
                  overrides=("train.eval_every=6", "train.eval_batches=1", "train.checkpoint_every=6",
                             "train.keep_last=1"),
                  about="smoke test: the micro model (2 layers x 64 wide, T = 64), 12 steps probed every 2 "
                        "(seconds an arm)"),
    # does torch's real kernel lean in natural training? `flashguard natural --preset nat512-kernels
    # --out runs/nat512-kernels` (docs/natural/README.md)
    NaturalPreset("nat512-kernels", "tiny-cpu-512-docs", steps=1000, diagnostics_every=50, arms=KERNEL_ARMS,
                  harmed=SDPA.name, lab_fix=None, study_fix=None,
                  about="does torch's real kernel lean in natural training? nat512's set-up (the tiny-cpu model at "
                        "T = 512 on short documents, data.doc_starts, seed 1337, 1,000 steps, probes every 50 steps "
                        "on every layer) with attention through torch's own SDPA (sdpa: on CPU its fused flash kernel "
                        "in bf16, probed as the kernel itself, delta from its O), next to fp32 (the control), "
                        "torch-cpu (flashguard's model of that kernel, with its ties counted) and fa2; no fix arms "
                        "(N3, N4 not applicable). Run: `flashguard natural --preset "
                        "nat512-kernels --out runs/nat512-kernels` (or two arms at a time with --arms, one process a "
                        "core); measured on a shared 2-core AMD EPYC, minutes of steps an arm: sdpa 30, fp32 50, fa2 51, "
                        "torch-cpu 68 (with the C kernels, numerics/native.py)"),
    NaturalPreset("natural-kernels-smoke", "micro", steps=12, diagnostics_every=2, arms=KERNEL_ARMS,
                  harmed=SDPA.name, lab_fix=None, study_fix=None,
                  overrides=("train.eval_every=6", "train.eval_batches=1", "train.checkpoint_every=6",
                             "train.keep_last=1"),
                  about="smoke test of nat512-kernels' arms: the micro model (2 layers x 64 wide, T = 64), 12 steps "
                        "probed every 2 (seconds an arm)"),
)}


def get_natural_preset(name: str) -> NaturalPreset:
    return lookup_preset(NATURAL_PRESETS, name, "no natural-preconditions arms for preset")
