"""Cost of ``flashguard.watch`` on a small model: nothing on the steps it does not probe, and
what one probe step costs.

    OMP_NUM_THREADS=1 python benchmarks/watch.py [--preset tiny-cpu] [--steps 6] [--rounds 3]

One flashguard GPT (the preset's shape, attention backend ``sdpa``, i.e. torch's own
F.scaled_dot_product_attention, bf16 autocast, AdamW) trains on fixed batches in three ways,
in alternating rounds so that a machine whose speed drifts affects all alike:

* plain: no watch;
* watched, off-steps: a watch whose interval is never reached (its ``step()`` is called each step);
* watched, probe steps: ``every=1``, so every step captures all layers and runs the probes
  (default precision: ``fa2`` for the bf16 inputs, default subsample of 8 sequences).

Prints the median step time of each (wall clock, and the process's CPU time, which other jobs
on a shared machine disturb less), the cost of one ``step()`` call on a step it does not probe,
the probe step's extra time and its part in the probes' own compute (``time/diagnostics_s``),
and the overhead that implies at an interval of N steps: extra / (N x plain step).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from flashguard import keys
from flashguard.diagnostics.watch import DEFAULT_EVERY, watch
from flashguard.model import GPT, AttentionSpec, model_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-cpu")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6, help="steps per round and mode")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--precision", default=None)
    args = ap.parse_args()
    mcfg = model_config(args.preset)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, mcfg.vocab_size, (args.batch, mcfg.block_size), generator=g) for _ in range(4)]
    setups = {}
    for name, every in (("plain", None), ("off-steps", 10 ** 9), ("probe steps", 1)):
        torch.manual_seed(0)
        model = GPT(mcfg, attention=AttentionSpec(backend="sdpa"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        w = None
        if every is not None:
            w = watch(model, every=every, precision=args.precision, log_fn=lambda m: None)
            if every > 1:
                w.step()   # past step 0, the one probe step of that interval
        setups[name] = {"model": model, "opt": opt, "w": w, "times": [], "cpu": [], "probe_s": [], "i": 0}

    def run(s, n):
        for _ in range(n):
            x = xs[s["i"] % len(xs)]
            s["i"] += 1
            t0, c0 = time.perf_counter(), time.process_time()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = s["model"](x, torch.roll(x, -1, dims=1))
            loss.backward()
            s["opt"].step()
            s["opt"].zero_grad(set_to_none=True)
            rec = s["w"].step() if s["w"] is not None else None
            s["times"].append(time.perf_counter() - t0)
            s["cpu"].append(time.process_time() - c0)
            if rec is not None:
                s["probe_s"].append(rec[keys.DIAGNOSTICS_TIME])

    for s in setups.values():   # warm-up
        run(s, 1)
        s["times"].clear(), s["cpu"].clear(), s["probe_s"].clear()
    for _ in range(args.rounds):
        for s in setups.values():
            run(s, args.steps)
    off = setups["off-steps"]["w"]
    n_calls = 10000
    t0 = time.perf_counter()
    for _ in range(n_calls):
        off.step()
    step_call = (time.perf_counter() - t0) / n_calls
    probe = statistics.median(setups["probe steps"]["probe_s"])
    print(f"{args.preset} (sdpa, bf16 autocast, batch {args.batch}, {mcfg.n_layer} layers probed, "
          f"threads {torch.get_num_threads()}), medians of {args.rounds * args.steps} steps:")
    print(f"  Watch.step() on a step it does not probe: {step_call * 1e6:.1f} us")
    for clock in ("times", "cpu"):
        med = {n: statistics.median(s[clock]) for n, s in setups.items()}
        extra = med["probe steps"] - med["plain"]
        print(f"  [{'wall' if clock == 'times' else 'cpu'}] plain step {med['plain'] * 1e3:.1f} ms; "
              f"watched off-steps {med['off-steps'] * 1e3:.1f} ms ({med['off-steps'] / med['plain'] - 1:+.1%}); "
              f"probe step {med['probe steps'] * 1e3:.1f} ms (+{extra * 1e3:.1f} ms = "
              f"{extra / med['plain']:.2f} plain steps)")
        print("         implied overhead: " + ", ".join(f"every {n} steps {extra / (n * med['plain']):.2%}"
                                                         for n in (10, DEFAULT_EVERY, 200)))
    print(f"  probes' compute (time/diagnostics_s, wall) {probe * 1e3:.1f} ms")

if __name__ == "__main__":
    main()
