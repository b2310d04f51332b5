"""The check's forward and backward steps: the user's model, dtype and device, no optimizer step.

A batch is what the model's forward takes: a tensor (``model(x)``), a tuple or list
(``model(*batch)``) or a dict (``model(**batch)``). The loss is ``loss_fn(output, batch)``, by
default ``default_loss``. The gradients are taken with ``torch.autograd.grad`` and dropped, so
the model's ``.grad`` fields are left as they were; the model runs in eval mode (dropout off:
a dropped attention probability cannot be replayed on the captured inputs) and its mode is
restored afterwards.

The dtype: a model whose floating parameters are already in ``dtype`` runs as it is (its own
dtype); otherwise the steps run under ``torch.autocast(device, dtype)`` (bf16 or fp16), as a
mixed-precision training loop does; fp32 runs without autocast.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from .capture import CheckCapture

__all__ = ["default_loss", "run_steps", "precision_mode", "DTYPES"]

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


def _param_dtype(model: torch.nn.Module):
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def precision_mode(model: torch.nn.Module, dtype: torch.dtype) -> str:
    """"own dtype" (the parameters are in ``dtype``), "autocast" (bf16 or fp16 asked of other
    parameters), or for fp32 asked of low-precision parameters "own dtype (...)": autocast
    cannot raise a precision, so the model runs as it is and the report says which dtype ran."""
    own = _param_dtype(model)
    if own == dtype:
        return "own dtype"
    if dtype == torch.float32:
        return f"own dtype ({str(own).replace('torch.', '')}; fp32 asked, the weights are not)"
    return "autocast"


def _to(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to(v, device) for v in batch)
    return batch


def _call(model, batch):
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _input_ids(batch):
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        return batch.get("input_ids")
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0]
    return None


def default_loss(output, batch) -> torch.Tensor:
    """The output's own loss (``.loss``, or a scalar in a returned tuple: HF models given labels,
    nanoGPT given targets); else next-token cross-entropy of logits (B, T, V) on the batch's
    input ids (B, T). Anything else needs ``loss_fn``."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    if isinstance(output, (tuple, list)):
        scalars = [t for t in output if isinstance(t, torch.Tensor) and t.dim() == 0]
        if scalars:
            return scalars[0]
    logits = getattr(output, "logits", output[0] if isinstance(output, (tuple, list)) and output else output)
    ids = _input_ids(batch)
    if (isinstance(logits, torch.Tensor) and isinstance(ids, torch.Tensor) and logits.dim() == 3
            and ids.dim() == 2 and not ids.is_floating_point() and logits.shape[:2] == ids.shape
            and ids.shape[1] > 1):
        # position t predicts token t + 1: (B, T-1, V) against (B, T-1)
        return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    raise TypeError(f"flashguard.check: cannot find a loss in the model's output ({type(output).__name__}); "
                    "pass loss_fn=lambda output, batch: <a scalar tensor>")


def run_steps(model: torch.nn.Module, batches, *, steps: int, dtype: torch.dtype, loss_fn=None,
              sequences: int | None = None) -> tuple[CheckCapture, list[float]]:
    """``steps`` forward and backward passes on the first batches, SDPA calls captured; returns the
    capture and the losses."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("flashguard.check: the model has no parameter that requires a gradient, so no "
                         "backward pass reaches its attention")
    device = params[0].device
    amp = (torch.autocast(device.type, dtype=dtype) if precision_mode(model, dtype) == "autocast"
           else contextlib.nullcontext())
    loss_fn = loss_fn or default_loss
    was_training = model.training
    model.eval()
    losses: list[float] = []
    try:
        with CheckCapture(model, sequences=sequences) as cap:
            for step, batch in zip(range(steps), batches):
                cap.step = step
                batch = _to(batch, device)
                with amp:
                    loss = loss_fn(_call(model, batch), batch)
                # the gradients themselves are not kept: the hooks on the SDPA outputs keep dO
                torch.autograd.grad(loss.float(), params, allow_unused=True)
                losses.append(float(loss.detach()))
    finally:
        model.train(was_training)
    if not losses:
        raise ValueError("flashguard.check: the batch iterable gave no batch")
    return cap, losses
