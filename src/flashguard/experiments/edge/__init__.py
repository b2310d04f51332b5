"""The edge-attribution experiment (issue 23): at the lr where `paper` diverges and fp32 trains,
which part of the attention's bf16 error - its lean or its size, delta's or O's, forward or
backward - makes the divergence. presets.py: the arms and the claims; analysis.py: the rules;
runner.py: the runs and the report; sizes.py: the injected errors' measured sizes."""
from .presets import EDGE_PRESETS, get_edge_preset
from .runner import edge_markdown, run_edge

__all__ = ["EDGE_PRESETS", "get_edge_preset", "run_edge", "edge_markdown"]
