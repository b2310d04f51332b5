"""Offline evaluation of the early-warning monitor on finished runs, the command line.

    python -m flashguard.diagnostics.evaluate RUN_DIR [RUN_DIR ...] [--json FILE]

Replays each run's metrics.jsonl through the Monitor (thresholds: flashguard.diagnostics.monitor,
warm-up from the run's config.toml) and prints, per run, the divergence step and the lead time
of the first warning, or whether a run that did not diverge had a (false) warning; then the
summary over all runs (``flashguard.diagnostics.evaluation``).
"""
from __future__ import annotations

from .evaluation import RunEvaluation, evaluate_runs

__all__ = ["main"]


def main(argv=None) -> int:
    """python -m flashguard.diagnostics.evaluate RUN_DIR [RUN_DIR ...]: offline evaluation."""
    import argparse
    import json
    ap = argparse.ArgumentParser(prog="python -m flashguard.diagnostics.evaluate", description=main.__doc__)
    ap.add_argument("runs", nargs="+", help="run folders (or metrics.jsonl files)")
    ap.add_argument("--json", help="also write the evaluation as JSON here")
    args = ap.parse_args(argv)
    summary = evaluate_runs(args.runs)
    for r in summary["runs"]:
        print(RunEvaluation(**r).summary())
    rate = summary["false_alarm_rate"]
    print(f"diverged {summary['diverged']}, stable {summary['stable']}; lead times {summary['lead_times']} "
          f"({summary['warned_in_time']} >= {summary['goal_steps']} steps, {summary['missed']} missed); "
          f"false alarms {summary['false_alarms']}" + ("" if rate is None else f" ({rate:.0%} of stable runs)"))
    if args.json:
        from ..utils.atomic import atomic_write_text
        atomic_write_text(args.json, json.dumps(summary, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
