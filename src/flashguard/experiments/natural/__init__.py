"""The natural-preconditions experiment (issue #12 item 4): matched runs of one config (the
study's window structure: short documents, T = 512) that differ in the attention arithmetic
only (fp32, paper, paper + the study's fix, paper-fp32fwd), and claims N1-N5 on them: does a
positive delta lean arise in real training in the reference arithmetic, not in fp32, do the
fixes remove it, and does it make the run diverge? Preset ``nat512-kernels`` asks the same of
torch's real kernel (arms fp32, sdpa, torch-cpu, fa2; no fix arms: N3, N4 not applicable).

Runner: ``flashguard natural`` (``run_natural``; trains the arms, or with
``--runs arm=DIR,...`` analyses finished folders); definitions and verdict rules in analysis.py.
"""
from .analysis import CLAIMS, RULES, arm_outcome, judge_claims, rules_text
from .presets import NATURAL_PRESETS, Arm, NaturalPreset, get_natural_preset
from .runner import natural_markdown, parse_runs, run_natural

__all__ = ["run_natural", "natural_markdown", "parse_runs", "NATURAL_PRESETS", "NaturalPreset", "Arm",
           "get_natural_preset", "CLAIMS", "RULES", "arm_outcome", "judge_claims", "rules_text"]
