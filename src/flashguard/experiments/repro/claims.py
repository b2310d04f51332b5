"""The study's claims as verdicts over a repro's runs: held / not held / inconclusive, each
with the numbers behind it.

Training claims compare divergence (summary.py's rule) between runs that differ in one
option; mechanism claims read the probe metrics the `paper` run logged at the focus layer
(flashguard.diagnostics.probes). A localisation claim needs a failure to localise: when the
`paper` run did not diverge it is inconclusive, never "held".
"""
from __future__ import annotations

import statistics

from ... import keys
from ...attention.error_stats import sign_test_p
from ...utils.jsonl import read_metrics

__all__ = ["CLAIMS", "judge_claims"]

HELD, NOT_HELD, INCONCLUSIVE = "held", "not held", "inconclusive"

CLAIMS = {
    "C1": "Low-precision flash attention training diverges; fp32 attention does not",
    "C2": "Tiling is not the cause: one tile per row (block = T) diverges too",
    "C3": "One layer is enough: flash in layer L alone diverges, fp32 in layer L alone prevents it; "
          "its W_Q spectral norms grow",
    "C4": "delta = rowsum(dO*O) with the low-precision O is the culprit: a high-precision O, "
          "rowsum(dP*P) or an fp32 PV product each prevent the divergence",
    "C5": "The W_Q gradient error is low-rank and accumulates (its direction persists across steps)",
    "C6": "The delta error is biased positive (delta_lp - delta_hp > 0, its running sum grows)",
    "C8": "The fix works: the study's fix trains on where the paper run diverges (the lab's measured fix, "
          "paper-fp32fwd, judged beside it)",
}
MIN_PROBES = 8
P_MAX = 0.01   # sign-test p-value below which a lean across probes counts (C5, C6)


def _div(summaries: dict, name: str):
    s = summaries.get(name)
    return None if s is None or s["status"] in ("missing", "partial") else s["diverged_at"]


def _ran(summaries: dict, *names: str) -> bool:
    return all(n in summaries and summaries[n]["status"] in ("done", "diverged") for n in names)


def _fate(summaries: dict, name: str) -> str:
    s = summaries[name]
    if s["diverged_at"] is not None:
        return f"{name} diverged at step {s['diverged_at']}"
    return f"{name} trained {s['steps']} steps (final loss {s['final_loss']:.3f}, min {s['min_loss']:.3f})"


def _c1(S, L):
    if not _ran(S, "fp32", "paper"):
        return INCONCLUSIVE, "fp32 or paper run missing or unfinished", {}
    paper, fp32 = _div(S, "paper"), _div(S, "fp32")
    nums = {"paper_diverged_at": paper, "fp32_diverged_at": fp32}
    ev = f"{_fate(S, 'paper')}; {_fate(S, 'fp32')}"
    if paper is not None and fp32 is None:
        return HELD, ev, nums
    if paper is None:
        return NOT_HELD, ev + " (no divergence at this scale and length)", nums
    return INCONCLUSIVE, ev + " (fp32 diverged too: not a precision effect)", nums


def _needs_failure(S, names, judge):
    if not _ran(S, "paper", *names):
        return INCONCLUSIVE, f"runs missing or unfinished: {', '.join(n for n in ('paper', *names) if not _ran(S, n))}", {}
    if _div(S, "paper") is None:
        return INCONCLUSIVE, f"nothing to localise: {_fate(S, 'paper')}", {"paper_diverged_at": None}
    return judge()


def _c2(S, L):
    def judge():
        d = _div(S, "no-tiling")
        ev = f"{_fate(S, 'paper')}; {_fate(S, 'no-tiling')}"
        return (HELD if d is not None else NOT_HELD), ev, {"no_tiling_diverged_at": d}
    return _needs_failure(S, ["no-tiling"], judge)


def _norm_growth(run_dir, L) -> dict:
    """First and last per-head W_Q spectral norms of layer L, and the layer with the largest final max."""
    recs = [r for r in read_metrics(run_dir) if any(keys.WQ_NORM.matches(k) for k in r)]
    if len(recs) < 2:
        return {}
    first, last = recs[0], recs[-1]
    heads = []                     # (head, key) of layer L's per-head norms
    for k in last:
        where = keys.WQ_NORM.parse(k)
        if where is not None and where[0] == L:
            heads.append((where[1], k))
    layers = [k for k in last if keys.WQ_NORM_MAX.matches(k)]
    if not heads:
        return {}
    head, top = max(sorted(heads), key=lambda hk: last[hk[1]])
    largest = max(layers, key=lambda k: last[k]) if layers else None
    return {"focus_head": f"L{L}H{head}", "focus_norm_first": first.get(top), "focus_norm_last": last[top],
            "largest_layer": f"L{keys.WQ_NORM_MAX.parse(largest)[0]}" if largest else None,
            "probe_steps": [first[keys.STEP], last[keys.STEP]]}


def _c3(S, L, dirs):
    def judge():
        a, b = f"flash-layer{L}", f"fp32-layer{L}"
        da, db = _div(S, a), _div(S, b)
        nums = {f"{a}_diverged_at": da, f"{b}_diverged_at": db,
                **(_norm_growth(dirs["paper"], L) if "paper" in dirs else {})}
        ev = f"{_fate(S, a)}; {_fate(S, b)}"
        if "focus_head" in nums:
            ev += (f"; paper run: W_Q norm of L{L} {nums['focus_head']} {nums['focus_norm_first']:.2f} -> "
                   f"{nums['focus_norm_last']:.2f} (steps {nums['probe_steps'][0]}-{nums['probe_steps'][1]}), "
                   f"largest final norm in {nums['largest_layer']}")
        return (HELD if da is not None and db is None else NOT_HELD), ev, nums
    return _needs_failure(S, [f"flash-layer{L}", f"fp32-layer{L}"], judge)


def _c4(S, L):
    names = ["delta-o-highp", "delta-dp-p", "pv-fp32"]

    def judge():
        ds = {n: _div(S, n) for n in names}
        ev = "; ".join(_fate(S, n) for n in names)
        return (HELD if all(d is None for d in ds.values()) else NOT_HELD), ev, {f"{n}_diverged_at": d for n, d in ds.items()}
    return _needs_failure(S, names, judge)


def _probe_series(run_dir, key: str) -> list[float]:
    return [r[key] for r in read_metrics(run_dir) if key in r]


def _c5(S, L, dirs):
    if "paper" not in dirs:
        return INCONCLUSIVE, "paper run missing", {}
    rank1 = _probe_series(dirs["paper"], keys.WQ_ERR_RANK1_FRAC.key(L))
    cos = _probe_series(dirs["paper"], keys.WQ_ERR_COS_PREV.key(L))
    if len(rank1) < MIN_PROBES or len(cos) < MIN_PROBES - 1:
        return INCONCLUSIVE, f"only {len(rank1)} probes of layer {L} in the paper run (need {MIN_PROBES})", {}
    pos, neg = sum(c > 0 for c in cos), sum(c < 0 for c in cos)
    p = sign_test_p(pos, neg)
    nums = {"rank1_frac_median": statistics.median(rank1), "cos_prev_median": statistics.median(cos),
            "cos_prev_pos": pos, "cos_prev_neg": neg, "p_sign": p, "probes": len(rank1)}
    ev = (f"layer {L}, {len(rank1)} probes: median share of the top singular value {nums['rank1_frac_median']:.2f}; "
          f"cosine with the previous probe's error median {nums['cos_prev_median']:.2f}, positive {pos} / negative {neg} "
          f"(sign test p = {p:.2g})")
    low_rank, persists = nums["rank1_frac_median"] >= 0.5, pos > neg and p < P_MAX
    return (HELD if low_rank and persists else NOT_HELD), ev, nums


def _c6(S, L, dirs):
    if "paper" not in dirs:
        return INCONCLUSIVE, "paper run missing", {}
    err = _probe_series(dirs["paper"], keys.DELTA_ERR_MEAN.key(L))
    if len(err) < MIN_PROBES:
        return INCONCLUSIVE, f"only {len(err)} probes of layer {L} in the paper run (need {MIN_PROBES})", {}
    pos, neg = sum(e > 0 for e in err), sum(e < 0 for e in err)
    p = sign_test_p(pos, neg)
    nums = {"delta_err_mean": statistics.fmean(err), "pos": pos, "neg": neg, "p_sign": p, "cumsum": sum(err)}
    ev = (f"layer {L}, {len(err)} probes: delta_lp - delta_hp positive {pos} / negative {neg} (sign test p = {p:.2g}), "
          f"mean {nums['delta_err_mean']:.3g}, running sum {nums['cumsum']:.3g}")
    if p < P_MAX:
        return (HELD if pos > neg else NOT_HELD), ev, nums
    return NOT_HELD, ev + " (no consistent sign)", nums


def _c8(S, L):
    def judge():
        fix, measured = _div(S, "paper-fix"), _div(S, "paper-fp32fwd")
        ev = (f"{_fate(S, 'paper')}; {_fate(S, 'paper-fix')}; {_fate(S, 'paper-fp32fwd')} (the measured fix: "
              f"{'trains on' if measured is None else 'diverges too'})")
        return (HELD if fix is None else NOT_HELD), ev, {"paper_fix_diverged_at": fix,
                                                         "paper_fp32fwd_diverged_at": measured}
    return _needs_failure(S, ["paper-fix", "paper-fp32fwd"], judge)


def judge_claims(summaries: dict, dirs: dict, focus: int, which) -> list[dict]:
    """summaries: run name -> summarize_run(...); dirs: run name -> run folder."""
    judges = {"C1": lambda: _c1(summaries, focus), "C2": lambda: _c2(summaries, focus),
              "C3": lambda: _c3(summaries, focus, dirs), "C4": lambda: _c4(summaries, focus),
              "C5": lambda: _c5(summaries, focus, dirs), "C6": lambda: _c6(summaries, focus, dirs),
              "C8": lambda: _c8(summaries, focus)}
    out = []
    for cid in which:
        verdict, evidence, numbers = judges[cid]()
        out.append({"id": cid, "title": CLAIMS[cid].replace("layer L", f"layer {focus}"), "verdict": verdict,
                    "evidence": evidence, "numbers": numbers})
    return out
