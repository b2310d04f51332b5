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

from .commands import COMMANDS
from .commands.common import config_option_error, valid_values
from .commands.lab import lab_out
from .utils.allocator import retain_freed_memory

__all__ = ["main", "build_parser", "lab_out"]


def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The ``flashguard`` parser with every subcommand of flashguard.commands: (parser, its subparsers)."""
    values = valid_values()
    parser = argparse.ArgumentParser(prog="flashguard", description=__doc__, epilog="Valid values:\n" + values,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():
        command.add(sub, values)
    return parser, sub


def _parse(parser: argparse.ArgumentParser, sub, argv: list[str]) -> argparse.Namespace:
    """The arguments, with ``args.overrides``: key=value overrides may stand anywhere after
    ``train CONFIG`` (argparse cannot interleave them with --out), so they are collected from the
    arguments argparse does not know; only the commands that take overrides accept them."""
    if argv and argv[0] in COMMANDS and COMMANDS[argv[0]].OVERRIDES:
        # before argparse, whose first complaint (a missing --out) would hide this one
        problem = config_option_error(argv[1:], sub.choices[argv[0]])
        if problem:
            sub.choices[argv[0]].error(problem)
    args, extra = parser.parse_known_args(argv)
    args.overrides = [e for e in extra if "=" in e and not e.startswith("-")]
    unknown = [e for e in extra if e not in args.overrides]
    if unknown or (args.overrides and not COMMANDS[args.command].OVERRIDES):
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown or args.overrides)}")
    return args


def main(argv: list[str] | None = None) -> int:
    parser, sub = build_parser()
    args = _parse(parser, sub, sys.argv[1:] if argv is None else list(argv))
    retain_freed_memory()  # this process's tile-sized tensors reuse freed memory (utils/allocator.py)
    try:
        return COMMANDS[args.command].run(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:  # ConfigError is a ValueError
        print(f"flashguard {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
