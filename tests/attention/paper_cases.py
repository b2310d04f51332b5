"""Cases on which the ``paper`` preset must equal the study's reference code bit for bit.

Shared by tests/attention/test_paper_golden.py and tools/make_paper_golden.py.
"""
from __future__ import annotations

import hashlib

import torch


def _case(b, h, t, d, causal, stable, block, seed, amp=1.0, ties=False):
    return dict(b=b, h=h, t=t, d=d, causal=causal, stable=stable, block=block, seed=seed, amp=amp, ties=ties)


CASES = [
    # the reference's own tile size, several tiles per row, T not a multiple of it
    _case(1, 2, 1100, 64, True, False, 512, 1),
    _case(1, 2, 1100, 64, True, True, 512, 2),
    _case(1, 2, 1100, 64, False, False, 512, 3),
    _case(1, 2, 1100, 64, False, True, 512, 4),
    # other tile sizes, awkward lengths and head dims
    _case(2, 3, 97, 64, False, False, 32, 5),
    _case(2, 3, 97, 64, True, True, 32, 6),
    _case(2, 2, 300, 59, True, False, 64, 7),
    _case(2, 2, 300, 59, True, True, 128, 8),
    # repeated keys and large logits: tied row maxima, where STABLE=1 changes the arithmetic
    _case(1, 2, 256, 64, True, False, 64, 9, amp=3.0, ties=True),
    _case(1, 2, 256, 64, True, True, 64, 10, amp=3.0, ties=True),
    _case(1, 2, 600, 64, False, True, 512, 11, amp=3.0, ties=True),
    _case(1, 2, 600, 64, True, True, 512, 12, amp=3.0, ties=True),
]


def make_inputs(case):
    g = torch.Generator().manual_seed(case["seed"])
    shape = (case["b"], case["h"], case["t"], case["d"])
    q, k, v, do = (torch.randn(shape, generator=g) * case["amp"] for _ in range(4))
    if case["ties"]:
        k[..., ::7, :] = k[..., :1, :].clone()  # every 7th key repeats key 0: tied scores in each row
    return tuple(t.bfloat16() for t in (q, k, v, do))


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.int16).numpy().tobytes()).hexdigest()


def platform_tag() -> dict:
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}
