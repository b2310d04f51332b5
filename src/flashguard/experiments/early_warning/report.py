"""The early-warning evaluation as Markdown (OUT/early_warning.md), from the result dict."""
from __future__ import annotations

from ...utils.table import markdown_table

__all__ = ["early_warning_markdown"]


def _f(x, fmt="{:g}") -> str:
    return "-" if x is None else fmt.format(x)


def _lead(m) -> str:
    q = m["lead"]
    if q["median"] is None:
        return "-"
    return f"{q['median']:g} [{q['q1']:g}, {q['q3']:g}]"


def _fa(m) -> str:
    if m["stable"] == 0:
        return "- (no stable runs)"
    return f"{m['false_alarms']}/{m['stable']} ({m['false_alarm_rate']:.0%})"


def _hits(m) -> str:
    return f"{m['hits']}/{m['divergent']} ({m['hits_ahead']} ahead)"


def _scored(d: dict, runs: int) -> str:
    """A score detector whose signal some runs do not log: say so (no alarm is possible there)."""
    n = d.get("scored_runs")
    if n is None or n == runs:
        return ""
    if n == 0:
        return " **Its signal is logged in none of these runs: it cannot alarm here, its misses say nothing.**"
    return f" Its signal is logged in {n} of the {runs} runs only (the others cannot alarm)."


def early_warning_markdown(res: dict) -> str:
    L = _intro(res)
    L += _defaults_section(res)
    L += _calibrated_section(res)
    L += _monitor_section(res)
    L += _signals_section(res)
    L += _runs_section(res)
    if res["skipped"]:
        L += ["", "## Skipped", ""] + [f"* {s['path']}: {s['why']}" for s in res["skipped"]]
    if res.get("figures"):
        L += [""] + [f"![{f}]({f})" for f in res["figures"]]
    return "\n".join(L) + "\n"


def _intro(res: dict) -> list[str]:
    """The title, what was counted and how, and the detectors."""
    c = res["counts"]
    seeds = ", ".join(f"seed {s}: {v['divergent']} divergent / {v['stable']} stable / {v.get('other', 0)} other"
                      for s, v in c["by_seed"].items())
    L = ["# flashguard early-warning evaluation", "",
         f"Runs from {', '.join(res['run_folders'])}: **{c['runs']} finished runs, {c['divergent']} divergent, "
         f"{c['stable']} stable twins, {c.get('other', 0)} other** ({seeds}); {len(res['skipped'])} folders skipped "
         f"(unfinished or unreadable, listed below). The unit is a run. Divergent by the package's one rule only: "
         f"{res['divergence_rule']}. Stable twins: runs the rule calls undiverged whose delta error has no lean by "
         "construction (no injection, the arithmetic itself, or a zero-mean error of any size), as the issue defines "
         "them. Other: runs that lean by design (coherent, shuffled, scaled real errors) and did not diverge by the "
         "rule; some of them ran W_Q away without tripping the rule, so an alarm there is "
         "neither a false alarm nor a hit, and is counted apart (\"alarms / other\").",
         "",
         "A hit: the first alarm at or before the divergence step d, lead time = d - alarm step (\"ahead\": lead > 0; "
         "lead 0 is an alarm at the divergence step itself). A miss: no alarm up to d. A false alarm: any alarm "
         "in a stable run. Lead times: median [quartiles] over the hits.", "",
         "## Detectors", ""]
    L += [f"* **{d['name']}** (default {d['default']:g}): {d['about']}.{_scored(d, c['runs'])}"
          for d in res["detectors"]]
    return L


def _defaults_section(res: dict) -> list[str]:
    """Each detector at its default threshold, over all runs."""
    rows = []
    for d in res["detectors"]:
        m = res["default"][d["name"]]
        rows.append([d["name"], f"{d['default']:g}", _hits(m), m["misses"], _lead(m), _fa(m),
                     f"{m.get('other_alarms', 0)}/{m.get('other', 0)}"])
    return ["", "## At the default thresholds, all runs", "",
            markdown_table(["detector", "threshold", "hits / divergent", "misses", "lead time", "false alarms / stable",
                            "alarms / other"], rows)]


def _calibrated_section(res: dict) -> list[str]:
    """Each detector calibrated on one half of the seeds and measured on the other, both ways."""
    sp = res["split"]
    L = ["", "## Calibrated on one half of the seeds, measured on the other", "",
         f"Split: {sp['rule']}; calibration seeds {sp['calibration_seeds'] or '-'}, held-out seeds "
         f"{sp['held_out_seeds'] or '-'}. Rule, fixed before looking: the smallest threshold of the grid whose "
         f"false-alarm rate on the calibration half's stable runs is <= {res['false_alarm_target']:.0%}; "
         "the divergent runs take no part in the choice.", "",
         markdown_table(["detector", "fold", "calibrated threshold (default)", "held out: hits / divergent", "misses",
                         "lead time", "false alarms / stable"],
                        [_calibrated_row(d, fold, res[key][d["name"]]) for d in res["detectors"]
                         for fold, key in (("odd -> even", "calibrated"), ("even -> odd", "calibrated_reverse"))])]
    return L


def _calibrated_row(d: dict, fold: str, e: dict) -> list:
    if e["threshold"] is None:
        return [d["name"], fold, "none (no stable runs to calibrate on)", "-", "-", "-", "-"]
    cal = e["calibration"]
    chosen = f"{e['threshold']:g} ({d['default']:g})"
    if not e["met_target"]:
        chosen += (f"; **target not met**: false alarms {e['calibration_false_alarm_rate']:.0%} of "
                   f"{cal['stable']} calibration stable runs at best (alarmed even at the largest threshold: "
                   f"{', '.join(cal['alarmed_at_max']) or '-'})")
    m = e["held_out"]
    if m is None:
        return [d["name"], fold, chosen, "no held-out runs", "-", "-", "-"]
    return [d["name"], fold, chosen, _hits(m), m["misses"], _lead(m), _fa(m)]


def _monitor_section(res: dict) -> list[str]:
    """The monitor's thresholds as the calibration would set them (none when not calibrated)."""
    if not res["monitor_calibration"]:
        return []
    L = ["", "## The monitor's thresholds as calibration would set them", "",
         "The monitor's defaults are unchanged here; these are the values its calibrated scale k stands for "
         "(growth and logit thresholds x k, ratio thresholds ^ k).", ""]
    folds = ("odd->even", "even->odd")
    for name, e in res["monitor_calibration"].items():
        header = ["threshold", "default"] + [
            f"{fold} (k = {_f(e[fold]['scale'])}{'' if e[fold]['met_target'] else ', target not met'})" for fold in folds]
        rows = [[f, f"{e['defaults'][f]:.3g}"]
                + [_f(None if e[fold]["thresholds"] is None else e[fold]["thresholds"][f], "{:.3g}") for fold in folds]
                for f in e["defaults"]]
        L += [f"**{name}**", "", markdown_table(header, rows), ""]
    return L


def _signals_section(res: dict) -> list[str]:
    """Which signal leaves the stable runs' range first: per signal, then per divergent run."""
    sig, p90 = res["signals"], res.get("signals_p90")
    L = ["", "## Which signal leads", "",
         f"On each of the {sig['divergent']} divergent runs: the probe step at which each signal first leaves the "
         "stable runs' range (above the maximum over the stable runs of the same seed at that step, at two "
         "probe steps in a row), as lead = divergence step - that step. \"led\": runs in which the signal left "
         "first (ties count for each). Beside it the same with the 90th percentile of those stable runs as the "
         "range's top (one far-out stable run cannot hide a signal).", "",
         markdown_table(["signal", "left the range in (runs)", "led in (runs)", "median lead",
                         "p90 band: left / led / median lead"], _signal_rows(sig, p90))]
    if not sig["runs"]:
        return L
    names = sorted(sig["signals"])
    rows = []
    for row in sig["runs"]:
        lead = ", ".join(row["leader"]) or "-"
        if row["margin"] is not None:
            lead += f" ({row['margin']} steps, then {row['next']})"
        rows.append([row["run"], row["divergence_step"]] + [_f(row["leads"].get(n)) for n in names] + [lead])
    return L + ["", markdown_table(["run", "diverged at", *names, "leader (ahead of the next by)"], rows)]


def _signal_rows(sig: dict, p90: dict | None) -> list[list]:
    rows = []
    for name, s in sorted(sig["signals"].items(), key=lambda kv: (-kv[1]["led"], -kv[1]["left"], kv[0])):
        q = (p90 or {}).get("signals", {}).get(name)
        alt = "-" if q is None else f"{q['left']} / {q['led']} / {_f(q['median_lead'])}"
        rows.append([name, f"{s['left']}/{sig['divergent']}", s["led"], _f(s["median_lead"]), alt])
    return rows


_OUTCOME = {"hit": "{alarm_step} (lead {lead})", "miss": "miss", "false_alarm": "{alarm_step} (false alarm)",
            "quiet": "-"}


def _runs_section(res: dict) -> list[str]:
    """Each run: its divergence, final loss, peak logit and each detector's first alarm."""
    rows = []
    for r in res["runs"]:
        cells = []
        for d in res["detectors"]:
            o = res["default"][d["name"]]["runs"][r["id"]]
            cells.append(_OUTCOME[o["kind"]].format(alarm_step=o.get("alarm_step"), lead=o.get("lead")))
        div = f"step {r['divergence_step']}" if r["diverged"] else "stable"
        rows.append([r["id"], r["seed"], div, _f(r.get("final_loss"), "{:.3g}"), _f(r.get("peak_max_logit"), "{:.3g}")]
                    + cells)
    header = ["run", "seed", "divergence", "final loss", "peak max logit"] + [d["name"] for d in res["detectors"]]
    return ["", "## Runs (first alarm step at the default thresholds)", "", markdown_table(header, rows)]
