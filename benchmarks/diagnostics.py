"""Training-time overhead of the diagnostics probes on the tiny-cpu preset.

    python benchmarks/diagnostics.py [--every 100] [--steps 100] [--rounds 2] [--layers ...]

Two copies of the tiny-cpu GPT-2 (4 layers, width 256, T = 256, batch 16, flash attention in
the `paper` arithmetic, bf16 autocast, AdamW) train on the same batches in the same process:
one plain, one with the trainer's diagnostics hook (TrainerDiagnostics: capture hooks on the
step's own forward/backward, every probe on every layer, monitor, probe-state snapshots) at
interval --every. Rounds of --steps steps alternate between the two, so that a machine
whose speed drifts (other jobs) affects both alike. Prints the median step time of each,
their ratio (the overhead at that interval, measured), the mean cost of one probe and the
overhead that cost implies at other intervals: cost / (interval x plain step time).
Target: a probe costs at most 2 plain steps (4 % at every 50). Also times, on each probed
layer's shape, the probes' fp64 reference alone (forward and dQ) and the whole measurement
(``trace`` as the probes call it: that reference, the layer's arithmetic forward counting ties
and the census, its dQ backward): the cost no rearrangement of the metrics can remove. Writes
benchmarks/results/diagnostics-cpu-<threads>thread.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from flashguard import keys
from flashguard.diagnostics import DEFAULT_EVERY, TrainerDiagnostics
from flashguard.model import GPT, model_config
from flashguard.train.config import load_config
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/machine.py, however this file is loaded
from machine import machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--every", type=int, default=DEFAULT_EVERY, help="probe interval (steps)")
    ap.add_argument("--steps", type=int, default=None, help="steps per round (default: --every)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--layers", type=int, nargs="*", default=[], help="layers to probe (default: all)")
    args = ap.parse_args()
    steps = args.steps or args.every
    cfg = load_config(ROOT / "configs" / "tiny-cpu.toml",
                      [f"train.diagnostics_every={args.every}",
                       "train.diagnostics_layers=[" + ",".join(map(str, args.layers)) + "]"])
    mcfg = model_config("tiny-cpu")
    spec = cfg.attention.spec
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, mcfg.vocab_size, (args.batch, mcfg.block_size), generator=g),) * 2
               for _ in range(8)]
    batches = [(x, torch.roll(x, -1, dims=1)) for x, _ in batches]
    run_dir = Path(tempfile.mkdtemp(prefix="fg-diag-bench-"))
    setups = {}
    for name in ("plain", "probed"):
        torch.manual_seed(0)
        model = GPT(mcfg, spec)
        opt = model.configure_optimizer(weight_decay=0.0, lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
        diag = TrainerDiagnostics(cfg, model, run_dir, log_fn=lambda *_: None) if name == "probed" else None
        setups[name] = {"model": model, "opt": opt, "diag": diag, "step": 0, "times": [], "probe_s": []}

    def run(name, n):
        s = setups[name]
        model, opt, diag = s["model"], s["opt"], s["diag"]
        for _ in range(n):
            step = s["step"]
            x, y = batches[step % len(batches)]
            t0 = time.perf_counter()
            if diag is not None:
                diag.begin(step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(x, y)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
            record = {keys.STEP: step, keys.LOSS_TRAIN: loss.item(), keys.GRAD_NORM: gn}
            if diag is not None:
                diag.end(step, record)
                if keys.DIAGNOSTICS_TIME in record:
                    s["probe_s"].append(record[keys.DIAGNOSTICS_TIME])
            opt.step()
            opt.zero_grad(set_to_none=True)
            s["times"].append(time.perf_counter() - t0)
            s["step"] += 1

    for name in setups:  # warm-up without probes, then count steps from 0 (the first probe is at step 0)
        diag, setups[name]["diag"] = setups[name]["diag"], None
        run(name, 2)
        setups[name].update(diag=diag, step=0, times=[])
    totals = {"plain": [], "probed": []}
    for _ in range(args.rounds):
        for name in ("plain", "probed"):
            t0 = time.perf_counter()
            run(name, steps)
            totals[name].append(time.perf_counter() - t0)
    plain, probed = statistics.median(totals["plain"]), statistics.median(totals["probed"])
    step_s = statistics.median(setups["plain"]["times"])
    probe_s = setups["probed"]["probe_s"]
    cost = statistics.mean(probe_s) if probe_s else float("nan")
    layers = args.layers or list(range(mcfg.n_layer))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; tiny-cpu, batch {args.batch} x T "
          f"{mcfg.block_size}, {spec.short_str()}, bf16 autocast; "
          f"probes on layers {layers} every {args.every} steps; {args.rounds} rounds of {steps} steps")
    print(f"plain:  {plain:8.2f} s per round (median step {step_s:.3f} s)")
    print(f"probed: {probed:8.2f} s per round ({len(probe_s)} probes, {cost:.2f} s each = "
          f"{cost / step_s:.1f} plain steps)")
    ratio = probed / plain
    print(f"measured overhead at every {args.every}: {100 * (ratio - 1):+.1f} %  (probed / plain = {ratio:.3f})")
    for n in sorted({10, 25, 50, 100, 200, 500, args.every}):
        print(f"  implied overhead at every {n:>4}: {100 * cost / (n * step_s):5.1f} %")
    ref_s, trace_s = _trace_costs(args.batch, mcfg, spec, len(layers))
    print(f"  the fp64 reference alone (forward + dQ, as the probes run it, {len(layers)} layers): "
          f"{ref_s:.2f} s = {ref_s / step_s:.2f} plain steps")
    print(f"  the measurement alone (trace: that reference, the arithmetic's forward counting ties and its dQ): "
          f"{trace_s:.2f} s = {trace_s / step_s:.2f} plain steps (the limit no rearrangement of the metrics can beat)")
    ok = cost <= 2 * step_s
    print(f"  {'PASS' if ok else 'MISS'}  a probe costs <= 2 plain steps")
    from flashguard.utils.atomic import atomic_write_text
    path = ROOT / "benchmarks" / "results" / f"diagnostics-cpu-{torch.get_num_threads()}thread.json"
    atomic_write_text(path, json.dumps({
        "torch": torch.__version__, "machine": machine(), "threads": torch.get_num_threads(), "batch": args.batch, "every": args.every,
        "steps_per_round": steps, "rounds": args.rounds, "layers": layers, "precision": spec.short_str(),
        "round_s": totals, "plain_step_s": step_s, "probe_s": probe_s, "probe_cost_s": cost,
        "probe_in_plain_steps": cost / step_s, "measured_overhead": ratio - 1,
        "reference_s": ref_s, "reference_in_plain_steps": ref_s / step_s,
        "trace_s": trace_s, "trace_in_plain_steps": trace_s / step_s,
        "implied_overhead": {str(n): cost / (n * step_s) for n in (10, 25, 50, 100, 200, 500)}}, indent=1) + "\n")
    print(f"wrote {path}")


def _trace_costs(batch: int, mcfg, spec, n_layers: int, repeats: int = 3) -> tuple[float, float]:
    """Median seconds, over every probed layer's shape (one batch, causal), of (a) the probes' fp64
    reference alone (attention.trace's, forward and dQ) and (b) the whole measurement a probe makes
    of a layer, ``trace`` as the probes call it: that reference, the layer's arithmetic forward
    counting ties (and the census) and its dQ backward, and the reference's scores kept. (b) is the
    part of a probe that no rearrangement of its metrics can remove."""
    from flashguard.attention.trace import _reference
    from flashguard.diagnostics import LayerCapture
    from flashguard.diagnostics.probes import _policy_trace, _resolve
    hd = mcfg.n_embd // mcfg.n_head
    g = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(batch, mcfg.n_head, mcfg.block_size, hd, generator=g).bfloat16() for _ in range(4))
    cap = LayerCapture(layer=0, q=q, k=k, v=v, do=do, spec=spec, backend="flash", causal=True)
    policy, stab = _resolve(cap, None, None)

    def reference():
        _reference(q, k, v, do, attn_mask=None, causal=True, scale=cap.attn_scale, softcap=None, grads="dq")

    def measurement():  # what probes.shadow runs for a flash layer, before any metric
        with torch.no_grad():
            _policy_trace(cap, policy, stab, cap.attn_scale, grad=True)

    out = []
    for fn in (reference, measurement):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(n_layers):
                fn()
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
    return out[0], out[1]


if __name__ == "__main__":
    main()
