"""Summarise CPU-reproduction search runs (runs/search/*) as a Markdown table.

    PYTHONPATH=src python tools/search_summary.py runs/search/*

Divergence as the repro issue defines it (flashguard.train.divergence.LossWatch): the loss
reaches >= 2x its running minimum after warm-up, or a non-finite loss / gradient norm.
"""
from __future__ import annotations

import sys
from pathlib import Path

from flashguard.experiments.runs import summarize_run

HEADER = ["| run | attention precision | steps | final loss | min loss | max grad norm | diverged |",
          "|---|---|---|---|---|---|---|"]


def summarize(run: Path) -> dict:
    return {"run": run.name, **summarize_run(run)}


def row(s: dict) -> str:
    div = f"yes, step {s['diverged_at']} ({s['divergence']})" if s["diverged_at"] is not None else "no"
    return (f"| {s['run']} | `{s['precision']}` | {s['steps']} | {s['final_loss']:.3f} | {s['min_loss']:.3f} | "
            f"{s['max_grad_norm']:.3g} | {div} |")


def main(paths: list[str]) -> None:
    print("\n".join(HEADER))
    for p in paths:
        if (Path(p) / "metrics.jsonl").exists():
            print(row(summarize(Path(p))))


if __name__ == "__main__":
    main(sys.argv[1:])
