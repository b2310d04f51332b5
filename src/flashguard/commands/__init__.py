"""The subcommands of ``flashguard``: one module each, in the order ``flashguard --help`` lists them.

Each module has ``NAME``, ``add(sub, values)`` (its parser, added to the subparsers ``sub``;
``values`` is the text of the valid policies, stabilizers, configs and presets), ``run(args)``
(its exit status) and ``OVERRIDES`` (whether it takes dotted key=value config overrides).
``flashguard.cli`` assembles the parser from them and dispatches."""
from __future__ import annotations

from . import (audit, check, demo, diagnose, early_warning, edge, injection, lab, lr_sensitivity, natural, prepare,
               repro, report, showcase, train)

__all__ = ["COMMANDS"]

COMMANDS = {m.NAME: m for m in (demo, showcase, prepare, train, lab, diagnose, repro, injection, lr_sensitivity,
                                natural, early_warning, edge, audit, check, report)}
