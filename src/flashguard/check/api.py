"""``flashguard.check``: is this model's bf16 attention at risk, and what do I switch on?

    import flashguard
    result = flashguard.check(model, batches, out="check")    # batches: input ids, tuples or dicts
    print(result.verdict, result.recommendation["text"])

Runs ``steps`` forward and backward passes of ``model`` (``steps.run_steps``: the user's dtype,
device and attention implementation) while capturing every SDPA call with the backend torch
dispatched it to (``capture.CheckCapture``); measures, per layer, the kernel that ran and each
candidate fix against fp64 and the fp32 noise floor, and the census (``measure``); times each
fix against the kernel (``timing``); judges by ``verdict`` (the one rule, written down before
any result); and, given ``out``, writes check.json, check.md and check.png (``report``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..experiments.lab.measure import Bench
from .capture import layer_problems
from .dispatch import kernel_label
from .fixes import fixes_for
from .measure import kernel_runner, measure_layer
from .steps import DTYPES, precision_mode, run_steps
from .timing import time_ratios
from .verdict import choose_fix, overall_verdict

__all__ = ["check", "CheckResult", "UNIT"]

UNIT = ("one (sequence, head) pair: O's error averaged over the pair's rows and features (delta's over its "
        "rows) before the test across pairs; the rows of a sequence share its keys and values")
EAGER = ("the model made no call to torch.nn.functional.scaled_dot_product_attention (eager attention, or "
         "another kernel): check measures SDPA models only. Switch: transformers "
         "from_pretrained(..., attn_implementation=\"sdpa\") or model.set_attn_implementation(\"sdpa\"); your "
         "own module: call F.scaled_dot_product_attention")


@dataclass
class CheckResult:
    """What ``check`` found: ``verdict`` (none / low / high / unmeasured), ``recommendation``
    (a dict with ``text`` and the lines to copy), ``layers`` (per-layer dicts, each with its
    ``verdict``) and the rest of check.json (``to_dict()``)."""

    verdict: str
    recommendation: dict
    layers: list
    info: dict = field(default_factory=dict)
    fixes: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "recommendation": self.recommendation, **self.info,
                "fixes": self.fixes, "layers": self.layers}

    def summary(self) -> str:
        from .report import console_text
        return console_text(self.to_dict())

    __str__ = summary


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"flashguard.check: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"flashguard.check: dtype must be torch.bfloat16, float16 or float32, got {dtype!r}")
    return dtype


def _int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"flashguard.check: {name} must be an integer >= {low}, got {value!r}")
    return value


def check(model: torch.nn.Module, batches, *, steps: int = 2, dtype="bf16", out=None, loss_fn=None,
          sequences: int | None = None, repeats: int = 3, fixes: bool = True, name: str | None = None,
          progress=None) -> CheckResult:
    """Check ``model``'s attention on ``batches`` (an iterable: tensors of input ids, tuples of
    positional arguments or dicts of keyword arguments of the model's forward).

    steps: forward + backward passes (default 2), each on the next batch. dtype: "bf16" (default),
    "fp16", "fp32" or a torch dtype: the model runs in it as it is when its parameters have it,
    else under autocast. out: a folder for check.json, check.md and check.png (None: nothing is
    written). loss_fn: ``fn(output, batch) -> scalar`` (default ``steps.default_loss``: the
    output's loss, else next-token cross-entropy). sequences: keep at most this many batch
    entries per call and step (less memory and time). repeats: timing rounds per fix. fixes:
    measure the candidate fixes (default True). name: the model's name in the report."""
    t0 = time.perf_counter()
    dt = _dtype(dtype)
    steps, repeats = _int("steps", steps, 1), _int("repeats", repeats, 1)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"flashguard.check: model must be a torch.nn.Module, got {type(model).__name__}")
    say = progress or (lambda msg: None)
    say(f"{steps} forward and backward step(s) in {_name(dt)} ({precision_mode(model, dt)})")
    cap, losses = run_steps(model, batches, steps=steps, dtype=dt, loss_fn=loss_fn, sequences=sequences)
    info = _info(model, name, dt, cap, losses, steps)
    phases = info["phase_s"] = {"steps": time.perf_counter() - t0}
    layers = layer_problems(cap)
    if not layers:
        result = CheckResult("unmeasured", {"text": EAGER, "fix": None}, [], {**info, "kernel": "eager",
                                                                                "reason": EAGER})
        return _finish(result, out, t0)
    # the dtype the kernel received (autocast's) decides the floor and the candidates, not the one asked for
    received = next((L.problem.q.dtype for L in layers if L.problem is not None), dt)
    info["kernel_dtype"] = _name(received)
    candidates = fixes_for(received) if fixes else []
    bench, results = Bench(), []
    dev = torch.device(info["device"])
    # the Bench seeds the global RNG per problem: the user's generators are left as they were
    with torch.random.fork_rng(devices=[dev.index or 0] if dev.type == "cuda" else []):
        for layer in layers:
            say(f"L{layer.index}: {layer.backend}")
            results.append(measure_layer(bench, layer, cap.kernel_fn, candidates))
    info["kernel"] = kernel_label(cap.kernel_fn, _common(r.backend for r in results), info["device"])
    phases["measure"] = time.perf_counter() - t0 - phases["steps"]
    costs = _costs(results, cap.kernel_fn, candidates, repeats, say)
    phases["timing"] = time.perf_counter() - t0 - phases["steps"] - phases["measure"]
    result = _judge(results, candidates, costs, info)
    return _finish(result, out, t0)


def _name(dt) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dt, str(dt).replace("torch.", ""))


def _common(names) -> str:
    names = list(dict.fromkeys(names))
    return names[0] if len(names) == 1 else "/".join(names)


def _info(model, name, dt, cap, losses, steps) -> dict:
    p = next(model.parameters())
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return {"model": name or type(model).__name__, "attn_implementation": attn, "dtype": _name(dt),
            "precision_mode": precision_mode(model, dt), "device": str(p.device), "steps": steps,
            "losses": losses, "sdpa_calls": len(cap.calls), "calls_outside_forward": cap.other_calls,
            "unit": UNIT, "torch": torch.__version__}


def _costs(results, kernel_fn, candidates, repeats, say) -> dict:
    """Time ratios on the first measured layer's problem (the layers of a stack share its shape)."""
    first = next((r for r in results if r.kernel is not None), None)
    if first is None or not candidates:
        return {}
    say(f"timing the fixes on L{first.index}'s shape {tuple(first.shape)} ({repeats} rounds)")
    layer_problem = first.kernel.problem
    runners = {"kernel": kernel_runner(kernel_fn, first.backend.split("/")[0], layer_problem)}
    runners.update({f.name: f.runner(kernel_fn, layer_problem) for f in candidates})
    return {"shape": first.shape, "layer": first.index, "repeats": repeats,
            "times": time_ratios(runners, layer_problem, repeats=repeats)}


def _layer_dict(r) -> dict:
    d = {"layer": r.index, "backend": r.backend, "shape": r.shape, "verdict": r.risk, "reason": r.reason,
         "census": r.census, "note": r.note or None,
         "kernel": None if r.kernel is None else r.kernel.to_dict(), "fixes": {}}
    for name, m in r.fixes.items():
        d["fixes"][name] = {"error": m} if isinstance(m, str) else m.to_dict()
    return d


def _fix_summary(results, candidates, costs) -> dict:
    times = costs.get("times", {})
    out = {}
    for f in candidates:
        ms = [(r.index, r.fixes.get(f.name)) for r in results if r.kernel is not None]
        out[f.name] = {"leans_on": [i for i, m in ms if not isinstance(m, str) and m is not None and m.leans],
                       "refused_on": [i for i, m in ms if isinstance(m, str)],
                       "measured_on": sum(1 for _, m in ms if m is not None and not isinstance(m, str)),
                       "ratio": times.get(f.name, {}).get("ratio"), "seconds": times.get(f.name, {}).get("seconds"),
                       "switch": f.switch}
    return out


def _recommendation(verdict: str, fixes: dict) -> dict:
    if verdict in ("none", "unmeasured"):
        text = ("nothing to switch on: the kernel that ran does not lean beyond the fp32 noise floor here"
                if verdict == "none" else "nothing measured: see the layers' reasons")
        return {"text": text, "fix": None}
    best, other = choose_fix(fixes)
    if best is None and other is None:
        return {"text": "no candidate fix measured here removes the lean: see check.md", "fix": None}
    pick = best or other
    f = fixes[pick]
    cost = f"x{f['ratio']:.1f} the kernel's time (forward + backward)" if f["ratio"] is not None else "cost not timed"
    text = f"switch on {pick}: no lean on any layer, {cost}"
    if best is not None and other is not None:
        o = fixes[other]
        text += f"; cheaper without flashguard: {other} (x{o['ratio']:.1f}): {o['switch']['note']}"
    return {"text": text, "fix": pick, "plain": f["switch"]["plain"], "hf": f["switch"]["hf"],
            "note": f["switch"]["note"], "cost_ratio": f["ratio"]}


def _judge(results, candidates, costs, info) -> CheckResult:
    layers = [_layer_dict(r) for r in results]
    verdict = overall_verdict([r.risk for r in results])
    fixes = _fix_summary(results, candidates, costs)
    worst = next((r for r in results if r.risk == verdict), None)
    counts = {k: sum(1 for r in results if r.risk == k) for k in ("high", "low", "none", "unmeasured")}
    info = {**info, "layer_counts": counts,
            "reason": (f"L{worst.index}: {worst.reason}" if worst is not None and verdict != "none"
                       else f"no layer's kernel leans beyond the fp32 noise floor ({len(results)} layers)"),
            "timing": {k: v for k, v in costs.items() if k != "times"}}
    return CheckResult(verdict, _recommendation(verdict, fixes), layers, info, fixes)


def _finish(result: CheckResult, out, t0: float) -> CheckResult:
    result.info["runtime_s"] = time.perf_counter() - t0
    if out is not None:
        from .report import write_check
        result.info["files"] = {k: str(v) for k, v in write_check(result.to_dict(), out).items()}
    return result
