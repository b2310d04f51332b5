"""``flashguard check --model PATH [--text FILE] --out DIR``: the command line of ``flashguard.check``."""
from __future__ import annotations

import argparse

__all__ = ["add_check_arguments", "run_check", "DEFAULTS"]

# the defaults, chosen so that a 124M-parameter model is checked in minutes on 2 CPU cores
# (docs/check.md): 2 steps of 4 sequences of 256 tokens, every sequence measured
DEFAULTS = {"steps": 2, "batch": 4, "seq_len": 256, "repeats": 3}


def add_check_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = (
        "Is your model's low-precision attention at risk, and what do you switch on? Runs a few forward and\n"
        "backward steps of the model in your dtype and attention implementation, records which kernel torch\n"
        "dispatched each SDPA call to, captures every layer's q, k, v and dO, and measures there the kernel\n"
        "that ran and each candidate fix against fp64 and the fp32 noise floor (plus the tie census).\n"
        "Prints a verdict per layer and overall (none / low / high), what to switch on and its measured\n"
        "cost; writes OUT/check.json, check.md and check.png. Rule and defaults: docs/check.md.")
    p.add_argument("--model", required=True, metavar="PATH",
                   help="a Hugging Face checkpoint folder (save_pretrained), a flashguard run folder or a "
                        "checkpoint file (.pt)")
    p.add_argument("--text", metavar="FILE", help="text to tokenize into the batches (default: the embedded "
                                                  "corpus, Python's standard library sources)")
    p.add_argument("--out", default="check", help="output folder (default: check)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"),
                   help="the training dtype: the model runs in it as saved if its weights have it, else under "
                        "autocast (default: bf16)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    p.add_argument("--attn", default=None, metavar="NAME",
                   help="attention implementation: transformers' attn_implementation (default: sdpa); for a "
                        "flashguard checkpoint 'sdpa' puts every layer on torch's SDPA (default: as trained)")
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"], help="forward + backward steps (default: 2)")
    p.add_argument("--batch", type=int, default=DEFAULTS["batch"], help="sequences per step (default: 4)")
    p.add_argument("--seq-len", type=int, default=DEFAULTS["seq_len"],
                   help="tokens per sequence (default: 256, at most the model's positions)")
    p.add_argument("--repeats", type=int, default=DEFAULTS["repeats"],
                   help="timing rounds of each fix against the kernel (default: 3)")
    p.add_argument("--no-fixes", action="store_true", help="measure the kernel only, not the candidate fixes")


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"--{name} must be >= 1, got {value}")


def run_check(args) -> int:
    from .api import check
    from .load import embedded_tokens, encode, load_model, make_batches, read_text
    for name in ("steps", "batch", "seq_len", "repeats"):
        _positive(name.replace("_", "-"), getattr(args, name))
    text = read_text(args.text) if args.text else None          # a missing file fails before the model loads
    loaded = load_model(args.model, attn=args.attn, device=args.device)
    seq_len = min(args.seq_len, loaded.max_len - (loaded.kind == "flashguard")) if loaded.max_len else args.seq_len
    need = args.steps * args.batch * (seq_len + 1)
    if text is None:
        ids, source = embedded_tokens(loaded.tokenizer, need), "the embedded corpus"
    else:
        ids, source = encode(loaded.tokenizer, text), f"--text {args.text}"
    batches = make_batches(ids, steps=args.steps, batch=args.batch, seq_len=seq_len, vocab=loaded.vocab_size,
                           kind=loaded.kind, source=source)
    print(f"flashguard check: {loaded.name}, tokenizer {loaded.tokenizer_name}, text from {source}, "
          f"{args.steps} step(s) x {args.batch} x {seq_len} tokens")
    result = check(loaded.model, batches, steps=args.steps, dtype=args.dtype, out=args.out, repeats=args.repeats,
                   fixes=not args.no_fixes, name=loaded.name, progress=lambda m: print(f"  {m}"))
    print(result.summary())
    if result.verdict == "unmeasured" and loaded.kind == "flashguard" and not result.layers:
        print("  (a flashguard checkpoint trained with the flash or math backend: --attn sdpa checks it on "
              "torch's SDPA)")
    files = result.info.get("files", {})
    print(f"report: {', '.join(files.values())}")
    return 0
