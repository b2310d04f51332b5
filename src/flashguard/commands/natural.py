"""``flashguard natural``: does delta lean in natural training? The natural-preconditions arms, claims N1-N5.

Trains the natural-preconditions arms (fp32, paper, paper-fix, paper-fp32fwd on short
documents; same seed, same batches) with the probes on, or analyses finished ones given by
--runs, training nothing; judges claims N1-N5 on the delta lean across probes and divergence
into OUT/natural.md and OUT/natural.json. Resumable: rerun the same command.
"""
from __future__ import annotations

from .common import experiment, print_claims

NAME, OVERRIDES = "natural", True


def _options(p) -> None:
    p.add_argument("--runs", nargs="+", metavar="ARM=DIR",
                   help="ARM=DIR,ARM=DIR,...: run folders to analyse, nothing trained (arms not given are "
                        "'not run'; an unfinished run is judged on what it has)")
    p.add_argument("--arms", metavar="ARM,ARM",
                   help="train only these arms (comma-separated; default: all), e.g. to train two arms in two "
                        "processes with the same --out; the results judge every arm found under OUT/runs/")


def _arguments(args, preset) -> dict:
    from ..experiments.natural import parse_runs
    if args.runs is not None and args.arms is not None:
        raise ValueError("--arms chooses arms to train; --runs analyses finished folders and trains nothing: "
                         "give one of them")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()] if args.arms is not None else None
    return {"runs": parse_runs(args.runs, preset) if args.runs is not None else None, "arms": arms}


def _report(result: dict, out: str) -> None:
    from ..experiments.natural.analysis import series_text
    for o in result["outcomes"]:
        leans = "; ".join(series_text(r) for r in o["delta"]) or "no delta probes"
        print(f"{o['arm']:<14} {o['state']}; delta across probes: {leans}")
    print_claims(result["claims"])
    print(f"tables: {out}/natural.md, {out}/natural.json")


def _load():
    from ..experiments.natural import NATURAL_PRESETS, get_natural_preset, run_natural
    return NATURAL_PRESETS, get_natural_preset, run_natural


add, run = experiment(NAME, __doc__, _load, "nat512", _report, options=_options, arguments=_arguments)
