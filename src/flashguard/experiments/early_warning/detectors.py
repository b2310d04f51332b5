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
"""
from __future__ import annotations

import math
import re
from collections import deque
from dataclasses import replace

from ... import keys
from ...diagnostics.monitor import WARNING, WATCH, Monitor, MonitorThresholds

__all__ = ["Detector", "ScoreDetector", "SpikeDetector", "MaxLogitDetector", "MonitorDetector",
           "monitor_thresholds", "default_detectors", "replay"]

_MAX_LOGIT = re.compile(keys.MAX_LOGIT.pattern())   # per-layer keys (fullmatch)


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


class MaxLogitDetector(ScoreDetector):
    name = "max-logit"
    grid = (10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 75.0, 100.0, 150.0, 200.0, 300.0, 500.0, 1000.0, 3000.0, 1e4, 1e5)

    def __init__(self, threshold: float = 100.0):
        super().__init__(threshold)
        self.about = "largest attention logit over the layers (attn/max_logit/L*), alarm above the threshold"

    def start(self, warmup: int = 0) -> None:
        pass

    def score(self, record: dict) -> float | None:
        vals = [v for k, v in record.items() if _MAX_LOGIT.fullmatch(k) and _number(v)]
        if not vals:
            return None
        return max(math.inf if not math.isfinite(v) else v for v in vals)


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
            MaxLogitDetector()]


def replay(detector: Detector, records, *, warmup: int = 0) -> list[tuple[int, bool]]:
    """(step, alarmed) after each record: the detector's whole alarm history over a run."""
    detector.start(warmup)
    return [(r.get(keys.STEP), detector.update(r)) for r in records]
