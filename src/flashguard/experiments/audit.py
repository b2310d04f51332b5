"""`flashguard audit`: does *your* attention kernel lean under tied maxima?

Any attention kernel is measured as a black box with the lab's measurement: the lab's
problems of independent rows (ties planted, tail mass below / above half an ulp, T = 1024
across two tiles), the kernel's O and its delta = rowsum(dO * O) (fp32, from the stored bf16
O, as production backward passes take it) against fp64 on the same inputs, one value per
row, judged paired against the noise floor (the fp32 arithmetic with the kernel's input and
output formats, on the same rows). Built in, where the device has them:

* torch ``scaled_dot_product_attention`` per ``SDPBackend``: on CPU the fused flash kernel and the
  math kernel; on CUDA flash, memory-efficient and cuDNN;
* flashguard's PyTorch path per preset (white boxes: every intermediate visible), and its
  Triton kernels on CUDA, or on CPU in Triton's interpreter (``triton_interpreter=True``,
  ``flashguard audit --triton-interpreter``: the kernels' own rounding steps, run one program
  at a time in NumPy; not a GPU's matmul order or speed);
* ``flash_attn.flash_attn_func`` when the package imports (CUDA).

    flashguard audit --quick --out audit     # audit.json, audit.md, audit.png
"""
from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ..attention.error_stats import Z_CRIT
from ..attention.trace import Arithmetic
from ..utils.atomic import atomic_write_text
from ..utils.plotting import pyplot, save_png
from .lab.measure import Bench, BlackBox
from .lab.problems import Problem

__all__ = ["builtin_kernels", "audit_conditions", "run_audit", "write_audit", "use_triton_interpreter", "kernel_name"]

FLASHGUARD_PRESETS = ("paper", "paper-fp32fwd", "fa2", "torch-cpu")


def _sdpa(sdp_backend):
    from torch.nn.attention import sdpa_kernel

    def fn(q, k, v):
        with sdpa_kernel(sdp_backend):
            return F.scaled_dot_product_attention(q, k, v)
    return fn


# the Triton kernels' arithmetics audited (fa2-structured presets, as the kernels implement them)
TRITON_PRESETS = ("fa2", "fa2-fp16")


def _triton_arithmetics() -> list:
    return [Arithmetic.of(p, kernel="triton", block_q=64, block_k=64) for p in TRITON_PRESETS]


def use_triton_interpreter() -> None:
    """Run the Triton kernels in Triton's CPU interpreter. Triton reads TRITON_INTERPRET when it
    is imported, so this must come before anything imports it (the audit command calls it first)."""
    import os
    import sys

    from ..attention import triton_available
    if not triton_available():
        raise ValueError("--triton-interpreter: the triton package is not installed (pip install triton)")
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError("--triton-interpreter: triton was already imported without TRITON_INTERPRET=1; "
                         "set TRITON_INTERPRET=1 before the first import of triton")
    os.environ["TRITON_INTERPRET"] = "1"


def builtin_kernels(device: str = "cpu", *, triton_interpreter: bool = False) -> list:
    """The kernels this device offers: BlackBox entries and flashguard Arithmetic entries. On CPU,
    ``triton_interpreter`` adds flashguard's Triton kernels run in Triton's interpreter."""
    from torch.nn.attention import SDPBackend
    out: list = []
    if device == "cpu":
        out += [BlackBox("torch sdpa: flash (CPU)", _sdpa(SDPBackend.FLASH_ATTENTION)),
                BlackBox("torch sdpa: math (CPU)", _sdpa(SDPBackend.MATH))]
        if triton_interpreter:
            use_triton_interpreter()
            out += _triton_arithmetics()
    else:
        out += [BlackBox(f"torch sdpa: {name} (CUDA)", _to_cuda(_sdpa(b)))
                for name, b in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                                ("cudnn", SDPBackend.CUDNN_ATTENTION))]
        try:
            from flash_attn import flash_attn_func  # noqa: F401
            out.append(BlackBox("flash_attn.flash_attn_func (CUDA)", _to_cuda(_flash_attn)))
        except ImportError:
            pass
        from ..attention import triton_available
        if triton_available():
            out += _triton_arithmetics()
    out += [Arithmetic.of(p) for p in FLASHGUARD_PRESETS]
    return out


def _to_cuda(fn):
    def run(q, k, v):
        return fn(q.cuda(), k.cuda(), v.cuda()).cpu()
    return run


def _flash_attn(q, k, v):  # flash_attn takes (B, T, H, D)
    from flash_attn import flash_attn_func
    return flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def audit_conditions(quick: bool, seed: int = 0) -> list[Problem]:
    base = Problem(n_rows=1024 if quick else 3072, seed=seed)
    out = [replace(base, ties=k, tail=t) for k in (2, 8) for t in (0.25, 4.0)]
    out += [replace(base, ties=16, t=1024, tail=0.25), replace(base, ties=1, tail=0.25)]
    return out


def kernel_name(kern, device: str) -> str:
    """A kernel's row name: its label, and for a Triton arithmetic on CPU that it ran interpreted."""
    interpreted = getattr(kern, "kernel", None) == "triton" and device == "cpu"
    return kern.label() + (" (Triton CPU interpreter)" if interpreted else "")


def run_audit(kernels=None, *, quick: bool = False, seed: int = 0, device: str = "cpu",
              triton_interpreter: bool = False, progress=None) -> dict:
    t0 = time.perf_counter()
    say = progress or (lambda m: None)
    kernels = builtin_kernels(device, triton_interpreter=triton_interpreter) if kernels is None else kernels
    bench, rows, verdicts = Bench(), [], {}
    conds = audit_conditions(quick, seed)
    for kern in kernels:
        name = kernel_name(kern, device)
        say(name)
        leaning = []
        for c in conds:
            try:
                m = bench.measure(c, kern)
            except (RuntimeError, NotImplementedError) as e:  # a kernel that refuses these shapes
                rows.append({"kernel": name, "condition": c.label(), "error": f"{type(e).__name__}: {e}"})
                continue
            rows.append({"kernel": name, **m.to_dict()})
            if c.ties > 1 and m.leans:
                leaning.append(c.label())
        tried = [r for r in rows if r["kernel"] == name and "error" not in r and r["problem"]["ties"] > 1]
        if not tried:
            verdicts[name] = "not measured (the kernel refused every problem)"
        else:
            verdicts[name] = (f"leans under ties in {len(leaning)} of {len(tried)} conditions" if leaning
                              else f"no lean beyond the floor in {len(tried)} tie conditions")
    return {"quick": quick, "seed": seed, "device": device, "versions": {"torch": torch.__version__},
            "runtime_s": time.perf_counter() - t0, "unit": "one value per independent row", "rows": rows,
            "verdicts": verdicts}


def _md(result: dict) -> str:
    rows = [r for r in result["rows"] if "error" not in r]
    conds = list(dict.fromkeys(r["condition"] for r in rows))
    kernels = list(dict.fromkeys(r["kernel"] for r in result["rows"]))
    by = {(r["kernel"], r["condition"]): r for r in rows}

    def cell(r, part):
        s = r[part]
        lean = r.get({"o_vs_floor": "o_leans", "delta_vs_floor": "delta_leans"}.get(part, ""))
        mark = "**" if (s["verdict"].startswith("biased") if lean is None else lean) else ""
        return f"{mark}{s['mean'] * 1e6:+.0f}{mark} ({s['z']:+.1f}, r {s['bias_ratio']:+.2f})"

    def table(part):
        head = "| kernel | " + " | ".join(conds) + " |\n|" + "---|" * (len(conds) + 1)
        lines = [f"| {k} | " + " | ".join(cell(by[(k, c)], part) if (k, c) in by else "refused" for c in conds) + " |"
                 for k in kernels]
        return head + "\n" + "\n".join(lines)

    floor = {c: by[(kernels[0], c)]["o_floor"] for c in conds if (kernels[0], c) in by}
    md = [f"# Kernel audit ({'quick' if result['quick'] else 'full'}, {result['device']})", "",
          f"torch {result['versions']['torch']}; {result['runtime_s']:.0f} s. Problems: the lab's independent rows",
          "(`flashguard.experiments.lab.problems`). **Unit: one value per independent row.** Cells: the mean row",
          "error beyond the noise floor (the fp32 arithmetic with the kernel's input and output formats, same rows),",
          f"in 1e-6, with its z and bias ratio r; **bold**: a lean (|z| >= {Z_CRIT:.2f}, |r| >= 0.02).", "",
          "## Verdicts", ""]
    md += [f"* {k}: {v}" for k, v in result["verdicts"].items()]
    md += ["", "## O beyond the floor", "", table("o_vs_floor"), "", "## delta = rowsum(dO * O) beyond the floor", "",
           table("delta_vs_floor"), "", "Noise floor's own lean against fp64 (O): "
           + "; ".join(f"{c}: {s['mean'] * 1e6:+.0f} (z {s['z']:+.1f})" for c, s in floor.items()), ""]
    errs = [r for r in result["rows"] if "error" in r]
    if errs:
        md += ["## Refused", ""] + [f"* {r['kernel']} on {r['condition']}: {r['error']}" for r in errs] + [""]
    return "\n".join(md)


def write_audit(result: dict, out_dir) -> dict:
    plt = pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "audit.json", json.dumps(result, indent=1) + "\n")
    atomic_write_text(out / "audit.md", _md(result))
    rows = [r for r in result["rows"] if "error" not in r]
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    conds = list(dict.fromkeys(r["condition"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 3.8))
    w = 0.8 / max(len(kernels), 1)
    for i, k in enumerate(kernels):
        zs = [next((r["o_vs_floor"]["z"] for r in rows if r["kernel"] == k and r["condition"] == c), 0.0) for c in conds]
        ax.bar([j + i * w for j in range(len(conds))], zs, width=w, label=k)
    for y in (Z_CRIT, -Z_CRIT):
        ax.axhline(y, color="grey", lw=0.6, ls="--")
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(conds))], [c.split(",v=")[0] for c in conds], fontsize=7)
    ax.set_yscale("symlog", linthresh=5)
    ax.set_ylabel("z of O's lean beyond the floor")
    ax.legend(fontsize=7)
    save_png(fig, out / "audit.png")
    return {"json": out / "audit.json", "md": out / "audit.md", "png": out / "audit.png"}
