"""The LR-sensitivity figure (matplotlib, Agg; written atomically): final loss against peak lr.

One line per arithmetic: the mean over seeds of the counted loss (a diverged run counts as l0,
analysis.py), lr on a log axis; a black cross marks an lr where some seed's run diverged; the
dashed line is the mean loss at initialisation l0. Faint lines: each seed's own curve, when
there is more than one seed. An lr where a run is still unfinished is left out of its line.
"""
from __future__ import annotations

from pathlib import Path

from ...utils.plotting import pyplot, save_png

__all__ = ["lr_curves"]

COLOURS = ("#1565c0", "#c62828", "#2e7d32", "#ef6c00", "#6a1b9a", "#00838f")


def lr_curves(means: dict, per_seed: dict, labels: dict, path, *, title: str = "") -> Path:
    """means: {arithmetic name: mean_curve}; per_seed: {arithmetic name: [curve, ...]}; labels:
    {arithmetic name: label}, in drawing order."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    l0s = []
    for i, name in enumerate(labels):
        m, colour = means[name], COLOURS[i % len(COLOURS)]
        if m["seeds"] > 1:
            for c in per_seed[name]:
                pts = [(p["lr"], p["counted"]) for p in c["points"] if p["counted"] is not None]
                ax.plot([x for x, _ in pts], [y for _, y in pts], "-", color=colour, lw=0.7, alpha=0.3)
        pts = [(lr, y) for lr, y in zip(m["lrs"], m["counted"]) if y is not None]
        ax.plot([x for x, _ in pts], [y for _, y in pts], "-o", color=colour, ms=4, lw=1.6, label=labels[name])
        bad = [(lr, y) for lr, y, d in zip(m["lrs"], m["counted"], m["diverged"]) if d and y is not None]
        if bad:
            ax.scatter([x for x, _ in bad], [y for _, y in bad], marker="x", s=70, c="black", linewidths=2,
                       zorder=4)
        if m["l0"] is not None:
            l0s.append(m["l0"])
    if l0s:
        ax.axhline(sum(l0s) / len(l0s), ls="--", color="#757575", lw=1, label="loss at initialisation l0")
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final loss (diverged = l0)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "final loss against learning rate (x: a seed diverged)", fontsize=9)
    return save_png(fig, path)
