"""Live diagnostics of the failure mechanism and an early warning before the loss explodes.

* probes (``flashguard.diagnostics.probes``): functions that read a model and one batch's
  attention and return flat dicts of namespaced metrics (key list in that module's doc):
  W_Q / W_K spectral norms and growth, max |logit|, attention sink, tie rate and Pbar == 1 in
  the training policy, the fp64 shadow's O and delta errors, the W_Q gradient-error structure;
* ``LayerCapture`` / ``CaptureHooks`` / ``capture_batch``: how the probes get a layer's
  q, k, v, dO and qkv input (from a training step, or a forward/backward of their own);
* ``ProbeState``: what spans probes (previous norms, running sums, previous errors), JSON;
* the trainer hook (``train.diagnostics_every``, ``train.diagnostics_layers``;
  ``flashguard.diagnostics.trainer``) and ``flashguard diagnose`` (``.command``);
* ``Monitor`` / ``evaluate_run`` (``.monitor``): ok / watch / warning, online and offline;
* plots (``.plots``), imported on demand (matplotlib).
"""
from .capture import CaptureHooks, LayerCapture, capture_batch, resolve_layers
from .monitor import (OK, STATE_NAMES, WARNING, WATCH, Monitor, MonitorStatus, MonitorThresholds, RunEvaluation,
                      evaluate_run, evaluate_runs, find_divergence, read_metrics)
from .probes import (attention_metrics, error_structure, gradient_error_metrics, map_dq_to_wq, numerics_metrics,
                     probe_layer, run_probes, shadow, spectral_norms, weight_probe)
from .state import ProbeState
from .trainer import DEFAULT_EVERY, TrainerDiagnostics

__all__ = ["LayerCapture", "CaptureHooks", "capture_batch", "resolve_layers", "ProbeState",
           "weight_probe", "spectral_norms", "shadow", "attention_metrics", "numerics_metrics",
           "gradient_error_metrics", "error_structure", "map_dq_to_wq", "probe_layer", "run_probes",
           "Monitor", "MonitorThresholds", "MonitorStatus", "RunEvaluation", "evaluate_run", "evaluate_runs",
           "find_divergence", "read_metrics", "OK", "WATCH", "WARNING", "STATE_NAMES",
           "TrainerDiagnostics", "DEFAULT_EVERY"]
