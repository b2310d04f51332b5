"""The early-warning evaluation (issue 15): do the detectors warn before a real divergence, and
how often do they cry wolf on a stable run?

Runs: finished training runs, e.g. the injection grid's (``runs.load_runs``; divergent or stable by
the one rule, flashguard.train.divergence). Detectors (``detectors``): the package's monitor
replayed (warning, watch), loss and gradient-norm z-score spikes, a max-attention-logit
threshold, llm-foundry's KillLossSpike rule, the spectral entropy of the W_Q W_K^T update. Measures (``evaluate``): lead times and misses on divergent runs, false alarms on
stable ones. Calibration (``calibrate``): thresholds chosen on the odd seeds' stable runs at a
fixed false-alarm target, measured on the even seeds. Which signal leaves the stable range first
(``signals``). Command line: ``flashguard early-warning --runs DIR [DIR ...]
--out OUT`` (``runner.run_early_warning``).
"""
from .calibrate import FALSE_ALARM_TARGET, calibrate, choose_threshold, split_by_seed
from .detectors import (Detector, KillLossSpikeDetector, MaxLogitDetector, MonitorDetector, ScoreDetector,
                        SpectralEntropyDetector, SpikeDetector, default_detectors, monitor_thresholds, replay)
from .evaluate import Outcome, measure, outcome, sweep
from .runner import evaluate_detectors, run_early_warning
from .runs import Run, find_run_dirs, load_runs
from .signals import leading_signals, signal_series

__all__ = ["run_early_warning", "evaluate_detectors", "Run", "load_runs", "find_run_dirs", "Detector", "ScoreDetector",
           "SpikeDetector", "MaxLogitDetector", "MonitorDetector", "SpectralEntropyDetector", "KillLossSpikeDetector",
           "monitor_thresholds", "default_detectors", "replay",
           "Outcome", "outcome", "measure", "sweep", "FALSE_ALARM_TARGET", "split_by_seed", "choose_threshold",
           "calibrate", "leading_signals", "signal_series"]
