"""Training throughput of the tiny CPU preset with each attention backend.

    python benchmarks/train.py [--steps 10] [--rounds 3] [--batch 16]

Builds the `tiny-cpu` GPT-2 (4 layers, width 256, T = 256) and runs optimizer steps
(forward, backward, AdamW) under bf16 autocast on random tokens, for attention backends
sdpa (torch), flash + paper (the study's arithmetic), flash + fa2 (production arithmetic) and
flash + fa2 + safe. Configurations are interleaved round-robin; tokens/s is the median over
rounds and the ratio is against sdpa measured in the same run. Target (trainer issue):
flash + fa2 >= 0.8x sdpa.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from flashguard.model import GPT, AttentionSpec, model_config

CONFIGS = {
    "sdpa": AttentionSpec(backend="sdpa"),
    "flash+paper": AttentionSpec(backend="flash", precision="paper"),
    "flash+fa2": AttentionSpec(backend="flash", precision="fa2"),
    "flash+fa2+safe": AttentionSpec(backend="flash", precision="fa2", stabilizer="safe"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    cfg = model_config("tiny-cpu")
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size), generator=g)
    y = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size), generator=g)
    setups = {}
    for name, spec in CONFIGS.items():
        torch.manual_seed(0)
        model = GPT(cfg, spec)
        opt = model.configure_optimizer(weight_decay=0.0, lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
        setups[name] = (model, opt)

    def run(name, steps):
        model, opt = setups[name]
        t0 = time.perf_counter()
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return args.batch * cfg.block_size * steps / (time.perf_counter() - t0)

    for name in CONFIGS:
        run(name, 2)  # warm-up
    rates = {n: [] for n in CONFIGS}
    for _ in range(args.rounds):
        for name in CONFIGS:
            rates[name].append(run(name, args.steps))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; tiny-cpu, batch {args.batch} x "
          f"T {cfg.block_size}, bf16 autocast, {args.rounds} rounds of {args.steps} steps")
    base = statistics.median(rates["sdpa"])
    print(f"{'attention':<18}{'tokens/s':>10}{'x sdpa':>8}")
    for name, r in rates.items():
        med = statistics.median(r)
        print(f"{name:<18}{med:>10.0f}{med / base:>8.2f}")
    ok = statistics.median(rates["flash+fa2"]) / base >= 0.8
    print(f"  {'PASS' if ok else 'MISS'}  flash + fa2 >= 0.8x sdpa")


if __name__ == "__main__":
    main()
