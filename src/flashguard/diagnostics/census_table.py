"""The preconditions census as a table: this run against the study's GPT-2, a verdict per row.

    c = census_from_records(records)   # probe records: metrics.jsonl, or diagnose's metrics as one record
    print(format_census(c))      # the table, the per-layer values, the legend with every threshold
    c.to_dict()                  # for JSON (diagnose --out, the report)

Each row is one precondition of the study's mechanism (``flashguard.diagnostics.census`` says
what each metric measures). The run is judged at its latest probe: a rate at its strongest
layer (pooled over that layer's heads), the sink mass at its strongest head, the V sign
agreement and the ties at the sink pooled over every layer's exactly tied rows, each bias at
the layer that leans most. "Over training" counts the probes at which the same rule says
present (and weak). Every threshold is a constant here, and the legend prints them.

The study's column is what Qiu & Yao (2025, arXiv 2510.04212, "Why Low-Precision Transformer
Training Fails: An Analysis on Flash Attention") report, qualitatively, in their localisation and
mechanism analysis: they give no tie rate or sink mass for their GPT-2, so its column names the
finding, not a number. The legend cites them once (``STUDY``).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable

from .. import keys
from ..attention.error_stats import BIAS_RATIO_MIN, Z_CRIT
from .across_probes import ACROSS_PROBES_UNIT, ProbeSeries, format_across_probes, lean_across_probes

__all__ = ["PRESENT", "WEAK", "ABSENT", "NOT_MEASURED", "PRECONDITIONS", "Reading", "Precondition", "CensusRow",
           "Census", "census_from_records", "format_census", "census_legend", "over_training", "probe_records"]

PRESENT, WEAK, ABSENT, NOT_MEASURED = "present", "weak", "absent", "n/a"

# the study the census compares with, as the legend cites it
STUDY = ('the study: H. Qiu and Q. Yao, "Why Low-Precision Transformer Training Fails: An Analysis on Flash '
         'Attention", arXiv 2510.04212 (2025): its localisation (5b) and mechanism analysis (every row)')

# thresholds of the verdicts (the legend prints them)
RATE_PRESENT, RATE_WEAK = 1e-2, 1e-3      # ties, 2 x Pbar == 1: shares of (row, key tile) pairs
SINK_PRESENT, SINK_WEAK = 0.3, 0.1        # mean probability on key 0 (uniform causal attention: ~ln(T)/T)
AT_SINK_PRESENT, AT_SINK_WEAK = 0.5, 0.1  # share of the tied rows whose tied keys include key 0 ...
AT_SINK_LIFT_PRESENT, AT_SINK_LIFT_WEAK = 2.0, 1.5  # ... and its lift over chance (short causal rows tie there)
AGREE_PRESENT, AGREE_WEAK = 0.75, 0.6     # one-signed share of V's features (random signs: 0.5 for a pair)


@dataclass(frozen=True)
class Reading:
    """One precondition read from one probe record."""

    value: float | None          # None: not in the record (or no tied row to measure it on)
    where: str = ""              # "L1", "L1H0", "pooled over L0, L1"
    text: str = "-"              # the value as the table shows it
    sign: float = 0.0            # for a bias: the sign of its lean
    ratio: float | None = None   # for a bias: its bias ratio


@dataclass(frozen=True)
class Precondition:
    key: str
    name: str
    study: str                   # the study's GPT-2, in the table
    study_detail: str            # ... with what it says and where
    rule: str                    # how the verdict is computed (the legend)
    read: Callable[[dict, list[int]], Reading]
    judge: Callable[[Reading], str]


def _f(x: float) -> str:
    if x == 0:
        return "0"
    return f"{x:.3g}" if abs(x) >= 1e-3 else f"{x:.1e}"


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _strongest_layer(metric: keys.Metric):
    def read(rec: dict, layers: list[int]) -> Reading:
        vals = [(rec[metric.key(l)], l) for l in layers if _finite(rec.get(metric.key(l)))]
        if not vals:
            return Reading(None)
        v, l = max(vals)
        return Reading(v, f"L{l}", _f(v))
    return read


def _strongest_head(metric: keys.Metric):
    def read(rec: dict, layers: list[int]) -> Reading:
        vals = []
        for k, v in rec.items():
            where = metric.parse(k)
            if where is not None and where[1] is not None and where[0] in layers and _finite(v):
                vals.append((v, f"L{where[0]}H{where[1]}"))
        if not vals:
            return Reading(None)
        v, at = max(vals)
        return Reading(v, at, _f(v))
    return read


def _pooled_over_tied_rows(metric: keys.Metric):
    """The layers' values weighted by their exact tie rates (every layer sees the same rows)."""
    def read(rec: dict, layers: list[int]) -> Reading:
        pairs = [(rec[metric.key(l)], rec[keys.EXACT_TIE_RATE.key(l)], l) for l in layers
                 if _finite(rec.get(keys.EXACT_TIE_RATE.key(l))) and metric.key(l) in rec]
        if not pairs:
            return Reading(None)
        tied = [(v, w, l) for v, w, l in pairs if w > 0 and _finite(v)]
        if not tied:
            return Reading(None, "", "no tied rows")
        v = sum(v * w for v, w, _ in tied) / sum(w for _, w, _ in tied)
        return Reading(v, "pooled over " + ", ".join(f"L{l}" for _, _, l in tied), _f(v))
    return read


def _ties_at_sink(rec: dict, layers: list[int]) -> Reading:
    """The pooled share of tied rows at key 0, with its chance level (in ``ratio``)."""
    seen = _pooled_over_tied_rows(keys.TIE_AT_SINK)(rec, layers)
    chance = _pooled_over_tied_rows(keys.TIE_AT_SINK_CHANCE)(rec, layers)
    if seen.value is None or chance.value is None:
        return seen
    return Reading(seen.value, seen.where, f"{_f(seen.value)} (chance {_f(chance.value)})", ratio=chance.value)


def _judge_ties_at_sink(r: Reading) -> str:
    if r.value is None:
        return ABSENT if r.text == "no tied rows" else NOT_MEASURED
    lift = r.value / r.ratio if r.ratio else math.inf
    if r.value >= AT_SINK_PRESENT and lift >= AT_SINK_LIFT_PRESENT:
        return PRESENT
    return WEAK if r.value >= AT_SINK_WEAK and lift >= AT_SINK_LIFT_WEAK else ABSENT


def _leaning_layer(z_metric: keys.Metric, ratio_metric: keys.Metric, positive: bool):
    """The layer whose row-level z leans most (``positive``: most positive, the study's sign, unless
    no layer leans that way significantly; then the largest |z|)."""
    def read(rec: dict, layers: list[int]) -> Reading:
        vals = [(rec[z_metric.key(l)], rec.get(ratio_metric.key(l)), l) for l in layers
                if _finite(rec.get(z_metric.key(l)))]
        if not vals:
            return Reading(None)
        z, ratio, l = max(vals, key=lambda t: abs(t[0]))
        if positive:
            top = max(vals, key=lambda t: t[0])
            if top[0] >= Z_CRIT:
                z, ratio, l = top
        ratio = ratio if _finite(ratio) else None
        text = f"z {z:+.1f}" + ("" if ratio is None else f", ratio {ratio:+.2f}")
        return Reading(z, f"L{l}", text, sign=math.copysign(1.0, z) if z else 0.0, ratio=ratio)
    return read


def _at_least(present: float, weak: float):
    def judge(r: Reading) -> str:
        if r.value is None:
            return ABSENT if r.text == "no tied rows" else NOT_MEASURED
        return PRESENT if r.value >= present else WEAK if r.value >= weak else ABSENT
    return judge


def _lean(r: Reading) -> tuple[bool, bool]:
    """(significant, large enough): error_stats' lean rule, |z| >= Z_CRIT and |ratio| >= BIAS_RATIO_MIN."""
    significant = r.value is not None and abs(r.value) >= Z_CRIT
    return significant, r.ratio is not None and abs(r.ratio) >= BIAS_RATIO_MIN


def _judge_o_bias(r: Reading) -> str:
    if r.value is None:
        return NOT_MEASURED
    significant, large = _lean(r)
    return PRESENT if significant and large else WEAK if significant else ABSENT


def _judge_delta_bias(r: Reading) -> str:
    if r.value is None:
        return NOT_MEASURED
    significant, large = _lean(r)
    if significant and large and r.sign > 0:
        return PRESENT
    return WEAK if significant else ABSENT


_LEAN_RULE = (f"|z| >= {Z_CRIT:.2f} (p < 0.001) with |bias ratio| >= {BIAS_RATIO_MIN:g}, the lab's lean rule "
              "(attention.error_stats)")

PRECONDITIONS: tuple[Precondition, ...] = (
    Precondition(
        "ties", "1. tied row maxima", "present (common at sinks)",
        "rows of S with a repeated maximum: common with attention sinks, and much more common once scores are "
        "rounded to bf16; the study gives no rate",
        f"share of (row, key tile) pairs whose maximum repeats by the stabilizer's own tie rule (trace's count), "
        f"strongest layer: present >= {RATE_PRESENT:g}, weak >= {RATE_WEAK:g}, else absent",
        _strongest_layer(keys.TIE_RATE), _at_least(RATE_PRESENT, RATE_WEAK)),
    Precondition(
        "tie_at_sink", "1b. ties at the sink (key 0)", "present",
        "the repeated maxima sit at attention sinks",
        f"share of the exactly tied rows whose tied keys include key 0, pooled over layers, against its chance "
        f"level (each row's k tied keys drawn from its n visible keys: k / n): present >= {AT_SINK_PRESENT:g} and "
        f">= {AT_SINK_LIFT_PRESENT:g} x chance, weak >= {AT_SINK_WEAK:g} and >= {AT_SINK_LIFT_WEAK:g} x chance, "
        f"else absent (absent too without tied rows)",
        _ties_at_sink, _judge_ties_at_sink),
    Precondition(
        "multi_one", "2. rows with >= 2 Pbar == 1", "present (the trigger)",
        "a tied maximum gives Pbar = exp(0) = 1 exactly, so several V rows enter the Pbar V sum exactly",
        f"share of (row, key tile) pairs with two or more Pbar exactly 1 (trace's count), strongest layer: "
        f"present >= {RATE_PRESENT:g}, weak >= {RATE_WEAK:g}, else absent",
        _strongest_layer(keys.PBAR_ONE_MULTI), _at_least(RATE_PRESENT, RATE_WEAK)),
    Precondition(
        "sink", "3. sink mass", "present (attention sinks)",
        "attention sinks, where the ties are common; the study gives no sink mass",
        f"mean attention probability on key 0 (attn/sink_mass, fp64), strongest head: present >= {SINK_PRESENT:g}, "
        f"weak >= {SINK_WEAK:g}, else absent",
        _strongest_head(keys.SINK_MASS), _at_least(SINK_PRESENT, SINK_WEAK)),
    Precondition(
        "v_sign", "4. V one-signed at the tied keys", "present (V mostly < 0)",
        "in feature dimensions where V is mostly negative, two negative bf16 values of one exponent overflow "
        "the significand and the small same-sign terms set the sticky bits, so rounding goes up in magnitude "
        "every time: exact -4.703990459 becomes -4.71875 in bf16, an error of -0.0148",
        f"over the rows whose maximum repeats bit for bit, the share of V's features in which every tied key's "
        f"value has one sign, pooled over layers: present >= {AGREE_PRESENT:g}, weak >= {AGREE_WEAK:g} "
        f"(independent random signs give 0.5 for a pair), else absent (absent too without tied rows)",
        _pooled_over_tied_rows(keys.V_SIGN_AGREE), _at_least(AGREE_PRESENT, AGREE_WEAK)),
    Precondition(
        "o_bias", "5a. O bias (row z)", "present (O < 0 where V < 0)",
        "the O error is negative in the features where V is negative, every time",
        f"z of O's error over rows (one value per row: its mean over the row's features) at the layer that "
        f"leans most: present = a lean, {_LEAN_RULE}; weak = |z| >= {Z_CRIT:.2f} with a smaller ratio; "
        f"else absent",
        _leaning_layer(keys.O_ERR_Z_ROW, keys.O_ERR_RATIO_ROW, positive=False), _judge_o_bias),
    Precondition(
        "delta_bias", "5b. delta bias (row z)", "present: positive, coherent",
        "delta_lp - delta_hp has a consistent sign, positive, and its running sum keeps growing; it drifts W_Q "
        "(in their run layer 2, index 1, head 8 grew fastest)",
        f"z of delta's error over rows at the layer that leans most positive: present = a positive lean, "
        f"{_LEAN_RULE}; weak = a significant lean of the other sign or below the ratio; else absent",
        _leaning_layer(keys.DELTA_ERR_Z_ROW, keys.DELTA_ERR_RATIO_ROW, positive=True), _judge_delta_bias),
)

# the per-layer and per-head tables: (header, metric), values of the latest probe
LAYER_COLUMNS = [("ties", keys.TIE_RATE), ("exact ties", keys.EXACT_TIE_RATE), ("at key 0", keys.TIE_AT_SINK),
                 ("2xPbar=1", keys.PBAR_ONE_MULTI), ("sink", keys.SINK_MASS), ("V 1-signed", keys.V_SIGN_AGREE),
                 ("O z row", keys.O_ERR_Z_ROW), ("O ratio", keys.O_ERR_RATIO_ROW),
                 ("d z row", keys.DELTA_ERR_Z_ROW), ("d ratio", keys.DELTA_ERR_RATIO_ROW)]
HEAD_COLUMNS = [c for c in LAYER_COLUMNS if c[1].per_head]


def probe_records(records: list[dict]) -> list[dict]:
    """The records of probe steps (those holding a tie rate or a sink mass), in step order."""
    def probed(r):
        return any(keys.TIE_RATE.matches(k) or keys.SINK_MASS.matches(k) for k in r)
    return sorted((r for r in records if isinstance(r.get(keys.STEP), int) and probed(r)), key=lambda r: r[keys.STEP])


@dataclass
class CensusRow:
    key: str
    precondition: str
    study: str
    value: float | None
    text: str
    where: str
    verdict: str
    present: int             # probes at which the rule says present
    weak: int
    probes: int


@dataclass
class Census:
    step: int                                  # the latest probe's step (the one judged)
    steps: list[int]                           # every probe step read
    layers: list[int]
    rows: list[CensusRow]
    per_layer: dict[int, dict[str, float | None]]
    per_head: dict[str, dict[str, float | None]] = field(default_factory=dict)
    # the O and delta leans read across every probe (diagnostics.across_probes), per layer
    across: dict[str, dict[int, ProbeSeries]] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        out = {PRESENT: 0, WEAK: 0, ABSENT: 0, NOT_MEASURED: 0}
        for r in self.rows:
            out[r.verdict] += 1
        return out

    def summary(self) -> str:
        """One line: how many preconditions are present, weak, absent."""
        n = self.counts()
        parts = [f"{n[v]} {v}" for v in (PRESENT, WEAK, ABSENT) if n[v]] + \
                ([f"{n[NOT_MEASURED]} not measured"] if n[NOT_MEASURED] else [])
        return f"preconditions census at step {self.step}: " + ", ".join(parts)

    @classmethod
    def from_dict(cls, d: dict) -> "Census":
        """Back from ``to_dict`` (diagnose's JSON)."""
        across = {what: {int(l): ProbeSeries(**s) for l, s in per.items()}
                  for what, per in (d.get("across") or {}).items()}
        return cls(d["step"], list(d["steps"]), list(d["layers"]), [CensusRow(**r) for r in d["rows"]],
                   {int(k): v for k, v in d["per_layer"].items()}, dict(d.get("per_head") or {}), across)

    def to_dict(self) -> dict:
        return {"step": self.step, "steps": self.steps, "layers": self.layers,
                "rows": [asdict(r) for r in self.rows],
                "per_layer": {str(k): v for k, v in self.per_layer.items()}, "per_head": self.per_head,
                "across": {what: {str(l): ser.to_dict() for l, ser in per.items()} for what, per in self.across.items()},
                "summary": self.summary(), "legend": census_legend()}


def _layers(recs: list[dict]) -> list[int]:
    found = set()
    for r in recs:
        for k in r:
            parsed = keys.parse(k)
            if parsed is not None and parsed[0].namespace in ("attn", "numerics"):
                found.add(parsed[1])
    return sorted(found)


# measured over the exactly tied rows: nothing to show where there were none
_OVER_TIED = (keys.TIE_AT_SINK, keys.V_SIGN_AGREE)


def _value(rec: dict, metric: keys.Metric, layer: int, head: int | None = None):
    v = rec.get(metric.key(layer, head))
    if metric in _OVER_TIED and not rec.get(keys.EXACT_TIE_RATE.key(layer, head)):
        return None
    return v if _finite(v) else None


def census_from_records(records: list[dict], layers: list[int] | None = None) -> Census | None:
    """The census of a run's probe records (None when no record holds probe data)."""
    recs = probe_records(records)
    if not recs:
        return None
    layers = sorted(layers) if layers else _layers(recs)
    latest = recs[-1]
    rows = []
    for p in PRECONDITIONS:
        verdicts = [p.judge(p.read(r, layers)) for r in recs]
        now = p.read(latest, layers)
        rows.append(CensusRow(p.key, p.name, p.study, now.value, now.text, now.where, verdicts[-1],
                              verdicts.count(PRESENT), verdicts.count(WEAK), len(recs)))
    per_layer = {l: {h: _value(latest, m, l) for h, m in LAYER_COLUMNS} for l in layers}
    heads = sorted({where[1] for k in latest if (where := keys.TIE_RATE.parse(k)) is not None
                    and where[1] is not None and where[0] in layers})
    per_head = {f"L{l}H{h}": {c: _value(latest, m, l, h) for c, m in HEAD_COLUMNS} for l in layers for h in heads}
    across = {what: {l: ser for l, ser in lean_across_probes(recs, what).items() if l in layers}
              for what in ("delta", "O")}
    return Census(latest[keys.STEP], [r[keys.STEP] for r in recs], layers, rows, per_layer, per_head, across)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def over_training(r: CensusRow) -> str:
    return f"present at {r.present}/{r.probes}" + (f", weak at {r.weak}" if r.weak else "")


def census_legend() -> list[str]:
    """One line per precondition: the study's finding and the verdict's rule."""
    out = [STUDY + "."]
    for p in PRECONDITIONS:
        out.append(f"{p.name}: the study: {p.study_detail}. Verdict: {p.rule}.")
    out.append("Per layer (latest probe): ties = the tie rate by the stabilizer's rule; exact ties = maxima repeated "
               "bit for bit; at key 0 = the share of those at the sink; 2xPbar=1; sink = mean probability on key 0 "
               "(mean over heads); V 1-signed; O / d z row and ratio = z and bias ratio of O's / delta's error over "
               "rows (the rows of a sequence share its keys: diagnose's O z / d.err z over (sequence, head) units "
               "are the conservative reading).")
    out.append("Judged at the latest probe; 'over training' counts the probes at which the same rule says present "
               "(weak). n/a: the run's probes did not record it (probed before the census existed, or a layer "
               "without a flash arithmetic).")
    return out


def format_census(c: Census, *, heads: bool = False) -> str:
    steps = f"{len(c.steps)} probe{'s' if len(c.steps) != 1 else ''}, steps {c.steps[0]}-{c.steps[-1]}"
    lines = [f"preconditions census: this run vs the study's GPT-2 (judged at step {c.step}; {steps}; "
             f"layers {', '.join(f'L{l}' for l in c.layers)})",
             _table(["precondition", "the study's GPT-2", "this run", "where", "over training", "verdict"],
                    [[r.precondition, r.study, r.text, r.where or "-", over_training(r), r.verdict] for r in c.rows])]

    def cell(v):
        return "-" if v is None else _f(v)
    lines += ["", "per layer at step %d:" % c.step,
              _table(["layer"] + [h for h, _ in LAYER_COLUMNS],
                     [[f"L{l}"] + [cell(v) for v in c.per_layer[l].values()] for l in c.layers])]
    if heads and c.per_head:
        lines += ["", _table(["head"] + [h for h, _ in HEAD_COLUMNS],
                             [[name] + [cell(v) for v in vals.values()] for name, vals in c.per_head.items()])]
    if any(c.across.values()):
        lines += ["", f"bias across the probes (Stouffer z; unit: {ACROSS_PROBES_UNIT}; a lean: |z| >= {Z_CRIT:.2f} "
                      f"and mean ratio >= {BIAS_RATIO_MIN:g} of its sign):"]
        lines += [format_across_probes(per) for per in c.across.values() if per]
    lines += ["", "legend:"] + [f"  {ln}" for ln in census_legend()]
    return "\n".join(lines)
