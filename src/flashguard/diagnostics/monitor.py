"""Early-warning monitor: metrics records in, a state out (0 ok, 1 watch, 2 warning).

The monitor reads the records a run writes to metrics.jsonl, one per step, in order: the
trainer's own keys (``loss/train``, ``grad/norm``) every step and the probe keys every
``train.diagnostics_every`` steps. Online, the trainer feeds it every step's record and writes
``monitor/state`` into it (and a console line when the state changes); offline,
``flashguard.diagnostics.evaluate`` replays a finished run and measures what the monitor would
have said (lead time against the package's divergence rule).

Any model: the monitor reads keys, not a model. ``flashguard.watch`` (and the Hugging Face
callback built on it) feeds it every step's record of the user's own model: ``grad/norm``
every step (the gradient-spike signal), and at probe steps the signals the probes compute on any
SDPA call (max logit; delta's error for the delta-bias signal; the tie rate shown beside them)
and the W_Q / W_K spectral norms where the watch finds the projections
(``flashguard.diagnostics.projections``: Hugging Face's ``q_proj`` / ``k_proj`` and GPT-2's packed
``c_attn`` automatically, others by the module names the user passes), so the W_Q growth and
ratio signals too. A signal whose keys never come is never raised; the state is judged on the
others (``signals_seen``). The W_Q gradient-error signal (``grad_err``) needs flashguard's
trainer.

Signals and thresholds (``MonitorThresholds``). First set by hand from the study's account and
one stable 300-step tiny-cpu run; then calibrated (issue 15, docs/early-warning/) on the 150 runs
of the micro-grid injection experiment (seeds 1-5, 26 diverged by the package's rule): the
level thresholds below are the hand-set ones at scale k = 2.5 (growth and logit thresholds x k,
ratio thresholds ^ k), the smallest k of the grid at which the stable twins of the calibration
half (odd seeds) raised a warning in <= 10 % of runs. On the held-out even seeds the warning
came in 9 of 10 divergent runs, a median 520 steps ahead, with 0 of 12 false alarms (a
max-logit threshold of 150, calibrated the same way: 9 of 10, 545 steps, 0 of 12). The watch
level is not calibrated: its delta-bias signal fires on most healthy runs whatever k is.
Nothing is judged before ``ignore_before``: right after the warm-up the weights grow as fast
as in a runaway. ``MonitorThresholds.for_warmup(w)`` (used by the trainer and by
``evaluate.evaluate_run``) sets it to 2 x the warm-up steps.

Growth signals (the feedback loop of the study: W_Q grows, logits grow, gradients spike):
  wq_growth       fastest per-head W_Q spectral-norm growth, from ``weights/wq_spectral_norm/*``
                  over the last ``growth_window`` (100) steps (at least half of it), as
                  log-growth per 100 steps: watch >= 1.0, warning >= 2.0. In the CPU probe runs
                  a runaway layer grew 1.7 -> 11 in 300 steps (0.62 per 100 steps on average).
                  (A window, not the probe-to-probe ``weights/wq_growth``, so that a short probe
                  interval does not turn norm noise into growth.)
  wq_norm_ratio   largest ratio of a head's W_Q spectral norm to its value ``ratio_window``
                  (1,000) steps earlier (or at the first probe judged, if later): watch >= 2^2.5,
                  warning >= 4^2.5 = 32 (stable CPU runs: 1.7 -> 2.9 over steps 300-2,000).
  max_logit       largest |attention logit| of any layer, ``attn/max_logit/L*``: watch >= 125,
                  warning >= 500 (bf16 resolves a logit of 64 only to 0.25-0.5).
  grad_spike      ``grad/norm`` over the median of the previous 50 finite values: watch >= 10^2.5,
                  warning >= 1e5 or non-finite; a spike keeps its level for 20 steps.
Probe-based levels must hold at ``persist`` (2) consecutive probes: one noisy probe is not
enough. Mechanism signals (the study's mechanism is at work; alone only a watch):
  delta_bias      for some layer, |sum| / sum |.| of the last 8 ``numerics/delta_err_mean``
                  values >= 0.9 (a consistently signed delta error, the study's bias);
  grad_err        ``grad/wq_err_cos_prev`` >= 0.5 at ``persist`` consecutive probes (the W_Q
                  gradient errors point the same way step after step, so they add up).
State: warning when a growth signal is at warning level, or two growth signals are at watch
level at once, or a growth signal and a mechanism signal are (growth while the mechanism is
at work: the loop of the study closing); watch when any signal is at watch level; else ok.
"""
from __future__ import annotations

import math
import re
import statistics
from collections import deque
from dataclasses import dataclass

from .. import keys

__all__ = ["OK", "WATCH", "WARNING", "STATE_NAMES", "MonitorThresholds", "MonitorStatus", "Monitor"]

OK, WATCH, WARNING = 0, 1, 2
STATE_NAMES = {OK: "ok", WATCH: "watch", WARNING: "warning"}

_WQ_NORM = re.compile(keys.WQ_NORM.pattern(heads=True))            # per head (fullmatch)
_MAX_LOGIT = re.compile(keys.MAX_LOGIT.pattern())                    # per layer
_DELTA = re.compile(keys.DELTA_ERR_MEAN.pattern())
_COS_PREV = re.compile(keys.WQ_ERR_COS_PREV.pattern())

GROWTH_SIGNALS = ("wq_growth", "wq_norm_ratio", "max_logit", "grad_spike")
MECHANISM_SIGNALS = ("delta_bias", "grad_err")


@dataclass(frozen=True)
class MonitorThresholds:
    ignore_before: int = 0
    # calibrated: the hand-set values (0.4, 0.8; 2, 4; 50, 200; 10, 100) at scale k = 2.5
    wq_growth_watch: float = 0.4 * 2.5
    wq_growth_warn: float = 0.8 * 2.5
    growth_window: int = 100
    wq_norm_ratio_watch: float = 2.0 ** 2.5
    wq_norm_ratio_warn: float = 4.0 ** 2.5
    ratio_window: int = 1000
    max_logit_watch: float = 50.0 * 2.5
    max_logit_warn: float = 200.0 * 2.5
    grad_spike_watch: float = 10.0 ** 2.5
    grad_spike_warn: float = 100.0 ** 2.5
    grad_window: int = 50
    spike_hold: int = 20
    delta_consistency: float = 0.9
    delta_window: int = 8
    grad_err_cos: float = 0.5
    persist: int = 2

    @classmethod
    def for_warmup(cls, warmup_steps: int, **changes) -> "MonitorThresholds":
        """Defaults for a run with this many warm-up steps: nothing judged before 2 x warm-up."""
        return cls(ignore_before=2 * max(int(warmup_steps), 0), **changes)


@dataclass
class MonitorStatus:
    step: int
    state: int
    reasons: list[str]
    changed: bool

    @property
    def name(self) -> str:
        return STATE_NAMES[self.state]

    def message(self) -> str:
        why = "; ".join(self.reasons) if self.reasons else "all signals below their thresholds"
        return f"monitor: step {self.step}: {self.name.upper()} ({why})"


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _level(value: float, watch: float, warn: float) -> int:
    if not math.isfinite(value):
        return WARNING
    return WARNING if value >= warn else WATCH if value >= watch else OK


class Monitor:
    """Feed records in step order with ``update(record)``; each call returns a MonitorStatus."""

    def __init__(self, thresholds: MonitorThresholds | None = None):
        self.th = thresholds or MonitorThresholds()
        self.state = OK
        self.levels: dict[str, int] = {s: OK for s in GROWTH_SIGNALS + MECHANISM_SIGNALS}
        self.why: dict[str, str] = {}
        self._raw: dict[str, deque] = {s: deque(maxlen=self.th.persist)
                                       for s in ("wq_growth", "wq_norm_ratio", "max_logit", "grad_err")}
        self._norm_hist: dict[str, deque] = {}   # per head: (step, ln norm), the last growth_window
        self._ratio_hist: dict[str, deque] = {}  # per head: (step, norm), the last ratio_window
        self._grad_hist: deque = deque(maxlen=self.th.grad_window)
        self._spike_until = -1
        self._delta: dict[int, deque] = {}
        self.signals_seen: set[str] = set()   # the signals whose keys have come in at least once

    # ---- signals ----

    def _persisted(self, name: str, raw: int, why: str) -> None:
        q = self._raw[name]
        q.append(raw)
        level = min(q) if len(q) == q.maxlen else OK
        self.levels[name] = level
        if level:
            self.why[name] = why
        else:
            self.why.pop(name, None)

    def _probe_signals(self, step: int, rec: dict) -> None:
        th = self.th
        growth = []
        for k, v in rec.items():
            if _WQ_NORM.fullmatch(k) and _finite(v) and v > 0:
                hist = self._norm_hist.setdefault(k, deque())
                hist.append((step, math.log(v)))
                while len(hist) >= 2 and hist[1][0] <= step - th.growth_window:
                    hist.popleft()
                s0, l0 = hist[0]
                if step - s0 >= th.growth_window / 2:
                    growth.append((100.0 * (math.log(v) - l0) / (step - s0), k))
        if growth:
            v, k = max(growth, key=lambda t: t[0] if math.isfinite(t[0]) else math.inf)
            self._persisted("wq_growth", _level(v, th.wq_growth_watch, th.wq_growth_warn),
                            f"W_Q norm growth {v:.3g}/100 steps at {k.split('/')[-1]}")
        ratios = []
        for k, v in rec.items():
            if _WQ_NORM.fullmatch(k) and _finite(v) and v > 0:
                hist = self._ratio_hist.setdefault(k, deque())
                hist.append((step, v))
                while len(hist) >= 2 and hist[1][0] <= step - th.ratio_window:
                    hist.popleft()
                ratios.append((v / hist[0][1], hist[0][0], k))
        if ratios:
            r, since, k = max(ratios)
            self._persisted("wq_norm_ratio", _level(r, th.wq_norm_ratio_watch, th.wq_norm_ratio_warn),
                            f"W_Q norm x{r:.3g} since step {since} at {k.split('/')[-1]}")
        logits = [(v, k) for k, v in rec.items() if _MAX_LOGIT.fullmatch(k) and isinstance(v, (int, float))]
        if logits:
            v, k = max(logits, key=lambda t: t[0] if math.isfinite(t[0]) else math.inf)
            self._persisted("max_logit", _level(v, th.max_logit_watch, th.max_logit_warn),
                            f"max |logit| {v:.3g} in {k.split('/')[-1]}")
        cos = [(v, k) for k, v in rec.items() if _COS_PREV.fullmatch(k) and _finite(v)]
        if cos:
            v, k = max(cos)
            self._persisted("grad_err", WATCH if v >= th.grad_err_cos else OK,
                            f"W_Q gradient error repeats (cos {v:.2f} with the last probe) in {k.split('/')[-1]}")
        best = None
        for k, v in rec.items():
            m = _DELTA.fullmatch(k)
            if m and _finite(v):
                q = self._delta.setdefault(int(m.group(1)), deque(maxlen=th.delta_window))
                q.append(v)
                if len(q) == q.maxlen:
                    tot = sum(abs(x) for x in q)
                    c = abs(sum(q)) / tot if tot > 0 else 0.0
                    if best is None or c > best[0]:
                        best = (c, int(m.group(1)), sum(q) > 0)
        if best is not None:
            c, layer, pos = best
            self.levels["delta_bias"] = WATCH if c >= th.delta_consistency else OK
            if self.levels["delta_bias"]:
                self.why["delta_bias"] = (f"delta error {'positive' if pos else 'negative'} at "
                                          f"{c:.0%} consistency over {th.delta_window} probes in L{layer}")
            else:
                self.why.pop("delta_bias", None)

    def _grad_signal(self, step: int, rec: dict) -> None:
        th = self.th
        g = rec.get(keys.GRAD_NORM)
        if not isinstance(g, (int, float)) or isinstance(g, bool):
            return
        level, why = OK, None
        if not math.isfinite(g):
            level, why = WARNING, f"gradient norm {g}"
        elif len(self._grad_hist) >= min(10, th.grad_window):
            med = statistics.median(self._grad_hist)
            if med > 0:
                r = g / med
                level = _level(r, th.grad_spike_watch, th.grad_spike_warn)
                why = f"gradient norm {g:.3g} = {r:.3g}x its recent median"
        if math.isfinite(g):
            self._grad_hist.append(g)
        if level and (level >= self.levels["grad_spike"] or step > self._spike_until):
            self.levels["grad_spike"], self.why["grad_spike"] = level, why
            self._spike_until = step + th.spike_hold
        elif not level and step > self._spike_until:
            self.levels["grad_spike"] = OK
            self.why.pop("grad_spike", None)

    # ---- the state ----

    def _note_signals(self, record: dict) -> None:
        for k in record:
            if k == keys.GRAD_NORM:
                self.signals_seen.add("grad_spike")
            elif _WQ_NORM.fullmatch(k):
                self.signals_seen.update(("wq_growth", "wq_norm_ratio"))
            elif _MAX_LOGIT.fullmatch(k):
                self.signals_seen.add("max_logit")
            elif _DELTA.fullmatch(k):
                self.signals_seen.add("delta_bias")
            elif _COS_PREV.fullmatch(k):
                self.signals_seen.add("grad_err")

    def update(self, record: dict) -> MonitorStatus:
        step = int(record.get(keys.STEP, -1))
        self._note_signals(record)
        if step >= self.th.ignore_before:
            self._probe_signals(step, record)
            self._grad_signal(step, record)
        elif _finite(record.get(keys.GRAD_NORM)):
            self._grad_hist.append(record[keys.GRAD_NORM])
        growth = [self.levels[s] for s in GROWTH_SIGNALS]
        n_growth = sum(1 for x in growth if x >= WATCH)
        mechanism = any(self.levels[s] >= WATCH for s in MECHANISM_SIGNALS)
        if max(growth) >= WARNING or n_growth >= 2 or (n_growth and mechanism):
            state = WARNING
        elif max(self.levels.values()) >= WATCH:
            state = WATCH
        else:
            state = OK
        reasons = [self.why[s] for s in GROWTH_SIGNALS + MECHANISM_SIGNALS if self.levels[s] and s in self.why]
        changed = state != self.state
        self.state = state
        return MonitorStatus(step=step, state=state, reasons=reasons, changed=changed)
