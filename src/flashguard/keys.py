"""The keys of a run's metrics records (``metrics.jsonl``): one schema for every writer and reader.

Writers: the trainer (``flashguard.train.loop``), the probes (``flashguard.diagnostics.probes``)
and the trainer's diagnostics hook. Readers: the early-warning monitor, ``flashguard diagnose``,
the plots, the repro's run summaries and claims, the report's figures. Build and match keys
with the names here, never with string literals, so that a rename is one edit and a reader
cannot ask for a key no writer makes (tests/diagnostics/test_keys.py checks both directions
on a real probed run).

A record is ``{"step": int, KEY: float, ...}``. The trainer's keys are fixed strings. A probe
metric is a ``Metric``: its keys are ``<namespace>/<name>/L<layer>`` for a layer and
``<namespace>/<name>/L<layer>H<head>`` for one head; layers and heads count from 0 (the study's
"layer 2" is ``L1``). What each metric means is in ``flashguard.diagnostics.probes``.

This module imports nothing from the package, so every layer (train, diagnostics,
experiments) can import it without importing the others.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["STEP", "LOSS_TRAIN", "LOSS_VAL", "LR", "GRAD_NORM", "STEP_TIME", "TOKENS_PER_S", "EVAL_TIME", "DIVERGED",
           "DIAGNOSTICS_TIME", "DIAGNOSTICS_FAILED", "MONITOR_STATE", "TRAINER_KEYS",
           "Metric", "PROBE_METRICS", "PROBE_NAMESPACES", "metric", "parse", "is_probe_key",
           "SPECTRAL_NORM", "GROWTH", "SPECTRAL_NORM_MAX", "GROWTH_MAX",
           "WQ_NORM", "WK_NORM", "WQ_GROWTH", "WK_GROWTH", "WQ_NORM_MAX", "WK_NORM_MAX", "WQ_GROWTH_MAX",
           "WK_GROWTH_MAX", "MAX_LOGIT", "SINK_MASS", "SINK_TOP_FRAC", "TIE_RATE", "PBAR_ONE", "PBAR_ONE_MULTI",
           "O_ERR_BIAS", "O_ERR_ABS", "O_ERR_BIAS_ABSMAX", "O_ERR_BIAS_VSIGN", "DELTA_ERR_MEAN", "DELTA_ERR_ABS",
           "DELTA_ERR_REL", "DELTA_ERR_POS_FRAC", "DELTA_ERR_CUMSUM", "O_ERR_Z", "DELTA_ERR_Z",
           "EXACT_TIE_RATE", "TIE_AT_SINK", "TIE_AT_SINK_CHANCE", "V_SIGN_AGREE", "O_ERR_Z_ROW", "O_ERR_RATIO_ROW",
           "DELTA_ERR_Z_ROW", "DELTA_ERR_RATIO_ROW", "CENSUS_METRICS", "DELTA_FROM_O_MEAN", "DELTA_FROM_O_Z",
           "DELTA_OWN_MEAN", "DELTA_OWN_Z", "DELTA_FROM_O_TIED", "DELTA_FROM_O_UNTIED", "DELTA_OWN_TIED",
           "DELTA_OWN_UNTIED", "TIED_ROW_FRAC", "DELTA_SPLIT_METRICS", "WQ_ERR_SV", "WQ_ERR_RANK1_FRAC",
           "WQ_ERR_NORM", "WQ_ERR_REL", "WQ_ERR_COS_PREV", "WQ_ERR_COS_SUM", "WQ_ERR_ALIGN_TOP",
           "WQ_ERR_TOP_PUSH", "WQ_ERR_SV_PATTERN", "wq_err", "wq_err_sv", "parse_sv", "UPDATE_ENTROPY",
           "HOOK_METRICS"]

# ---- the trainer's keys (every logged step) -------------------------------------------------
STEP = "step"
LOSS_TRAIN = "loss/train"            # the step's training loss (cross-entropy; without a z-loss)
LOSS_VAL = "loss/val"                # validation loss, at the evaluation steps
LR = "optim/lr"
GRAD_NORM = "grad/norm"              # gradient norm before clipping
STEP_TIME = "time/step_s"
TOKENS_PER_S = "time/tokens_per_s"
EVAL_TIME = "time/eval_s"           # seconds the validation loss took, at the evaluation steps (not in step_s)
DIVERGED = "event/diverged"          # 1 at a step the divergence rule fired (flashguard.train.divergence)
TRAINER_KEYS = (LOSS_TRAIN, LOSS_VAL, LR, GRAD_NORM, STEP_TIME, TOKENS_PER_S, EVAL_TIME, DIVERGED)

# ---- the diagnostics hook's keys (flashguard.diagnostics.trainer) ----------------------------
DIAGNOSTICS_TIME = "time/diagnostics_s"   # cost of the probes, at the probe steps
DIAGNOSTICS_FAILED = "diagnostics/failed"  # 1 at a probe step whose probes raised
MONITOR_STATE = "monitor/state"           # 0 ok, 1 watch, 2 warning (every step)

PROBE_NAMESPACES = ("weights", "attn", "numerics", "grad")
_KEY = re.compile(r"^(?P<ns>[a-z]+)/(?P<name>[A-Za-z0-9_]+)/L(?P<layer>\d+)(?:H(?P<head>\d+))?$")


@dataclass(frozen=True)
class Metric:
    """One probe metric: written per layer (``per_layer``), per head (``per_head``) or both.

    ``key(layer)`` / ``key(layer, head)`` build a key and refuse a granularity the writers do
    not write; ``pattern(...)`` is a regex (for ``re.fullmatch``) of its keys, ``parse(key)``
    gives ``(layer, head)`` of one of its keys or None."""

    namespace: str
    name: str
    per_layer: bool = True
    per_head: bool = False

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def prefix(self) -> str:
        return f"{self.namespace}/{self.name}/L"

    def key(self, layer: int, head: int | None = None) -> str:
        if head is None and not self.per_layer:
            raise ValueError(f"{self.namespace}/{self.name} is written per head only: give a head")
        if head is not None and not self.per_head:
            raise ValueError(f"{self.namespace}/{self.name} is written per layer only, not per head")
        return f"{self.prefix}{int(layer)}" + ("" if head is None else f"H{int(head)}")

    def pattern(self, layer: int | None = None, *, heads: bool = False) -> str:
        """Regex of this metric's per-layer keys (``heads=False``) or per-head keys, of one
        layer or (``layer=None``) of any; groups: layer, then head."""
        if heads and not self.per_head:
            raise ValueError(f"{self.namespace}/{self.name} is written per layer only, not per head")
        if not heads and not self.per_layer:
            raise ValueError(f"{self.namespace}/{self.name} is written per head only")
        lay = r"(\d+)" if layer is None else f"({int(layer)})"
        return re.escape(self.prefix) + lay + (r"H(\d+)" if heads else "")

    def parse(self, key: str) -> tuple[int, int | None] | None:
        m = _KEY.match(key)
        if not m or m["ns"] != self.namespace or m["name"] != self.name:
            return None
        head = None if m["head"] is None else int(m["head"])
        if (head is None and not self.per_layer) or (head is not None and not self.per_head):
            return None
        return int(m["layer"]), head

    def matches(self, key: str) -> bool:
        return self.parse(key) is not None


def _m(ns: str, name: str, *, layer: bool = True, head: bool = False) -> Metric:
    return Metric(ns, name, per_layer=layer, per_head=head)


# ---- weights (weight_probe) ------------------------------------------------------------------
WQ_NORM, WK_NORM = _m("weights", "wq_spectral_norm", layer=False, head=True), \
    _m("weights", "wk_spectral_norm", layer=False, head=True)
WQ_GROWTH, WK_GROWTH = _m("weights", "wq_growth", layer=False, head=True), \
    _m("weights", "wk_growth", layer=False, head=True)
WQ_NORM_MAX, WK_NORM_MAX = _m("weights", "wq_spectral_norm_max"), _m("weights", "wk_spectral_norm_max")
WQ_GROWTH_MAX, WK_GROWTH_MAX = _m("weights", "wq_growth_max"), _m("weights", "wk_growth_max")
# by projection ("wq" / "wk"), for the writer that loops over both
SPECTRAL_NORM = {"wq": WQ_NORM, "wk": WK_NORM}
GROWTH = {"wq": WQ_GROWTH, "wk": WK_GROWTH}
SPECTRAL_NORM_MAX = {"wq": WQ_NORM_MAX, "wk": WK_NORM_MAX}
GROWTH_MAX = {"wq": WQ_GROWTH_MAX, "wk": WK_GROWTH_MAX}
# the normalised spectral entropy of the W_Q W_K^T update, minimum over the layer's heads
# (flashguard.diagnostics.update_entropy, every train.update_entropy_every steps; not a probe)
UPDATE_ENTROPY = _m("weights", "update_entropy")

# ---- attention (attention_metrics) -----------------------------------------------------------
MAX_LOGIT = _m("attn", "max_logit", head=True)
SINK_MASS = _m("attn", "sink_mass", head=True)
SINK_TOP_FRAC = _m("attn", "sink_top_frac")

# ---- numerics (numerics_metrics) -------------------------------------------------------------
TIE_RATE = _m("numerics", "tie_rate", head=True)
PBAR_ONE = _m("numerics", "pbar_one", head=True)
PBAR_ONE_MULTI = _m("numerics", "pbar_one_multi", head=True)
O_ERR_BIAS = _m("numerics", "o_err_bias")
O_ERR_ABS = _m("numerics", "o_err_abs")
O_ERR_BIAS_ABSMAX = _m("numerics", "o_err_bias_absmax")
O_ERR_BIAS_VSIGN = _m("numerics", "o_err_bias_vsign")
DELTA_ERR_MEAN = _m("numerics", "delta_err_mean")
DELTA_ERR_ABS = _m("numerics", "delta_err_abs")
DELTA_ERR_REL = _m("numerics", "delta_err_rel")
DELTA_ERR_POS_FRAC = _m("numerics", "delta_err_pos_frac")
DELTA_ERR_CUMSUM = _m("numerics", "delta_err_cumsum")
O_ERR_Z = _m("numerics", "o_err_z")          # z of O's error over (sequence, head) units
DELTA_ERR_Z = _m("numerics", "delta_err_z")  # z of delta's error over (sequence, head) units
# delta's error split where it is born (issue 23 item 3): from O's error (rowsum(dO * O_lp) in fp64
# - delta_ref) and from delta's own product and sum (delta_lp - rowsum(dO * O_lp) in fp64); each
# part's mean and z over (sequence, head) units, and its mean over rows with several Pbar == 1 in
# one tile (tied) and over the others
DELTA_FROM_O_MEAN = _m("numerics", "delta_from_o_mean")
DELTA_FROM_O_Z = _m("numerics", "delta_from_o_z")
DELTA_OWN_MEAN = _m("numerics", "delta_own_mean")
DELTA_OWN_Z = _m("numerics", "delta_own_z")
DELTA_FROM_O_TIED = _m("numerics", "delta_from_o_tied")
DELTA_FROM_O_UNTIED = _m("numerics", "delta_from_o_untied")
DELTA_OWN_TIED = _m("numerics", "delta_own_tied")
DELTA_OWN_UNTIED = _m("numerics", "delta_own_untied")
TIED_ROW_FRAC = _m("numerics", "tied_row_frac")
DELTA_SPLIT_METRICS = (DELTA_FROM_O_MEAN, DELTA_FROM_O_Z, DELTA_OWN_MEAN, DELTA_OWN_Z, DELTA_FROM_O_TIED,
                       DELTA_FROM_O_UNTIED, DELTA_OWN_TIED, DELTA_OWN_UNTIED, TIED_ROW_FRAC)

# ---- the preconditions census (flashguard.diagnostics.census) --------------------------------
EXACT_TIE_RATE = _m("numerics", "exact_tie_rate", head=True)   # (row, key tile) pairs whose max repeats bit for bit
TIE_AT_SINK = _m("numerics", "tie_at_sink", head=True)         # of those, the share whose tied keys include key 0
TIE_AT_SINK_CHANCE = _m("numerics", "tie_at_sink_chance", head=True)  # ... if the tied keys were drawn at random
V_SIGN_AGREE = _m("numerics", "v_sign_agree", head=True)       # of those, mean share of one-signed V features
O_ERR_Z_ROW = _m("numerics", "o_err_z_row")                    # z of O's error over row units
O_ERR_RATIO_ROW = _m("numerics", "o_err_ratio_row")            # its bias ratio (mean / mean |row error|)
DELTA_ERR_Z_ROW = _m("numerics", "delta_err_z_row")
DELTA_ERR_RATIO_ROW = _m("numerics", "delta_err_ratio_row")
CENSUS_METRICS = (EXACT_TIE_RATE, TIE_AT_SINK, TIE_AT_SINK_CHANCE, V_SIGN_AGREE, O_ERR_Z_ROW, O_ERR_RATIO_ROW,
                  DELTA_ERR_Z_ROW, DELTA_ERR_RATIO_ROW)

# ---- the W_Q gradient error (gradient_error_metrics; names as error_structure gives them) ----
_SV = re.compile(r"^sv(\d+)$")
WQ_ERR_RANK1_FRAC = _m("grad", "wq_err_rank1_frac")
WQ_ERR_NORM = _m("grad", "wq_err_norm", head=True)
WQ_ERR_REL = _m("grad", "wq_err_rel")
WQ_ERR_COS_PREV = _m("grad", "wq_err_cos_prev")
WQ_ERR_COS_SUM = _m("grad", "wq_err_cos_sum")
WQ_ERR_ALIGN_TOP = _m("grad", "wq_err_align_top", head=True)
WQ_ERR_TOP_PUSH = _m("grad", "wq_err_top_push", head=True)
_WQ_ERR = {m.name[len("wq_err_"):]: m for m in (WQ_ERR_RANK1_FRAC, WQ_ERR_NORM, WQ_ERR_REL, WQ_ERR_COS_PREV,
                                                 WQ_ERR_COS_SUM, WQ_ERR_ALIGN_TOP, WQ_ERR_TOP_PUSH)}


def wq_err_sv(i: int) -> Metric:
    """The i-th (from 1) singular value of the W_Q gradient error: ``grad/wq_err_sv<i>/L<l>``."""
    if int(i) < 1:
        raise ValueError(f"singular values count from 1, got {i}")
    return _m("grad", f"wq_err_sv{int(i)}")


WQ_ERR_SV = tuple(wq_err_sv(i) for i in range(1, 5))   # the probes write N_SINGULAR = 4
WQ_ERR_SV_PATTERN = r"grad/wq_err_sv(\d+)/L(\d+)"      # any of them, any layer (groups: i, layer)


def parse_sv(key: str) -> tuple[int, int] | None:
    """(i, layer) of a ``grad/wq_err_sv<i>/L<layer>`` key, else None."""
    m = re.fullmatch(WQ_ERR_SV_PATTERN, key)
    return (int(m.group(1)), int(m.group(2))) if m else None


def wq_err(name: str) -> Metric:
    """The gradient-error metric of an ``error_structure`` name (``sv1``, ``rank1_frac``, ``norm``,
    ``rel``, ``cos_prev``, ``cos_sum``, ``align_top``, ``top_push``); ValueError for a name the
    schema does not know (add it here first)."""
    m = _SV.match(name)
    if m:
        return wq_err_sv(int(m.group(1)))
    try:
        return _WQ_ERR[name]
    except KeyError:
        raise ValueError(f"gradient-error metric {name!r} is not in the schema (flashguard.keys)") from None


PROBE_METRICS: tuple[Metric, ...] = (
    WQ_NORM, WK_NORM, WQ_GROWTH, WK_GROWTH, WQ_NORM_MAX, WK_NORM_MAX, WQ_GROWTH_MAX, WK_GROWTH_MAX,
    MAX_LOGIT, SINK_MASS, SINK_TOP_FRAC,
    TIE_RATE, PBAR_ONE, PBAR_ONE_MULTI, O_ERR_BIAS, O_ERR_ABS, O_ERR_BIAS_ABSMAX, O_ERR_BIAS_VSIGN,
    DELTA_ERR_MEAN, DELTA_ERR_ABS, DELTA_ERR_REL, DELTA_ERR_POS_FRAC, DELTA_ERR_CUMSUM, O_ERR_Z, DELTA_ERR_Z,
    *DELTA_SPLIT_METRICS, *CENSUS_METRICS,
    *WQ_ERR_SV, WQ_ERR_RANK1_FRAC, WQ_ERR_NORM, WQ_ERR_REL, WQ_ERR_COS_PREV, WQ_ERR_COS_SUM, WQ_ERR_ALIGN_TOP,
    WQ_ERR_TOP_PUSH,
)
# metrics of the weights that a hook of their own writes, not the probes (so not every probed run has them)
HOOK_METRICS: tuple[Metric, ...] = (UPDATE_ENTROPY,)
_BY_NAME = {(m.namespace, m.name): m for m in (*PROBE_METRICS, *HOOK_METRICS)}


def metric(key: str) -> Metric | None:
    """The schema's Metric of a probe key, else None (also for a key at a granularity the
    metric is not written at, e.g. a per-head key of a per-layer metric)."""
    m = _KEY.match(key)
    found = _BY_NAME.get((m["ns"], m["name"])) if m else None
    return found if found is not None and found.matches(key) else None


def parse(key: str) -> tuple[Metric, int, int | None] | None:
    """``(metric, layer, head)`` of a probe key of the schema, else None."""
    m = metric(key)
    if m is None:
        return None
    layer, head = m.parse(key)
    return m, layer, head


def is_probe_key(key: str) -> bool:
    """A key in a probe namespace (``weights/``, ``attn/``, ``numerics/``, ``grad/`` other than
    ``grad/norm``), whether or not the schema knows it."""
    return key != GRAD_NORM and key.split("/", 1)[0] in PROBE_NAMESPACES
