"""A GPT-2 language model whose attention is chosen per layer.

Reads top to bottom: configuration (GPTConfig), the modules (CausalSelfAttention, MLP, Block),
the model (GPT). Which attention a layer runs, and the call into flashguard.attention, is
``.attention`` (AttentionSpec, backends sdpa | flash | math); the per-head weight views the
probes read are ``.heads``. Shapes in comments use B = batch, T = sequence length, C = n_embd,
H = n_head, D = head_dim = C // H, V = vocab_size.

Conventions shared with nanoGPT, so checkpoints map one to one: module names
``transformer.{wte,wpe,h.<i>.{ln_1,attn.c_attn,attn.c_proj,ln_2,mlp.c_fc,mlp.c_proj},ln_f}``
and ``lm_head`` (tied to ``transformer.wte``); targets equal to -1 are ignored by the loss.

``dropout`` applies to the embeddings and to both residual branches, as in GPT-2;
``attn_dropout`` to the attention probabilities, in every backend, while the model trains
(.attention says how). Both default to 0, as the study trains.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import AttentionSpec, attend, check_layer_spec, effective_backend
from .checks import is_int, is_real
from .heads import HeadWeights
from .linear import Linear

__all__ = ["GPTConfig", "CausalSelfAttention", "MLP", "Block", "GPT"]


# --------------------------------------------------------------------------------------------
# configuration

@dataclass(frozen=True)
class GPTConfig:
    """Shape and training-time options of the model. Every field is checked on construction."""

    block_size: int = 1024       # longest input (number of learned positions)
    vocab_size: int = 50304      # GPT-2's 50257 padded up to a multiple of 64
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768            # must be divisible by n_head
    bias: bool = False           # biases in Linear and LayerNorm (the study trains without)
    dropout: float = 0.0         # embeddings and residual branches
    attn_dropout: float = 0.0    # attention probabilities, while training (dropout_p of the attention call)
    qk_layernorm: bool = False   # LayerNorm over head_dim on q and k (weights shared by heads)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap); None = off
    z_loss: float = 0.0          # loss += z_loss * mean(logsumexp(logits)^2)  (PaLM)

    def __post_init__(self):
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be an integer >= 1, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by "
                             f"n_head ({self.n_head})")
        for name in ("bias", "qk_layernorm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("dropout", "attn_dropout"):
            value = getattr(self, name)
            if not is_real(value) or not 0.0 <= value < 1.0:
                raise ValueError(f"GPTConfig.{name} must be a number in [0, 1), got {value!r}")
        cap = self.attn_softcap
        if cap is not None and (not is_real(cap) or not math.isfinite(cap) or cap <= 0):
            raise ValueError(f"GPTConfig.attn_softcap must be None or a finite number > 0, got {cap!r}")
        if not is_real(self.z_loss) or not math.isfinite(self.z_loss) or self.z_loss < 0:
            raise ValueError(f"GPTConfig.z_loss must be a finite number >= 0, got {self.z_loss!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# modules

class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection; backend from ``spec``."""

    def __init__(self, config: GPTConfig, spec: AttentionSpec, layer_index: int):
        super().__init__()
        self.n_head, self.n_embd, self.head_dim = config.n_head, config.n_embd, config.head_dim
        self.layer_index = layer_index
        self.softcap = config.attn_softcap
        self.attn_dropout = float(config.attn_dropout)
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # rows: q | k | v
        self.c_proj = Linear(config.n_embd, config.n_embd, bias=config.bias)
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
        check_layer_spec(spec, self.softcap)
        self._spec = spec

    @property
    def effective_backend(self) -> str:
        """The backend that actually runs (``sdpa`` runs ``math`` under a softcap)."""
        return effective_backend(self.spec, self.softcap)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of (B, H, T, D) tensors with this layer's spec -> (B, H, T, D), with the
        attention dropout while training (none in eval mode).
        A method of its own so that the probes can wrap it (flashguard.diagnostics.capture)."""
        return attend(self.spec, q, k, v, softcap=self.softcap,
                      dropout_p=self.attn_dropout if self.training else 0.0)

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
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
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

class GPT(HeadWeights, nn.Module):
    """GPT-2 with per-layer attention backends.

    ``forward(idx, targets=None) -> (logits, loss)``:
      * with targets: logits (B, T, V) and the loss to minimise = cross-entropy + z-loss term.
        The parts of the last such call are kept, detached, as ``model.last_ce`` (pure
        cross-entropy, for logging) and ``model.last_z`` (the added z-loss term, 0 when
        z_loss = 0), so ``loss == last_ce + last_z``.
      * without targets: logits of the last position only, (B, 1, V), and loss None.
    Logits are returned in the compute dtype (bf16 under autocast); the loss is computed in fp32.
    ``wq_heads`` / ``wk_heads`` / ``wv_heads`` (per-head weight views, for the probes) come from
    .heads.HeadWeights.
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
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
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

    # ---- sampling ----

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (B, T) -> (B, T + max_new_tokens).

        The context is cropped to the last block_size tokens. ``temperature=0`` picks the most
        likely token; ``top_k`` keeps only the k most likely. Call ``model.eval()`` first if the
        model has dropout.
        """
        if not is_int(max_new_tokens) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        if not is_real(temperature) or temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature!r}")
        if top_k is not None and (not is_int(top_k) or top_k < 1):
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
