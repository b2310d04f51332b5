"""Per-step cost of the delta error injection on the tiny CPU preset, against no injection.

    OMP_NUM_THREADS=1 python benchmarks/injection.py [--steps 4] [--rounds 3] [--batch 16]

Builds the `tiny-cpu` GPT-2 (4 layers, width 256, T = 256, flash + paper in every layer) from
configs/tiny-cpu.toml and times optimizer steps (forward, backward, AdamW, bf16 autocast) on
random tokens, in one process: no injection; `coherent` injection (p = 1, alpha = 10) with an
fp64 and with an fp32 reference (the injection adds one exact attention per layer per backward,
the sign draws are negligible). Configurations are interleaved round-robin; the seconds per step
are the median over rounds, the ratio is against no injection measured in the same run.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from flashguard.train import build_model, load_config
from flashguard.train.injection import install_injection

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.toml"
SETUPS = {
    "no injection": [],
    "coherent, fp64 reference": ['injection.rule="coherent"', "injection.p=1.0", "injection.alpha=10.0"],
    "coherent, fp32 reference": ['injection.rule="coherent"', "injection.p=1.0", "injection.alpha=10.0",
                                 'injection.reference="fp32"'],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    setups = {}
    for name, overrides in SETUPS.items():
        cfg = load_config(CONFIG, [f"data.batch_size={args.batch}", *overrides])
        torch.manual_seed(0)
        model = build_model(cfg)
        clock = install_injection(model, cfg)
        opt = model.configure_optimizer(weight_decay=0.0, lr=1e-3)
        setups[name] = (model, opt, clock)
    T, V = model.config.block_size, model.config.vocab_size
    x = torch.randint(0, V, (args.batch, T), generator=g)
    y = torch.randint(0, V, (args.batch, T), generator=g)

    def run(name, steps):
        model, opt, clock = setups[name]
        t0 = time.perf_counter()
        for step in range(steps):
            if clock is not None:
                clock.begin_step(step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return (time.perf_counter() - t0) / steps

    for name in SETUPS:
        run(name, 1)  # warm-up
    times = {n: [] for n in SETUPS}
    for _ in range(args.rounds):
        for name in SETUPS:
            times[name].append(run(name, args.steps))
    base = statistics.median(times["no injection"])
    print(f"tiny-cpu, batch {args.batch} x T {T}, {torch.get_num_threads()} thread(s), "
          f"{args.rounds} rounds x {args.steps} steps")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:<26} {med:6.3f} s/step  ({med / base:.2f}x; rounds {', '.join(f'{t:.3f}' for t in ts)})")


if __name__ == "__main__":
    main()
