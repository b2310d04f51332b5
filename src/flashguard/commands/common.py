"""What several subcommands share: help text wrapping, the valid values, the override check."""
from __future__ import annotations

import argparse
import textwrap

__all__ = ["wrap", "valid_values", "config_option_error", "described_parser", "delegated", "experiment",
           "print_claims"]


def wrap(text: str, hang: str = "") -> str:
    """Help text wrapped line by line (the parsers keep line breaks: RawDescriptionHelpFormatter)."""
    return "\n".join(textwrap.fill(line, 79, subsequent_indent=hang, break_on_hyphens=False) for line in text.split("\n"))


def described_parser(sub, name: str, help: str, description: str, values: str) -> argparse.ArgumentParser:
    """A subcommand's parser with a wrapped ``description`` (line breaks kept) and the valid
    values (``values``, valid_values()) as its epilog."""
    return sub.add_parser(name, help=help, formatter_class=argparse.RawDescriptionHelpFormatter,
                          description=wrap(description), epilog="Valid values:\n" + values)


def experiment(name: str, doc: str, load, default: str | None, report, *, seeds: bool = False,
               options=None, arguments=None):
    """``add(sub, values)`` and ``run(args)`` of an experiment's command, which trains a preset's runs
    (resumable) and judges claims. ``doc``: the command module's docstring, "``flashguard NAME``:
    HELP", a blank line, the description. ``load()`` imports (its presets, their getter, its runner)
    when first needed; the runner is called as ``runner(preset, out, steps=, overrides=, **kw)``
    with ``kw`` = ``arguments(args, preset)`` (default: seeds=args.seeds when ``seeds``, else none),
    then ``report(result, out)`` prints it. Options: --preset (one of the presets: ``default``,
    required when None), --steps, --out, --seeds when ``seeds``, and those ``options(p)`` adds;
    key=value arguments override the preset's config."""
    def add(sub, values: str):
        first, _, rest = doc.partition("\n\n")
        p = described_parser(sub, name, first.split(": ", 1)[1].rstrip("."),
                             "\n\n".join(" ".join(par.split()) for par in rest.split("\n\n")), values)
        p.epilog = wrap("key=value arguments override the preset's config for every run (e.g. data.dir=... "
                        "model.n_layer=2).") + "\n\n" + p.epilog
        p.add_argument("--preset", choices=list(load()[0]), default=default, required=default is None,
                       help="training set-up" + (f" (default: {default})" if default else ""))
        p.add_argument("--steps", type=_at_least_one, help="steps per run (default: the preset's)")
        p.add_argument("--out", required=True, help="output folder (resumable: rerun the same command to continue)")
        if seeds:
            p.add_argument("--seeds", type=_seeds, help="comma-separated training seeds, every arm per seed "
                                                        "(default: the config's train.seed)")
        if options:
            options(p)
        return p

    def run(args) -> int:
        _, get_preset, runner = load()
        preset = get_preset(args.preset)
        kw = arguments(args, preset) if arguments else {"seeds": args.seeds} if seeds else {}
        report(runner(preset, args.out, steps=args.steps, overrides=args.overrides, **kw), args.out)
        return 0

    return add, run


def _at_least_one(text: str) -> int:
    try:
        steps = int(text)
    except ValueError:
        steps = 0
    if steps < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return steps


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError("is empty")
    return seeds


def print_claims(claims) -> None:
    """An experiment's verdicts, one line a claim: id, verdict, evidence."""
    for c in claims:
        print(f"{c['id']}  {c['verdict']:<12}  {c['evidence']}")


def delegated(name: str, help: str, load):
    """``add(sub, values)`` and ``run(args)`` of a subcommand whose arguments and entry live in its
    own package: ``load()`` imports them there, (add_arguments, run), when they are first needed."""
    def add(sub, values: str):
        p = sub.add_parser(name, help=help)
        load()[0](p)
        return p

    def run(args) -> int:
        return load()[1](args)

    return add, run


def valid_values() -> str:
    """The valid values of the options that take a policy, a stabilizer or a config, from their registries."""
    from ..attention.stabilizers import STABILIZERS
    from ..experiments.repro.presets import PRESETS
    from ..numerics.policy import POLICIES
    from ..train.shipped import config_precision, shipped_configs
    trains = {name: config_precision(path) for name, path in shipped_configs().items()}
    paper = ("; paper is the study's reference bf16 arithmetic, which leans under tied maxima: chosen on "
             "purpose, to show the mechanism; add attention.precision=fa2 to train in production flash "
             "attention's arithmetic" if "paper" in trains.values() else "")
    return wrap(f"precision policies (attention.precision, lab --precision): {', '.join(POLICIES)}, "
                f"or one with changed fields as 'paper[pv=fp32]';\n"
                f"stabilizers (attention.stabilizer): {', '.join(STABILIZERS)}, with options as 'paper:beta=7,tol=1e-3';\n"
                f"shipped configs (flashguard train NAME), with the attention.precision each trains: "
                f"{', '.join(f'{n} ({p})' for n, p in trains.items())}{paper};\n"
                f"repro presets (repro --preset): {', '.join(PRESETS)}.", hang="  ")


def config_option_error(argv: list[str], parser: argparse.ArgumentParser) -> str | None:
    """For the commands that take key=value overrides: the error for a ``--key value`` (or
    ``--key=value``) that is not one of the command's options but names a training-config key,
    naming the ``key=value`` override to write instead (``--steps 10`` -> ``train.steps=10``); None when there is none."""
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
            from ..train.config import RunConfig, config_to_dict
            keys = [f"{section}.{key}" for section, table in config_to_dict(RunConfig()).items()
                    for key in table if key != "layers"]
        name = option[2:].replace("-", "_")
        found = [k for k in keys if name in (k, k.split(".", 1)[1])]
        if found:
            fix = " or ".join(f"{k}={value}" for k in found)
            return f"unknown option {option}: set {fix} (a config key is set by a key=value argument, not an option)"
    return None
