"""``flashguard repro``: the study's claims as matched training runs, with verdicts.

Trains a preset's matched runs (same seed, same batches): fp32 attention, the reference
arithmetic with no fix, the study's fix, paper-fp32fwd, and the study's localisation ablations;
judges claims C1-C6, C8 (held / not held / inconclusive, with the numbers behind each) into
OUT/claims.md and OUT/repro.json. Resumable: rerun the same command.

The other experiments are commands of their own: injection, lr-sensitivity, natural,
early-warning, edge.
"""
from __future__ import annotations

from .common import experiment

NAME, OVERRIDES = "repro", True


def _options(p) -> None:
    from ..experiments.repro import CLAIMS
    p.add_argument("--claims", default=None, help=f"comma-separated claims to test (default: all of "
                                                   f"{','.join(CLAIMS)}); only their runs are trained")
    p.add_argument("--remedies", action="store_true", help="also train QK-LayerNorm, z-loss and soft-capping runs "
                                                           "and write the remedies table")


def _arguments(args, preset) -> dict:
    from ..experiments.repro import CLAIMS
    claims = [c.strip().upper() for c in (args.claims or ",".join(CLAIMS)).split(",") if c.strip()]
    return {"claims": claims, "remedies": args.remedies}


def _report(result: dict, out: str) -> None:
    width = max(len(c["id"]) for c in result["claims"])
    for c in result["claims"]:
        print(f"{c['id']:<{width}}  {c['verdict']:<12}  {c['evidence']}")
    print(f"claims and runs: {out}/claims.md; write the report with: flashguard report {out}")


def _load():
    from ..experiments.repro import PRESETS, get_preset, run_repro
    return PRESETS, get_preset, run_repro


add, run = experiment(NAME, __doc__, _load, "tiny-cpu", _report, options=_options, arguments=_arguments)
