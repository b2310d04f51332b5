"""Live diagnostics of the failure mechanism and an early warning before the loss explodes.

* probes (``flashguard.diagnostics.probes``): functions that read a model and one batch's
  attention and return flat dicts of namespaced metrics (key list in that module's doc):
  W_Q / W_K spectral norms and growth, max |logit|, attention sink, tie rate and Pbar == 1 in
  the training policy, the fp64 shadow's O and delta errors, the W_Q gradient-error structure;
* ``LayerCapture`` / ``CaptureHooks`` / ``capture_batch``: how the probes get a layer's
  q, k, v, dO and qkv input (from a training step, or a forward/backward of their own);
* ``ProbeState``: what spans probes (previous norms, running sums, previous errors), JSON;
* the trainer hook ``DiagnosticsHook`` (``train.diagnostics_every``, ``train.diagnostics_layers``;
  ``flashguard.diagnostics.trainer``), passed to ``train(..., hooks=[DiagnosticsHook()])``, or with the
  [injection] section's hook by ``train(..., hooks=training_hooks())``, and
  ``flashguard diagnose`` (``.command``);
* the preconditions census (``.census``: the tied keys, their V signs and the row-level biases, written by
  the probes; ``.census_table``: the run against the study's GPT-2 with a verdict per precondition, which
  ``flashguard diagnose --census`` prints and the report shows);
* ``Monitor`` (``.monitor``): ok / watch / warning, online;
* ``evaluate_run`` / ``evaluate_runs`` (``.evaluation``; command line ``.evaluate``): the
  monitor replayed offline on finished runs, its lead time measured against the divergence
  rule of ``flashguard.train.divergence`` (``find_divergence``, re-exported here);
* ``read_metrics`` (``flashguard.utils.jsonl``, re-exported here): a run's metrics.jsonl;
* plots (``.plots``), imported on demand (matplotlib).
"""
from ..train.divergence import find_divergence
from ..utils.jsonl import read_metrics
from .capture import CaptureHooks, LayerCapture, capture_batch, resolve_layers
from .evaluation import RunEvaluation, evaluate_run, evaluate_runs
from .monitor import OK, STATE_NAMES, WARNING, WATCH, Monitor, MonitorStatus, MonitorThresholds
from .probes import (attention_metrics, error_structure, gradient_error_metrics, map_dq_to_wq, numerics_metrics,
                     probe_layer, run_probes, shadow, spectral_norms, weight_probe)
from .state import ProbeState
from .trainer import DEFAULT_EVERY, DiagnosticsHook, TrainerDiagnostics, training_hooks

__all__ = ["LayerCapture", "CaptureHooks", "capture_batch", "resolve_layers", "ProbeState",
           "weight_probe", "spectral_norms", "shadow", "attention_metrics", "numerics_metrics",
           "gradient_error_metrics", "error_structure", "map_dq_to_wq", "probe_layer", "run_probes",
           "Monitor", "MonitorThresholds", "MonitorStatus", "RunEvaluation", "evaluate_run", "evaluate_runs",
           "find_divergence", "read_metrics", "OK", "WATCH", "WARNING", "STATE_NAMES",
           "TrainerDiagnostics", "DiagnosticsHook", "training_hooks", "DEFAULT_EVERY"]
