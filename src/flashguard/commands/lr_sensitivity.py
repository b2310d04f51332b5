"""``flashguard lr-sensitivity``: final loss over a grid of learning rates per attention arithmetic, with verdicts.

Trains each attention arithmetic of the preset at every learning rate of its log grid (same
seed, same batches) and measures Wortsman et al.'s (2023) LR sensitivity and the largest
trainable lr; judges claims L1 (does the arithmetic narrow what trains) and L2, ... (does each
fix restore it) into OUT/lr_sensitivity.md and OUT/lr_sensitivity.json, with the curves
(OUT/lr_curves.png). Resumable: rerun the same command.
"""
from __future__ import annotations

from .common import experiment, print_claims

NAME, OVERRIDES = "lr-sensitivity", True


def _report(result: dict, out: str) -> None:
    for m in result["means"]:
        largest = ", ".join("none" if x is None else f"{x:.3g}" for x in m["largest_trainable_lr"])
        sens = "-" if m["sensitivity"] is None else f"{m['sensitivity']:.3f}"
        print(f"{m['arithmetic']:<16} LR sensitivity {sens} (mean over seeds); largest trainable lr per seed {largest}")
    print_claims(result["claims"])
    print(f"tables and runs: {out}/lr_sensitivity.md; figure: {', '.join(result['figures'])}")


def _load():
    from ..experiments.lr_sensitivity import LR_PRESETS, get_lr_preset, run_lr_sensitivity
    return LR_PRESETS, get_lr_preset, run_lr_sensitivity


add, run = experiment(NAME, __doc__, _load, None, _report, seeds=True)
