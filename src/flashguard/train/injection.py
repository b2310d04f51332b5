"""The [injection] section put into a model: one hook per chosen flash layer, one clock.

    clock = install_injection(model, cfg, rank=rank)   # None when injection.rule = "none"
    each step: clock.begin_step(step)                  # before the step's forward/backward

A training run does both through ``InjectionHook()`` (a flashguard.train.hooks.TrainHook, passed
like any other: ``train(cfg, run_dir, hooks=[InjectionHook(), ...])``, or
flashguard.diagnostics.training_hooks()): ``attach`` installs when the loop has built the model,
``step_begin`` advances the clock each step. It claims every ``injection.*`` key; the loop refuses
an [injection] section without it.

The hooks (DeltaHook, or OutputHook for injection.point = o) ride on the layers' AttentionSpecs
(``delta_hook`` / ``output_hook``), so nothing global changes and a
model built without them (diagnose, the report) runs the plain arithmetic. The draws depend on
(injection seed, step, call within the step, layer, rank) only: a resumed or replayed run draws
the same signs at the same steps without any state in the checkpoint.
"""
from __future__ import annotations

import dataclasses

from ..attention.injection import InjectionClock, make_hook
from .config import ConfigError, InjectionConfig, RunConfig, injection_of
from .hooks import TrainHook

__all__ = ["install_injection", "injected_layers", "InjectionHook"]


def injected_layers(model, layers) -> list[int]:
    """The layers an injection goes into: ``layers`` (checked: they exist and run flash), or
    every flash layer when empty. ConfigError names injection.layers."""
    specs = model.attention_specs
    flash = [i for i, s in enumerate(specs) if s.backend == "flash"]
    if not layers:
        if not flash:
            raise ConfigError("injection: no layer runs the flash backend (the injection acts on its backward)")
        layers = flash
    for i in layers:
        if not 0 <= i < len(specs):
            raise ConfigError(f"injection.layers: layer {i} does not exist (layers 0..{len(specs) - 1})")
        if specs[i].backend != "flash":
            raise ConfigError(f"injection.layers: layer {i} runs the {specs[i].backend} backend, not flash")
        if specs[i].kernel == "triton":
            raise ConfigError(f"injection: layer {i} runs attention.kernel = triton; the injection's backward "
                              "runs on the pytorch kernel (set attention.kernel = auto or pytorch)")
    return sorted(layers)


def install_injection(model, cfg: RunConfig, *, rank: int = 0, observer=None) -> InjectionClock | None:
    """Give the chosen flash layers of ``model`` (a GPT) a hook of ``cfg.injection`` sharing
    one InjectionClock, which is returned (None, and the model untouched, for rule = none)."""
    injection = injection_of(cfg.injection, seed=cfg.train.seed)
    if injection is None:
        return None
    clock = InjectionClock(rank=rank)
    specs = list(model.attention_specs)
    for i in injected_layers(model, list(cfg.injection.layers)):
        field, hook = make_hook(injection, i, clock, observer=observer)
        specs[i] = dataclasses.replace(specs[i], **{field: hook})
    model.set_attention(specs)
    return clock


class InjectionHook(TrainHook):
    """The [injection] section as a hook of the training loop: the hooks go into the model when the
    loop has built it (``attach``; nothing for injection.rule = none), and the clock learns each step
    before its forward pass."""

    config_keys = tuple(f"injection.{f.name}" for f in dataclasses.fields(InjectionConfig))

    def __init__(self):
        self.clock: InjectionClock | None = None

    def attach(self, model, cfg: RunConfig, rank: int) -> None:
        self.clock = install_injection(model, cfg, rank=rank)

    def step_begin(self, step: int, model) -> None:
        if self.clock is not None:
            self.clock.begin_step(step)
