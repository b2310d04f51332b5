"""flashguard command line."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashguard", description=__doc__.strip() + " Subcommands:")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("showcase", help="one-minute tour: tie-induced rounding bias and its fixes")
    args = parser.parse_args(argv)
    if args.command == "showcase":
        import torch

        from .experiments.showcase import run_showcase
        torch.set_printoptions(precision=4)
        run_showcase()
    return 0


if __name__ == "__main__":
    sys.exit(main())
