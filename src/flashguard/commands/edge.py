"""``flashguard edge``: what diverges at the LR edge, one part of the attention error changed at a time.

At the learning rate where paper diverges and fp32 trains, trains arms that change one part of
the attention error (its sign at the same size, its size, delta's or O's, forward or backward,
the real kernel), >= 10 seeds each; judges claims E0-E10 (F1-F4 for micro-edge-forward) by
Fisher's exact test on the divergence counts, Holm-adjusted, with a log-rank test beside, into
OUT/edge.md and OUT/edge.json, with survival curves. Resumable: rerun the same command; seeds may
be split across processes.
"""
from __future__ import annotations

from .common import experiment

NAME, OVERRIDES = "edge", True


def _report(result: dict, out: str) -> None:
    for block in result["by_lr"]:
        print(f"peak lr {block['lr']:.3g}:")
        for a in block["arms"]:
            print(f"  {a['label']:<40} diverged {a['diverged']}/{a['finished']}")
        for c in block["claims"]:
            print(f"  {c['id']:<4} {c['verdict']:<12} {c['evidence']}")
    print(f"tables and runs: {out}/edge.md")


def _load():
    from ..experiments.edge import EDGE_PRESETS, get_edge_preset, run_edge
    return EDGE_PRESETS, get_edge_preset, run_edge


add, run = experiment(NAME, __doc__, _load, "micro-edge", _report, seeds=True)
