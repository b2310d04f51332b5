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


def _arguments(args, preset) -> dict:
    from ..experiments.natural import parse_runs
    return {"runs": parse_runs(args.runs, preset) if args.runs is not None else None}


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
