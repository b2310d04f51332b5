"""``flashguard.watch``: the trainer's probes of the mechanism, on any model that calls SDPA.

    import flashguard
    with flashguard.watch(model, every=50, log_dir="runs/mine/flashguard") as w:
        for x, y in loader:
            loss = model(x, labels=y).loss
            loss.backward()
            opt.step(); opt.zero_grad()
            w.step(loss=loss)           # once per optimizer step (or pass optimizer=opt instead)

Every ``every`` steps (steps 0, N, 2N, ... counted by ``step()`` from ``start``) the watch
captures, during that step's first forward and its backward, the q, k, v and dO of the chosen
layers' ``torch.nn.functional.scaled_dot_product_attention`` calls (the one SDPA capture,
``flashguard.diagnostics.sdpa_capture``), and at the end of the step runs the trainer's probes
on them (``flashguard.diagnostics.probes.probe_layer``: attention_metrics and numerics_metrics,
measured by ``attention.trace`` against fp64, with ``attention.error_stats``' (sequence, head)
unit): the max logit and the attention sink, the tie rate and Pbar == 1, the O and delta
errors with their z. The record - ``{"step", <probe keys>, "time/diagnostics_s"}`` and, when
``step(loss=...)`` got one, ``"loss/train"`` - has the trainer's keys (``flashguard.keys``) and
goes through the trainer's loggers (``flashguard.train.loggers``): ``log_dir/metrics.jsonl``
(appended), ``log_dir/tensorboard`` when tensorboard is installed, console lines for failures;
``w.records`` keeps them too. The weight probes (W_Q / W_K spectral norms) and the W_Q
gradient error need the model's query projection and are not written for an arbitrary model.

Layer identity (the ``L<i>`` of the keys):

* ``layers=None`` or integers: the order of the SDPA calls within one forward of ``model``
  (``model(...)``; the first call is L0) - for a decoder stack, the block index. Only calls made
  inside the model's first forward of the step count, so the backward's recomputation under
  gradient checkpointing and later forwards (gradient accumulation: later micro-batches; an
  evaluation) are not taken.
* module names (``layers=["transformer.h.0.attn", ...]``, names as ``model.named_modules()``
  gives them): the first SDPA call made inside each named module; L<i> is the name's position
  in the list, or give ``{i: name}``. ``log_dir/watch.json`` records the map.

What the probes measure: the SDPA kernel torch picked is a black box, so the numerics are the
captured inputs run once more in a flash arithmetic whose every rounding is known, next to
fp64. ``precision`` chooses it (a policy name, e.g. ``"paper"`` for the study's reference code;
or ``options``, a FlashOptions, with its stabilizer: the PyTorch kernel at its default tiles
measures it); by default the production arithmetic of the inputs' dtype: ``fa2`` for bf16,
``fa2-fp16`` for fp16, ``fp32`` / ``fp64`` for those. ``subsample`` is the number of sequences (batch entries)
measured per layer (each with all its rows: the rows of a sequence share its keys and values,
and one value per (sequence, head) is the unit of the z statistics); None measures all.

Masks: ``is_causal`` and masks equal to the causal pattern (boolean, or additive 0 / <= -1e4)
are measured; a call with another mask (padding, a position bias) is skipped and said once.
Attention dropout is not replayed (the probes measure the attention of the same inputs
without it).

Cost: on the steps it does not probe the watch installs nothing (``F.scaled_dot_product_attention``
is torch's own, no module hook is registered); ``step()`` counts. On a probe step: the capture
(detached views, and dO kept until the end of the step) and the probes' compute, logged as
``time/diagnostics_s`` (benchmarks/watch.py measures both). Failing probes never stop
training: they write ``diagnostics/failed = 1`` and one console line.

Distributed: only rank 0 watches (``enabled`` overrides).
"""
from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn as nn

from .. import keys
from .capture import LayerCapture
from .probes import probe_layer
from .sdpa_capture import SdpaCapture
from .state import ProbeState

__all__ = ["Watch", "watch", "DEFAULT_EVERY", "DEFAULT_SUBSAMPLE", "default_precision"]

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

    Stepping: ``step(loss=None)`` once per optimizer step, after it (ends the current step, begins
    the next), or ``optimizer=``, whose every ``step()`` then calls it; integrations that know
    the step number call ``begin_step(step)`` / ``end_step()`` instead."""

    def __init__(self, model: nn.Module, *, layers=None, every: int = DEFAULT_EVERY, log_dir=None,
                 precision=None, stabilizer=None, options=None, subsample: int | None = DEFAULT_SUBSAMPLE,
                 start: int = 0, optimizer=None, grad_scale: float = 1.0, tensorboard: bool | None = None,
                 loggers=(), log_fn=None, enabled: bool | None = None, arm: bool = True):
        from ..train.loggers import Console, Loggers

        self.options, self.by_dtype = self._check_options(every=every, subsample=subsample, precision=precision,
                                                          stabilizer=stabilizer, options=options)
        self._by_dtype: dict = {}
        self.model = model
        self.every, self.subsample = every, subsample
        self.grad_scale = float(grad_scale)
        self.layers, self._modules, self.layer_names = _resolve_layers(model, layers)
        if enabled is None:
            dist = torch.distributed
            enabled = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        self.enabled = bool(enabled)
        self.step_index = int(start)
        self.state = ProbeState()
        self.records: list[dict] = []
        self.log_dir = None if log_dir is None else Path(log_dir)
        self._capture: SdpaCapture | None = None
        self._armed_step: int | None = None
        self._handles: list = []
        self._said: set[str] = set()
        self._opt_handle = None
        parts = []
        if self.enabled and self.log_dir is not None:
            parts = self._file_loggers(tensorboard)
        self._log = Loggers([*parts, Console(log_fn or _stderr), *loggers])
        if self.enabled and optimizer is not None:
            self._opt_handle = optimizer.register_step_post_hook(lambda *_: self.step())
        if arm:
            self.begin_step(self.step_index)

    @staticmethod
    def _check_options(*, every, subsample, precision=None, stabilizer=None, options=None):
        """ValueError for a bad option: at construction, not at the first probe step. Returns
        ``_measured_options``' (FlashOptions, by input dtype)."""
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"flashguard.watch: every must be an integer >= 1, got {every!r}")
        if subsample is not None and (isinstance(subsample, bool) or not isinstance(subsample, int) or subsample < 1):
            raise ValueError(f"flashguard.watch: subsample (sequences per layer) must be an integer >= 1 or None, "
                             f"got {subsample!r}")
        return _measured_options(options, precision, stabilizer)

    def options_for(self, dtype: torch.dtype):
        """The FlashOptions a captured call of inputs ``dtype`` is measured in."""
        if not self.by_dtype:
            return self.options
        if dtype not in self._by_dtype:
            self._by_dtype[dtype] = self.options.replace(precision=default_precision(dtype))
        return self._by_dtype[dtype]

    def _file_loggers(self, tensorboard):
        from ..train.config import ConfigError
        from ..train.loggers import JsonlMetrics, TensorBoardMetrics
        from ..utils.atomic import atomic_write_json
        self.log_dir.mkdir(parents=True, exist_ok=True)
        layer_map = ({f"L{i}": n for i, n in sorted(self.layer_names.items())} if self.layer_names
                     else "SDPA call order within one forward (L0 = first call)")
        atomic_write_json(self.log_dir / "watch.json", {
            "every": self.every, "start": self.step_index,
            "precision": "by input dtype" if self.by_dtype else self.options.precision.short_str(),
            "stabilizer": str(self.options.stabilizer), "subsample_sequences": self.subsample,
            "layers": layer_map if self.layers is None or self.layer_names
            else {"indices": self.layers, "identity": layer_map}})
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

    # ---- stepping -------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return self.enabled and step % self.every == 0

    @property
    def armed(self) -> bool:
        """True while the capture is installed (a probe step in progress)."""
        return self._capture is not None

    def step(self, loss=None) -> dict | None:
        """End the current step (its probes, if it was a probe step: their record is returned) and
        begin the next. ``loss`` (a float or a tensor; read only on probe steps) is logged with them."""
        record = self.end_step(loss)
        self.begin_step(self.step_index + 1)
        return record

    def begin_step(self, step: int) -> None:
        """The step ``step`` is about to run its forward: install the capture if it is a probe step."""
        if self._capture is not None and self._armed_step == step:
            return
        self._disarm()
        self.step_index = int(step)
        if self.due(self.step_index):
            self._arm()

    def end_step(self, loss=None) -> dict | None:
        """The current step's backward is done: remove the capture, run and log the probes."""
        if self._capture is None:
            return None
        cap, step = self._capture, self.step_index
        self._disarm()
        t0 = time.perf_counter()
        record: dict = {keys.STEP: step}
        if loss is not None:
            record[keys.LOSS_TRAIN] = float(loss.detach().float()) if isinstance(loss, torch.Tensor) else float(loss)
        try:
            for c in self._layer_captures(cap.calls):
                opts = self.options_for(c.q.dtype)
                record.update(probe_layer(c, state=self.state, precision=opts.precision,
                                          stabilizer=opts.stabilizer, grad=False))
            self.state.step = step
        except Exception as e:  # the probes must never stop a training run
            record[keys.DIAGNOSTICS_FAILED] = 1.0
            self._say("failed", f"probes failed at step {step}: {e!r}\n{traceback.format_exc()}")
        record[keys.DIAGNOSTICS_TIME] = time.perf_counter() - t0
        self.records.append(record)
        self._log.metrics(record)
        return record

    def close(self) -> None:
        self._disarm()
        if self._opt_handle is not None:
            self._opt_handle.remove()
            self._opt_handle = None
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
        self._capture = SdpaCapture(select=select, sequences=self.subsample).install()
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
    ``precision``: the arithmetic the captured inputs are measured in (default: by input dtype).
    ``subsample``: sequences per layer measured (None: all).
    Further keywords: ``stabilizer`` ("none"), ``options`` (a FlashOptions: precision and
    stabilizer at once; ``precision`` / ``stabilizer`` then change it), ``start`` (0), ``optimizer`` (steps on its
    ``step()``), ``grad_scale`` (multiplies dO; gradient accumulation), ``tensorboard``
    (None: if installed), ``loggers`` (more RunLoggers), ``log_fn``, ``enabled``."""
    return Watch(model, layers=layers, every=every, log_dir=log_dir, precision=precision, subsample=subsample, **kw)
