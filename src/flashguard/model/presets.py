"""Named model shapes: ``model_config("tiny-cpu", dropout=0.1)``."""
from __future__ import annotations

import dataclasses

from .gpt import GPTConfig

__all__ = ["MODEL_PRESETS", "model_config"]

MODEL_PRESETS: dict[str, GPTConfig] = {
    # GPT-2 small as in the study: 12 x 768, 12 heads, context 1024, GPT-2 BPE padded to 50304.
    "gpt2-124m": GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768),
    # A byte-level model that trains on a CPU.
    "tiny-cpu": GPTConfig(block_size=256, vocab_size=256, n_layer=4, n_head=4, n_embd=256),
    # tiny-cpu with the study's windows, for the short-document corpus (prepare embedded-docs): a
    # window holds several separators, the identical tokens attention sinks form on. T = 1024 is
    # two 512-tiles of the flash attention (O accumulated across key tiles, as in the study's
    # GPT-2); T = 512 is one. Same width and head dim (64) as tiny-cpu and GPT-2.
    "tiny-cpu-512": GPTConfig(block_size=512, vocab_size=256, n_layer=4, n_head=4, n_embd=256),
    "tiny-cpu-1024": GPTConfig(block_size=1024, vocab_size=256, n_layer=4, n_head=4, n_embd=256),
    # Smoke tests: a forward + backward takes milliseconds.
    "micro": GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=2, n_embd=64),
}


def model_config(preset: str, **overrides) -> GPTConfig:
    """The preset's GPTConfig with some fields replaced (validated like any GPTConfig)."""
    if preset not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; known: {', '.join(MODEL_PRESETS)}")
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown GPTConfig field(s) {unknown}; known: {', '.join(sorted(known))}")
    return dataclasses.replace(MODEL_PRESETS[preset], **overrides)
