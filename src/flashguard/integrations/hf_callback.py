"""flashguard's probes in a Hugging Face ``Trainer``: a ``TrainerCallback`` built on ``flashguard.watch``.

    from flashguard.integrations.hf_callback import FlashguardCallback
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[FlashguardCallback(every=50)])      # -> OUTPUT_DIR/flashguard/metrics.jsonl

Every step the callback logs the training loss (the model output's ``.loss``, read by a forward
hook in training mode: the step's micro-batches summed when the Trainer passes
``num_items_in_batch``, else averaged) and the gradient norm before clipping (read when each
backward ends, ``torch.autograd``'s end-of-backward callback, so the Trainer's ``max_grad_norm``
clipping does not hide a spike), with the early-warning monitor's state. Every ``every``
optimizer steps it captures the SDPA inputs and output gradients of the chosen layers during
that step's first micro-batch, and before the optimizer step writes the probes' record (the
trainer's keys, ``flashguard.keys``) to ``log_dir`` (default ``args.output_dir/flashguard``), with
a one-line console summary. Steps are HF's ``state.global_step`` before the step: the first
optimizer step is step 0, as in flashguard's trainer. dO is multiplied by
``args.gradient_accumulation_steps`` (the trainer divides each micro-batch's loss by it), so the
delta errors are those of the step's mean loss. The monitor judges nothing before 2 x the
Trainer's warm-up steps. Only the main process probes. The model must call
``torch.nn.functional.scaled_dot_product_attention`` (``attn_implementation="sdpa"``);
everything else is ``flashguard.diagnostics.watch``'s.

On a monitor warning (``on_warning``, off by default):

* ``"log"`` (default): the warning is logged (``monitor/state`` = 2 and a console line) and
  training goes on;
* ``"stop"``: the Trainer stops after the step that raised it (``control.should_training_stop``,
  as llm-foundry's ``KillLossSpike`` stops a run); ``.stopped_at`` is that step;
* ``"skip"``: the step that turns the monitor's state to warning does not update the weights
  (every gradient is set to None before the optimizer step, so torch's optimizers leave the
  parameters and their state as they were, as OLMo-core's skip-step optimizers do; the learning
  rate schedule still advances); ``.skipped`` lists those steps. A warning that persists is not
  skipped again: skipping every step would freeze the weights that raised it. (With fp16 and a
  GradScaler a step without gradients is refused by the scaler: use ``"stop"`` there.)

This module imports transformers; ``import flashguard`` and ``flashguard.integrations`` do not.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import TrainerCallback

from ..diagnostics.monitor import WARNING
from ..diagnostics.watch import DEFAULT_EVERY, DEFAULT_SUBSAMPLE, Watch, grad_norm

__all__ = ["FlashguardCallback", "ON_WARNING"]

ON_WARNING = ("log", "stop", "skip")


class FlashguardCallback(TrainerCallback):
    """``flashguard.watch`` driven by the Trainer's step events; arguments as ``watch``'s
    (``layers``, ``every``, ``log_dir``, ``precision``, ``subsample`` and its keywords
    ``stabilizer``, ``options``, ``tensorboard``, ``wandb``, ``loggers``, ``log_fn``, ``console``,
    ``projections``, ``n_head``, ``thresholds``), and ``on_warning`` ("log", "stop" or "skip").
    ``.watch`` is the running Watch (its ``records`` stay readable after training)."""

    def __init__(self, layers=None, every: int = DEFAULT_EVERY, log_dir=None, precision=None,
                 subsample: int | None = DEFAULT_SUBSAMPLE, on_warning: str = "log", **watch_kw):
        bad = sorted(set(watch_kw) & {"start", "optimizer", "grad_scale", "enabled", "arm"})
        if bad:
            raise ValueError(f"FlashguardCallback sets {bad} from the Trainer; do not pass them")
        if on_warning not in ON_WARNING:
            raise ValueError(f"FlashguardCallback: on_warning is one of {ON_WARNING}, got {on_warning!r}")
        self.on_warning = on_warning
        self.options = dict(layers=layers, every=every, log_dir=log_dir, precision=precision, subsample=subsample,
                            **watch_kw)
        self.watch: Watch | None = None
        self.stopped_at: int | None = None
        self.skipped: list[int] = []
        self._model = None
        self._hook = None
        self._losses: list = []
        self._summed = False
        self._grad_norm = None
        # fail on bad options when the callback is made, not when training starts
        Watch._check_options(every=every, subsample=subsample, precision=precision,
                             stabilizer=watch_kw.get("stabilizer"), options=watch_kw.get("options"))

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("FlashguardCallback: the Trainer passed no model")
        self._close()
        opts = dict(self.options)
        if opts["log_dir"] is None and state.is_world_process_zero:
            opts["log_dir"] = Path(args.output_dir) / "flashguard"
        if "warmup_steps" not in opts and "thresholds" not in opts:
            try:
                opts["warmup_steps"] = int(args.get_warmup_steps(state.max_steps))
            except Exception:   # an older or newer TrainingArguments: no warm-up grace
                pass
        self.watch = Watch(model, start=state.global_step, grad_scale=float(args.gradient_accumulation_steps),
                           enabled=state.is_world_process_zero, arm=False, **opts)
        self._model = model
        if self.watch.enabled:
            self._hook = model.register_forward_hook(self._read_loss, with_kwargs=True)

    # ---- the step's loss and gradient norm -------------------------------------------------
    def _read_loss(self, module, args, kwargs, output):
        if not module.training:
            return
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            return
        self._losses.append(loss.detach())
        self._summed = kwargs.get("num_items_in_batch") is not None
        if loss.requires_grad:
            loss.register_hook(self._queue_grad_norm)

    def _queue_grad_norm(self, grad):
        # runs when the backward reaches the loss; the queued callback when that backward is done,
        # every gradient accumulated and none clipped yet
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._read_grad_norm)
        except Exception:
            pass
        return None

    def _read_grad_norm(self):
        self._grad_norm = grad_norm(self._model)

    def _step_loss(self):
        if not self._losses:
            return None
        total = torch.stack([x.float() for x in self._losses]).sum()
        return total if self._summed else total / len(self._losses)

    # ---- the step events ---------------------------------------------------------------------
    def on_step_begin(self, args, state, control, **kwargs):
        if self.watch is not None:
            self._losses, self._grad_norm = [], None
            self.watch.begin_step(state.global_step)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        # after the last micro-batch's backward, before the update: the step's dO are all in
        self._end(args, state, control)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        self._end(args, state, control)   # a no-op when on_pre_optimizer_step ran it (transformers without it)
        return control

    def _end(self, args, state, control):
        w = self.watch
        if w is None or not w._open:
            return
        step = w.step_index
        gn = self._grad_norm
        if gn is None and not (args.max_grad_norm and args.max_grad_norm > 0):
            gn = grad_norm(self._model)   # no clipping: the gradients as they are now
        w.end_step(loss=self._step_loss(), grad_norm=gn)
        self._losses, self._grad_norm = [], None
        st = w.status
        if st is None or st.state != WARNING or st.step != step:
            return
        why = "; ".join(st.reasons) or "warning"
        if self.on_warning == "stop" and not control.should_training_stop:
            control.should_training_stop = True
            self.stopped_at = step
            w._log.message(f"step {step}: monitor WARNING ({why}): stopping the run (on_warning='stop')")
        elif self.on_warning == "skip" and st.changed:
            for p in self._model.parameters():
                p.grad = None
            self.skipped.append(step)
            w._log.message(f"step {step}: monitor WARNING ({why}): this step's update is skipped (on_warning='skip')")

    def on_train_end(self, args, state, control, **kwargs):
        self._close()

    def _close(self):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.watch is not None:
            self.watch.close()
