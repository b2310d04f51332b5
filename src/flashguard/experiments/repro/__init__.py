"""`flashguard repro`: the study's claims as matched training runs with verdicts."""
from .claims import CLAIMS, judge_claims
from .presets import PRESETS, ReproPreset, RunSpec, get_preset, run_specs
from .runner import claims_markdown, run_repro

__all__ = ["CLAIMS", "judge_claims", "PRESETS", "ReproPreset", "RunSpec", "get_preset", "run_specs", "run_repro",
           "claims_markdown"]
