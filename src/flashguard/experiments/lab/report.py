"""lab.json, lab.md and PNG figures from a run_lab() result."""
from __future__ import annotations

import json
from pathlib import Path

from ...utils.atomic import atomic_output, atomic_write_text

__all__ = ["write_lab", "TITLES"]

TITLES = {
    "i_tie_bias": "(i) tied maxima + mostly negative V: O biased negative, delta error positive",
    "ii_no_ties_no_bias": "(ii) without ties the bias vanishes",
    "iii_paper_fix_beta2": "(iii) the paper's stabilizer (beta = 2) removes the bias",
    "iii_paper_fix_beta7": "(iii) the paper's stabilizer (beta = 7) removes the bias",
    "iv_worked_example": "(iv) -4.703990459442139 rounds to -4.71875 in bf16",
    "safe_criterion": "safe: unbiased wherever paper beta=2 is, and no new bias",
}


def _cell(row: dict, part: str = "o") -> str:
    s = row[part]
    mark = {"biased +": "**+**", "biased -": "**-**", "no bias": ""}[s["verdict"]]
    return f"{s['bias_ratio']:+.2f}±{s['ratio_ci95']:.2f}{mark}"


def _table(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(line) + " |" for line in lines]
    return "\n".join(out)


def _pivot(rows, experiment, policies, stabilizers):
    """condition -> {(policy, stabilizer): row} for one experiment."""
    table: dict[str, dict] = {}
    for r in rows:
        if r["experiment"] == experiment and r["policy"] in policies and r["stabilizer"] in stabilizers:
            table.setdefault(r["condition"], {})[(r["policy"], r["stabilizer"])] = r
    return table


def render_markdown(result: dict) -> str:
    rows = result["rows"]
    md = [f"# Rounding-bias lab ({'quick' if result['quick'] else 'full'})", "",
          f"Facts tested in the `{result['policy']}` arithmetic; seed {result['seed']}; torch "
          f"{result['versions']['torch']}; {result['runtime_s']:.0f} s.", "",
          "Cells are the bias ratio mean(err) / mean(|err|) of O (0: unbiased, +-1: every error one sign)",
          "with its 95% CI over instances; **+** / **-** marks a significant bias (sign test p < 0.01,",
          "|ratio| >= 0.05, CI of the mean excluding 0, mean |error| above 1e-9).", "", "## Verdicts", ""]
    md.append(_table(["experiment", "verdict", "evidence"],
                     [[TITLES.get(k, k), f"**{v}**", "<br>".join(result["details"][k])]
                      for k, v in result["verdicts"].items()]))
    stabs = ["none", "paper(beta=2,tol=0.001)", "paper(beta=7,tol=0.001)", "safe"]
    for pol in ("paper", "fa2"):
        piv = _pivot(rows, "stabilizers", {pol}, set(stabs))
        md += ["", f"## Which stabilizer removes it where: `{pol}` arithmetic", ""]
        md.append(_table(["condition", "none", "paper beta=2", "paper beta=7", "safe"],
                         [[c] + [_cell(cells[(pol, s)]) if (pol, s) in cells else "" for s in stabs]
                          for c, cells in piv.items()]))
    src = [r for r in rows if r["experiment"] == "stabilizers" and r["policy"] == "paper" and r.get("l_err")]
    if src:
        md += ["", "## Where the bias comes from in the reference arithmetic", "",
               "Bias ratio of the rounding of the PV sum (against the exact sum of the same rounded Pbar",
               "times V) and of the bf16 row sum l (against the exact sum of the same Pbar), next to O's.", ""]
        md.append(_table(["condition", "stabilizer", "PV sum", "row sum l", "O"],
                         [[r["condition"], r["stabilizer"], _cell(r, "pv_err"), _cell(r, "l_err"), _cell(r)]
                          for r in src]))
    fmt_rows = [r for r in rows if r["experiment"] == "formats"]
    policies = list(dict.fromkeys(r["policy"] for r in fmt_rows))
    piv = _pivot(rows, "formats", set(policies), {"none", "safe"})
    md += ["", "## Is there a bias in production arithmetic, fp16, fp8? (no stabilizer / safe)", ""]
    md.append(_table(["condition"] + [f"{p} none / safe" for p in policies],
                     [[c] + [f"{_cell(cells[(p, 'none')])} / {_cell(cells[(p, 'safe')])}" for p in policies]
                      for c, cells in piv.items()]))
    pr = [r for r in rows if r["experiment"] == "pr2721"]
    md += ["", "## FlashAttention PR #2721: l from unrounded Pbar vs from the rounded Pbar", "",
           "`row_sum_rounded=true` is the fix (l sums the Pbar the numerator uses).", ""]
    md.append(_table(["condition", "policy", "O bias ratio", "mean O error", "delta bias ratio"],
                     [[r["condition"], r["policy"], _cell(r), f"{r['o']['mean']:+.2e}", _cell(r, "delta")] for r in pr]))
    md += ["", "Figures: `bias_vs_k.png`, `bias_vs_format.png`, `bias_vs_stabilizer.png`.", ""]
    return "\n".join(md)


def _figures(result: dict, out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    paths = []

    def save(fig, name):
        path = out / name
        with atomic_output(path, "wb") as f:
            fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)

    # bias against k (gap 8, max 1), per arithmetic and stabilizer
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, pol in zip(axes, ("paper", "fa2")):
        for stab in ("none", "paper(beta=2,tol=0.001)", "safe"):
            pts = sorted((r["problem"]["ties"], r["o"]["bias_ratio"], r["o"]["ratio_ci95"]) for r in rows
                         if r["experiment"] == "stabilizers" and r["policy"] == pol and r["stabilizer"] == stab
                         and r["problem"]["gap"] == 8.0 and r["problem"]["max_logit"] == 1.0 and not r["problem"]["sink"])
            if pts:
                ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o",
                            capsize=3, label=stab.split("(")[0])
        ax.axhline(0, color="k", lw=0.6)
        ax.set_title(f"{pol} arithmetic (gap 8)")
        ax.set_xlabel("tied maxima k")
        ax.set_xscale("log", base=2)
    axes[0].set_ylabel("O bias ratio")
    axes[0].legend()
    save(fig, "bias_vs_k.png")

    # bias against format
    fr = [r for r in rows if r["experiment"] == "formats" and r["problem"]["ties"] == 2]
    pols = list(dict.fromkeys(r["policy"] for r in fr))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, stab in enumerate(("none", "safe")):
        vals = [next((r["o"]["bias_ratio"] for r in fr if r["policy"] == p and r["stabilizer"] == stab), 0) for p in pols]
        ax.bar([j + 0.4 * i for j in range(len(pols))], vals, width=0.4, label=stab)
    ax.set_xticks([j + 0.2 for j in range(len(pols))], pols)
    ax.axhline(0, color="k", lw=0.6)
    ax.set_ylabel("O bias ratio (k = 2, gap 8)")
    ax.legend()
    save(fig, "bias_vs_format.png")

    # bias against stabilizer, per arithmetic, k = 4, gap 8
    fig, ax = plt.subplots(figsize=(7, 3.6))
    stabs = ["none", "paper(beta=2,tol=0.001)", "paper(beta=7,tol=0.001)", "safe"]
    for i, pol in enumerate(("paper", "fa2")):
        vals = []
        for s in stabs:
            v = [r["o"]["bias_ratio"] for r in rows if r["experiment"] == "stabilizers" and r["policy"] == pol
                 and r["stabilizer"] == s and r["problem"]["ties"] == 4 and r["problem"]["gap"] == 8.0
                 and r["problem"]["max_logit"] == 1.0 and not r["problem"]["sink"]]
            vals.append(v[0] if v else 0)
        ax.bar([j + 0.4 * i for j in range(len(stabs))], vals, width=0.4, label=f"{pol} arithmetic")
    ax.set_xticks([j + 0.2 for j in range(len(stabs))], ["none", "paper b=2", "paper b=7", "safe"])
    ax.axhline(0, color="k", lw=0.6)
    ax.set_ylabel("O bias ratio (k = 4, gap 8)")
    ax.legend()
    save(fig, "bias_vs_stabilizer.png")
    return paths


def write_lab(result: dict, out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "lab.json", json.dumps(result, indent=1) + "\n")
    atomic_write_text(out / "lab.md", render_markdown(result))
    figs = _figures(result, out)
    return {"json": out / "lab.json", "md": out / "lab.md", **{p.stem: p for p in figs}}
