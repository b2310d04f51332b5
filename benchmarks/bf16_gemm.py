"""torch's bf16 products against the C kernels that reproduce them (numerics/bf16_gemm.py).

    python benchmarks/bf16_gemm.py --json benchmarks/results/bf16-gemm-1thread.json
    python benchmarks/bf16_gemm.py --reference /path/to/attention.py   # + the study's code

Only where the C path is on (a CPU whose torch runs ATen's portable bf16 gemm: AVX2 without
AVX-512); elsewhere it says so and exits. One thread. Three kinds of row, each timed with the C
path on and off in the same process, interleaved round-robin, medians:

* the products themselves, at the shapes of the attention (B 2 x H 12, T 1024, D 64, tiles of
  512) and of a tiny-cpu training step (4,096 tokens, width 256), beside the fp32 product of
  the same operands upcast (what an fp32 GEMM costs here);
* ``paper`` attention forward+backward at T 1024 (and the study's reference code, which always
  runs torch's products);
* a tiny-cpu training step (batch 16 x T 256, bf16 autocast, AdamW) with SDPA and with
  flash + ``paper``: the model's Linear layers and the attention's products.
The outputs are bit for bit the same either way (tests/numerics/test_bf16_gemm.py,
tests/train/test_loss_hash.py); this measures only the time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from flashguard.attention import flash_attention
from flashguard.numerics import bf16_gemm
from flashguard.utils.atomic import atomic_write_text

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/machine.py, however this file is loaded
from machine import machine  # noqa: E402
from attention import load_reference_code  # noqa: E402

_ACTIVE = bf16_gemm.active


def c_path(on: bool) -> None:
    """Switch the C path on or off for what follows (matmul and the Linear read it per call)."""
    bf16_gemm.active = _ACTIVE if on else (lambda: False)


def _operands(g, shape_a, shape_b, la, lb):
    a = torch.randn(*shape_a, generator=g).bfloat16()
    b = torch.randn(*shape_b, generator=g).bfloat16()
    return bf16_gemm._laid_out(a, la), bf16_gemm._laid_out(b, lb)


def products(g) -> dict:
    """name -> (a, b): the products of the two workloads, laid out as they reach torch."""
    return {
        "attention S = q k^T (24 x 512x64 @ 64x512, dot8)": _operands(g, (24, 512, 64), (24, 64, 512), "row", "col"),
        "attention P V (24 x 512x512 @ 512x64, ilp4)": _operands(g, (24, 512, 512), (24, 512, 64), "row", "row"),
        "attention dV = P^T dO (24 x 512x512 @ 512x64, seq)": _operands(g, (24, 512, 512), (24, 512, 64), "col", "row"),
        "linear forward x W^T (4096x256 @ 256x1024, dot8)": _operands(g, (4096, 256), (256, 1024), "row", "col"),
        "linear grad x = g W (4096x1024 @ 1024x256, ilp4)": _operands(g, (4096, 1024), (1024, 256), "row", "row"),
        "linear grad W = g^T x (1024x4096 @ 4096x256, seq)": _operands(g, (1024, 4096), (4096, 256), "col", "row"),
    }


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def interleaved(configs: dict, repeats: int) -> dict:
    """name -> sorted times (s); configs: name -> (c_path_on, fn); one warm-up call each."""
    for on, fn in configs.values():
        c_path(on)
        fn()
    times = {name: [] for name in configs}
    for _ in range(repeats):
        for name, (on, fn) in configs.items():
            c_path(on)
            times[name].append(_time(fn))
    c_path(True)
    return {k: sorted(v) for k, v in times.items()}


def attention_fn(reference: str | None):
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 12, 1024, 64, generator=g).bfloat16() for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def paper():
        torch.autograd.grad(flash_attention(q, k, v, is_causal=True, precision="paper"), (q, k, v), do)

    if not reference:
        return paper, None
    code = load_reference_code(reference)

    def ref():
        torch.autograd.grad(code(q, k, v), (q, k, v), do)
    return paper, ref


def step_fn(backend: str):
    from flashguard.model import GPT, AttentionSpec, model_config
    cfg = model_config("tiny-cpu")
    torch.manual_seed(0)
    spec = AttentionSpec("sdpa") if backend == "sdpa" else AttentionSpec("flash", precision="paper")
    model = GPT(cfg, spec)
    opt = model.configure_optimizer(weight_decay=0.1, lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (16, cfg.block_size), generator=g)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(x, torch.roll(x, -1, 1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per product and attention call")
    ap.add_argument("--step-repeats", type=int, default=3, help="timed training steps per config")
    ap.add_argument("--reference", help="path to the study's attention.py, to time it too")
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not _ACTIVE():
        print("the C bf16 products are off on this machine (torch's bf16 matmul here is not ATen's portable "
              f"gemm, or no C compiler: {torch.backends.cpu.get_cpu_capability()}); nothing to compare")
        return 0
    out = {"machine": machine(), "threads": 1, "products": {}, "calls": {}}
    g = torch.Generator().manual_seed(0)
    for name, (a, b) in products(g).items():
        af, bf = a.float(), b.float()
        t = interleaved({"torch": (False, lambda: torch.matmul(a, b)), "C": (True, lambda: bf16_gemm.matmul(a, b)),
                         "fp32": (False, lambda: torch.matmul(af, bf))}, args.repeats)
        out["products"][name] = {k: statistics.median(v) for k, v in t.items()}
        print(name, {k: f"{1e3 * v:.1f} ms" for k, v in out["products"][name].items()}, flush=True)
    paper, ref = attention_fn(args.reference)
    configs = {"paper attention, torch's products": (False, paper), "paper attention, C products": (True, paper)}
    if ref is not None:
        configs["the study's reference code"] = (True, ref)
    for name, v in interleaved(configs, args.repeats).items():
        out["calls"][name] = statistics.median(v)
    for backend in ("sdpa", "paper"):
        step = step_fn(backend)
        label = "SDPA" if backend == "sdpa" else "flash + paper"
        t = interleaved({f"tiny-cpu step, {label}, torch's products": (False, step),
                         f"tiny-cpu step, {label}, C products": (True, step)}, args.step_repeats)
        out["calls"].update({k: statistics.median(v) for k, v in t.items()})
    for name, s in out["calls"].items():
        print(f"{name}: {1e3 * s:.0f} ms", flush=True)
    if args.json:
        atomic_write_text(Path(args.json), json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
