"""The early-warning detectors, each replayed offline over a finished run's metrics records.

A detector reads the records one at a time, in step order, and says after each one whether it is
alarmed (``update(record) -> bool``): it is causal by construction, its answer at step s depends
on the records up to s only (tests/experiments/test_early_warning.py checks that cutting the
stream after s changes nothing up to s). Every detector has one ``threshold`` (larger: fewer
alarms) so that calibration can sweep it over ``grid``; ``first_alarms`` gives the first alarm
step for many thresholds in one pass where the detector allows it.

* ``MonitorDetector``: the package's online monitor (``flashguard.diagnostics.monitor.Monitor``)
  replayed as the trainer runs it (``MonitorThresholds.for_warmup`` of the run's warm-up); alarm
  = its ``warning`` state (``level="warning"``) or ``watch`` or worse (``level="watch"``). Its
  threshold is a scale k on the monitor's level thresholds, k = 1 being its defaults:
  ``wq_growth_*`` and ``max_logit_*`` are multiplied by k; the ratio thresholds
  ``wq_norm_ratio_*`` and ``grad_spike_*`` are raised to the power k (a ratio's scale is its
  logarithm: 4^k stays above 1 for any k > 0, 4 k does not). The mechanism thresholds
  (delta sign consistency, gradient-error cosine, both fractions in [0, 1]) and the windows stay.
  ``monitor_thresholds(k, warmup)`` is the MonitorThresholds a k stands for.
* ``SpikeDetector``: z-score of one every-step value (``loss/train`` or ``grad/norm``) against the
  mean and standard deviation of the previous ``window`` (128) finite values, alarm at z >=
  threshold (6), as OLMo-core's stability monitor scores loss and gradient-norm spikes. Scored
  only once the window is full (as there: no statistics from a handful of warm-up steps); a
  non-finite value scores +inf. One-sided: a falling loss is no alarm.
* ``MaxLogitDetector``: the largest attention logit over the layers (``attn/max_logit/L<l>``,
  the probes' per-layer maximum, as Megatron-LM logs the max attention logit), alarm above the
  threshold (default 100: the tau of MuonClip's QK-clip, a published "too large" logit). Scored at
  the probe steps only (the records that carry the probe).
* ``SpectralEntropyDetector``: score = 1 - the smallest normalised spectral entropy of the
  W_Q W_K^T update over the layers (``weights/update_entropy/L<l>``, the minimum over heads that
  ``train.update_entropy_every`` logs; definition in flashguard.diagnostics.update_entropy, after
  arXiv 2606.28116): larger = an update concentrated in fewer directions; alarm at score >=
  threshold, grid in (0, 1). Scored only on the records that carry the key. The default 0.5
  (entropy below one half) is ours, not the preprint's: calibration sets it.
* ``KillLossSpikeDetector``: llm-foundry's ``KillLossSpike`` callback's rule on ``loss/train``
  (its class docstring and code; defaults window 100, outlier_multiplier 2, patience 4, loss_cap
  10); threshold = the outlier multiplier. Details in its docstring.
"""
from __future__ import annotations

import math
import re
from collections import deque
from dataclasses import replace

from ... import keys
from ...diagnostics.monitor import WARNING, WATCH, Monitor, MonitorThresholds

__all__ = ["Detector", "ScoreDetector", "SpikeDetector", "MaxLogitDetector", "MonitorDetector",
           "SpectralEntropyDetector", "KillLossSpikeDetector", "monitor_thresholds", "default_detectors", "replay"]

_MAX_LOGIT = re.compile(keys.MAX_LOGIT.pattern())   # per-layer keys (fullmatch)
_UPDATE_ENTROPY = re.compile(keys.UPDATE_ENTROPY.pattern())


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class Detector:
    """Base: ``start(warmup)`` resets the state for a new run, ``update(record) -> bool`` is the
    alarm after that record. Subclasses set ``name``, ``threshold`` and ``grid``."""

    name: str = "detector"
    about: str = ""
    grid: tuple[float, ...] = ()

    def __init__(self, threshold: float):
        self.threshold = float(threshold)

    def with_threshold(self, threshold: float) -> "Detector":
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.threshold = float(threshold)
        clone.start()  # a fresh state: the clone must not share the original's history
        return clone

    def start(self, warmup: int = 0) -> None:
        raise NotImplementedError

    def update(self, record: dict) -> bool:
        raise NotImplementedError

    def first_alarm(self, records, *, warmup: int = 0, until: int | None = None) -> int | None:
        """The first step (<= ``until`` if given) whose record leaves this detector alarmed."""
        return self.first_alarms(records, [self.threshold], warmup=warmup, until=until)[self.threshold]

    def first_alarms(self, records, thresholds, *, warmup: int = 0, until: int | None = None) -> dict:
        """{threshold: first alarm step or None}; generic: one replay per threshold."""
        out = {}
        for t in thresholds:
            d = self.with_threshold(t)
            d.start(warmup)
            out[float(t)] = None
            for r in records:
                step = r.get(keys.STEP)
                if until is not None and step > until:
                    break
                if d.update(r):
                    out[float(t)] = step
                    break
        return out


class ScoreDetector(Detector):
    """A detector whose alarm is ``score >= threshold`` for a scalar score per record (None: the
    record says nothing); all thresholds are then answered from one pass over the scores."""

    def score(self, record: dict) -> float | None:
        raise NotImplementedError

    def update(self, record: dict) -> bool:
        s = self.score(record)
        return s is not None and s >= self.threshold

    def scores(self, records, *, warmup: int = 0, until: int | None = None) -> list[tuple[int, float]]:
        self.start(warmup)
        out = []
        for r in records:
            step = r.get(keys.STEP)
            if until is not None and step > until:
                break
            s = self.score(r)
            if s is not None:
                out.append((step, s))
        return out

    def first_alarms(self, records, thresholds, *, warmup: int = 0, until: int | None = None) -> dict:
        sc = self.scores(records, warmup=warmup, until=until)
        out = {}
        for t in thresholds:
            out[float(t)] = next((step for step, s in sc if s >= t), None)
        return out


class SpikeDetector(ScoreDetector):
    grid = (2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 15.0, 20.0, 30.0, 50.0, 100.0, 300.0, 1000.0)

    def __init__(self, key: str, threshold: float = 6.0, *, window: int = 128, name: str | None = None):
        super().__init__(threshold)
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        self.key, self.window = key, int(window)
        self.name = name or f"{key} spike"
        self.about = (f"z of {key} against the mean and sd of its previous {window} values, alarm at z >= "
                      "threshold (OLMo-core's stability monitor: 6 sigma)")
        self.start()

    def start(self, warmup: int = 0) -> None:
        self._hist: deque = deque(maxlen=self.window)

    def score(self, record: dict) -> float | None:
        x = record.get(self.key)
        if not _number(x):
            return None
        if not math.isfinite(x):
            return math.inf
        z = None
        if len(self._hist) == self.window:
            n = len(self._hist)
            mean = sum(self._hist) / n
            sd = math.sqrt(sum((v - mean) ** 2 for v in self._hist) / n)
            # a constant history: any rise is infinitely many sd, no rise is none
            z = (x - mean) / sd if sd > 0 else (math.inf if x > mean else 0.0)
        self._hist.append(float(x))
        return z


class _PerLayerDetector(ScoreDetector):
    """A stateless score of one per-layer key: ``layer_score`` of the numbers a record holds at
    the keys ``pattern`` matches (no score on a record without any)."""

    pattern: re.Pattern

    def start(self, warmup: int = 0) -> None:
        pass

    def layer_score(self, vals: list[float]) -> float:
        raise NotImplementedError

    def score(self, record: dict) -> float | None:
        vals = [v for k, v in record.items() if self.pattern.fullmatch(k) and _number(v)]
        return self.layer_score(vals) if vals else None


class MaxLogitDetector(_PerLayerDetector):
    name = "max-logit"
    pattern = _MAX_LOGIT
    grid = (10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 75.0, 100.0, 150.0, 200.0, 300.0, 500.0, 1000.0, 3000.0, 1e4, 1e5)

    def __init__(self, threshold: float = 100.0):
        super().__init__(threshold)
        self.about = "largest attention logit over the layers (attn/max_logit/L*), alarm above the threshold"

    def layer_score(self, vals: list[float]) -> float:
        return max(math.inf if not math.isfinite(v) else v for v in vals)


class SpectralEntropyDetector(_PerLayerDetector):
    """score = 1 - min over layers of ``weights/update_entropy/L<l>`` (H in [0, 1], the normalised
    spectral entropy of the W_Q W_K^T update, flashguard.diagnostics.update_entropy); alarm at
    score >= threshold, i.e. some layer's update entropy <= 1 - threshold. None (no score) on a
    record without the key; a non-finite value scores +inf."""

    name = "update-entropy"
    pattern = _UPDATE_ENTROPY
    grid = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)

    def __init__(self, threshold: float = 0.5):
        super().__init__(threshold)
        self.about = ("1 - the smallest normalised spectral entropy of the W_Q W_K^T update over the layers "
                      "(weights/update_entropy/L*, train.update_entropy_every; after arXiv 2606.28116), alarm at "
                      "score >= threshold; scored where the key is logged")

    def layer_score(self, vals: list[float]) -> float:
        if not all(math.isfinite(v) for v in vals):
            return math.inf
        return 1.0 - min(vals)


class KillLossSpikeDetector(Detector):
    """llm-foundry's ``KillLossSpike`` rule (llmfoundry/callbacks/kill_loss_spike_callback.py, its
    documented definition and defaults), replayed on ``loss/train``:

    * a rolling window of the last ``window`` (100) training losses; nothing is tested until it is
      full (as there: "only start ... once a full window of loss data");
    * once it is full, a loss >= ``outlier_multiplier`` (2; this detector's threshold) x the window's
      mean is an outlier (>= as in the source's code; its docstring says "greater than"); a
      non-outlier resets the count; more than ``patience`` (4) consecutive outliers is a loss spike:
      alarm (so the 5th outlier in a row alarms);
    * persistently high loss: in both of the source's versions the test is that at least half of the
      window's losses exceed ``loss_cap`` (10), from the step 2 x window on (a count of the losses
      seen, this one included), not the window's mean: that is what is implemented here. Tested, as
      there, only when the loss is not a spike (the alarm is the same either way).

    Where the versions differ: every loss enters the window after it is tested, outliers included
    (both versions do this); the window and the cap are fixed (the first version; a later one
    widens the window to 5 % of the run's steps and sets the cap to the first window's largest
    loss, at most 10, unless they are given, which needs the run's length in advance). Choices of
    ours: a non-finite loss is an outlier and stays out of the window (in the source a NaN is never
    an outlier and poisons the mean); a record without ``loss/train`` changes nothing. The window
    counts records, i.e. steps when the loss is logged every step (``train.log_every = 1``).
    Warm-up is not used (the source has none). Larger thresholds alarm no earlier."""

    name = "kill-loss-spike"
    grid = (1.1, 1.2, 1.3, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0)

    def __init__(self, threshold: float = 2.0, *, window: int = 100, patience: int = 4, loss_cap: float = 10.0):
        super().__init__(threshold)
        if window < 1 or patience < 0:
            raise ValueError(f"window must be >= 1 and patience >= 0, got {window}, {patience}")
        self.window, self.patience, self.loss_cap = int(window), int(patience), float(loss_cap)
        self.about = (f"llm-foundry's KillLossSpike rule on loss/train: once a window of {window} losses is full, "
                      f"more than {patience} consecutive losses >= threshold x the window's mean (threshold = "
                      f"outlier_multiplier, default 2), or from step {2 * window} on at least half the window above "
                      f"{loss_cap:g}")
        self.start()

    def start(self, warmup: int = 0) -> None:
        self._hist: deque = deque(maxlen=self.window)
        self._seen = 0       # losses seen (records with the key)
        self._outliers = 0

    def update(self, record: dict) -> bool:
        x = record.get(keys.LOSS_TRAIN)
        if not _number(x):
            return False
        self._seen += 1
        alarm = False
        if len(self._hist) == self.window:
            mean = sum(self._hist) / len(self._hist)
            if not math.isfinite(x) or x >= self.threshold * mean:
                self._outliers += 1
                alarm = self._outliers > self.patience
            else:
                self._outliers = 0
            if not alarm and self._seen >= 2 * self.window:
                alarm = sum(v > self.loss_cap for v in self._hist) >= self.window / 2
        if math.isfinite(x):
            self._hist.append(float(x))
        return alarm


def monitor_thresholds(scale: float, warmup: int = 0) -> MonitorThresholds:
    """The monitor's thresholds at scale k (k = 1: ``MonitorThresholds.for_warmup(warmup)``, the
    defaults): growth rate and logit thresholds x k, ratio thresholds ^ k."""
    k = float(scale)
    if not k > 0:
        raise ValueError(f"monitor scale must be > 0, got {scale}")
    d = MonitorThresholds.for_warmup(warmup)
    return replace(d, wq_growth_watch=d.wq_growth_watch * k, wq_growth_warn=d.wq_growth_warn * k,
                   wq_norm_ratio_watch=d.wq_norm_ratio_watch ** k, wq_norm_ratio_warn=d.wq_norm_ratio_warn ** k,
                   max_logit_watch=d.max_logit_watch * k, max_logit_warn=d.max_logit_warn * k,
                   grad_spike_watch=d.grad_spike_watch ** k, grad_spike_warn=d.grad_spike_warn ** k)


class MonitorDetector(Detector):
    grid = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0)

    def __init__(self, level: str = "warning", threshold: float = 1.0, *, shared: dict | None = None):
        """``shared``: a dict given to both levels' detectors, so that one replay of the monitor per
        run and scale serves the watch and the warning detector alike (a replay is the costly part)."""
        super().__init__(threshold)
        if level not in ("warning", "watch"):
            raise ValueError(f"monitor level must be 'warning' or 'watch', got {level!r}")
        self.level = level
        self._min_state = WARNING if level == "warning" else WATCH
        self._shared = {} if shared is None else shared
        self.name = f"monitor-{level}"
        self.about = (f"flashguard's monitor (diagnostics/monitor.py) replayed, alarm = its {level} state"
                      + (" or worse" if level == "watch" else "") + "; threshold = scale k of its level thresholds "
                      "(1 = defaults)")
        self.start()

    def start(self, warmup: int = 0) -> None:
        self._monitor = Monitor(monitor_thresholds(self.threshold, warmup))

    def update(self, record: dict) -> bool:
        return self._monitor.update(record).state >= self._min_state

    def _first_states(self, records, scale: float, warmup: int, until: int | None) -> tuple:
        """(first watch-or-worse step, first warning step) of one replay at ``scale``, stopping at
        the first warning (the later of the two)."""
        key = (id(records), float(scale), int(warmup), until)
        hit = self._shared.get(key)
        if hit is not None and hit[0] is records:   # the records themselves are kept, so the id stays theirs
            return hit[1]
        mon = Monitor(monitor_thresholds(scale, warmup))
        first = [None, None]
        for r in records:
            step = r.get(keys.STEP)
            if until is not None and step > until:
                break
            state = mon.update(r).state
            if state >= WATCH and first[0] is None:
                first[0] = step
            if state >= WARNING:
                first[1] = step
                break
        self._shared[key] = (records, tuple(first))
        return tuple(first)

    def first_alarms(self, records, thresholds, *, warmup: int = 0, until: int | None = None) -> dict:
        i = 1 if self.level == "warning" else 0
        return {float(t): self._first_states(records, t, warmup, until)[i] for t in thresholds}


def default_detectors() -> list[Detector]:
    """The detectors of the evaluation, at their default thresholds."""
    shared: dict = {}
    return [MonitorDetector("warning", shared=shared), MonitorDetector("watch", shared=shared),
            SpikeDetector(keys.LOSS_TRAIN, name="loss-spike"), SpikeDetector(keys.GRAD_NORM, name="grad-spike"),
            MaxLogitDetector(), KillLossSpikeDetector(), SpectralEntropyDetector()]


def replay(detector: Detector, records, *, warmup: int = 0) -> list[tuple[int, bool]]:
    """(step, alarmed) after each record: the detector's whole alarm history over a run."""
    detector.start(warmup)
    return [(r.get(keys.STEP), detector.update(r)) for r in records]
