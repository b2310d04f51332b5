"""``flashguard early-warning``: the early-warning detectors measured on finished runs."""
from __future__ import annotations

from .common import wrap

NAME, OVERRIDES = "early-warning", False


def add(sub, values: str):
    p = sub.add_parser(NAME, help="do the early-warning detectors warn before a divergence? (on finished runs)",
                       description=wrap("Replays the early-warning detectors over finished training runs "
                                        "(nothing is trained): lead times and misses on the divergent runs, "
                                        "false alarms on the stable ones, thresholds calibrated on the odd "
                                        "seeds and measured on the even ones. Writes OUT/early_warning.md, "
                                        "OUT/early_warning.json and figures."))
    p.add_argument("--runs", nargs="+", metavar="DIR", required=True,
                   help="folders of finished runs (searched recursively; unfinished runs skipped)")
    p.add_argument("--out", required=True, help="output folder")
    return p


def _num(x) -> str:
    return "-" if x is None else f"{x:g}"


def run(args) -> int:
    from ..experiments.early_warning import run_early_warning
    result = run_early_warning(args.runs, args.out)
    c = result["counts"]
    print(f"{c['runs']} runs: {c['divergent']} divergent, {c['stable']} stable ({len(result['skipped'])} skipped)")
    for d in result["detectors"]:
        m, cal = result["default"][d["name"]], result["calibrated"][d["name"]]
        print(f"{d['name']:<16} default {d['default']:g}: hits {m['hits']}/{m['divergent']}, median lead "
              f"{_num(m['lead']['median'])}, false alarms {m['false_alarms']}/{m['stable']}; "
              f"calibrated threshold {_num(cal['threshold'])}" + ("" if cal["met_target"] else " (target not met)"))
    print(f"tables: {args.out}/early_warning.md; figures: {', '.join(result['figures'])}")
    return 0
