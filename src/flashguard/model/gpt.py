"""A GPT-2 language model whose attention arithmetic is chosen per layer.

Reads top to bottom: configuration (GPTConfig), attention choice (AttentionSpec, layer_specs),
the modules (CausalSelfAttention, MLP, Block), the model (GPT). Shapes in comments use
B = batch, T = sequence length, C = n_embd, H = n_head, D = head_dim = C // H, V = vocab_size.

Conventions shared with nanoGPT, so checkpoints map one to one: module names
``transformer.{wte,wpe,h.<i>.{ln_1,attn.c_attn,attn.c_proj,ln_2,mlp.c_fc,mlp.c_proj},ln_f}``
and ``lm_head`` (tied to ``transformer.wte``); targets equal to -1 are ignored by the loss.

Attention backends (AttentionSpec.backend):

* ``sdpa``       torch.nn.functional.scaled_dot_product_attention (whatever kernel torch picks).
* ``flash``      flashguard's flash_attention with a PrecisionPolicy and a stabilizer: the
                 study's object, emulating a chosen low-precision FA2 arithmetic; its
                 ``kernel`` (auto | pytorch | triton) and tiles say which implementation runs it.
* ``reference``  flashguard's reference_attention in fp32 (autocast disabled inside), cast back
                 to the input dtype: "standard attention in high precision".

Attention-logit soft-capping (GPTConfig.attn_softcap) replaces the scores S by
cap * tanh(S / cap) before the mask and the softmax. torch SDPA cannot do this, so a layer
whose backend is ``sdpa`` uses the ``reference`` math instead when a cap is set.

There is no dropout on the attention probabilities (flash and reference have none, and
backends must stay comparable); ``dropout`` applies to the embeddings and to both residual
branches, as in GPT-2. The study trains with dropout 0.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..attention import flash_attention, get_stabilizer, reference_attention
from ..attention.function import KERNEL_BACKENDS, choose_backend, flash_attention_with_delta_hook
from ..attention.stabilizers import Stabilizer
from ..attention.triton_flash import triton_unsupported_settings
from ..numerics.policy import PrecisionPolicy, get_policy

__all__ = ["GPTConfig", "AttentionSpec", "SpecError", "BACKENDS", "KERNELS", "layer_specs", "CausalSelfAttention", "MLP",
           "Block", "GPT"]


# --------------------------------------------------------------------------------------------
# configuration

def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(frozen=True)
class GPTConfig:
    """Shape and training-time options of the model. Every field is checked on construction."""

    block_size: int = 1024       # longest input (number of learned positions)
    vocab_size: int = 50304      # GPT-2's 50257 padded up to a multiple of 64
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768            # must be divisible by n_head
    bias: bool = False           # biases in Linear and LayerNorm (the study trains without)
    dropout: float = 0.0         # embeddings and residual branches (none on attention probs)
    qk_layernorm: bool = False   # LayerNorm over head_dim on q and k (weights shared by heads)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap); None = off
    z_loss: float = 0.0          # loss += z_loss * mean(logsumexp(logits)^2)  (PaLM)

    def __post_init__(self):
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be an integer >= 1, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by "
                             f"n_head ({self.n_head})")
        for name in ("bias", "qk_layernorm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if not _is_real(self.dropout) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be a number in [0, 1), got {self.dropout!r}")
        cap = self.attn_softcap
        if cap is not None and (not _is_real(cap) or not math.isfinite(cap) or cap <= 0):
            raise ValueError(f"GPTConfig.attn_softcap must be None or a finite number > 0, got {cap!r}")
        if not _is_real(self.z_loss) or not math.isfinite(self.z_loss) or self.z_loss < 0:
            raise ValueError(f"GPTConfig.z_loss must be a finite number >= 0, got {self.z_loss!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# which attention each layer runs

BACKENDS = ("sdpa", "flash", "reference")
KERNELS = KERNEL_BACKENDS  # which implementation runs a flash layer: flash_attention's backend= (auto | pytorch | triton)

# field metadata: "flash" = used by the flash backend only; "setting" = False for a field that is
# not a configuration value (the injection's hook, set by code)
_FLASH = {"flash": True}


class SpecError(ValueError):
    """A bad AttentionSpec value; ``field`` names it (a config names it by its own key)."""

    def __init__(self, field_name: str, problem: str):
        super().__init__(f"AttentionSpec.{field_name}: {problem}")
        self.field, self.problem = field_name, problem


@dataclass(frozen=True)
class AttentionSpec:
    """How one layer computes attention: the one definition of the attention choice (a training
    config's [attention] section holds one and names its keys after these fields).

    ``precision`` (a flashguard preset name or a PrecisionPolicy), ``stabilizer`` (``none``,
    ``paper``, ``paper:beta=7``, ``safe`` or a Stabilizer), the tile sizes ``block_q`` /
    ``block_k`` (None = the kernel's default: 512 on the PyTorch path, the Triton kernels' own)
    and ``kernel`` (flash_attention's backend: ``auto`` = Triton on CUDA when it supports the
    call, else PyTorch; ``pytorch``; ``triton``, refused here for settings it cannot run) are
    used by the ``flash`` backend only, and so is ``delta_hook``: a callable the layer's
    backward pass hands its delta to and takes the delta to use from (the error-injection
    experiment, flashguard.attention.injection; the PyTorch kernel then runs, so ``kernel``
    may not be ``triton``).
    """

    backend: str = "sdpa"
    precision: str | PrecisionPolicy = dataclasses.field(default="fa2", metadata=_FLASH)
    stabilizer: str | Stabilizer = dataclasses.field(default="none", metadata=_FLASH)
    block_q: int | None = dataclasses.field(default=None, metadata=_FLASH)
    block_k: int | None = dataclasses.field(default=None, metadata=_FLASH)
    kernel: str = dataclasses.field(default="auto", metadata=_FLASH)
    delta_hook: Callable | None = dataclasses.field(default=None, metadata={"flash": True, "setting": False})

    def __post_init__(self):
        for name in FIELDS:
            problem = _field_problem(name, getattr(self, name))
            if problem:
                raise SpecError(name, problem)
        if self.delta_hook is not None and self.backend != "flash":
            raise SpecError("delta_hook", f"applies to the flash backend only, not {self.backend!r}")
        if self.backend == "flash" and self.kernel == "triton":
            if self.delta_hook is not None:
                raise SpecError("kernel", "the injection's delta hook runs on the pytorch kernel, not triton")
            reason = triton_unsupported_settings(precision=self.precision, stabilizer=self.stabilizer,
                                                 block_q=self.block_q, block_k=self.block_k)
            if reason:
                raise SpecError("kernel", f"the triton kernel cannot run {reason}")

    def with_changes(self, change: Mapping[str, Any]) -> "AttentionSpec":
        """This spec with the fields in ``change`` set (SpecError for an unknown field, a bad value,
        or a flash-only field set where the backend is not flash: it would be silently ignored)."""
        unknown = sorted(set(change) - set(FIELDS))
        if unknown:
            raise SpecError(unknown[0], f"unknown field(s) {unknown}; known: {', '.join(FIELDS)}")
        spec = dataclasses.replace(self, **change)
        misplaced = sorted(set(change) & set(FLASH_ONLY)) if spec.backend != "flash" else []
        if misplaced:
            raise SpecError(misplaced[0], f"{misplaced} only apply to the flash backend, but this layer's "
                                          f"backend is {spec.backend!r}")
        return spec

    def settings(self) -> dict:
        """The fields a configuration sets (all but delta_hook), by name."""
        return {name: getattr(self, name) for name in SETTINGS}

    def kernel_for(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softcap: float | None = None) -> str:
        """The flash kernel this spec runs on these inputs, ``pytorch`` or ``triton``: ``kernel``
        resolved as flash_attention resolves it (choose_backend); the delta hook's path is PyTorch."""
        if self.delta_hook is not None:
            return "pytorch"
        return choose_backend(q, k, v, precision=self.precision, stabilizer=self.stabilizer, block_q=self.block_q,
                              block_k=self.block_k, softcap=softcap, backend=self.kernel)

    def short_str(self) -> str:
        """For run names and logs: ``sdpa``, ``reference``, ``flash[paper,safe]``, ``flash[fa2,none,128x128]``,
        ``flash[fa2,none,triton]`` (the kernel when it is not ``auto``)."""
        if self.backend != "flash":
            return self.backend
        prec = self.precision if isinstance(self.precision, str) else self.precision.short_str()
        stab = self.stabilizer if isinstance(self.stabilizer, str) else self.stabilizer.name
        parts = [prec, stab]
        if self.block_q is not None or self.block_k is not None:
            parts.append(f"{self.block_q or 'default'}x{self.block_k or 'default'}")
        if self.kernel != "auto":
            parts.append(self.kernel)
        return f"flash[{','.join(parts)}]"


FIELDS = tuple(f.name for f in dataclasses.fields(AttentionSpec))
SETTINGS = tuple(f.name for f in dataclasses.fields(AttentionSpec) if f.metadata.get("setting", True))
FLASH_ONLY = tuple(f.name for f in dataclasses.fields(AttentionSpec) if f.metadata.get("flash", False))


def _field_problem(name: str, value) -> str | None:
    """What is wrong with one AttentionSpec field's value on its own (None: nothing)."""
    if name == "backend":
        return None if value in BACKENDS else f"unknown backend {value!r}; known: {', '.join(BACKENDS)}"
    if name == "kernel":
        return None if value in KERNELS else f"unknown kernel {value!r}; known: {', '.join(KERNELS)}"
    lookup = {"precision": get_policy, "stabilizer": get_stabilizer}.get(name)
    if lookup is not None:
        try:
            lookup(value)
        except (ValueError, TypeError) as e:
            return str(e)
        return None
    if name in ("block_q", "block_k"):
        if value is not None and (not _is_int(value) or value < 1):
            return f"must be None or an integer >= 1, got {value!r}"
        return None
    if name == "delta_hook" and value is not None and not callable(value):
        return f"must be None or callable, got {value!r}"
    return None


def layer_specs(default: AttentionSpec, overrides: Mapping[Any, Mapping[str, Any] | AttentionSpec] | None,
                n_layer: int) -> list[AttentionSpec]:
    """One AttentionSpec per layer: ``default`` everywhere, changed where ``overrides`` says.

    ``overrides`` maps a layer index (0-based; an int or a string of digits, as TOML keys are
    strings) to the fields to change, or to a whole AttentionSpec:

        layer_specs(AttentionSpec("flash", precision="paper"), {1: {"precision": "fp32"}}, 12)
        layer_specs(AttentionSpec("sdpa"), {1: {"backend": "flash", "precision": "paper"}}, 12)

    Raises ValueError for an index outside [0, n_layer), an unknown field, or a flash-only
    field (precision, stabilizer, block_q, block_k, kernel) set on a layer whose backend is not
    flash (it would be silently ignored).
    """
    if not isinstance(default, AttentionSpec):
        raise TypeError(f"default must be an AttentionSpec, got {type(default).__name__}")
    if not _is_int(n_layer) or n_layer < 1:
        raise ValueError(f"n_layer must be an integer >= 1, got {n_layer!r}")
    specs = [default] * n_layer
    for key, change in (overrides or {}).items():
        index = layer_index(key)
        if not 0 <= index < n_layer:
            raise ValueError(f"attention override for layer {index}: the model has layers "
                             f"0..{n_layer - 1} (n_layer={n_layer})")
        if isinstance(change, AttentionSpec):
            specs[index] = change
            continue
        if not isinstance(change, Mapping):
            raise ValueError(f"attention override for layer {index} must be a dict of fields or an "
                             f"AttentionSpec, got {type(change).__name__}")
        try:
            specs[index] = default.with_changes(change)
        except SpecError as e:
            raise ValueError(f"attention override for layer {index}: {e}") from None
    return specs


def layer_index(key) -> int:
    """A layer override's key as an index: an int, or a string of digits (TOML keys are strings)."""
    if isinstance(key, str) and key.strip().isdigit():
        return int(key)
    if _is_int(key):
        return int(key)
    raise ValueError(f"attention override key {key!r} is not a layer index")


# --------------------------------------------------------------------------------------------
# modules

class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection; backend from ``spec``."""

    def __init__(self, config: GPTConfig, spec: AttentionSpec, layer_index: int):
        super().__init__()
        self.n_head, self.n_embd, self.head_dim = config.n_head, config.n_embd, config.head_dim
        self.layer_index = layer_index
        self.softcap = config.attn_softcap
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # rows: q | k | v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.residual_projection = True  # scaled init, see GPT._init_weights
        self.resid_dropout = nn.Dropout(config.dropout)
        if config.qk_layernorm:
            self.q_ln = nn.LayerNorm(self.head_dim, bias=config.bias)
            self.k_ln = nn.LayerNorm(self.head_dim, bias=config.bias)
        else:
            self.q_ln = self.k_ln = None
        self.spec = spec

    @property
    def spec(self) -> AttentionSpec:
        return self._spec

    @spec.setter
    def spec(self, spec: AttentionSpec) -> None:
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"spec must be an AttentionSpec, got {type(spec).__name__}")
        if spec.backend == "flash" and spec.kernel == "triton" and self.softcap is not None:
            raise SpecError("kernel", "the triton kernel cannot run softcap (GPTConfig.attn_softcap); "
                                      "use kernel auto or pytorch")
        self._spec = spec

    @property
    def effective_backend(self) -> str:
        """The backend that actually runs: ``sdpa`` falls back to ``reference`` under a softcap."""
        if self.spec.backend == "sdpa" and self.softcap is not None:
            return "reference"
        return self.spec.backend

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of (B, H, T, D) tensors with this layer's backend -> (B, H, T, D)."""
        backend = self.effective_backend
        if backend == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if backend == "flash":
            s = self.spec
            if s.delta_hook is not None:
                return flash_attention_with_delta_hook(q, k, v, delta_hook=s.delta_hook, is_causal=True,
                                                       precision=s.precision, stabilizer=s.stabilizer,
                                                       block_q=s.block_q, block_k=s.block_k, softcap=self.softcap)
            return flash_attention(q, k, v, is_causal=True, precision=s.precision,
                                   stabilizer=s.stabilizer, block_q=s.block_q, block_k=s.block_k,
                                   softcap=self.softcap, backend=s.kernel)
        # reference: the math in fp32, whatever autocast would do to its matmuls
        with torch.autocast(q.device.type, enabled=False):
            y = reference_attention(q, k, v, is_causal=True, dtype=torch.float32, softcap=self.softcap)
        return y.to(v.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)              # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)    # (B, H, T, D)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)    # (B, H, T, D)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)    # (B, H, T, D)
        if self.q_ln is not None:
            # autocast may return LayerNorm in fp32: hand the kernel one dtype, as a real one needs
            q, k = self.q_ln(q).to(v.dtype), self.k_ln(k).to(v.dtype)   # (B, H, T, D)
        y = self.attend(q, k, v)                                        # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, C)                # (B, T, C)
        return self.resid_dropout(self.c_proj(y))                       # (B, T, C)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.residual_projection = True
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gelu(self.c_fc(x))               # (B, T, 4C)
        return self.dropout(self.c_proj(x))       # (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig, spec: AttentionSpec, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, spec, layer_index)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))   # (B, T, C)
        x = x + self.mlp(self.ln_2(x))    # (B, T, C)
        return x


# --------------------------------------------------------------------------------------------
# the model

class GPT(nn.Module):
    """GPT-2 with per-layer attention backends.

    ``forward(idx, targets=None) -> (logits, loss)``:
      * with targets: logits (B, T, V) and the loss to minimise = cross-entropy + z-loss term.
        The parts of the last such call are kept, detached, as ``model.last_ce`` (pure
        cross-entropy, for logging) and ``model.last_z`` (the added z-loss term, 0 when
        z_loss = 0), so ``loss == last_ce + last_z``.
      * without targets: logits of the last position only, (B, 1, V), and loss None.
    Logits are returned in the compute dtype (bf16 under autocast); the loss is computed in fp32.
    """

    def __init__(self, config: GPTConfig,
                 attention: AttentionSpec | Sequence[AttentionSpec] = AttentionSpec()):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        specs = self._spec_list(attention)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList(Block(config, specs[i], i) for i in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied: one (V, C) matrix
        self.apply(self._init_weights)
        self.last_ce: torch.Tensor | None = None
        self.last_z: torch.Tensor | None = None

    def _spec_list(self, attention) -> list[AttentionSpec]:
        n = self.config.n_layer
        if isinstance(attention, AttentionSpec):
            return [attention] * n
        if isinstance(attention, (str, bytes)) or not isinstance(attention, Sequence):
            raise TypeError(f"attention must be an AttentionSpec or a sequence of them, "
                            f"got {type(attention).__name__}")
        specs = list(attention)
        if len(specs) != n:
            raise ValueError(f"attention: got {len(specs)} AttentionSpecs for n_layer={n} layers")
        for i, s in enumerate(specs):
            if not isinstance(s, AttentionSpec):
                raise TypeError(f"attention[{i}] must be an AttentionSpec, got {type(s).__name__}")
        return specs

    def _init_weights(self, module: nn.Module) -> None:
        # GPT-2: N(0, 0.02) for every matrix and embedding, residual projections scaled by
        # 1/sqrt(2 n_layer) (two residual additions per layer), zero biases, LayerNorm = identity.
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "residual_projection", False):
                std /= math.sqrt(2 * self.config.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            if module.weight is not None:
                nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    # ---- attention choice ----

    @property
    def attention_specs(self) -> list[AttentionSpec]:
        return [block.attn.spec for block in self.transformer.h]

    def set_attention(self, attention: AttentionSpec | Sequence[AttentionSpec]) -> None:
        """Switch the attention of every layer (same weights), e.g. to compare backends."""
        for block, spec in zip(self.transformer.h, self._spec_list(attention)):
            block.attn.spec = spec

    # ---- forward ----

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"input length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)           # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)                                                      # (B, T, C)
        x = self.transformer.ln_f(x)                                          # (B, T, C)

        if targets is None:
            return self.lm_head(x[:, [-1], :]), None                          # (B, 1, V)

        logits = self.lm_head(x)                                              # (B, T, V)
        flat = logits.float().view(-1, logits.size(-1))                       # (B*T, V) fp32
        tgt = targets.reshape(-1)                                             # (B*T,)
        ce = F.cross_entropy(flat, tgt, ignore_index=-1)
        if self.config.z_loss > 0:
            keep = (tgt != -1).float()                                        # (B*T,)
            lse = torch.logsumexp(flat, dim=-1)                               # (B*T,)
            # mean over the kept rows, written without boolean indexing (no torch.compile break)
            z = self.config.z_loss * (lse.square() * keep).sum() / keep.sum().clamp_min(1.0)
            loss = ce + z
        else:
            z = torch.zeros((), device=ce.device)
            loss = ce
        self.last_ce, self.last_z = ce.detach(), z.detach()
        return logits, loss

    # ---- optimisation ----

    def configure_optimizer(self, weight_decay: float, lr: float, betas: tuple[float, float] = (0.9, 0.95),
                            eps: float = 1e-8, **adamw_kwargs) -> torch.optim.AdamW:
        """AdamW; weight decay on 2-D parameters (embeddings, matmul weights) only.

        Biases and LayerNorm parameters (1-D) are not decayed. The tied embedding / lm_head
        matrix appears once. Extra keywords go to torch.optim.AdamW (e.g. ``fused=True``).
        """
        params = [p for p in self.parameters() if p.requires_grad]  # parameters() deduplicates
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **adamw_kwargs)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count (the tied embedding / lm_head counted once).

        ``non_embedding=True`` leaves out both the token and the position embeddings: the
        count that scaling laws use (GPT-2 small: 84,953,856 ~ 85M). nanoGPT's
        get_num_params leaves out only the position embeddings.
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wte.weight.numel() + self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward): 6 N + 12 L C T (PaLM appendix B),
        N = parameters without the position embeddings (the tied lm_head matmul counts)."""
        cfg, T = self.config, seq_len or self.config.block_size
        n = self.num_params(non_embedding=False) - self.transformer.wpe.weight.numel()
        return 6 * n + 12 * cfg.n_layer * cfg.n_embd * T

    # ---- diagnostics access ----

    def _check_layer(self, layer: int) -> None:
        if not _is_int(layer) or not 0 <= layer < self.config.n_layer:
            raise ValueError(f"layer must be in 0..{self.config.n_layer - 1}, got {layer!r}")

    def _qkv_heads(self, layer: int, part: int, grad: bool) -> torch.Tensor | None:
        self._check_layer(layer)
        w = self.transformer.h[layer].attn.c_attn.weight                     # (3C, C)
        if grad:
            w = w.grad
            if w is None:
                return None
        C, H = self.config.n_embd, self.config.n_head
        return w.detach()[part * C:(part + 1) * C].view(H, C // H, C)        # (H, D, C)

    def wq_heads(self, layer: int, grad: bool = False) -> torch.Tensor | None:
        """Per-head slices of layer ``layer``'s query projection, (n_head, head_dim, n_embd).

        Head h computes q_h = x @ wq_heads(layer)[h].T. A detached view of the weight (no copy:
        it follows training); ``grad=True`` gives the same slices of ``.grad`` (None if unset).
        """
        return self._qkv_heads(layer, 0, grad)

    def wk_heads(self, layer: int, grad: bool = False) -> torch.Tensor | None:
        """As wq_heads, for the key projection."""
        return self._qkv_heads(layer, 1, grad)

    def wv_heads(self, layer: int, grad: bool = False) -> torch.Tensor | None:
        """As wq_heads, for the value projection."""
        return self._qkv_heads(layer, 2, grad)

    # ---- sampling ----

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (B, T) -> (B, T + max_new_tokens).

        The context is cropped to the last block_size tokens. ``temperature=0`` picks the most
        likely token; ``top_k`` keeps only the k most likely. Call ``model.eval()`` first if the
        model has dropout.
        """
        if not _is_int(max_new_tokens) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        if not _is_real(temperature) or temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature!r}")
        if top_k is not None and (not _is_int(top_k) or top_k < 1):
            raise ValueError(f"top_k must be None or an integer >= 1, got {top_k!r}")
        for _ in range(max_new_tokens):
            ctx = idx[:, -self.config.block_size:]                            # (B, <=block)
            logits, _ = self(ctx)
            logits = logits[:, -1, :].float()                                 # (B, V)
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)                     # (B, 1)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                nxt = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            idx = torch.cat((idx, nxt), dim=1)
        return idx
