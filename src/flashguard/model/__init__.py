"""nanoGPT-style GPT-2 whose attention backend and precision are chosen per layer.

``gpt`` holds the model (GPTConfig, the blocks, GPT), ``attention`` which attention a layer runs
(AttentionSpec and its backends), ``heads`` the per-head weight views the probes read,
``presets`` the named shapes.
"""
from .attention import BACKENDS, KERNELS, AttentionSpec, SpecError, layer_specs
from .gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig
from .presets import MODEL_PRESETS, model_config

__all__ = ["GPT", "GPTConfig", "AttentionSpec", "SpecError", "BACKENDS", "KERNELS", "layer_specs", "MODEL_PRESETS",
           "model_config", "CausalSelfAttention", "MLP", "Block"]
