"""The LR-sensitivity experiment (Wortsman et al. 2023, "Small-scale proxies for large-scale
Transformer training instabilities"): the final loss over a log grid of peak learning rates for
several attention arithmetics, at the same seed and batches. Does bf16 flash attention (the
study's reference arithmetic, ``paper``) narrow the range of learning rates that train, and do
the fixes (``paper-fp32fwd``, the study's stabilizer) restore fp32's range?

Runner: ``flashguard lr-sensitivity`` (``run_lr_sensitivity``); definitions
and verdict rules in analysis.py.
"""
from .analysis import HARM_CLAIM, compare, curve, final_loss, judge_fix, judge_harm, mean_curve, run_outcome
from .presets import LR_PRESETS, Arithmetic, LRPreset, get_lr_preset, log_grid, run_spec
from .runner import lr_markdown, run_lr_sensitivity

__all__ = ["run_lr_sensitivity", "lr_markdown", "LR_PRESETS", "LRPreset", "Arithmetic", "get_lr_preset", "log_grid",
           "run_spec", "curve", "mean_curve", "compare", "judge_harm", "judge_fix", "final_loss", "run_outcome",
           "HARM_CLAIM"]
