"""The check's outputs: the console text, check.json, check.md and check.png (atomic writes)."""
from __future__ import annotations

import json
from pathlib import Path

from ..attention.error_stats import Z_CRIT
from ..utils.atomic import atomic_write_text
from ..utils.plotting import pyplot, save_png
from ..utils.table import markdown_table
from .verdict import HIGH_BIAS_RATIO, TIE_RATE_LOW

__all__ = ["console_text", "markdown", "write_check", "check_figure"]


def _costs(d: dict) -> str:
    parts = [f"{n} x{f['ratio']:.1f}" for n, f in d.get("fixes", {}).items() if f.get("ratio") is not None]
    return ", ".join(parts)


def _head(d: dict) -> str:
    if d.get("kernel") == "eager":
        return f"{d['model']}: {d['dtype']} ({d['precision_mode']}), {d['device']}, {d['steps']} step(s)"
    c = d.get("layer_counts", {})
    return (f"{d['model']}: {d['dtype']} ({d['precision_mode']}), {d['device']}, {d['steps']} step(s); "
            f"kernel: {d['kernel']}; layers: {c.get('high', 0)} high, {c.get('low', 0)} low, "
            f"{c.get('none', 0)} none")


def console_text(d: dict) -> str:
    """What ``flashguard check`` prints: a line per layer, the verdict, what to switch on."""
    lines = [_head(d)]
    for L in d.get("layers", []):
        lines.append(f"  L{L['layer']:<3} {L['backend']:<6} {L['verdict']:<5} {L['reason']}")
    lines.append(f"verdict: {d['verdict']} - {d.get('reason', '')}")
    rec = d["recommendation"]
    lines.append(f"switch on: {rec['text']}")
    for key in ("plain", "hf"):
        if rec.get(key):
            lines.append(f"    {rec[key]}")
    if _costs(d):
        t = d.get("timing", {})
        lines.append(f"cost of each fix, forward + backward against the kernel (L{t.get('layer')}, "
                     f"shape {tuple(t.get('shape') or ())}, median of {t.get('repeats')}): {_costs(d)}")
    return "\n".join(lines)


def _cell(m: dict | None, q: str) -> str:
    if m is None:
        return "-"
    if "error" in m:
        return "refused"
    v = m[f"{q}_vs_floor"]
    mark = "**" if m[f"{q}_leans"] else ""
    return f"{mark}{v['mean']:+.1e}{mark} (z {v['z']:+.1f}, r {v['bias_ratio']:+.2f})"


def _layer_table(d: dict) -> str:
    fixes = list(d.get("fixes", {}))
    head = ["layer", "backend", "verdict", "kernel O", "kernel delta"] + [f"{f} O / delta" for f in fixes] + \
           ["tie rate", "at sink", "V one-signed"]
    rows = []
    for L in d["layers"]:
        c = L.get("census") or {}
        fx = [f"{_cell(L['fixes'].get(f), 'o')} / {_cell(L['fixes'].get(f), 'delta')}" for f in fixes]
        cen = ([f"{c['exact_tie_rate']:.2%}", f"{c['tie_at_sink']:.0%}", f"{c['v_sign_agree']:.0%}"] if c
               else ["-", "-", "-"])
        rows.append([f"L{L['layer']}", L["backend"], L["verdict"], _cell(L["kernel"], "o"),
                     _cell(L["kernel"], "delta")] + fx + cen)
    return markdown_table(head, rows)


def _fix_table(d: dict) -> str:
    rows = []
    for n, f in d.get("fixes", {}).items():
        switch = f"`{f['switch']['plain']}`" if f["switch"]["plain"] else f["switch"]["note"]
        ratio = f"{f['ratio']:.1f}" if f.get("ratio") is not None else "-"
        rows.append([n, ", ".join(f"L{i}" for i in f["leans_on"]) or "none",
                     ", ".join(f"L{i}" for i in f["refused_on"]) or "-", ratio, switch])
    return markdown_table(["fix", "leans on layers", "refused on", "cost (x kernel)", "switch on"], rows)


def markdown(d: dict) -> str:
    rec = d["recommendation"]
    md = [f"# flashguard check: {d['model']}", "", _head(d) + ".", "",
          f"**Verdict: {d['verdict']}.** {d.get('reason', '')}", "", f"**Switch on:** {rec['text']}", ""]
    for key, what in (("plain", "any model calling SDPA"), ("hf", "transformers")):
        if rec.get(key):
            md += [f"{what}:", "", "    " + rec[key], ""]
    if d.get("kernel") == "eager":
        return "\n".join(md)
    md += ["## Per layer", "", "Cells: the lean beyond the fp32 noise floor (mean unit error of the kernel or fix "
           "minus the floor's; delta's scale is the loss gradient's) with z and bias ratio r; **bold**: a lean by the one rule "
           "(`leans_beyond_floor`: own error against fp64 biased, |z| >= 3.29 and |r| >= 0.02, and the paired "
           "difference from the floor biased the same way).", "", _layer_table(d)]
    md += ["", "## Fixes", "", _fix_table(d)]
    t = d.get("timing", {})
    if t:
        md += ["", f"Cost: forward + backward time over the kernel's, on L{t['layer']}'s captured shape "
               f"{tuple(t['shape'])}, median of {t['repeats']} interleaved rounds after a warm-up."]
    md += ["", "## How this was measured", "",
           f"* Unit of independence: {d['unit']}.",
           f"* Rule: high = O or delta leans beyond the floor with |r| >= {HIGH_BIAS_RATIO}; low = a smaller lean, "
           f"or no lean but >= {TIE_RATE_LOW:.1%} of (row, key tile) pairs tied at the maximum; none = neither "
           "(`flashguard.check.verdict`).",
           f"* {d['steps']} step(s), losses {', '.join(f'{x:.4f}' for x in d['losses'])}; {d['sdpa_calls']} SDPA "
           f"calls captured; torch {d['torch']}; {d.get('runtime_s', 0):.0f} s.", ""]
    return "\n".join(md)


def check_figure(d: dict):
    """Per layer, the z of O's and delta's lean beyond the floor for the kernel and each fix
    (left), and each fix's cost (right)."""
    plt = pyplot()
    layers = [L for L in d["layers"] if L.get("kernel")]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 1]})
    xs = [L["layer"] for L in layers]
    series = [("kernel", lambda L: L["kernel"])] + [(n, (lambda L, n=n: L["fixes"].get(n)))
                                                     for n in d.get("fixes", {})]
    for name, get in series:
        for q, marker in (("o", "o"), ("delta", "^")):
            zs = [get(L)[f"{q}_vs_floor"]["z"] if get(L) and "error" not in get(L) else float("nan")
                  for L in layers]
            ax.plot(xs, zs, marker=marker, lw=0.8, label=f"{name}: {'O' if q == 'o' else 'delta'}")
    for y in (Z_CRIT, -Z_CRIT):
        ax.axhline(y, color="grey", lw=0.6, ls="--")
    ax.set_yscale("symlog", linthresh=5)
    lo, hi = ax.get_ylim()
    ax.set_ylim(min(lo, -10), max(hi, 10))     # the +-3.29 lines always in view, never the whole axis
    ax.set_xticks(xs, [f"L{i}" for i in xs], fontsize=7)
    ax.set_xlabel("layer (SDPA call in a forward)")
    ax.set_ylabel("z of the lean beyond the fp32 floor")
    ax.set_title(f"{d['model']}: verdict {d['verdict']}", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    fixes = {n: f["ratio"] for n, f in d.get("fixes", {}).items() if f.get("ratio") is not None}
    bx.bar(list(fixes), list(fixes.values()), color="tab:blue")
    bx.axhline(1.0, color="grey", lw=0.6)
    bx.set_ylabel("time, x the kernel's (fwd + bwd)")
    bx.tick_params(axis="x", labelsize=6, rotation=30)
    bx.set_title("cost of each fix", fontsize=9)
    if not fixes:
        bx.set_visible(False)
    return fig


def write_check(d: dict, out_dir) -> dict:
    """check.json, check.md and (when a layer was measured) check.png in ``out_dir``; their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "check.json", "md": out / "check.md"}
    atomic_write_text(paths["json"], json.dumps(d, indent=1, default=str) + "\n")
    atomic_write_text(paths["md"], markdown(d))
    if any(L.get("kernel") for L in d.get("layers", [])):
        paths["png"] = save_png(check_figure(d), out / "check.png")
    return paths
