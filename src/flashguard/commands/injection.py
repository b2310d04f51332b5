"""``flashguard injection``: delta's error injected in fp32 training: does its sign or its size explode a run?

Trains the preset's grid of matched runs (same seed, same batches) that add an error of size
alpha to delta, under each sign rule (zero-mean, coherent with probability p, shuffled, the real
arithmetic's), in fp32 attention; writes the phase table, the divergence boundaries alpha*(p)
and claim I1 into OUT/injection.md and OUT/injection.json, with the phase diagram. Resumable:
rerun the same command.
"""
from __future__ import annotations

from .common import experiment, print_claims

NAME, OVERRIDES = "injection", True


def _report(result: dict, out: str) -> None:
    for col in result["columns"]:
        print(f"alpha*({col}) {result['boundaries'][col]['text']}")
    print_claims(result["claims"])
    print(f"table and runs: {out}/injection.md; figures: {', '.join(result['figures'])}")


def _load():
    from ..experiments.injection import INJECTION_PRESETS, get_injection_preset, run_injection
    return INJECTION_PRESETS, get_injection_preset, run_injection


add, run = experiment(NAME, __doc__, _load, "tiny-cpu", _report, seeds=True)
