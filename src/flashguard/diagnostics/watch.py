"""``flashguard.watch``: the trainer's probes of the mechanism, on any model that calls SDPA.

    import flashguard
    with flashguard.watch(model, every=50, log_dir="runs/mine/flashguard") as w:
        for x, y in loader:
            loss = model(x, labels=y).loss
            loss.backward()
            opt.step()
            w.step(loss=loss, model=model)   # once per optimizer step, before zero_grad (its grad norm)
            opt.zero_grad()

Every step (cheap): the loss (``step(loss=...)``) and the gradient norm (``step(model=...)``
reads the model's ``.grad`` now, so call it before ``zero_grad``; ``grad_norm=`` takes a value
you have, e.g. what ``clip_grad_norm_`` returned: the norm before clipping) go into one record
``{"step", "loss/train", "grad/norm", "monitor/state"}`` with the early-warning monitor's state
(``flashguard.diagnostics.monitor``). With ``optimizer=opt`` the watch steps on the optimizer's
``step()`` and reads the gradient norm of its parameters just before it (after any clipping:
pass the pre-clip value with ``w.log(grad_norm=...)`` if you clip); ``w.log(loss=...)`` gives
the loss then. A step record costs a norm over the gradients (torch's ``get_total_norm``, as
``clip_grad_norm_`` computes it) and reading two numbers (a device sync each, as ``loss.item()``).

Every ``every`` steps (steps 0, N, 2N, ... counted by ``step()`` from ``start``) the watch
captures, during that step's first forward and its backward, the q, k, v and dO of the chosen
layers' ``torch.nn.functional.scaled_dot_product_attention`` calls (the one SDPA capture,
``flashguard.diagnostics.sdpa_capture``), and at the end of the step runs the trainer's probes
on them (``flashguard.diagnostics.probes.probe_layer``: attention_metrics and numerics_metrics,
measured by ``attention.trace`` against fp64, with ``attention.error_stats``' (sequence, head)
unit): the max logit and the attention sink, the tie rate and Pbar == 1, the O and delta
errors with their z; and the weight probes (``probes.weight_probe``: per-head W_Q / W_K spectral
norms and their growth) where the projections are found (``flashguard.diagnostics.projections``:
flashguard's GPT, Hugging Face architectures' ``q_proj`` / ``k_proj`` and GPT-2's packed ``c_attn``
automatically; others by ``projections=`` names; ``projections=False``: none). The probe step's
record is the step record with the probe keys (``flashguard.keys``) and ``time/diagnostics_s``.
A one-line summary goes to the console (``console=False``: not): the loss, the largest max
logit, tie rate and delta lean z over the layers, and the monitor's state with its reasons
(docs/watch.md reads it); a change of the monitor's state between probes gets its own line.

Records go through the trainer's loggers (``flashguard.train.loggers``): ``log_dir/metrics.jsonl``
(appended), ``log_dir/tensorboard`` when tensorboard is installed, W&B with ``wandb=True`` (or a
dict of ``wandb.init`` arguments; the optional extra ``pip install flashguard[wandb]``), console
lines; ``w.records`` keeps the probe steps' records, ``w.status`` the monitor's last status.
``log_dir/watch.json`` says what the folder is (``kind: "flashguard.watch"``: a watch folder of
the user's model, which ``flashguard diagnose`` / ``--monitor`` / ``--census`` and ``flashguard
report`` read as such), the layer map, the projections and the arithmetic each layer was
measured in. The W_Q gradient error needs the model's training batch and is not written.

Layer identity (the ``L<i>`` of the keys):

* ``layers=None`` or integers: the order of the SDPA calls within one forward of ``model``
  (``model(...)``; the first call is L0) - for a decoder stack, the block index. Only calls made
  inside the model's first forward of the step count, so the backward's recomputation under
  gradient checkpointing and later forwards (gradient accumulation: later micro-batches; an
  evaluation) are not taken.
* module names (``layers=["transformer.h.0.attn", ...]``, names as ``model.named_modules()``
  gives them): the first SDPA call made inside each named module; L<i> is the name's position
  in the list, or give ``{i: name}``. ``log_dir/watch.json`` records the map.

What the probes measure: the captured inputs run once more in a flash arithmetic whose every
rounding is known, next to fp64. By default that arithmetic is **the kernel torch ran**: each
probed call's backend is asked of torch's own selection (``flashguard.check.dispatch``,
``torch._fused_sdp_choice``, with the call's arguments as the kernel received them), and the
kernel's precision preset is measured: on CPU in bf16 torch's flash kernel, ``torch-cpu``
(flashguard's bit-exact model of it, docs/audit/torch-cpu.md); on a GPU in bf16 the preset of
the backend (``torch-flash-cuda``, ``mem-efficient``, ``cudnn``: models from the kernels'
source, docs/kernels.md); else (the math backend, another dtype, a replaced SDPA) the production
arithmetic of the dtype (``fa2`` for bf16, ``fa2-fp16``, ``fp32``, ``fp64``), labelled as a
model in watch.json. ``precision`` chooses it instead (a policy name, e.g. ``"paper"`` for the
study's reference code; or ``options``, a FlashOptions, with its stabilizer: the PyTorch kernel
at its default tiles measures it). ``subsample`` is the number of sequences (batch entries)
measured per layer (each with all its rows: the rows of a sequence share its keys and values,
and one value per (sequence, head) is the unit of the z statistics); None measures all.

Masks: ``is_causal`` and masks equal to the causal pattern (boolean, or additive 0 / <= -1e4)
are measured; a call with another mask (padding, a position bias) is skipped and said once.
Attention dropout is not replayed (the probes measure the attention of the same inputs
without it).

Cost: on the steps it does not probe the watch installs nothing (``F.scaled_dot_product_attention``
is torch's own, no module hook is registered); ``step()`` counts and writes the step record. On
a probe step: the capture (detached views, and dO kept until the end of the step) and the
probes' compute, logged as ``time/diagnostics_s`` (benchmarks/watch.py measures both). Failing
probes never stop training: they write ``diagnostics/failed = 1`` and one console line.

Distributed: only rank 0 watches (``enabled`` overrides).
"""
from __future__ import annotations

import math
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn as nn

from .. import keys
from ..check.dispatch import is_torch_sdpa, kernel_label, torch_choice
from .capture import LayerCapture
from .monitor import STATE_NAMES, WARNING, Monitor, MonitorStatus, MonitorThresholds
from .probes import probe_layer, weight_probe
from .sdpa_capture import SdpaCapture
from .state import ProbeState

__all__ = ["Watch", "watch", "DEFAULT_EVERY", "DEFAULT_SUBSAMPLE", "WATCH_KIND", "default_precision",
           "kernel_precision", "grad_norm", "summary_line"]

WATCH_KIND = "flashguard.watch"   # watch.json's "kind": what flashguard's commands recognise a watch folder by

DEFAULT_EVERY = 50        # as the trainer's diagnostics (flashguard.diagnostics.trainer.DEFAULT_EVERY)
DEFAULT_SUBSAMPLE = 8     # sequences per layer: 8 x heads units for the z statistics, a bounded cost
_MASKED = -1e4            # an additive mask entry at or below this hides its key (HF uses finfo.min)

# the production arithmetic of each input dtype: what SDPA's fused kernels compute
_BY_DTYPE = {torch.bfloat16: "fa2", torch.float16: "fa2-fp16", torch.float32: "fp32", torch.float64: "fp64"}


def default_precision(dtype: torch.dtype) -> str:
    """The policy the probes measure a call of inputs ``dtype`` in when no precision is given."""
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise ValueError(f"flashguard.watch: no default precision for {dtype}; pass precision=") from None


# the kernel torch dispatched to -> flashguard's preset of it (bf16 inputs; numerics.policy, docs/kernels.md)
_KERNEL_PRESETS = {("cpu", "flash"): "torch-cpu", ("cuda", "flash"): "torch-flash-cuda",
                   ("cuda", "efficient"): "mem-efficient", ("cuda", "cudnn"): "cudnn"}


def kernel_precision(backend: str, device: str, dtype: torch.dtype, torch_sdpa: bool = True) -> tuple[str, str]:
    """(policy name, what it is) that models the SDPA kernel ``backend`` (``dispatch.BACKEND_NAMES``)
    on ``device`` for inputs of ``dtype``: the kernel's preset where flashguard has one (bf16),
    else the production arithmetic of the dtype (``default_precision``), said to be a model."""
    from ..numerics.policy import GPU_PRESETS
    name = _KERNEL_PRESETS.get((device, backend)) if torch_sdpa and dtype == torch.bfloat16 else None
    if name == "torch-cpu":
        return name, "flashguard's bit-exact model of torch's CPU flash kernel (docs/audit/torch-cpu.md)"
    if name is not None:
        assert name in GPU_PRESETS, name
        return name, f"a model of torch's {backend} kernel from its source (docs/kernels.md; unvalidated on a GPU)"
    fallback = default_precision(dtype)
    what = "a replaced F.scaled_dot_product_attention" if not torch_sdpa else f"torch's {backend} kernel on {device}"
    return fallback, (f"no preset of {what} in {str(dtype).removeprefix('torch.')}: the production arithmetic "
                      f"{fallback}, as a model")


def grad_norm(params) -> float | None:
    """The 2-norm of the gradients of ``params`` (tensors or an nn.Module) as they are now, as
    ``clip_grad_norm_`` computes it; None when none has a gradient."""
    if isinstance(params, nn.Module):
        params = params.parameters()
    grads = [p.grad for p in params if isinstance(p, torch.Tensor) and p.grad is not None]
    if not grads:
        return None
    total = getattr(torch.nn.utils, "get_total_norm", None)
    if total is not None:
        return float(total(grads))
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach().float()).cpu()
                                                       for g in grads])))


_total_grad_norm = grad_norm


def _as_float(x) -> float:
    return float(x.detach().float()) if isinstance(x, torch.Tensor) else float(x)


def _per_layer(record: dict, metric) -> list[tuple[float, int]]:
    import re
    pat = re.compile(metric.pattern())
    out = []
    for k, v in record.items():
        m = pat.fullmatch(k)
        if m and isinstance(v, float) and math.isfinite(v):
            out.append((v, int(m.group(1))))
    return out


def summary_line(record: dict, status: MonitorStatus | None = None) -> str:
    """The console's one line for a probe step's record (docs/watch.md reads it)."""
    parts = [f"step {record.get(keys.STEP)}"]
    if keys.LOSS_TRAIN in record:
        parts[0] += f": loss {record[keys.LOSS_TRAIN]:.4g}"
    if keys.GRAD_NORM in record:
        parts[0] += f", grad norm {record[keys.GRAD_NORM]:.3g}"
    logits = _per_layer(record, keys.MAX_LOGIT)
    if logits:
        v, layer = max(logits)
        parts.append(f"max|logit| {v:.3g} (L{layer})")
    ties = _per_layer(record, keys.TIE_RATE)
    if ties:
        v, layer = max(ties)
        parts.append(f"ties {100 * v:.2g}% (L{layer})")
    zs = _per_layer(record, keys.DELTA_ERR_Z)
    if zs:
        v, layer = max(zs, key=lambda t: abs(t[0]))
        parts.append(f"delta lean z {v:+.1f} (L{layer}{', a lean' if abs(v) >= 3.29 else ''})")
    wq = _per_layer(record, keys.WQ_NORM_MAX)
    if wq:
        v, layer = max(wq)
        parts.append(f"W_Q norm {v:.3g} (L{layer})")
    if record.get(keys.DIAGNOSTICS_FAILED):
        parts.append("probes failed")
    if status is not None:
        text = f"monitor {status.name}" if status.state == 0 else f"monitor {status.name.upper()}"
        if status.reasons:
            text += ": " + "; ".join(status.reasons)
        parts.append(text)
    return " | ".join(parts)


class _DispatchCapture(SdpaCapture):
    """``SdpaCapture`` that also asks torch, just before each call, which kernel it dispatches the
    call to (``check.dispatch.torch_choice``, with the arguments as the kernel receives them, as
    ``flashguard check`` does): ``dispatch[label]`` = {backend, dtype, device, torch, fn}."""

    def __init__(self, *, select, sequences):
        from ..check.capture import _as_received
        self._received = _as_received
        self._select_inner = select
        self._last = None
        self.dispatch: dict = {}
        super().__init__(select=self._select_noting, sequences=sequences)

    def _select_noting(self):
        label = self._select_inner()
        if label is not None:
            self.dispatch[label] = self._last
        return label

    def _wrap(self, original):
        ours = is_torch_sdpa(_unwrap_captures(original))

        def dispatching(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                        enable_gqa=False, **kw):
            if query.dim() == 4:
                q, k, v, m = self._received(query, key, value, attn_mask)
                self._last = {"backend": torch_choice(q, k, v, m, dropout_p, is_causal, scale, enable_gqa),
                              "dtype": q.dtype, "device": q.device.type, "torch": ours, "fn": original}
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa, **kw)
        dispatching.__wrapped__ = original
        return super()._wrap(dispatching)


def _unwrap_captures(fn):
    """``fn`` without the SDPA captures' own wrappers (which call what they wrap unchanged): a capture
    installed before this one (another watch, a check) does not hide torch's SDPA under it."""
    while callable(fn) and hasattr(fn, "__wrapped__") and "Capture._wrap.<locals>" in getattr(fn, "__qualname__", ""):
        fn = fn.__wrapped__
    return fn


def _stderr(text: str) -> None:
    print(f"flashguard.watch: {text}", file=sys.stderr)


def _resolve_layers(model: nn.Module, layers):
    """(indices or None for every call, {index: module} or None for call order, {index: name})."""
    if layers is None:
        return None, None, {}
    if isinstance(layers, (int, str)):
        layers = [layers]
    if isinstance(layers, dict):
        names = {}
        for i, n in layers.items():
            if isinstance(i, bool) or not isinstance(i, int) or i < 0 or not isinstance(n, str):
                raise ValueError(f"flashguard.watch: layers as a dict maps layer indices >= 0 to module names, "
                                 f"got {i!r}: {n!r}")
            names[i] = n
    else:
        items = list(layers)
        if not items:
            return None, None, {}
        if all(isinstance(i, int) and not isinstance(i, bool) for i in items):
            if any(i < 0 for i in items):
                raise ValueError(f"flashguard.watch: layer indices count SDPA calls from 0, got {items}")
            return sorted(set(items)), None, {}
        if not all(isinstance(i, str) for i in items):
            raise ValueError(f"flashguard.watch: layers are SDPA call indices (ints) or module names (strs), "
                             f"not a mix: {items}")
        if len(set(items)) != len(items):
            raise ValueError(f"flashguard.watch: a module is named twice in layers={items}")
        names = dict(enumerate(items))
    modules = dict(model.named_modules())
    unknown = [n for n in names.values() if n not in modules]
    if unknown:
        some = [n for n in modules if n][:8]
        raise ValueError(f"flashguard.watch: no module named {unknown[0]!r} in the model (names as "
                         f"model.named_modules() gives them, e.g. {some})")
    return sorted(names), {i: modules[n] for i, n in names.items()}, names


def _mask_as_causal(mask: torch.Tensor | None, is_causal: bool, t_q: int, t_k: int) -> bool | None:
    """The call's mask as the probes can measure it: True (causal, top-left), False (none), or
    None for a mask they cannot (padding, a position bias)."""
    if mask is None:
        return bool(is_causal)
    if is_causal:
        return None
    if mask.dtype == torch.bool:
        visible = mask
    else:
        visible = mask == 0
        # any other entry must hide its key; a finite bias changes the scores, which the probes do not model
        if not bool(torch.where(visible, True, mask <= _MASKED).all()):
            return None
    tril = torch.ones(t_q, t_k, dtype=torch.bool, device=mask.device).tril()
    if bool((visible == tril).all()):
        return True
    if bool(visible.all()):
        return False
    return None


def _measured_options(options, precision, stabilizer):
    """(the FlashOptions the probes measure in, whether its precision is chosen by each call's input
    dtype): ``options`` with ``precision`` / ``stabilizer`` changed where given. The probes run the
    PyTorch kernel at its default tiles on the call's own inputs (SDPA has no soft-cap), so options
    that set tiles, a kernel or a soft-cap are refused rather than silently not used."""
    from ..attention.options import OptionError, flash_options
    fields = {name: value for name, value in (("precision", precision), ("stabilizer", stabilizer))
              if value is not None}
    try:
        opts = flash_options(options, fields, where="flashguard.watch")
    except OptionError as e:
        raise ValueError(f"flashguard.watch: {e}") from None
    unused = [f"{name}={getattr(opts, name)!r}" for name in ("block_q", "block_k", "softcap")
              if getattr(opts, name) is not None] + ([f"kernel={opts.kernel!r}"] if opts.kernel == "triton" else [])
    if unused:
        raise ValueError(f"flashguard.watch measures on the PyTorch kernel at its default tiles, without a soft-cap: "
                         f"{', '.join(unused)} would not be used")
    return opts, options is None and precision is None


class Watch:
    """See the module docstring. Built by ``flashguard.watch(...)``; a context manager (leaving
    it closes the watch) or ``close()`` by hand.

    Stepping: ``step(loss=None, model=None, grad_norm=None)`` once per optimizer step, after it
    (ends the current step, begins the next), or ``optimizer=``, whose every ``step()`` then calls
    it; integrations that know the step number call ``begin_step(step)`` / ``end_step()`` instead.
    ``log(loss=..., grad_norm=...)`` gives the current step's values ahead of its end."""

    def __init__(self, model: nn.Module, *, layers=None, every: int = DEFAULT_EVERY, log_dir=None,
                 precision=None, stabilizer=None, options=None, subsample: int | None = DEFAULT_SUBSAMPLE,
                 start: int = 0, optimizer=None, grad_scale: float = 1.0, tensorboard: bool | None = None,
                 loggers=(), log_fn=None, enabled: bool | None = None, arm: bool = True, projections=None,
                 n_head: int | None = None, warmup_steps: int = 0, thresholds: MonitorThresholds | None = None,
                 console: bool = True, wandb=None):
        from ..train.loggers import Console, Loggers

        self.options, self.by_dtype = self._check_options(every=every, subsample=subsample, precision=precision,
                                                          stabilizer=stabilizer, options=options)
        self._by_dtype: dict = {}
        self.model = model
        self.every, self.subsample = every, subsample
        self.grad_scale = float(grad_scale)
        self.layers, self._modules, self.layer_names = _resolve_layers(model, layers)
        self._weights, self.projections = self._find_weights(model, projections, n_head)
        if enabled is None:
            dist = torch.distributed
            enabled = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        self.enabled = bool(enabled)
        self.step_index = int(start)
        self.state = ProbeState()
        self.warmup_steps = int(warmup_steps)
        self.monitor = Monitor(thresholds or MonitorThresholds.for_warmup(self.warmup_steps))
        self.status: MonitorStatus | None = None
        self.console = bool(console)
        self.records: list[dict] = []
        self.measured: dict[int, dict] = {}   # layer -> the kernel that ran and the arithmetic measured
        self.log_dir = None if log_dir is None else Path(log_dir)
        self._capture: _DispatchCapture | None = None
        self._armed_step: int | None = None
        self._open = False
        self._pending: dict = {}
        self._handles: list = []
        self._said: set[str] = set()
        self._opt_handles: list = []
        self._meta: dict = {}
        parts = []
        if self.enabled and self.log_dir is not None:
            parts = self._file_loggers(tensorboard)
        if self.enabled and wandb:
            from ..train.loggers import WandbMetrics
            try:
                parts.append(WandbMetrics(**(wandb if isinstance(wandb, dict) else {})))
            except BaseException:
                for lg in parts:
                    lg.close()
                raise
        self._log = Loggers([*parts, Console(log_fn or _stderr), *loggers])
        if self.enabled and optimizer is not None:
            self._opt_handles = [optimizer.register_step_pre_hook(self._before_optimizer_step),
                                 optimizer.register_step_post_hook(lambda *_: self.step())]
        if arm:
            self.begin_step(self.step_index)

    @staticmethod
    def _check_options(*, every, subsample, precision=None, stabilizer=None, options=None):
        """ValueError for a bad option: at construction, not at the first probe step. Returns
        ``_measured_options``' (FlashOptions, by the kernel that ran)."""
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"flashguard.watch: every must be an integer >= 1, got {every!r}")
        if subsample is not None and (isinstance(subsample, bool) or not isinstance(subsample, int) or subsample < 1):
            raise ValueError(f"flashguard.watch: subsample (sequences per layer) must be an integer >= 1 or None, "
                             f"got {subsample!r}")
        return _measured_options(options, precision, stabilizer)

    def _find_weights(self, model, projections, n_head):
        """(what weight_probe reads, {L<i>: where}) for the W_Q / W_K probes, or (None, {})."""
        from .projections import find_projections
        self._weights_auto = False
        if projections is False:
            return None, {}
        if projections is None and hasattr(model, "wq_heads") and hasattr(model, "wk_heads") \
                and hasattr(getattr(model, "config", None), "n_layer") and self._modules is None:
            return model, {"all": "the model's own wq_heads / wk_heads"}
        found = find_projections(model, projections, n_head=n_head,
                                 modules=self.layer_names if projections is None and self.layer_names else None)
        if found is None:
            if projections is not None:
                raise ValueError("flashguard.watch: projections: nothing found")
            return None, {}
        self._weights_auto = projections is None and not self.layer_names
        return found, {f"L{i}": w for i, w in found.where.items()}

    def options_for(self, dtype: torch.dtype):
        """The FlashOptions a captured call of inputs ``dtype`` is measured in when torch's dispatch
        is not known (the production arithmetic of the dtype)."""
        if not self.by_dtype:
            return self.options
        if dtype not in self._by_dtype:
            self._by_dtype[dtype] = self.options.replace(precision=default_precision(dtype))
        return self._by_dtype[dtype]

    def _options_for_call(self, layer: int, cap: LayerCapture, dispatch: dict | None):
        """The FlashOptions the call is measured in: the user's, or the kernel torch ran (recorded
        in ``measured``)."""
        if not self.by_dtype:
            self.measured[layer] = {"precision": self.options.precision.short_str(), "about": "chosen by the user"}
            return self.options
        if dispatch is None:
            opts = self.options_for(cap.q.dtype)
            self.measured[layer] = {"precision": opts.precision.short_str(),
                                    "about": "torch's dispatch unknown: the production arithmetic of the dtype"}
            return opts
        name, about = kernel_precision(dispatch["backend"], dispatch["device"], dispatch["dtype"], dispatch["torch"])
        key = ("kernel", name)
        if key not in self._by_dtype:
            self._by_dtype[key] = self.options.replace(precision=name)
        self.measured[layer] = {"kernel": kernel_label(_unwrap_captures(dispatch["fn"]), dispatch["backend"],
                                                       dispatch["device"]),
                                "dtype": str(dispatch["dtype"]).removeprefix("torch."), "precision": name,
                                "about": about}
        return self._by_dtype[key]

    def _file_loggers(self, tensorboard):
        from ..train.config import ConfigError
        from ..train.loggers import JsonlMetrics, TensorBoardMetrics
        self.log_dir.mkdir(parents=True, exist_ok=True)
        layer_map = ({f"L{i}": n for i, n in sorted(self.layer_names.items())} if self.layer_names
                     else "SDPA call order within one forward (L0 = first call)")
        self._meta = {
            "kind": WATCH_KIND,
            "about": "a watch folder of your own model's training (flashguard.watch), not a flashguard training run",
            "model": type(self.model).__name__, "every": self.every, "start": self.step_index,
            "warmup_steps": self.warmup_steps,
            "precision": "the kernel torch ran" if self.by_dtype else self.options.precision.short_str(),
            "stabilizer": str(self.options.stabilizer), "subsample_sequences": self.subsample,
            "layers": layer_map if self.layers is None or self.layer_names
            else {"indices": self.layers, "identity": layer_map},
            "projections": self.projections or "none found (no W_Q / W_K norms)",
            "measured": {}}
        self._write_meta()
        out = [JsonlMetrics(self.log_dir / "metrics.jsonl")]
        if tensorboard is not False:
            try:
                out.append(TensorBoardMetrics(self.log_dir / "tensorboard"))
            except ConfigError:
                if tensorboard:
                    for lg in out:
                        lg.close()
                    raise
        return out

    def _write_meta(self) -> None:
        from ..utils.atomic import atomic_write_json
        if self.enabled and self.log_dir is not None and self._meta:
            atomic_write_json(self.log_dir / "watch.json", self._meta)

    # ---- stepping -------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return self.enabled and step % self.every == 0

    @property
    def armed(self) -> bool:
        """True while the capture is installed (a probe step in progress)."""
        return self._capture is not None

    def log(self, loss=None, grad_norm=None) -> None:
        """The current step's loss and / or gradient norm, given before its end (with ``optimizer=``
        stepping, before ``opt.step()``); ``end_step`` / ``step`` arguments take precedence."""
        if loss is not None:
            self._pending["loss"] = loss
        if grad_norm is not None:
            self._pending["grad_norm"] = grad_norm

    def _before_optimizer_step(self, optimizer, *args) -> None:
        if "grad_norm" not in self._pending:
            g = grad_norm(p for group in optimizer.param_groups for p in group["params"])
            if g is not None:
                self._pending["grad_norm"] = g

    def step(self, loss=None, model=None, grad_norm=None) -> dict | None:
        """End the current step and begin the next. ``loss`` (a float or a tensor) and the gradient
        norm (``grad_norm``, or read from ``model``'s gradients now) are logged every step; on a
        probe step the record with the probes is returned (else None)."""
        record = self.end_step(loss, model=model, grad_norm=grad_norm)
        self.begin_step(self.step_index + 1)
        return record

    def begin_step(self, step: int) -> None:
        """The step ``step`` is about to run its forward: install the capture if it is a probe step."""
        self._open = True
        if self._capture is not None and self._armed_step == step:
            return
        self._disarm()
        self.step_index = int(step)
        if self.due(self.step_index):
            self._arm()

    def end_step(self, loss=None, *, model=None, grad_norm=None) -> dict | None:
        """The current step's backward is done: remove the capture, run and log the probes, write
        the step record and update the monitor. Returns the probe step's record (else None); a
        second call for the same step does nothing."""
        if not self._open:
            return None
        self._open = False
        cap, step = self._capture, self.step_index
        self._disarm()
        pending, self._pending = self._pending, {}
        loss = pending.get("loss") if loss is None else loss
        if grad_norm is None and model is not None:
            grad_norm = _total_grad_norm(model)
        grad_norm = pending.get("grad_norm") if grad_norm is None else grad_norm
        if not self.enabled:
            return None
        record: dict = {keys.STEP: step}
        if loss is not None:
            record[keys.LOSS_TRAIN] = _as_float(loss)
        if grad_norm is not None:
            record[keys.GRAD_NORM] = _as_float(grad_norm)
        if cap is not None:
            self._probe(cap, step, record)
        elif len(record) == 1:
            return None        # nothing measured this step: no record
        self.status = self.monitor.update(record)
        record[keys.MONITOR_STATE] = float(self.status.state)
        self._log.metrics(record)
        if cap is not None:
            self.records.append(record)
            if self.console:
                self._log.message(summary_line(record, self.status))
        elif self.status.changed:
            self._log.message(f"step {step}: monitor {self.status.name.upper()}"
                              + (f": {'; '.join(self.status.reasons)}" if self.status.reasons else ""))
        return record if cap is not None else None

    @property
    def warning(self) -> bool:
        """The monitor's state after the last step is warning."""
        return self.status is not None and self.status.state == WARNING

    def _probe(self, cap, step: int, record: dict) -> None:
        t0 = time.perf_counter()
        try:
            before = dict(self.measured)
            for c in self._layer_captures(cap.calls):
                opts = self._options_for_call(c.layer, c, cap.dispatch.get(c.layer))
                record.update(probe_layer(c, state=self.state, precision=opts.precision,
                                          stabilizer=opts.stabilizer, grad=False))
            record.update(self._weight_record(step))
            self.state.step = step
            if self.measured != before and self.by_dtype:
                self._said_measured()
        except Exception as e:  # the probes must never stop a training run
            record[keys.DIAGNOSTICS_FAILED] = 1.0
            self._say("failed", f"probes failed at step {step}: {e!r}\n{traceback.format_exc()}")
        record[keys.DIAGNOSTICS_TIME] = time.perf_counter() - t0

    def _weight_record(self, step: int) -> dict:
        if self._weights is None:
            return {}
        if getattr(self, "_weights_auto", False) and self._calls != len(self._weights):
            self._say("weights", f"found {len(self._weights)} attention projection(s) but the forward made "
                                 f"{self._calls} SDPA call(s): the W_Q / W_K norms are not written (name the "
                                 "layers' projections with projections=)")
            self._weights = None
            return {}
        layers = getattr(self._weights, "layers", None)
        if layers is None:
            layers = list(range(self._weights.config.n_layer))
        if self.layers is not None and self._modules is None:
            layers = [i for i in layers if i in self.layers]
        return weight_probe(self._weights, layers, step=step, state=self.state) if layers else {}

    def _said_measured(self) -> None:
        groups: dict = {}
        for layer, m in sorted(self.measured.items()):
            groups.setdefault((m.get("kernel"), m["precision"], m["about"]), []).append(f"L{layer}")
        for (kernel, name, about), layers in groups.items():
            ran = f"{kernel} ran; " if kernel else ""
            self._say(f"measured {kernel} {name}", f"{', '.join(layers)}: {ran}measured in {name} ({about})")
        if self._meta:
            self._meta["measured"] = {f"L{i}": m for i, m in sorted(self.measured.items())}
            self._write_meta()

    def close(self) -> None:
        self._disarm()
        for h in self._opt_handles:
            h.remove()
        self._opt_handles = []
        self._log.close()

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the capture ----------------------------------------------------------------------
    def _arm(self) -> None:
        self._calls, self._depth, self._done, self._stack, self._seen = 0, 0, False, [], set()
        if self._modules is None:   # call order within the model's first forward
            self._handles = [self.model.register_forward_pre_hook(self._root_enter),
                             self.model.register_forward_hook(self._root_exit, always_call=True)]
            select = self._select_by_order
        else:                       # the innermost named module running
            self._handles = []
            for i, mod in self._modules.items():
                self._handles.append(mod.register_forward_pre_hook(self._module_enter(i)))
                self._handles.append(mod.register_forward_hook(self._module_exit(i), always_call=True))
            select = self._select_by_module
        self._capture = _DispatchCapture(select=select, sequences=self.subsample).install()
        self._armed_step = self.step_index

    def _disarm(self) -> None:
        if self._capture is not None:
            self._capture.remove()
            self._capture = None
        for h in self._handles:
            h.remove()
        self._handles = []
        self._armed_step = None

    def _root_enter(self, module, args):
        self._depth += 1

    def _root_exit(self, module, args, output):
        self._depth -= 1
        if self._depth <= 0:
            self._done = True      # later forwards of the step (micro-batches, evaluation) are not taken

    def _select_by_order(self):
        if self._depth <= 0 or self._done:
            return None            # not inside the model's first forward: another model, a recomputation
        i = self._calls
        self._calls += 1
        return i if self.layers is None or i in self.layers else None

    def _module_enter(self, i):
        def hook(module, args):
            self._stack.append(i)
        return hook

    def _module_exit(self, i):
        def hook(module, args, output):
            if self._stack and self._stack[-1] == i:
                self._stack.pop()
        return hook

    def _select_by_module(self):
        if not self._stack or self._stack[-1] in self._seen:
            return None
        self._seen.add(self._stack[-1])
        return self._stack[-1]

    def _say(self, what: str, text: str) -> None:
        if what not in self._said:
            self._said.add(what)
            self._log.message(text)

    def _layer_captures(self, calls: list[dict]) -> list[LayerCapture]:
        if not calls:
            self._say("none", f"no SDPA call was captured at step {self.step_index}: does the model call "
                              "torch.nn.functional.scaled_dot_product_attention (transformers: "
                              "attn_implementation='sdpa'), through model(...), not compiled?")
        got = {}
        for r in calls:
            q = r["q"]
            causal = _mask_as_causal(r["attn_mask"], r["causal"], q.shape[-2], r["k"].shape[-2])
            if causal is None:
                self._say(f"mask{r['label']}", f"L{r['label']}: its SDPA call has a mask other than the causal "
                                               "pattern (padding? a position bias?): not measured")
                continue
            if r["dropout_p"]:
                self._say("dropout", f"attention dropout {r['dropout_p']} is not replayed: the probes measure the "
                                     "attention of the same inputs without it")
            do = r["do"]
            if do is not None and self.grad_scale != 1.0:
                do = do * self.grad_scale
            got[r["label"]] = LayerCapture(layer=r["label"], q=q, k=r["k"], v=r["v"], do=do, spec=None,
                                           backend="sdpa", causal=causal, scale=r["scale"])
        if self.layers is not None:
            missing = [i for i in self.layers if i not in got and not any(c["label"] == i for c in calls)]
            if missing:
                self._say("missing", f"no SDPA call seen for layer(s) {missing} at step {self.step_index}"
                          + ("" if self._modules is not None else
                             f" ({self._calls} call(s) in the model's forward)"))
        return [got[i] for i in sorted(got)]


def watch(model: nn.Module, layers=None, every: int = DEFAULT_EVERY, log_dir=None, precision=None,
          subsample: int | None = DEFAULT_SUBSAMPLE, **kw) -> Watch:
    """Probe the attention of ``model`` every ``every`` steps; see ``flashguard.diagnostics.watch``.

    ``layers``: None (every SDPA call of a forward), SDPA call indices, or module names.
    ``log_dir``: metrics.jsonl (+ tensorboard/) go there; None keeps the records in ``.records`` only.
    ``precision``: the arithmetic the captured inputs are measured in (default: the kernel torch ran).
    ``subsample``: sequences per layer measured (None: all).
    Further keywords: ``stabilizer`` ("none"), ``options`` (a FlashOptions: precision and
    stabilizer at once; ``precision`` / ``stabilizer`` then change it), ``start`` (0), ``optimizer`` (steps on its
    ``step()``), ``grad_scale`` (multiplies dO; gradient accumulation), ``tensorboard``
    (None: if installed), ``wandb`` (True or ``wandb.init`` arguments: the optional extra
    ``flashguard[wandb]``), ``loggers`` (more RunLoggers), ``log_fn``, ``console`` (the summary
    line at probe steps, True), ``projections`` (None: found automatically; False: no W_Q / W_K
    norms; names), ``n_head``, ``warmup_steps`` (the monitor judges nothing before 2 x this),
    ``thresholds`` (MonitorThresholds), ``enabled``."""
    return Watch(model, layers=layers, every=every, log_dir=log_dir, precision=precision, subsample=subsample, **kw)
