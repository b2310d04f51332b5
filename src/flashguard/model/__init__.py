"""nanoGPT-style GPT-2 whose attention backend and precision are chosen per layer."""
from .gpt import (BACKENDS, GPT, KERNELS, AttentionSpec, Block, CausalSelfAttention, GPTConfig, MLP, SpecError,
                  layer_specs)
from .presets import MODEL_PRESETS, model_config

__all__ = ["GPT", "GPTConfig", "AttentionSpec", "SpecError", "BACKENDS", "KERNELS", "layer_specs", "MODEL_PRESETS",
           "model_config", "CausalSelfAttention", "MLP", "Block"]
