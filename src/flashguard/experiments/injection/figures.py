"""The injection experiment's figures (matplotlib, Agg): the phase diagram and the W_Q norms.

``phase_diagram``: one column per sign rule (zero-mean, coherent p ascending, shuffled, real),
alpha on a log axis; a cell is a red cross where the runs diverged (labelled with the median
divergence step), a green circle where they trained on, orange where seeds disagree, grey where
runs are missing; the line joins the coherent columns' boundaries alpha*(p) (an arrow: above the
grid). ``wq_norms``: each layer's W_Q spectral norm (max over heads) over the steps, for the
baseline, every arm of the fully coherent column and the zero-mean arm at the largest alpha.
"""
from __future__ import annotations

from pathlib import Path

from ...utils.plotting import pyplot, save_png

__all__ = ["phase_diagram", "wq_norms"]

STYLE = {"diverged": ("x", "#c62828", True), "trained": ("o", "#2e7d32", False), "split": ("s", "#ef6c00", True),
         "missing": ("$?$", "#9e9e9e", True)}


def phase_diagram(cells: dict, columns: list[str], alphas, bounds: dict, path, *, title: str = "") -> Path:
    plt = pyplot()
    alphas = sorted(alphas)
    fig, ax = plt.subplots(figsize=(1.3 * len(columns) + 2.5, 4.2))
    for x, col in enumerate(columns):
        for a in alphas:
            c = cells.get((col, a), {"state": "missing", "median_step": None})
            marker, colour, filled = STYLE[c["state"]]
            if filled:  # x, square, ?: one colour
                ax.scatter([x], [a], marker=marker, s=110, c=colour, linewidths=2, zorder=3)
            else:       # an open circle
                ax.scatter([x], [a], marker=marker, s=110, facecolors="none", edgecolors=colour, linewidths=2,
                           zorder=3)
            if c["state"] in ("diverged", "split") and c.get("median_step") is not None:
                ax.annotate(f"{c['median_step']:g}", (x, a), textcoords="offset points", xytext=(9, -3), fontsize=7)
    coherent = [(x, col) for x, col in enumerate(columns) if col == "zero-mean" or col.startswith("coherent")]
    xs, ys = [], []
    for x, col in coherent:
        b = bounds.get(col, {})
        if b.get("alpha_star") is not None:
            xs.append(x)
            ys.append(b["alpha_star"])
        elif b.get("known"):
            ax.annotate("", (x, alphas[-1] * 2.2), xytext=(x, alphas[-1] * 1.25),
                        arrowprops=dict(arrowstyle="->", color="#1565c0"))
    if xs:
        ax.plot(xs, ys, "-", color="#1565c0", lw=1.5, zorder=2, label="boundary alpha*(p)")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    labels = [("zero-mean\n(p = 0.5)" if c == "zero-mean" else c.replace("coherent-p", "coherent\np = ")) for c in columns]
    ax.set_xticks(range(len(columns)), labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylim(alphas[0] / 1.6, alphas[-1] * 2.6)
    ax.set_ylabel("alpha (injected error / real error)")
    ax.set_xlim(-0.6, len(columns) - 0.4)
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_title(title or "delta error injection: x diverged (median step), o trained on", fontsize=9)
    return save_png(fig, path)


def wq_norms(outcomes: dict, arms: list[str], path, *, title: str = "") -> Path | None:
    """outcomes: {arm name: run_outcome}; the arms to draw, in order. None if no run has probes."""
    layers = sorted({layer for name in arms if name in outcomes for layer in outcomes[name]["wq_norm"]})
    if not layers:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, len(layers), figsize=(3.6 * len(layers), 3.2), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for ax, layer in zip(axes[0], layers):
        values = []
        for i, name in enumerate(arms):
            pts = outcomes.get(name, {}).get("wq_norm", {}).get(layer)
            if pts:
                ax.plot([s for s, _ in pts], [v for _, v in pts], "-o", ms=2.5, lw=1.2, color=cmap(i % 10),
                        label=name)
                values += [v for _, v in pts if v > 0]
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.set_xlabel("step")
        if values and max(values) > 10 * min(values):  # a runaway: log scale
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("W_Q spectral norm (max over heads)")
    axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.suptitle(title or "W_Q spectral norms of the injected arms", fontsize=9)
    return save_png(fig, path)
