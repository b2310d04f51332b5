"""``flashguard demo``: the main job (lab, matched training runs, claims, report)."""
from __future__ import annotations

from .common import wrap

NAME, OVERRIDES = "demo", False


def add(sub, values: str):
    d = sub.add_parser("demo", help="the main job (minutes on a CPU): lab, matched training runs, claims and a report",
                       description=wrap("Prepares the embedded corpus (no network), runs the rounding-bias lab "
                                        "(quick), trains fp32 attention, the study's reference arithmetic with no "
                                        "fix, with the study's fix and with the lab's measured fix (paper-fp32fwd) "
                                        "on the same batches with the mechanism probes on, judges claims C1, C5, "
                                        "C6, C8, trains the error-injection comparison and a short edge "
                                        "attribution (2 seeds) and writes OUT/report/report.html. Rerun to resume. Finished runs keep no "
                                        "checkpoints (the report reads their metrics) unless --keep-checkpoints."))
    d.add_argument("--out", default="demo", help="output folder (default: demo); rerun to resume")
    d.add_argument("--data", default="data/embedded", help="corpus folder, prepared there if missing "
                                                           "(default: data/embedded)")
    d.add_argument("--steps", type=int, help="steps per training run, >= 1 (default: 200 for the matched runs, 1,500 for the causal comparison)")
    d.add_argument("--keep-checkpoints", action="store_true",
                   help="keep each run's last checkpoint (about 40 MB each; for flashguard diagnose)")
    return d


def run(args) -> int:
    from ..experiments.demo import run_demo
    run_demo(args.out, data_dir=args.data, steps=args.steps, keep_checkpoints=args.keep_checkpoints)
    return 0
