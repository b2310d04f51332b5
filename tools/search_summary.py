"""Summarise CPU-reproduction search runs (runs/search/*) as a Markdown table.

    python tools/search_summary.py runs/search/*

Divergence as the repro issue defines it: the loss reaches >= 2x its running minimum, or a
non-finite loss / gradient norm (the trainer then stops with divergence.json).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def summarize(run: Path) -> dict:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    best, first_div, max_ratio = math.inf, None, 0.0
    for r in recs:
        loss = r["loss/train"]
        if not math.isfinite(loss) or not math.isfinite(r.get("grad/norm", 0.0)):
            first_div = first_div if first_div is not None else r["step"]
            continue
        best = min(best, loss)
        max_ratio = max(max_ratio, loss / best)
        if loss >= 2 * best and first_div is None:
            first_div = r["step"]
    cfg = (run / "config.toml").read_text() if (run / "config.toml").exists() else ""
    precision = next((line.split("=", 1)[1].strip().strip('"') for line in cfg.splitlines()
                      if line.startswith("precision")), "?")
    vals = [r["loss/val"] for r in recs if "loss/val" in r]
    return {"run": run.name, "precision": precision, "steps": len(recs), "final_loss": recs[-1]["loss/train"],
            "min_loss": best, "max_loss_over_min": max_ratio, "diverged_at": first_div,
            "max_grad_norm": max(r.get("grad/norm", 0.0) for r in recs), "last_val": vals[-1] if vals else None,
            "stopped": (run / "divergence.json").exists()}


def main(paths: list[str]) -> None:
    print("| run | attention precision | steps | final loss | min loss | max loss/min | max grad norm | diverged |")
    print("|---|---|---|---|---|---|---|---|")
    for p in paths:
        if not (Path(p) / "metrics.jsonl").exists():
            continue
        s = summarize(Path(p))
        div = f"yes, step {s['diverged_at']}" if s["diverged_at"] is not None else "no"
        print(f"| {s['run']} | `{s['precision']}` | {s['steps']} | {s['final_loss']:.3f} | {s['min_loss']:.3f} | "
              f"{s['max_loss_over_min']:.2f} | {s['max_grad_norm']:.3g} | {div} |")


if __name__ == "__main__":
    main(sys.argv[1:])
