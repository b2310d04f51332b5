"""`flashguard repro` arguments and entry point."""
from __future__ import annotations

import argparse

from .claims import CLAIMS
from .presets import PRESETS, get_preset
from .runner import run_repro

__all__ = ["add_repro_arguments", "run_repro_command"]


def add_repro_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny-cpu", choices=list(PRESETS), help="training set-up (default: tiny-cpu)")
    p.add_argument("--claims", default=",".join(CLAIMS),
                   help=f"comma-separated claims to test (default: all of {','.join(CLAIMS)}); only their runs are trained")
    p.add_argument("--remedies", action="store_true", help="also train QK-LayerNorm, z-loss and soft-capping runs "
                                                           "and write the remedies table")
    p.add_argument("--steps", type=int, help="steps per run (default: the preset's)")
    p.add_argument("--out", required=True, help="output folder (resumable: rerun the same command to continue)")
    p.epilog = "key=value arguments override the preset's config for every run (e.g. data.dir=... model.n_layer=2)."


def run_repro_command(args) -> int:
    claims = [c.strip().upper() for c in args.claims.split(",") if c.strip()]
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    result = run_repro(get_preset(args.preset), args.out, claims=claims, remedies=args.remedies, steps=args.steps,
                       overrides=args.overrides)
    width = max(len(c["id"]) for c in result["claims"])
    for c in result["claims"]:
        print(f"{c['id']:<{width}}  {c['verdict']:<12}  {c['evidence']}")
    print(f"claims and runs: {args.out}/claims.md; write the report with: flashguard report {args.out}")
    return 0
