"""Where a real kernel's lean enters: its faithful model, changed one step at a time.

``flashguard audit --decompose`` measures, on the audit's problems (independent rows, ties
planted and not), PyTorch's fused CPU flash kernel as a black box, its model ``torch-cpu``
(numerics.policy), and the model with one step of its arithmetic changed back to the exact
one. The model's agreement with the kernel is measured bit for bit on the same inputs. The
step responsible is computed: a single change that removes the lean (the lab's one rule,
``leans_beyond_floor``) in every condition where the model leans. Unit: one independent row.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

from ..attention.function import flash_attention
from ..attention.trace import Arithmetic
from ..utils.atomic import atomic_write_text
from ..utils.table import markdown_table
from .audit import _sdpa, audit_conditions
from .lab.measure import Bench, BlackBox

__all__ = ["TORCH_CPU_STEPS", "decompose_torch_cpu", "kernel_agreement", "write_decomposition"]

# (what changes, precision): the model, then one step of it at a time
TORCH_CPU_STEPS = (
    ("the model (torch-cpu)", "torch-cpu"),
    ("exact exp instead of fexp_u20", "torch-cpu[exp=exact]"),
    ("O = acc / l instead of acc * (1 / l)", "torch-cpu[normalize=divide]"),
    ("row sum of the bf16-rounded P̄ (flash-attention PR #2721)", "torch-cpu[row_sum_rounded=true]"),
)
# measured beside the steps, not a step: the production model with both arithmetic changes back
REFERENCES = (("fa2 (exact exp and acc / l; not a single step)", "fa2"),)


_kernel = _sdpa(SDPBackend.FLASH_ATTENTION)  # the audit's own call of the kernel
KERNEL = BlackBox("torch sdpa: flash (CPU)", _kernel)


def _bf16_ulp(mag: torch.Tensor) -> torch.Tensor:
    """The bf16 spacing at |x| = mag (8 significant bits); 1 where mag is 0."""
    return torch.where(mag > 0, torch.exp2(torch.floor(torch.log2(mag)) - 7), torch.ones_like(mag))


def kernel_agreement(model_o: torch.Tensor, kernel_o: torch.Tensor) -> dict:
    """How two bf16 outputs (..., D) agree: the fraction of bit-identical elements, the largest
    difference in bf16 ulps of the row's largest |O| (``max_row_ulps``: an fp32 accumulation
    order moves a rounding by at most one of those), and in ulps of the element itself
    (``max_ulps``: larger for elements near 0, where the row's sum cancels)."""
    a, b = model_o.float(), kernel_o.float()
    same = (model_o.view(torch.int16) == kernel_o.view(torch.int16)) | ((a == 0) & (b == 0))
    diff = (a - b).abs()
    row = torch.maximum(a.abs(), b.abs()).amax(-1, keepdim=True)
    return {"identical": float(same.double().mean()), "elements": same.numel(),
            "max_row_ulps": float((diff / _bf16_ulp(row)).max()),
            "max_ulps": float((diff / _bf16_ulp(torch.maximum(a.abs(), b.abs()))).max())}


def decompose_torch_cpu(*, quick: bool = True, seed: int = 0, progress=None) -> dict:
    """Every step of TORCH_CPU_STEPS and the kernel on every audit condition (fp32 floor paired)."""
    t0 = time.perf_counter()
    say = progress or (lambda m: None)
    bench, rows = Bench(), []
    conds = audit_conditions(quick, seed)
    for c in conds:
        say(c.label())
        q, k, v, _ = (x.to(torch.bfloat16) for x in bench.inputs(c))
        agree = kernel_agreement(flash_attention(q, k, v, precision="torch-cpu"), _kernel(q, k, v))
        for step, precision in (("torch's kernel (black box)", None),) + TORCH_CPU_STEPS + REFERENCES:
            m = bench.measure(c, KERNEL if precision is None else Arithmetic.of(precision))
            rows.append({"condition": c.label(), "ties": c.ties, "step": step, "precision": precision,
                         "o_leans": m.o_leans, "delta_leans": m.delta_leans, "leans": m.leans,
                         "o_vs_floor": m.o_vs_floor.to_dict(), "delta_vs_floor": m.delta_vs_floor.to_dict(),
                         "o": m.o.to_dict(), "o_mae": m.o_mae, "o_mae_floor": m.o_mae_floor,
                         **({"agreement": agree} if precision == "torch-cpu" else {})})
    return {"quick": quick, "seed": seed, "unit": "one value per independent row",
            "versions": {"torch": torch.__version__}, "runtime_s": time.perf_counter() - t0,
            "rows": rows, "responsible": responsible_steps(rows)}


def responsible_steps(rows: list[dict]) -> list[str]:
    """The single changes that remove the model's lean in every condition where the model leans
    (none if the model leans nowhere)."""
    leaning = {r["condition"] for r in rows if r["precision"] == "torch-cpu" and r["leans"]}
    if not leaning:
        return []
    out = []
    for step, precision in TORCH_CPU_STEPS[1:]:
        cells = [r for r in rows if r["precision"] == precision and r["condition"] in leaning]
        if cells and not any(r["leans"] for r in cells):
            out.append(step)
    return out


def _cell(r: dict, part: str) -> str:
    s = r[f"{part}_vs_floor"]
    mark = "**" if r[f"{part}_leans"] else ""
    return f"{mark}{s['mean'] * 1e6:+.1f} (z {s['z']:+.1f}, ratio {s['bias_ratio']:+.2f}){mark}"


def decomposition_markdown(result: dict) -> str:
    rows = result["rows"]
    conds = list(dict.fromkeys(r["condition"] for r in rows))
    steps = list(dict.fromkeys(r["step"] for r in rows))
    by = {(r["step"], r["condition"]): r for r in rows}
    out = ["# PyTorch's CPU flash kernel: where its lean enters", "",
           f"torch {result['versions']['torch']}, {'quick' if result['quick'] else 'full'} audit conditions, "
           f"seed {result['seed']}; unit: {result['unit']}. Each cell: mean O error beyond the fp32 noise floor "
           "(x1e-6, paired on the same rows), its z and bias ratio; **bold**: leans by the lab's one rule "
           "(own error a bias, |z| >= 3.29 and |ratio| >= 0.02, and the paired difference from the floor a bias "
           "of the same sign).", ""]
    for part, title in (("o", "O"), ("delta", "delta = rowsum(dO * O)")):
        grid = [[s] + [_cell(by[(s, c)], part) for c in conds] for s in steps]
        out += [f"## {title}", "", markdown_table(["step"] + conds, grid), ""]
    agree = [(r["condition"], r["agreement"]) for r in rows if "agreement" in r]
    out += ["## The model against the kernel, bit for bit", "",
            markdown_table(["condition", "bit-identical elements",
                            "largest difference, bf16 ulps of the row's largest abs(O)", "of the element"],
                           [[c, f"{a['identical'] * 100:.3f} % of {a['elements']:,}", f"{a['max_row_ulps']:.2f}",
                             f"{a['max_ulps']:.2f}"] for c, a in agree])]
    resp = result["responsible"]
    out += ["", "## The step responsible (computed)", "",
            ("A single change removes the model's lean in every condition where it leans: " + "; ".join(resp) + "."
             if resp else "No single change removes the model's lean everywhere it leans (or the model leans nowhere)."),
            "", f"Measured in {result['runtime_s']:.0f} s."]
    return "\n".join(out) + "\n"


def write_decomposition(result: dict, out_dir) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "torch-cpu-decomposition.json", json.dumps(result, indent=1))
    path = out / "torch-cpu-decomposition.md"
    atomic_write_text(path, decomposition_markdown(result))
    return path
