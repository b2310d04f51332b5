"""flashguard's probes in a Hugging Face ``Trainer``: a ``TrainerCallback`` built on ``flashguard.watch``.

    from flashguard.integrations.hf_callback import FlashguardCallback
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[FlashguardCallback(every=50)])      # -> OUTPUT_DIR/flashguard/metrics.jsonl

Every ``every`` optimizer steps the callback captures the SDPA inputs and output gradients of
the chosen layers during that step's first micro-batch, and before the optimizer step writes the
probes' record (the trainer's keys, ``flashguard.keys``) to ``log_dir`` (default
``args.output_dir/flashguard``). Steps are HF's ``state.global_step`` before the step: the first
optimizer step is step 0, as in flashguard's trainer. dO is multiplied by
``args.gradient_accumulation_steps`` (the trainer divides each micro-batch's loss by it), so the
delta errors are those of the step's mean loss. Only the main process probes. The model must
call ``torch.nn.functional.scaled_dot_product_attention`` (``attn_implementation="sdpa"``);
everything else is ``flashguard.diagnostics.watch``'s.

This module imports transformers; ``import flashguard`` and ``flashguard.integrations`` do not.
"""
from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from ..diagnostics.watch import DEFAULT_EVERY, DEFAULT_SUBSAMPLE, Watch

__all__ = ["FlashguardCallback"]


class FlashguardCallback(TrainerCallback):
    """``flashguard.watch`` driven by the Trainer's step events; arguments as ``watch``'s
    (``layers``, ``every``, ``log_dir``, ``precision``, ``subsample`` and its keywords
    ``stabilizer``, ``options``, ``tensorboard``, ``loggers``, ``log_fn``). ``.watch`` is the running Watch
    (its ``records`` stay readable after training)."""

    def __init__(self, layers=None, every: int = DEFAULT_EVERY, log_dir=None, precision=None,
                 subsample: int | None = DEFAULT_SUBSAMPLE, **watch_kw):
        bad = sorted(set(watch_kw) & {"start", "optimizer", "grad_scale", "enabled", "arm"})
        if bad:
            raise ValueError(f"FlashguardCallback sets {bad} from the Trainer; do not pass them")
        self.options = dict(layers=layers, every=every, log_dir=log_dir, precision=precision, subsample=subsample,
                            **watch_kw)
        self.watch: Watch | None = None
        # fail on bad options when the callback is made, not when training starts
        Watch._check_options(every=every, subsample=subsample, precision=precision,
                             stabilizer=watch_kw.get("stabilizer"), options=watch_kw.get("options"))

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("FlashguardCallback: the Trainer passed no model")
        if self.watch is not None:
            self.watch.close()
        opts = dict(self.options)
        if opts["log_dir"] is None and state.is_world_process_zero:
            opts["log_dir"] = Path(args.output_dir) / "flashguard"
        self.watch = Watch(model, start=state.global_step, grad_scale=float(args.gradient_accumulation_steps),
                           enabled=state.is_world_process_zero, arm=False, **opts)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.watch is not None:
            self.watch.begin_step(state.global_step)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        # after the last micro-batch's backward, before the update: the step's dO are all in
        if self.watch is not None:
            self.watch.end_step()

    def on_step_end(self, args, state, control, **kwargs):
        if self.watch is not None:
            self.watch.end_step()   # a no-op when on_pre_optimizer_step ran it (transformers without it)

    def on_train_end(self, args, state, control, **kwargs):
        if self.watch is not None:
            self.watch.close()
