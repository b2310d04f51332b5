"""``flashguard lab``: the rounding-bias lab, its verdicts printed and its tables written."""
from __future__ import annotations

import sys

from .common import described_parser

NAME, OVERRIDES = "lab", False


def add(sub, values: str):
    from ..numerics.policy import POLICIES
    p = described_parser(sub, "lab", "rounding-bias lab: the study's arithmetic facts with verdicts, open questions",
                         "Measures attention arithmetics on rows with planted ties against fp64 "
                         "and the fp32 noise floor: the study's facts (i)-(iii) in --precision with "
                         "verdicts, which arithmetic leans under ties and which stabilizer removes "
                         "it, where the bias enters, FlashAttention PR #2721. Writes lab.json, "
                         "lab.md and figures.", values)
    p.add_argument("--quick", action="store_true", help="fewer conditions and instances (35 s on one core)")
    p.add_argument("--out", default=None, help="output folder for lab.json, lab.md and figures (default: lab for "
                                               "the default precision, lab-PRECISION for another, so that one "
                                               "precision's results never overwrite another's)")
    # --precision, as attention.precision and flash_attention(precision=) call it
    p.add_argument("--precision", default="paper",
                   help=f"arithmetic the study's facts are tested in: {', '.join(POLICIES)} "
                        "or 'preset[field=value,...]' (default: paper)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--capture", default=None, metavar="RUN_DIR",
                   help="also measure the q, k, v, dO a training run's checkpoint saw (one problem per layer)")
    p.add_argument("--capture-step", type=int, default=None, help="checkpoint step of --capture (default: latest)")
    p.add_argument("--capture-batches", type=int, default=4, help="logged batches to capture (default: 4)")
    return p


def lab_out(precision: str) -> str:
    """`flashguard lab`'s default output folder for a precision: lab (the default), lab-PRECISION otherwise."""
    if precision == "paper":
        return "lab"
    return "lab-" + "".join(c if c.isalnum() or c in "-_.=" else "_" for c in precision).strip("_")


def run(args) -> int:
    from ..experiments import lab
    from ..experiments.lab.report import write_lab
    from ..numerics.policy import get_policy
    get_policy(args.precision)  # a typo is refused before anything runs
    out = args.out if args.out is not None else lab_out(args.precision)
    captured = None
    if args.capture:
        from ..experiments.lab.captured import from_run
        try:
            captured = from_run(args.capture, step=args.capture_step, batches=args.capture_batches)
        except (ValueError, FileNotFoundError) as e:
            print(f"flashguard lab: error: --capture {args.capture}: {e}", file=sys.stderr)
            return 2
    result = lab.run_lab(quick=args.quick, precision=args.precision, seed=args.seed, progress=lambda m: print(f"  {m}"),
                         captured=captured)
    paths = write_lab(result, out)
    _print_result(result, paths)
    return 0


def _print_result(result: dict, paths: dict) -> None:
    width = max(len(k) for k in result["verdicts"])
    for key, verdict in result["verdicts"].items():
        print(f"{key:<{width}}  {verdict}")
    for pol, answer in result["answers"].items():
        print(f"{pol}: {answer['line']}")
    for pol, answer in (result.get("captured") or {}).get("answers", {}).items():
        print(f"{pol} (captured): {answer['line']}")
    print(f"{len(result['rows'])} measurements in {result['runtime_s']:.0f} s; tables in {paths['md']}")
