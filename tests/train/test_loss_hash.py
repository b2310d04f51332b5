"""A short training run's numbers, pinned: speed work on the attention, the model or the optimizer
step must leave every loss and every parameter bit for bit where it was.

Eight AdamW steps of the micro GPT under bf16 autocast on seeded random tokens, on one thread,
per attention arithmetic (``paper`` in one tile and in 16 x 16 tiles, ``fa2`` likewise, sdpa as
a control, and ``torch-cpu`` and ``fa2-cuda``, which run the C kernels of numerics/native.py). The hash covers each step's loss (float.hex) and, after the last step, the bytes of
every parameter. The recorded hashes were made before the attention's speed-ups (masked fills
as bitwise ops, the exp of -inf skipped, matmul operands laid out once per call, no torch.cat of
a single tile) and hold after them. bf16 gemm kernels round differently on other CPUs (oneDNN
picks AMX, AVX512-BF16, AVX512 or AVX2 kernels by the CPU it finds), so the hashes are compared
only on the platforms they were recorded on (``_platform``); elsewhere the test checks that two
runs give the same hash and skips the comparison, saying so.
"""
from __future__ import annotations

import hashlib

import pytest
import torch
import torch.nn.functional as F

from flashguard.model import GPT, AttentionSpec, model_config

MICRO = model_config("micro")
SPECS = {
    "paper": AttentionSpec("flash", precision="paper"),
    "paper-16x16": AttentionSpec("flash", precision="paper", block_q=16, block_k=16),
    "fa2": AttentionSpec("flash", precision="fa2"),
    "fa2-16x16": AttentionSpec("flash", precision="fa2", block_q=16, block_k=16),
    "sdpa": AttentionSpec("sdpa"),
    "torch-cpu": AttentionSpec("flash", precision="torch-cpu"),   # numerics/native.py's fexp_u20
    "fa2-cuda": AttentionSpec("flash", precision="fa2-cuda"),     # and its fma32
}
STEPS = 8

# recorded at 1 thread on torch 2.13.0+cpu, _platform() == RECORDED_PLATFORM (before the speed-ups)
RECORDED = {
    "paper": "8c569a53a5dd9840",
    "paper-16x16": "8a0e429830a4e382",
    "fa2": "035aefc789c2beed",
    "fa2-16x16": "4a5147494cef0647",
    "sdpa": "d3ba6aacc170d4e3",
}
RECORDED_PLATFORM = ("2.13.0+cpu", "c3792b94b67b8918")
# and on a second platform (an AMD EPYC: oneDNN's AVX512-BF16 kernels without AMX), recorded at
# commit 23c7bb9, before the C kernels (numerics/native.py): every arithmetic, torch-cpu and
# fa2-cuda included, hashes alike before and after them
RECORDED_ELSEWHERE = {("2.13.0+cpu", "33c8dcb075af8cfb"): {
    "paper": "1c566eb60ebe808a",
    "paper-16x16": "f04b2ea86ba5d81f",
    "fa2": "37ddcde5aa376751",
    "fa2-16x16": "2bb84417a1fc1d99",
    "sdpa": "0c7b9182e5891016",
    "torch-cpu": "13dba22843841d8b",
    "fa2-cuda": "2ce3ff0cbf04b80c",
}, ("2.13.0+cpu", "02f2d89967f34cc3"): {
    # a third (an AMD EPYC with AVX2 only: ATen's portable bf16 gemm), recorded at commit d55ff59,
    # before the C bf16 products (numerics/bf16_gemm.py), which hash alike
    "paper": "02bc0a7cf11a00ef",
    "paper-16x16": "bda9268fcb67afb3",
    "fa2": "b2c1a341208653d2",
    "fa2-16x16": "77eb17c1d1c1b199",
    "sdpa": "fef1f45e9567821c",
    "torch-cpu": "ef090cb981ba17f9",
    "fa2-cuda": "8e24bd6c72f48ac1",
}}


def _platform() -> str:
    """A hash of this machine's CPU arithmetic on random data (bf16 and fp32 matmuls, exp,
    softmax, LayerNorm, GELU): platforms whose kernels round differently get different ones."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 64, generator=g), torch.randn(64, 192, generator=g)
    h = hashlib.sha256()
    for t in (a.bfloat16() @ b.bfloat16(), a @ b, torch.exp(a), torch.exp(a.bfloat16()), torch.softmax(a, -1),
              F.layer_norm(a, (64,)), F.gelu(a, approximate="tanh"), F.gelu(a.bfloat16(), approximate="tanh")):
        h.update(t.float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _run(spec: AttentionSpec) -> str:
    """sha256 (16 hex digits) of the losses of STEPS training steps and of the final parameters."""
    torch.manual_seed(0)
    model = GPT(MICRO, spec)
    opt = model.configure_optimizer(weight_decay=0.1, lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(1)
    h = hashlib.sha256()
    for _ in range(STEPS):
        x = torch.randint(0, MICRO.vocab_size, (4, MICRO.block_size), generator=g)
        y = torch.randint(0, MICRO.vocab_size, (4, MICRO.block_size), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        h.update(float(loss.item()).hex().encode())
    for name, p in model.named_parameters():
        h.update(name.encode() + p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


# one_thread (tests/conftest.py): the recorded hashes are of one thread's arithmetic; with more,
# CPU reductions split differently
@pytest.mark.parametrize("name", sorted(SPECS))
def test_training_losses_and_parameters_hash_as_recorded(name, one_thread):
    got = _run(SPECS[name])
    assert _run(SPECS[name]) == got  # deterministic on this machine, whatever the platform
    here = (torch.__version__, _platform())
    platforms = {RECORDED_PLATFORM: RECORDED, **RECORDED_ELSEWHERE}
    recorded = platforms.get(here, {})
    if name not in recorded:
        where = [p for p, r in platforms.items() if name in r]
        pytest.skip(f"{name}: hashes recorded on {where}, this is {here} (its kernels round differently)")
    assert got == recorded[name]
