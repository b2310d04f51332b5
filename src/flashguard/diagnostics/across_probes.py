"""A lean read across a run's probes: Stouffer's z over the probes' z of one error.

One probe measures a bias on one batch with (sequence, head) units; at the sizes a CPU run
probes (16 sequences x 4 heads) a lean of a few percent of the error is below its |z| >= 3.29
at any single probe. Probes see different batches, so where the error has no lean each
probe's z is an independent N(0, 1) draw, and their sum over sqrt(n) is N(0, 1) again: a small
lean that keeps its sign over training adds up in it, one that comes and goes does not.

    s = lean_across_probes(records)      # records: metrics.jsonl
    s[0].stouffer_z, s[0].positive, s[0].verdict

The verdict is the lab's lean rule carried over: |Stouffer z| >= Z_CRIT and the mean bias
ratio over the probes (the row-level ratio each probe records) >= BIAS_RATIO_MIN in size;
significant with a smaller ratio is ``weak``. Stated with it: the unit (a probe, each a mean of
(sequence, head) units) and the assumption (probes independent under no lean).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .. import keys
from ..attention.error_stats import BIAS_RATIO_MIN, Z_CRIT

__all__ = ["ProbeSeries", "lean_across_probes", "format_across_probes", "ACROSS_PROBES_UNIT", "split_across_probes"]

ACROSS_PROBES_UNIT = ("one z per probe (each over the probe's (sequence, head) units); probes see different "
                      "batches, independent N(0, 1) draws where there is no lean")

# what is read: (name, the z per probe, the bias ratio per probe)
SERIES = {"delta": (keys.DELTA_ERR_Z, keys.DELTA_ERR_RATIO_ROW), "O": (keys.O_ERR_Z, keys.O_ERR_RATIO_ROW)}


@dataclass(frozen=True)
class ProbeSeries:
    what: str                 # "delta" or "O"
    layer: int
    steps: list[int]
    zs: list[float]
    positive: int             # probes whose z > 0
    stouffer_z: float
    mean_ratio: float | None  # mean of the probes' row-level bias ratios
    verdict: str              # "leans +", "leans -", "weak +", "weak -", "no lean", "n/a"

    def to_dict(self) -> dict:
        return asdict(self)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _verdict(z: float, ratio: float | None) -> str:
    if abs(z) < Z_CRIT:
        return "no lean"
    sign = "+" if z > 0 else "-"
    large = ratio is not None and abs(ratio) >= BIAS_RATIO_MIN and math.copysign(1.0, ratio) == math.copysign(1.0, z)
    return f"leans {sign}" if large else f"weak {sign}"


def lean_across_probes(records: list[dict], what: str = "delta", *, since: int = 0,
                       until: int | None = None) -> dict[int, ProbeSeries]:
    """Per layer, the probes' z of ``what``'s error ("delta" or "O") at steps in [since, until]."""
    if what not in SERIES:
        raise ValueError(f"lean_across_probes: what must be one of {', '.join(SERIES)}, got {what!r}")
    z_metric, ratio_metric = SERIES[what]
    by_layer: dict[int, list[tuple[int, float, float | None]]] = {}
    for r in records:
        step = r.get(keys.STEP)
        if not isinstance(step, int) or step < since or (until is not None and step > until):
            continue
        for k, v in r.items():
            where = z_metric.parse(k)
            if where is None or not _finite(v):
                continue
            ratio = r.get(ratio_metric.key(where[0]))
            by_layer.setdefault(where[0], []).append((step, float(v), float(ratio) if _finite(ratio) else None))
    out = {}
    for layer, pts in sorted(by_layer.items()):
        pts.sort()
        zs = [z for _, z, _ in pts]
        ratios = [q for _, _, q in pts if q is not None]
        sz = sum(zs) / math.sqrt(len(zs))
        mean_ratio = sum(ratios) / len(ratios) if ratios else None
        out[layer] = ProbeSeries(what, layer, [s for s, _, _ in pts], zs, sum(z > 0 for z in zs), sz, mean_ratio,
                                 _verdict(sz, mean_ratio))
    return out


def format_across_probes(series: dict[int, ProbeSeries]) -> str:
    """One line per layer: positive probes, Stouffer z, mean ratio, verdict."""
    lines = []
    for s in series.values():
        ratio = "-" if s.mean_ratio is None else f"{s.mean_ratio:+.3f}"
        lines.append(f"  L{s.layer}: {s.what} error positive at {s.positive}/{len(s.zs)} probes "
                     f"(steps {s.steps[0]}-{s.steps[-1]}), Stouffer z {s.stouffer_z:+.1f}, mean ratio {ratio}: "
                     f"{s.verdict}")
    return "\n".join(lines)


# delta's error split where it is born (probes.delta_split_metrics): per part, its z and its mean
# over all, tied and untied rows
_SPLIT = {"from_o": (keys.DELTA_FROM_O_Z, keys.DELTA_FROM_O_MEAN, keys.DELTA_FROM_O_TIED, keys.DELTA_FROM_O_UNTIED),
          "own": (keys.DELTA_OWN_Z, keys.DELTA_OWN_MEAN, keys.DELTA_OWN_TIED, keys.DELTA_OWN_UNTIED)}


def split_across_probes(records: list[dict], *, since: int = 0) -> dict[int, dict]:
    """Per layer, delta's error split into the part O's error carries (``from_o``) and the part
    delta's own product and sum add (``own``), read across the probes as ``lean_across_probes``
    reads the whole: for each part Stouffer's z over the probes' z (|z| >= Z_CRIT: significant),
    the probes with z > 0, and the mean over probes of its mean over all rows, over tied rows
    (several Pbar == 1 in a tile) and over the others; and the mean share of tied rows. A probe
    without tied rows adds nothing to the tied mean (and likewise untied)."""
    acc: dict[int, dict] = {}
    for r in records:
        step = r.get(keys.STEP)
        if not isinstance(step, int) or step < since:
            continue
        for part, (z_m, mean_m, tied_m, untied_m) in _SPLIT.items():
            for k, v in r.items():
                where = z_m.parse(k)
                if where is None or not _finite(v):
                    continue
                layer = where[0]
                a = acc.setdefault(layer, {}).setdefault(part, {"z": [], "mean": [], "tied": [], "untied": []})
                a["z"].append(float(v))
                for name, m in (("mean", mean_m), ("tied", tied_m), ("untied", untied_m)):
                    x = r.get(m.key(layer))
                    if _finite(x):
                        a[name].append(float(x))
                if part == "own" and _finite(r.get(keys.TIED_ROW_FRAC.key(layer))):
                    acc[layer].setdefault("tied_frac", []).append(float(r[keys.TIED_ROW_FRAC.key(layer)]))
    out = {}
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    for layer, parts in sorted(acc.items()):
        row = {"tied_row_frac": mean(parts.get("tied_frac", []))}
        for part in _SPLIT:
            a = parts.get(part)
            if not a:
                continue
            sz = sum(a["z"]) / math.sqrt(len(a["z"]))
            row[part] = {"probes": len(a["z"]), "positive": sum(z > 0 for z in a["z"]), "stouffer_z": sz,
                         "significant": abs(sz) >= Z_CRIT, "mean": mean(a["mean"]), "tied": mean(a["tied"]),
                         "untied": mean(a["untied"])}
        out[layer] = row
    return out
