"""``flashguard train``: train a GPT-2 with a TOML config and key=value overrides."""
from __future__ import annotations

import sys

from .common import described_parser

NAME, OVERRIDES = "train", True


def add(sub, values: str):
    p = described_parser(sub, "train", "train a GPT-2 (single process, or under torchrun)",
                         "Train with a TOML config; key=value arguments override it "
                         "(e.g. train.steps=200 attention.precision=fa2 "
                         "attention.layers.1.precision=fp32). Below, the attention.precision "
                         "each shipped config trains: paper, the study's reference bf16 "
                         "arithmetic, is there on purpose, to show the mechanism; "
                         "attention.precision=fa2 trains in production flash attention's "
                         "arithmetic.", values)
    p.add_argument("config", help="a shipped config's name (e.g. tiny-cpu) or a TOML file; then any number of "
                                  "dotted key=value overrides")
    p.add_argument("--out", required=True, help="run folder (config.toml, metrics.jsonl, batches.jsonl, checkpoints/)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--replay", metavar="RUN_DIR", help="use the batches logged by another run, step for step")
    return p


def run(args) -> int:
    from ..diagnostics import training_hooks
    from ..train import EXIT_DIVERGED, load_config, train
    from ..train.shipped import find_config
    cfg = load_config(find_config(args.config), args.overrides)
    result = train(cfg, args.out, resume=args.resume, replay=args.replay, hooks=training_hooks())
    if result.diverged and cfg.train.on_divergence == "stop":
        print(f"run diverged at step {result.steps_done}; see {args.out}/divergence.json", file=sys.stderr)
        return EXIT_DIVERGED
    best = f", best val loss {result.best_val:.4f}" if result.best_val is not None else ""
    print(f"done: {result.steps_done} steps, last train loss {result.last_loss:.4f}{best}; run in {args.out}")
    return 0
