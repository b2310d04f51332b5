"""Constructed attention problems with known answers (shared by the diagnostics tests)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

MICRO = Path(__file__).resolve().parents[2] / "configs" / "micro.toml"


# A fixture here rather than in a conftest.py: a second tests/*/conftest.py module would shadow
# tests/train/conftest.py for its `from conftest import ...` when both folders are collected.
@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A small byte-level corpus prepared by the real `prepare text` path (as tests/train)."""
    from flashguard.data import prepare_text
    src = tmp_path_factory.mktemp("diag_corpus")
    rng = random.Random(0)
    words = ["attention", "flash", "bf16", "rounding", "bias", "gradient", "softmax", "tie", "max", "row"]
    for i in range(40):
        (src / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words) for _ in range(400)) + "\n")
    out = tmp_path_factory.mktemp("diag_data")
    prepare_text([str(src)], out, tokenizer="byte", progress=False, overwrite=True)
    return out


def micro_overrides(data: Path, **extra) -> list[str]:
    """Overrides of configs/micro.toml for a seconds-long run on the test corpus (as tests/train)."""
    items = {"data.dir": f'"{data}"', "train.progress": "false", "train.steps": "6",
             "train.checkpoint_every": "3", "train.eval_every": "3", "train.eval_batches": "1"}
    items.update({k: str(v) for k, v in extra.items()})
    return [f"{k}={v}" for k, v in items.items()]


def tied_problem(seed=0, B=2, H=2, T=64, D=64, neg=0.9, top=3.0, dtype=torch.bfloat16):
    """Every query row i has its own pair of tied maximal keys; every other key scores 9 to 14
    below them (Pbar = exp(-9..-14): the rest of the row only sets sticky bits of the PV sum).

    q_i = 8 e_i and scale = 1/sqrt(64), so S[i, j] = k_j[i] exactly (one non-zero product).
    V is mostly negative (a fraction ``neg`` of entries in (-2, -1], the rest in [1, 2)), and
    dO of row i is the mean V of its two tied keys plus noise: dO correlates positively with V.
    """
    g = torch.Generator().manual_seed(seed)
    q = torch.zeros(B, H, T, D)
    q[..., torch.arange(T), torch.arange(T)] = 8.0
    s = top - 9.0 - 5.0 * torch.rand(B, H, T, T, generator=g)
    pairs = torch.stack([torch.randperm(T, generator=g)[:2] for _ in range(B * H * T)]).view(B, H, T, 2)
    s.scatter_(-1, pairs, top)
    k = torch.zeros(B, H, T, D)
    k[..., :T] = s.transpose(-2, -1)
    v = -(1.0 + torch.rand(B, H, T, D, generator=g))
    v = v * torch.where(torch.rand(B, H, T, D, generator=g) < neg, 1.0, -1.0)
    v_pair = torch.gather(v.unsqueeze(2).expand(B, H, T, T, D), 3,
                          pairs.unsqueeze(-1).expand(B, H, T, 2, D)).mean(3)
    do = v_pair + 0.3 * torch.randn(B, H, T, D, generator=g)
    return [t.to(dtype) for t in (q, k, v, do)]


def distinct_problem(B=1, H=2, T=32, D=64, seed=0, dtype=torch.bfloat16):
    """Scores S[i, :] = a permutation of T values 0.4 apart in [-10, 3): no two equal in bf16."""
    g = torch.Generator().manual_seed(seed)
    q = torch.zeros(B, H, T, D)
    q[..., torch.arange(T), torch.arange(T)] = 8.0  # S = k_j[i] with scale 1/sqrt(64)
    levels = 3.0 - 0.40625 * torch.arange(T, dtype=torch.float32)   # multiples of 1/32: exact in bf16
    s = torch.stack([levels[torch.randperm(T, generator=g)] for _ in range(B * H * T)]).view(B, H, T, T)
    k = torch.zeros(B, H, T, D)
    k[..., :T] = s.transpose(-2, -1)
    v = torch.randn(B, H, T, D, generator=g)
    do = torch.randn(B, H, T, D, generator=g)
    return [t.to(dtype) for t in (q, k, v, do)]
