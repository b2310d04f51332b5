"""`flashguard repro` arguments and entry point."""
from __future__ import annotations

import argparse

from .claims import CLAIMS
from .presets import PRESETS, get_preset
from .runner import run_repro

__all__ = ["add_repro_arguments", "run_repro_command"]


def add_repro_arguments(p: argparse.ArgumentParser) -> None:
    from ..injection.presets import INJECTION_PRESETS
    from ..edge.presets import EDGE_PRESETS
    from ..lr_sensitivity.presets import LR_PRESETS
    from ..natural.presets import NATURAL_PRESETS
    p.add_argument("--preset", default=None,
                   help=f"training set-up (default: tiny-cpu; natural: nat512); claims: {', '.join(PRESETS)}; "
                        f"injection: {', '.join(INJECTION_PRESETS)}; lr-sensitivity: {', '.join(LR_PRESETS)}; "
                        f"natural: {', '.join(NATURAL_PRESETS)}; edge: {', '.join(EDGE_PRESETS)}")
    p.add_argument("--experiment", default="claims",
                   choices=("claims", "injection", "early-warning", "lr-sensitivity", "natural", "edge"),
                   help="claims: the study's claims as matched runs (default); injection: the delta error-injection "
                        "grid (alpha x sign rule) with its phase diagram; early-warning: the early-warning detectors "
                        "measured on finished runs (--runs), nothing trained; lr-sensitivity: final loss over a log "
                        "grid of learning rates per attention arithmetic (Wortsman et al. 2023), with verdicts; "
                        "natural: the natural-preconditions arms (fp32, paper, paper-fix, paper-fp32fwd on short "
                        "documents) with claims N1-N5 on the delta lean across probes and divergence (trains the "
                        "arms, or analyses finished ones given by --runs arm=DIR,...); edge: at the lr where paper "
                        "diverges and fp32 trains, arms that change one part of the attention error (its sign at the "
                        "same size, its size, delta's or O's, forward or backward, the real kernel), >= 10 seeds, "
                        "Fisher and log-rank against paper (claims E0-E10)")
    p.add_argument("--runs", nargs="+", metavar="DIR",
                   help="early-warning: folders of finished runs (searched recursively; unfinished runs skipped); "
                        "natural: ARM=DIR,ARM=DIR,... run folders to analyse, nothing trained (arms not given are "
                        "'not run'; an unfinished run is judged on what it has)")
    p.add_argument("--seeds", help="injection, lr-sensitivity, edge: comma-separated training seeds, every arm (every "
                                   "run of the grid) per seed (default: the config's train.seed)")
    p.add_argument("--claims", default=None,
                   help=f"comma-separated claims to test (default: all of {','.join(CLAIMS)}); only their runs are trained")
    p.add_argument("--remedies", action="store_true", help="also train QK-LayerNorm, z-loss and soft-capping runs "
                                                           "and write the remedies table")
    p.add_argument("--steps", type=int, help="steps per run (default: the preset's)")
    p.add_argument("--out", required=True, help="output folder (resumable: rerun the same command to continue)")
    p.epilog = "key=value arguments override the preset's config for every run (e.g. data.dir=... model.n_layer=2)."


def run_repro_command(args) -> int:
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.experiment == "injection":
        return _run_injection_command(args)
    if args.experiment == "early-warning":
        return _run_early_warning_command(args)
    if args.experiment == "lr-sensitivity":
        return _run_lr_sensitivity_command(args)
    if args.experiment == "natural":
        return _run_natural_command(args)
    if args.experiment == "edge":
        return _run_edge_command(args)
    if args.runs is not None:
        raise ValueError("--runs applies to --experiment early-warning and natural only")
    if args.seeds is not None:
        raise ValueError("--seeds applies to --experiment injection, lr-sensitivity and edge only")
    claims = [c.strip().upper() for c in (args.claims or ",".join(CLAIMS)).split(",") if c.strip()]
    result = run_repro(get_preset(args.preset or "tiny-cpu"), args.out, claims=claims, remedies=args.remedies,
                       steps=args.steps, overrides=args.overrides)
    width = max(len(c["id"]) for c in result["claims"])
    for c in result["claims"]:
        print(f"{c['id']:<{width}}  {c['verdict']:<12}  {c['evidence']}")
    print(f"claims and runs: {args.out}/claims.md; write the report with: flashguard report {args.out}")
    return 0


def _run_injection_command(args) -> int:
    from ..injection import get_injection_preset, run_injection
    if args.claims is not None or args.remedies:
        raise ValueError("--claims and --remedies apply to --experiment claims, not injection")
    seeds = _seeds(args.seeds)
    result = run_injection(get_injection_preset(args.preset or "tiny-cpu"), args.out, seeds=seeds, steps=args.steps,
                           overrides=args.overrides)
    for col in result["columns"]:
        print(f"alpha*({col}) {result['boundaries'][col]['text']}")
    _print_claims(result["claims"])
    print(f"table and runs: {args.out}/injection.md; figures: {', '.join(result['figures'])}")
    return 0


def _seeds(text: str | None) -> list[int] | None:
    """--seeds as a list of integers (None: not given)."""
    if text is None:
        return None
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers, got {text!r}") from None
    if not seeds:
        raise ValueError("--seeds is empty")
    return seeds


def _refuse(given, experiment: str) -> None:
    """Refuse by name the options of ``given`` ((name, value) pairs, value None when not given)
    that were given: --experiment ``experiment`` does not take them."""
    wrong = [n for n, v in given if v is not None]
    if wrong:
        raise ValueError(f"{', '.join(wrong)}: not for --experiment {experiment}")


def _refuse_claims_options(args, experiment: str) -> None:
    """--claims, --remedies and --runs name what the claims, early-warning and natural experiments
    read; an experiment that trains its own grid refuses them by name."""
    _refuse((("--claims", args.claims), ("--remedies", args.remedies or None), ("--runs", args.runs)), experiment)


def _print_claims(claims) -> None:
    for c in claims:
        print(f"{c['id']}  {c['verdict']:<12}  {c['evidence']}")


def _run_edge_command(args) -> int:
    from ..edge import get_edge_preset, run_edge
    _refuse_claims_options(args, "edge (it trains its own arms and judges claims E0-E10)")
    result = run_edge(get_edge_preset(args.preset or "micro-edge"), args.out, seeds=_seeds(args.seeds),
                      steps=args.steps, overrides=args.overrides)
    for block in result["by_lr"]:
        print(f"peak lr {block['lr']:.3g}:")
        for a in block["arms"]:
            print(f"  {a['label']:<40} diverged {a['diverged']}/{a['finished']}")
        for c in block["claims"]:
            print(f"  {c['id']:<4} {c['verdict']:<12} {c['evidence']}")
    print(f"tables and runs: {args.out}/edge.md")
    return 0


def _run_lr_sensitivity_command(args) -> int:
    from ..lr_sensitivity import get_lr_preset, run_lr_sensitivity
    _refuse_claims_options(args, "lr-sensitivity (it trains its own lr grid; --claims and --remedies are for "
                                 "claims, --runs for early-warning and natural)")
    result = run_lr_sensitivity(get_lr_preset(args.preset or "tiny-cpu"), args.out, seeds=_seeds(args.seeds),
                                steps=args.steps, overrides=args.overrides)
    for m in result["means"]:
        largest = ", ".join("none" if x is None else f"{x:.3g}" for x in m["largest_trainable_lr"])
        sens = "-" if m["sensitivity"] is None else f"{m['sensitivity']:.3f}"
        print(f"{m['arithmetic']:<16} LR sensitivity {sens} (mean over seeds); largest trainable lr per seed {largest}")
    _print_claims(result["claims"])
    print(f"tables and runs: {args.out}/lr_sensitivity.md; figure: {', '.join(result['figures'])}")
    return 0


def _run_natural_command(args) -> int:
    from ..natural import get_natural_preset, parse_runs, run_natural
    from ..natural.analysis import series_text
    _refuse((("--seeds", args.seeds), ("--claims", args.claims), ("--remedies", args.remedies or None)),
            "natural (its arms share one seed, the config's; --claims and --remedies are for claims)")
    preset = get_natural_preset(args.preset or "nat512")
    runs = parse_runs(args.runs, preset) if args.runs is not None else None
    result = run_natural(preset, args.out, runs=runs, steps=args.steps, overrides=args.overrides)
    for o in result["outcomes"]:
        leans = "; ".join(series_text(r) for r in o["delta"]) or "no delta probes"
        print(f"{o['arm']:<14} {o['state']}; delta across probes: {leans}")
    _print_claims(result["claims"])
    print(f"tables: {args.out}/natural.md, {args.out}/natural.json")
    return 0


def _run_early_warning_command(args) -> int:
    from ..early_warning import run_early_warning
    if args.runs is None:
        raise ValueError("--experiment early-warning needs --runs DIR [DIR ...] (folders of finished runs)")
    _refuse((("--seeds", args.seeds), ("--claims", args.claims), ("--steps", args.steps),
             ("--remedies", args.remedies or None), ("key=value overrides", args.overrides or None)),
            "early-warning (it trains nothing)")
    result = run_early_warning(args.runs, args.out)
    c = result["counts"]
    print(f"{c['runs']} runs: {c['divergent']} divergent, {c['stable']} stable ({len(result['skipped'])} skipped)")

    def num(x):
        return "-" if x is None else f"{x:g}"

    for d in result["detectors"]:
        m, cal = result["default"][d["name"]], result["calibrated"][d["name"]]
        print(f"{d['name']:<16} default {d['default']:g}: hits {m['hits']}/{m['divergent']}, median lead "
              f"{num(m['lead']['median'])}, false alarms {m['false_alarms']}/{m['stable']}; "
              f"calibrated threshold {num(cal['threshold'])}" + ("" if cal["met_target"] else " (target not met)"))
    print(f"tables: {args.out}/early_warning.md; figures: {', '.join(result['figures'])}")
    return 0
