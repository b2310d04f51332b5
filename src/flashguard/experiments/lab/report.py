"""lab.json, lab.md and PNG figures from a run_lab() result."""
from __future__ import annotations

import json
from pathlib import Path

from ...attention.error_stats import BIAS_RATIO_MIN, Z_CRIT
from ...utils.atomic import atomic_write_text
from ...utils.plotting import pyplot, save_png
from ...utils.table import markdown_table
from .candidates import FORMAT_POLICIES, fix_family
from .experiments import DECOMPOSITION

__all__ = ["write_lab", "render_markdown", "TITLES"]

TITLES = {
    "i_tie_bias": "(i) tied maxima + mostly negative V: O leans negative, delta positive (beyond the fp32 floor)",
    "ii_no_ties_no_bias": "(ii) without ties there is no lean",
    "iii_paper_fix_beta2": "(iii) the study's fix (beta = 2) removes the lean",
    "iii_paper_fix_beta7": "(iii) the study's fix (beta = 7) removes the lean",
    "iv_worked_example": "(iv) -4.703990459442139 rounds to -4.71875 in bf16",
}


# paired cells are bold when the arithmetic leans beyond the floor (error_stats.leans_beyond_floor:
# its own error a bias of the paired lean's sign); a unit error against fp64 when it is a bias
_LEAN_FLAG = {"o_vs_floor": "o_leans", "delta_vs_floor": "delta_leans"}


def _vs(row: dict, part: str = "o_vs_floor") -> str:
    s = row[part]
    lean = row.get(_LEAN_FLAG[part]) if part in _LEAN_FLAG else None
    mark = "**" if (s["verdict"].startswith("biased") if lean is None else lean) else ""
    return f"{mark}{s['mean'] * 1e6:+.0f}{mark} ({s['z']:+.1f})"


def _grid(rows: list[dict], experiment: str, arithmetics: list[str], part: str, floor_row: bool = True) -> str:
    """conditions as columns, arithmetics as rows; cells: mean unit error beyond the floor (z)."""
    sel = [r for r in rows if r["experiment"] == experiment]
    conds = list(dict.fromkeys(r["condition"] for r in sel))
    by = {(r["arithmetic"], r["condition"]): r for r in sel}
    lines = []
    if floor_row and arithmetics:
        first = arithmetics[0]
        lines.append(["floor (fp32, same output rounding): its own lean"] +
                     [_vs(by[(first, c)], "o_floor") if (first, c) in by else "" for c in conds])
    for a in arithmetics:
        cells = [_vs(by[(a, c)], part) if (a, c) in by else "" for c in conds]
        if any(cells):
            maes = [by[(a, c)]["o_mae"] / by[(a, c)]["o_mae_floor"] for c in conds if (a, c) in by]
            bad = sum(by[(a, c)]["bad_rows"] for c in conds if (a, c) in by)
            lines.append([f"`{a}`"] + cells + [f"{max(maes):.2f}x" + (f", {bad} bad rows" if bad else "")])
    return markdown_table(["arithmetic"] + conds + ["worst mean abs O error / floor's"], lines)


def render_markdown(result: dict) -> str:
    rows = result["rows"]
    md = [f"# Rounding-bias lab ({'quick' if result['quick'] else 'full'})", "",
          f"Facts (i)-(iii) tested in the `{result['policy']}` arithmetic; seed {result['seed']}; torch "
          f"{result['versions']['torch']}; {result['runtime_s']:.0f} s.", "",
          "Problems: every row its own query, maximum and tail (`experiments/lab/problems.py`); k = tied keys",
          "per row, T = keys (512-tiles), tail = the row's tail mass in half-ulps of k in bf16 (below 1, a",
          "bf16 row sum rounds the tail away), v = V's mean and sd. **Unit: one value per independent row**",
          "(the error averaged over the row's features; per instance for the sink problem).",
          "", "Cells: the mean unit error of O beyond the noise floor, in units of 1e-6, and its z (paired:",
          "the floor is the `fp32` arithmetic with the same input and output formats on the same problems).",
          f"**Bold**: a lean beyond the floor: the arithmetic's own error against fp64 is a bias (|z| >= {Z_CRIT:.2f},",
          f"two-sided p < 0.001, and |bias ratio| >= {BIAS_RATIO_MIN}) and so is its paired difference from the floor,",
          "with the same sign (it errs further in its own direction than the floor does). A large z without",
          "bold is an arithmetic that differs from the floor but not towards a lean of its own (e.g. less",
          "biased than the floor: its O lands elsewhere on the output grid).",
          "The first row of each table is the floor's own lean against fp64 (its bf16 output rounding):",
          "a lean no attention arithmetic with a bf16 output can remove.", "",
          "## Answers per arithmetic", ""]
    md += [f"* `{pol}`: {a['line']}" for pol, a in result["answers"].items()]
    md += ["", "## Verdicts", ""]
    md.append(markdown_table(["fact", "verdict", "evidence"],
                     [[TITLES.get(k, k), f"**{v}**", "<br>".join(result["details"][k])]
                      for k, v in result["verdicts"].items()]))
    for pol in FORMAT_POLICIES:
        family = fix_family(pol)
        arith = list(dict.fromkeys(r["arithmetic"] for r in rows if r["experiment"] == "fixes"
                                   and r["policy"].split("[")[0] in family))
        md += ["", f"## `{pol}`: O beyond the floor, with each fix", ""]
        md.append(_grid(rows, "fixes", arith, "o_vs_floor"))
        md += ["", "delta = rowsum(dO * O) beyond the floor (1e-6, z):", ""]
        md.append(_grid(rows, "fixes", arith, "delta_vs_floor", floor_row=False))
        unrounded = result["answers"][pol].get("unrounded")
        if unrounded:
            u_arith = list(dict.fromkeys(r["arithmetic"] for r in rows if r["experiment"] == "fixes-unrounded"
                                         and r["policy"].split("[")[0] in family))
            md += ["", "Nothing removes the lean at the output format, so the same measured with O left unrounded "
                       "(fp32 output, its floor likewise): the arithmetic's own error before O's one rounding.", ""]
            md.append(_grid(rows, "fixes-unrounded", u_arith, "o_vs_floor"))
            md += ["", "delta, O unrounded:", ""]
            md.append(_grid(rows, "fixes-unrounded", u_arith, "delta_vs_floor", floor_row=False))
            if unrounded["failures"]:
                md += ["", "Why candidates fail with O unrounded (first reason each):", ""]
                md += [f"* `{a}`: {rs[0]}" + (f" (and {len(rs) - 1} more conditions)" if len(rs) > 1 else "")
                       for a, rs in unrounded["failures"].items()]
        fails = result["answers"][pol]["failures"]
        if fails:
            md += ["", "Why the other candidates fail (first reason each):", ""]
            md += [f"* `{a}`: {reasons[0]}" + (f" (and {len(reasons) - 1} more conditions)" if len(reasons) > 1 else "")
                   for a, reasons in fails.items()]
    md += ["", "## Where the bias enters: one component raised to fp32 at a time", "",
           "Components: " + "; ".join(f"{k} = `{v}`" for k, v in DECOMPOSITION.items()) + ". Rows with "
           "`output=fp32` are judged against a floor with an fp32 output too, whose error is near zero: their "
           "accuracy ratio is large by construction.", ""]
    arith = list(dict.fromkeys(r["arithmetic"] for r in rows if r["experiment"] == "decomposition"))
    md.append(_grid(rows, "decomposition", arith, "o_vs_floor"))
    pr = [r for r in rows if r["experiment"] == "pr2721"]
    md += ["", "## FlashAttention PR #2721: l from the unrounded Pbar vs from the rounded one", "",
           "`row_sum_rounded=true` is the PR's fix (l sums the Pbar the numerator uses). No ties (k = 1).", ""]
    md.append(markdown_table(["condition", "arithmetic", "O beyond floor", "O against fp64", "mean abs O error"],
                     [[r["condition"], f"`{r['arithmetic']}`", _vs(r), _vs(r, "o"), f"{r['o_mae']:.2e}"] for r in pr]))
    cap = result.get("captured")
    if cap:
        md += ["", "## Captured problems: the attention inputs of a real run", "",
               "One problem per layer (q, k, v, dO as the layer received them); **unit: one value per sequence",
               "and head** (the rows of a sequence share its keys and values). Cells as above.", ""]
        md += [f"* `{pol}`: {a['line']}" for pol, a in cap["answers"].items()]
        arith = list(dict.fromkeys(r["arithmetic"] for r in cap["rows"]))
        md += ["", "O beyond the floor:", ""]
        md.append(_grid(cap["rows"], "captured", arith, "o_vs_floor"))
        md += ["", "delta beyond the floor:", ""]
        md.append(_grid(cap["rows"], "captured", arith, "delta_vs_floor", floor_row=False))
    md += ["", "Figures: `bias_vs_k.png`, `bias_vs_format.png`.", ""]
    return "\n".join(md)


def _figures(result: dict, out: Path) -> list[Path]:
    plt = pyplot()
    rows = [r for r in result["rows"] if r["experiment"] == "fixes"]
    paths = []

    def save(fig, name):
        paths.append(save_png(fig, out / name))

    def z_of(pol_arith, cond_filter):
        pts = sorted((r["problem"]["ties"], r["o_vs_floor"]["z"]) for r in rows
                     if r["arithmetic"] == pol_arith and cond_filter(r["problem"]))
        return [p[0] for p in pts], [p[1] for p in pts]

    small_tail = lambda p: p["tail"] == 0.25 and not p["sink"] and not p["offset"] and p["v_mean"] < 0  # noqa: E731
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=False)
    for ax, pol in zip(axes, ("paper", "fa2")):
        family = fix_family(pol)
        labels = [a for a in dict.fromkeys(r["arithmetic"] for r in rows)
                  if a.split(" /")[0].split("[")[0] in family
                  and "beta=7" not in a]
        for a in labels:
            xs, ys = z_of(a, small_tail)
            if xs:
                ax.plot(xs, ys, marker="o", label=a)
        for y in (Z_CRIT, -Z_CRIT):
            ax.axhline(y, color="grey", lw=0.6, ls="--")
        ax.set_title(f"{pol} arithmetic (tail 0.25 half-ulps)")
        ax.set_xlabel("tied maxima k")
        ax.set_xscale("log", base=2)
        ax.set_ylabel("z of O's lean beyond the floor")
        ax.legend(fontsize=7)
    save(fig, "bias_vs_k.png")

    fig, ax = plt.subplots(figsize=(8, 3.6))
    pk = lambda p: p["ties"] == 8 and small_tail(p)  # noqa: E731
    for i, (name, pick) in enumerate((("no fix", lambda pol: f"{pol} / none"),
                                      ("recommended", lambda pol: (result["answers"][pol]["removed_by"] or [None])[0]))):
        vals = []
        for pol in FORMAT_POLICIES:
            a = pick(pol)
            v = [r["o_vs_floor"]["z"] for r in rows if a and r["arithmetic"] == a and pk(r["problem"])]
            vals.append(v[0] if v else 0.0)
        ax.bar([j + 0.4 * i for j in range(len(FORMAT_POLICIES))], vals, width=0.4, label=name)
    ax.set_xticks([j + 0.2 for j in range(len(FORMAT_POLICIES))], FORMAT_POLICIES)
    for y in (Z_CRIT, -Z_CRIT):
        ax.axhline(y, color="grey", lw=0.6, ls="--")
    ax.set_ylabel("z of O's lean beyond the floor (k = 8)")
    ax.set_yscale("symlog", linthresh=5)
    ax.legend()
    save(fig, "bias_vs_format.png")
    return paths


def write_lab(result: dict, out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "lab.json", json.dumps(result, indent=1) + "\n")
    atomic_write_text(out / "lab.md", render_markdown(result))
    figs = _figures(result, out)
    return {"json": out / "lab.json", "md": out / "lab.md", **{p.stem: p for p in figs}}
