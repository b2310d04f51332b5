"""flashguard: find, explain and fix the loss explosions of low-precision flash attention.

First look: `flashguard showcase` (seconds: the tie bias of bf16 flash attention, per arithmetic).
The main job: `flashguard demo` (minutes on a CPU: lab, matched training runs, claims, report.html).
`flashguard COMMAND --help` describes each command.

Exit codes: 0 done; 2 bad arguments, configuration or data (one line names the problem);
3 a training run diverged (see RUN_DIR/divergence.json); 1 anything unexpected.
"""
from __future__ import annotations

import argparse
import sys
import textwrap


def _wrap(text: str, hang: str = "") -> str:
    """Help text wrapped line by line (the parsers keep line breaks: RawDescriptionHelpFormatter)."""
    return "\n".join(textwrap.fill(line, 79, subsequent_indent=hang, break_on_hyphens=False) for line in text.split("\n"))


def _values() -> str:
    """The valid values of the options that take a policy, a stabilizer or a config, from their registries."""
    from .attention.stabilizers import STABILIZERS
    from .experiments.repro.presets import PRESETS
    from .numerics.policy import POLICIES
    from .train.shipped import config_precision, shipped_configs
    trains = {name: config_precision(path) for name, path in shipped_configs().items()}
    paper = ("; paper is the study's reference bf16 arithmetic, which leans under tied maxima: chosen on "
             "purpose, to show the mechanism; add attention.precision=fa2 to train in production flash "
             "attention's arithmetic" if "paper" in trains.values() else "")
    return _wrap(f"precision policies (attention.precision, lab --precision): {', '.join(POLICIES)}, "
            f"or one with changed fields as 'paper[pv=fp32]';\n"
            f"stabilizers (attention.stabilizer): {', '.join(STABILIZERS)}, with options as 'paper:beta=7,tol=1e-3';\n"
            f"shipped configs (flashguard train NAME), with the attention.precision each trains: "
            f"{', '.join(f'{n} ({p})' for n, p in trains.items())}{paper};\n"
            f"repro presets (repro --preset): {', '.join(PRESETS)}.", hang="  ")


def _add_train(sub, values: str) -> None:
    p = sub.add_parser("train", help="train a GPT-2 (single process, or under torchrun)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description=_wrap("Train with a TOML config; key=value arguments override it "
                                         "(e.g. train.steps=200 attention.precision=fa2 "
                                         "attention.layers.1.precision=fp32). Below, the attention.precision "
                                         "each shipped config trains: paper, the study's reference bf16 "
                                         "arithmetic, is there on purpose, to show the mechanism; "
                                         "attention.precision=fa2 trains in production flash attention's "
                                         "arithmetic."),
                       epilog="Valid values:\n" + values)
    p.add_argument("config", help="a shipped config's name (e.g. tiny-cpu) or a TOML file; then any number of "
                                  "dotted key=value overrides")
    p.add_argument("--out", required=True, help="run folder (config.toml, metrics.jsonl, batches.jsonl, checkpoints/)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--replay", metavar="RUN_DIR", help="use the batches logged by another run, step for step")


def _add_lab(sub, values: str) -> None:
    from .numerics.policy import POLICIES
    p = sub.add_parser("lab", help="rounding-bias lab: the study's arithmetic facts with verdicts, open questions",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description=_wrap("Measures attention arithmetics on rows with planted ties against fp64 "
                                         "and the fp32 noise floor: the study's facts (i)-(iii) in --precision with "
                                         "verdicts, which arithmetic leans under ties and which stabilizer removes "
                                         "it, where the bias enters, FlashAttention PR #2721. Writes lab.json, "
                                         "lab.md and figures."),
                       epilog="Valid values:\n" + values)
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


def lab_out(precision: str) -> str:
    """`flashguard lab`'s default output folder for a precision: lab (the default), lab-PRECISION otherwise."""
    if precision == "paper":
        return "lab"
    return "lab-" + "".join(c if c.isalnum() or c in "-_.=" else "_" for c in precision).strip("_")


def _lab(args) -> int:
    from .experiments import lab
    from .experiments.lab.report import write_lab
    from .numerics.policy import get_policy
    get_policy(args.precision)  # a typo is refused before anything runs
    out = args.out if args.out is not None else lab_out(args.precision)
    captured = None
    if args.capture:
        from .experiments.lab.captured import from_run
        try:
            captured = from_run(args.capture, step=args.capture_step, batches=args.capture_batches)
        except (ValueError, FileNotFoundError) as e:
            print(f"flashguard lab: error: --capture {args.capture}: {e}", file=sys.stderr)
            return 2
    result = lab.run_lab(quick=args.quick, precision=args.precision, seed=args.seed, progress=lambda m: print(f"  {m}"),
                         captured=captured)
    paths = write_lab(result, out)
    width = max(len(k) for k in result["verdicts"])
    for key, verdict in result["verdicts"].items():
        print(f"{key:<{width}}  {verdict}")
    for pol, answer in result["answers"].items():
        print(f"{pol}: {answer['line']}")
    for pol, answer in (result.get("captured") or {}).get("answers", {}).items():
        print(f"{pol} (captured): {answer['line']}")
    print(f"{len(result['rows'])} measurements in {result['runtime_s']:.0f} s; tables in {paths['md']}")
    return 0


def _config_option_error(argv: list[str], parser: argparse.ArgumentParser) -> str | None:
    """For ``train`` and ``repro``: the error for a ``--key value`` (or ``--key=value``) that is not
    one of the command's options but names a training-config key, naming the ``key=value`` override
    to write instead (``--steps 10`` -> ``train.steps=10``); None when there is none."""
    known = parser._option_string_actions   # argparse also accepts unambiguous prefixes of these
    keys = None
    for i, token in enumerate(argv):
        if not token.startswith("--") or token == "--":
            continue
        option, eq, value = token.partition("=")
        if any(k.startswith(option) for k in known):
            continue
        if not eq:
            follows = argv[i + 1] if i + 1 < len(argv) else ""
            value = follows if follows and not follows.startswith("-") else "VALUE"
        if keys is None:
            from .train.config import RunConfig, config_to_dict
            keys = [f"{section}.{key}" for section, table in config_to_dict(RunConfig()).items()
                    for key in table if key != "layers"]
        name = option[2:].replace("-", "_")
        found = [k for k in keys if name in (k, k.split(".", 1)[1])]
        if found:
            fix = " or ".join(f"{k}={value}" for k in found)
            return f"unknown option {option}: set {fix} (a config key is set by a key=value argument, not an option)"
    return None


def _train(args) -> int:
    from .train import EXIT_DIVERGED, load_config, train
    from .train.shipped import find_config
    from .diagnostics import DiagnosticsHook
    cfg = load_config(find_config(args.config), args.overrides)
    result = train(cfg, args.out, resume=args.resume, replay=args.replay, hooks=[DiagnosticsHook()])
    if result.diverged and cfg.train.on_divergence == "stop":
        print(f"run diverged at step {result.steps_done}; see {args.out}/divergence.json", file=sys.stderr)
        return EXIT_DIVERGED
    best = f", best val loss {result.best_val:.4f}" if result.best_val is not None else ""
    print(f"done: {result.steps_done} steps, last train loss {result.last_loss:.4f}{best}; run in {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    values = _values()
    parser = argparse.ArgumentParser(prog="flashguard", description=__doc__, epilog="Valid values:\n" + values,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    d = sub.add_parser("demo", help="the main job (minutes on a CPU): lab, matched training runs, claims and a report",
                       description=_wrap("Prepares the embedded corpus (no network), runs the rounding-bias lab "
                                         "(quick), trains fp32 attention, the study's reference arithmetic with no "
                                         "fix, with the study's fix and with safe on the same batches with the "
                                         "mechanism probes on, judges claims C1, C5, C6, C8 and writes "
                                         "OUT/report/report.html. Rerun to resume. Finished runs keep no "
                                         "checkpoints (the report reads their metrics) unless --keep-checkpoints."))
    d.add_argument("--out", default="demo", help="output folder (default: demo); rerun to resume")
    d.add_argument("--data", default="data/embedded", help="corpus folder, prepared there if missing "
                                                           "(default: data/embedded)")
    d.add_argument("--steps", type=int, help="steps per training run, >= 1 (default: 200 for the matched runs, 1,500 for the causal comparison)")
    d.add_argument("--keep-checkpoints", action="store_true",
                   help="keep each run's last checkpoint (about 40 MB each; for flashguard diagnose)")
    sub.add_parser("showcase", help="the first look (seconds): tie-induced rounding bias per arithmetic and its fixes",
                   description=_wrap("One lab problem (1,024 rows with 8 keys tied at the maximum) through the "
                                     "reference arithmetic with no fix, the study's fix and safe, paper-fp32fwd "
                                     "and production fa2: the lean of O and delta beyond the fp32 noise floor, "
                                     "with z. Writes nothing."))
    from .data.command import add_prepare_arguments, run_prepare
    add_prepare_arguments(sub.add_parser("prepare", help="tokenize a corpus into nanoGPT-style train.bin / val.bin"))
    _add_train(sub, values)
    _add_lab(sub, values)
    from .diagnostics.command import add_diagnose_arguments, run_diagnose
    add_diagnose_arguments(sub.add_parser("diagnose", help="run the mechanism probes on a run's checkpoint and batch"))
    from .experiments.repro.command import add_repro_arguments, run_repro_command
    repro = sub.add_parser(
        "repro", help="the study's claims as matched training runs, with verdicts",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_wrap("Trains a preset's matched runs (same seed, same batches): fp32 attention, the "
                          "reference arithmetic with no fix, the study's fix, safe, and the study's localisation "
                          "ablations; judges claims C1-C6, C8 (held / not held / inconclusive, with the numbers "
                          "behind each) into OUT/claims.md and OUT/repro.json. Resumable: rerun the same command."))
    add_repro_arguments(repro)
    repro.epilog = "\n\n".join(filter(None, [repro.epilog, "Valid values:\n" + values]))
    au = sub.add_parser("audit", help="does your attention kernel lean under tied maxima? (torch SDPA backends, "
                                      "flashguard presets, Triton, flash-attn)",
                        description=_wrap("Measures each attention kernel this device offers as a black box on the "
                                          "lab's problems of independent rows: O and delta against fp64, one value "
                                          "per row, paired against the fp32 noise floor. Writes OUT/audit.md, "
                                          "audit.json and audit.png."))
    au.add_argument("--quick", action="store_true", help="1,024 rows per condition instead of 3,072")
    au.add_argument("--out", default="audit", help="output folder (default: audit)")
    au.add_argument("--device", default="cpu", help="cpu (default) or cuda: which kernels are audited")
    au.add_argument("--decompose", action="store_true",
                    help="instead: where torch's CPU flash kernel leans, step by step: the kernel, its faithful model "
                         "(precision torch-cpu) and the model with one step changed at a time, with the model's bit "
                         "agreement with the kernel (OUT/torch-cpu-decomposition.md; 7 s quick, on one core)")
    au.add_argument("--seed", type=int, default=0)
    au.add_argument("--triton-interpreter", action="store_true",
                    help="on CPU, also audit flashguard's Triton kernels (fa2, fa2-fp16) in Triton's CPU interpreter "
                         "(their rounding steps, not a GPU's matmul order; the full audit took 170 s with them on one core)")
    from .check.command import add_check_arguments, run_check
    add_check_arguments(sub.add_parser("check", help="is your model's bf16 attention at risk, and what to switch on? "
                                                     "(a Hugging Face or flashguard checkpoint)"))
    from .experiments.report import add_report_arguments, run_report
    add_report_arguments(sub.add_parser("report", help="report.md and report.html with figures, from a repro, "
                                                       "training runs and/or a lab folder"))
    # key=value overrides may stand anywhere after `train CONFIG` (argparse cannot interleave
    # them with --out), so they are collected from the arguments argparse does not know
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("train", "repro"):
        # before argparse, whose first complaint (a missing --out) would hide this one
        problem = _config_option_error(argv[1:], sub.choices[argv[0]])
        if problem:
            sub.choices[argv[0]].error(problem)
    args, extra = parser.parse_known_args(argv)
    args.overrides = [e for e in extra if "=" in e and not e.startswith("-")]
    unknown = [e for e in extra if e not in args.overrides]
    if unknown or (args.overrides and args.command not in ("train", "repro")):
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown or args.overrides)}")
    try:
        if args.command == "demo":
            from .experiments.demo import run_demo
            run_demo(args.out, data_dir=args.data, steps=args.steps, keep_checkpoints=args.keep_checkpoints)
            return 0
        if args.command == "showcase":
            from .experiments.showcase import run_showcase
            run_showcase()
            return 0
        if args.command == "prepare":
            return run_prepare(args)
        if args.command == "train":
            return _train(args)
        if args.command == "lab":
            return _lab(args)
        if args.command == "diagnose":
            return run_diagnose(args)
        if args.command == "repro":
            return run_repro_command(args)
        if args.command == "report":
            return run_report(args)
        if args.command == "check":
            return run_check(args)
        if args.command == "audit":
            from .experiments.audit import run_audit, write_audit
            if args.device not in ("cpu", "cuda"):
                raise ValueError(f"--device must be cpu or cuda, got {args.device!r}")
            if args.triton_interpreter and args.device != "cpu":
                raise ValueError("--triton-interpreter is for --device cpu (on cuda the Triton kernels run compiled)")
            if args.device == "cuda" and not __import__("torch").cuda.is_available():
                raise ValueError("--device cuda: no CUDA device here")
            if args.decompose:
                if args.device != "cpu":
                    raise ValueError("--decompose measures torch's CPU flash kernel: use --device cpu")
                from .experiments.kernel_decomposition import decompose_torch_cpu, write_decomposition
                dec = decompose_torch_cpu(quick=args.quick, seed=args.seed, progress=lambda m: print(f"  {m}"))
                print("the step responsible:", "; ".join(dec["responsible"]) or "none found")
                print(f"tables in {write_decomposition(dec, args.out)}")
                return 0
            result = run_audit(quick=args.quick, seed=args.seed, device=args.device,
                               triton_interpreter=args.triton_interpreter, progress=lambda m: print(f"  {m}"))
            paths = write_audit(result, args.out)
            for k, v in result["verdicts"].items():
                print(f"{k}: {v}")
            print(f"tables in {paths['md']}")
            return 0
    except (ValueError, FileNotFoundError, FileExistsError) as e:  # ConfigError is a ValueError
        print(f"flashguard {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
