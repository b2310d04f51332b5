"""nanoGPT-style GPT-2 whose attention backend and precision are chosen per layer."""
from .gpt import (BACKENDS, GPT, AttentionSpec, Block, CausalSelfAttention, GPTConfig, MLP,
                  layer_specs)
from .presets import MODEL_PRESETS, model_config

__all__ = ["GPT", "GPTConfig", "AttentionSpec", "BACKENDS", "layer_specs", "MODEL_PRESETS",
           "model_config", "CausalSelfAttention", "MLP", "Block"]
