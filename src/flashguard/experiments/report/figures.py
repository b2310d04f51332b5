"""The report's PNG figures (matplotlib, Agg), across the runs of a study.

Each ``fig_*`` function returns a ``Figure`` (written atomically) or, when no run has its
data (e.g. runs without probes), a one-line reason it was skipped. A run keeps one colour
in every figure.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from ... import keys
from ...diagnostics.plots import draw_head_norms, series
from ...utils.atomic import atomic_write_bytes
from ...utils.plotting import pyplot, save_png
from .load import Run, Study

__all__ = ["Figure", "make_figures", "copy_lab_figures", "focus_layer", "FIGURE_NAMES"]

FIGURE_NAMES = ("loss.png", "wq_norms.png", "wq_norms_layers.png", "grad_error.png", "delta_bias.png")

LAB_CAPTIONS = {
    "bias_vs_k": "Lab: z of O's lean beyond the fp32 noise floor (one value per independent row) against the "
                 "number of tied row maxima k, per arithmetic and fix.",
    "bias_vs_format": "Lab: z of O's lean beyond the floor per number format (k = 8 ties), without a fix and "
                      "with the lab's recommended one.",
}


@dataclass
class Figure:
    path: Path
    title: str
    caption: str


def _finite(steps, values) -> tuple[list, list]:
    pts = [(s, v) for s, v in zip(steps, values) if math.isfinite(v)]
    return [s for s, _ in pts], [v for _, v in pts]


def _get(run: Run, key: str) -> tuple[list, list]:
    return _finite(*series(run.records, re.escape(key)).get(key, ([], [])))


def _colors(study: Study) -> dict[str, tuple]:
    cmap = pyplot().get_cmap("tab10" if len(study.runs) <= 10 else "tab20")
    return {r.name: cmap(i % cmap.N) for i, r in enumerate(study.runs)}


def focus_layer(study: Study) -> int:
    """repro.json's focus layer; else layer 1 (the study's "layer 2") if probed, else the first probed."""
    if isinstance(study.meta.get("focus_layer"), int):
        return study.meta["focus_layer"]
    layers = {where[0] for r in study.runs for rec in r.records for k in rec
              if (where := keys.WQ_NORM_MAX.parse(k)) is not None}
    return 1 if 1 in layers or not layers else min(layers)


def _with(study: Study, key: str, groups=("main",)) -> list[Run]:
    """Runs of these groups whose records hold ``key`` (any run if none of these groups does)."""
    have = [r for r in study.runs if any(key in rec for rec in r.records)]
    return [r for r in have if r.group in groups] or have


def _smooth(values: list[float]) -> tuple[list[float], int]:
    """Centred moving average over ~1% of the points (at least 1): light, keeps spikes visible."""
    w = max(1, len(values) // 100)
    if w == 1:
        return values, 1
    h = w // 2
    out = [sum(values[max(0, i - h):i + h + 1]) / len(values[max(0, i - h):i + h + 1]) for i in range(len(values))]
    return out, w


def fig_loss(study: Study, out: Path, colors) -> Figure | str:
    panels = [("main runs", [r for r in study.runs if r.group == "main"]),
              ("ablations and remedies", [r for r in study.runs if r.group != "main"])]
    panels = [(t, [r for r in rs if _get(r, keys.LOSS_TRAIN)[0]]) for t, rs in panels]
    panels = [(t, rs) for t, rs in panels if rs]
    if not panels:
        return f"loss: skipped, no run has a finite {keys.LOSS_TRAIN}"
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6.8 * len(panels), 4.2), sharey=True, squeeze=False,
                             constrained_layout=True)
    firsts, windows = [], set()
    for ax, (title, runs) in zip(axes[0], panels):
        for r in runs:
            steps, vals = _get(r, keys.LOSS_TRAIN)
            firsts.append(vals[0])
            smooth, w = _smooth(vals)
            windows.add(w)
            c = colors[r.name]
            ax.plot(steps, vals, color=c, alpha=0.2, linewidth=0.8)
            div = r.summary.get("diverged_at")
            label = r.name + (f" (diverged at {div})" if isinstance(div, int) else "")
            ax.plot(steps, smooth, color=c, linewidth=1.5, label=label)
            if isinstance(div, int):
                ax.axvline(div, color=c, linestyle="--", linewidth=1)
                before = [v for s, v in zip(steps, smooth) if s < div]  # where it leaves the curve
                ax.plot([div], [before[-1] if before else smooth[0]], marker="x", color=c, markersize=9, mew=2)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize="small")
    axes[0][0].set_ylabel("training loss")
    # an exploded loss (1e4, say) would flatten every other curve: cap the axis near the initial loss
    lo = min(min(_get(r, keys.LOSS_TRAIN)[1]) for _, rs in panels for r in rs)
    axes[0][0].set_ylim(max(0.0, lo * 0.95), max(firsts) * 1.15)
    fig.suptitle("training loss (Fig. 2)")
    w = max(windows)
    smooth_note = (f"Solid lines: centred moving average over up to {w} steps; faint lines: raw values. "
                   if w > 1 else "Raw values (no smoothing). ")
    return Figure(save_png(fig, out / "loss.png"), "Training loss",
                  "Training loss against step; main runs left, ablations and remedies right. " + smooth_note
                  + "A dashed line and a cross mark a run's divergence step; the y axis is capped at 1.15 x the "
                    "largest initial loss, so an exploded loss runs off the top and non-finite values are not drawn.")


def fig_wq_norms(study: Study, out: Path, layer: int) -> Figure | str:
    runs = _with(study, keys.WQ_NORM.key(layer, 0))
    if not runs:
        return f"W_Q norms: skipped, no run has per-head probe metrics for layer {layer} ({keys.WQ_NORM})"
    plt = pyplot()
    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 3.4), sharey=True, squeeze=False,
                             constrained_layout=True)
    for ax, r in zip(axes[0], runs):
        data = {k: _finite(*v) for k, v in series(r.records, keys.WQ_NORM.pattern(layer, heads=True)).items()}
        draw_head_norms(ax, data, layer)
        ax.set_title(r.name)
        div = r.summary.get("diverged_at")
        if isinstance(div, int):
            ax.axvline(div, color="tab:red", linestyle="--", linewidth=1)
    fig.suptitle(f"W_Q spectral norm per head, layer L{layer} (Fig. 3)")
    return Figure(save_png(fig, out / "wq_norms.png"), f"W_Q spectral norms, layer L{layer}",
                  f"Largest singular value of each head's W_Q slice in layer L{layer} (layers count from 0) at the "
                  "probe steps, one panel per run, same y axis; a red dashed line marks divergence.")


def fig_wq_layers(study: Study, out: Path, layer: int) -> Figure | str:
    have = [r for r in study.runs if series(r.records, keys.WQ_NORM_MAX.pattern())]
    if not have:
        return f"W_Q norms per layer: skipped, no run has {keys.WQ_NORM_MAX} probe metrics"
    run = next((r for r in have if r.name == "paper"), have[0])
    data = series(run.records, keys.WQ_NORM_MAX.pattern())
    fig, ax = pyplot().subplots(figsize=(6.5, 3.8))
    for key in sorted(data, key=lambda k: keys.WQ_NORM_MAX.parse(k)[0]):
        l = keys.WQ_NORM_MAX.parse(key)[0]
        ax.plot(*_finite(*data[key]), label=f"L{l}", linewidth=2.5 if l == layer else 1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("max spectral norm over heads")
    ax.set_title(f"W_Q spectral norm per layer (max over heads): {run.name}")
    ax.legend(fontsize="small")
    return Figure(save_png(fig, out / "wq_norms_layers.png"), f"W_Q spectral norms per layer ({run.name})",
                  f"Largest W_Q head spectral norm of each layer in run {run.name}; the focus layer L{layer} is "
                  "drawn thick. Does the growth stay in one layer?")


def fig_grad_error(study: Study, out: Path, layer: int, colors) -> Figure | str:
    runs = _with(study, keys.wq_err_sv(1).key(layer), groups=("main", "remedy"))
    if not runs:
        return f"gradient error: skipped, no run has grad/wq_err_* probe metrics for layer {layer}"
    plt = pyplot()
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 3.8), constrained_layout=True)
    styles = ["-", "--", ":", "-."]
    for r in runs:
        col = colors[r.name]
        for i, ls in enumerate(styles, 1):
            pts = [(x, y) for x, y in zip(*_get(r, keys.wq_err_sv(i).key(layer))) if y > 0]  # log axis
            a.plot([x for x, _ in pts], [y for _, y in pts], color=col, linestyle=ls,
                   linewidth=1.5 if i == 1 else 1, label=r.name if i == 1 else None)
        b.plot(*_get(r, keys.WQ_ERR_RANK1_FRAC.key(layer)), color=col, marker=".", label=r.name)
        c.plot(*_get(r, keys.WQ_ERR_COS_SUM.key(layer)), color=col, marker=".", label=r.name)
    a.set_yscale("log")
    a.set_title("top singular values (sv1 solid, sv2 --, sv3 :, sv4 -.)")
    b.set_title("rank-1 fraction sv1^2 / sum sv^2")
    b.set_ylim(0, 1.05)
    c.set_title("cosine with the sum of earlier errors")
    c.axhline(0, color="grey", linewidth=0.8)
    c.set_ylim(-1.05, 1.05)
    for ax in (a, b, c):
        ax.set_xlabel("step")
        ax.legend(fontsize="small")
    fig.suptitle(f"W_Q gradient error E = dW_Q(policy) - dW_Q(fp64 attention), layer L{layer} (Fig. 4)")
    return Figure(save_png(fig, out / "grad_error.png"), f"Gradient-error structure, layer L{layer}",
                  "Structure of the W_Q gradient error caused by the attention backward, at the probe steps: its "
                  "top singular values, the share of its energy in the first (1 = rank one) and its cosine with "
                  "the sum of the errors of all earlier probes (near 1: the errors add up instead of cancelling).")


def fig_delta_bias(study: Study, out: Path, layer: int, colors) -> Figure | str:
    key = keys.DELTA_ERR_CUMSUM.key(layer)
    runs = [r for r in study.runs if _get(r, key)[0]]
    if not runs:
        return f"delta bias: skipped, no run has {key} probe metrics"
    fig, ax = pyplot().subplots(figsize=(6.8, 3.8))
    for r in runs:
        ax.plot(*_get(r, key), color=colors[r.name], marker=".", label=r.name)
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("running sum")
    ax.set_title(f"cumulative delta error, layer L{layer}: sum of mean(delta_lp - delta_hp)")
    ax.legend(fontsize="small")
    return Figure(save_png(fig, out / "delta_bias.png"), f"Cumulative delta error, layer L{layer}",
                  "Running sum over the probes of the mean error of delta = rowsum(dO * O) against fp64 (Fig. 5 in "
                  "spirit): an unbiased error wanders around 0, a biased one climbs steadily.")


def make_figures(study: Study, out: Path) -> tuple[list[Figure], list[str]]:
    """Every training figure into ``out`` (a folder); returns (figures, one line per skipped one)."""
    layer, colors = focus_layer(study), _colors(study)
    made = [fig_loss(study, out, colors), fig_wq_norms(study, out, layer), fig_wq_layers(study, out, layer),
            fig_grad_error(study, out, layer, colors), fig_delta_bias(study, out, layer, colors)]
    return [f for f in made if isinstance(f, Figure)], [f for f in made if isinstance(f, str)]


def copy_lab_figures(study: Study, out: Path) -> list[Figure]:
    if study.lab is None:
        return []
    return [Figure(atomic_write_bytes(out / p.name, p.read_bytes()), p.stem.replace("_", " "),
                   LAB_CAPTIONS.get(p.stem, f"Lab figure {p.name}."))
            for p in sorted(study.lab.figures, key=lambda p: (list(LAB_CAPTIONS) + [p.stem]).index(p.stem))]
