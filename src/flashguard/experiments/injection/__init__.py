"""The error-injection experiment (issue 12): is it the sign structure of the delta error, not its
size, that makes low-precision flash attention training explode?

Training option: the ``[injection]`` config section (flashguard.train.config.InjectionConfig;
mechanism in flashguard.attention.injection). Runner: ``flashguard injection``
(``run_injection``), matched runs over a grid of alpha x sign rule, with the phase diagram of the
divergence boundary alpha*(p) and the verdict I1 (``judge_coherence``).
"""
from .analysis import COHERENCE_CLAIM, boundaries, cell_outcomes, judge_coherence, run_outcome
from .presets import INJECTION_PRESETS, Arm, InjectionPreset, arms, columns, get_injection_preset
from .runner import injection_markdown, run_injection

__all__ = ["run_injection", "injection_markdown", "INJECTION_PRESETS", "InjectionPreset", "get_injection_preset",
           "Arm", "arms", "columns", "judge_coherence", "cell_outcomes", "boundaries", "run_outcome",
           "COHERENCE_CLAIM"]
