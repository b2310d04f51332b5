"""The C kernels (numerics/native.py, csrc/fast_exp.c) against their PyTorch fallback, bit for bit.

The fallback is the reference: tests/attention/test_torch_cpu.py pins ``fexp_u20`` to torch's
own kernel and ``fma32`` to single rounding. Where no C compiler is found, the C tests skip and
every caller runs the fallback.
"""
import math

import pytest
import torch

from flashguard.numerics import native
from flashguard.numerics.fast_exp import fexp_u20, fexp_u20_torch, fma32, fma32_torch

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no C kernels: {native.status()}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _f32(words) -> torch.Tensor:
    return torch.tensor(words, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _softmax_arguments(n: int, seed: int) -> torch.Tensor:
    """x = S - m as softmax rows give it: 0, small negatives, the whole exponent range, and
    random bit patterns of every sign and size."""
    g = torch.Generator().manual_seed(seed)
    parts = [
        torch.zeros(16),
        -torch.rand(n, generator=g) * 2.0,
        -torch.rand(n, generator=g) * 100.0,
        -torch.exp(torch.randn(n, generator=g) * 8.0),
        torch.randint(-(2 ** 31), 2 ** 31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32),
    ]
    return torch.cat(parts)


def test_fexp_u20_c_equals_fallback_on_random_arguments():
    x = _softmax_arguments(200_000, seed=0)
    got, want = fexp_u20(x), fexp_u20_torch(x)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(_bits(got)[~nan], _bits(want)[~nan])


def test_fexp_u20_c_equals_fallback_at_the_edges():
    """Special values, the range limits and their neighbours, and every fp32 pattern in a
    stride over the whole 32-bit space."""
    specials = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x00000001, 0x80000001,
                0x7F7FFFFF, 0xFF7FFFFF, 0x00800000, 0x80800000]
    edges = [w + d for w in (0xC2AEAC50, 0x42B17218, 0x3F800000, 0xBF800000) for d in range(-64, 65)]
    stride = list(range(0, 2 ** 32, 4093))
    x = _f32(specials + edges + stride)
    got, want = fexp_u20(x), fexp_u20_torch(x)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(_bits(got)[~nan], _bits(want)[~nan])


def test_fexp_u20_keeps_shape_and_takes_strided_input():
    x = -torch.rand(3, 5, 40)[..., ::2]                 # not contiguous
    got = fexp_u20(x)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert torch.equal(_bits(got), _bits(fexp_u20_torch(x)))


def test_fma32_c_equals_fallback():
    g = torch.Generator().manual_seed(1)
    n = 300_000
    a = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
    b = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
    # c near -a*b: the cancellations where a double rounding would show
    c = torch.where(torch.rand(n, generator=g) < 0.5, -(a.double() * b.double()).float(),
                    torch.randn(n, generator=g))
    assert torch.equal(_bits(fma32(a, b, c)), _bits(fma32_torch(a, b, c)))


def test_fma32_broadcasts_like_the_fallback():
    a, b, c = torch.randn(4, 1, 7), torch.randn(1, 3, 7), torch.tensor(0.25)
    got = fma32(a, b, c)
    assert got.shape == (4, 3, 7)
    assert torch.equal(_bits(got), _bits(fma32_torch(a, b, c)))


def test_fallback_is_used_when_disabled(monkeypatch):
    monkeypatch.setenv("FLASHGUARD_NATIVE", "0")
    assert native.library() is None and "FLASHGUARD_NATIVE=0" in native.status()
    assert fexp_u20(torch.zeros(1)).item() == pytest.approx(math.exp(0) - 5.34e-5, abs=1e-6)


def test_the_status_follows_the_switch_both_ways(monkeypatch):
    """Off and on again in one process (the benchmarks' fallback arms): status() says what holds now,
    not what the last call under FLASHGUARD_NATIVE=0 said."""
    monkeypatch.delenv("FLASHGUARD_NATIVE", raising=False)
    lib, loaded = native.library(), native.status()
    monkeypatch.setenv("FLASHGUARD_NATIVE", "0")
    assert native.library() is None and "FLASHGUARD_NATIVE=0" in native.status()
    monkeypatch.delenv("FLASHGUARD_NATIVE")
    assert native.library() is lib and native.status() == loaded and "FLASHGUARD_NATIVE=0" not in loaded


def test_a_failed_build_falls_back_with_a_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_status", native._status)
    monkeypatch.setattr(native, "_loaded", native._loaded)
    monkeypatch.setenv("FLASHGUARD_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "flashguard-no-such-compiler")
    assert native.library() is None
    assert "no C compiler" in native.status()
    assert fexp_u20(torch.zeros(2)).shape == (2,)   # the fallback answers


@pytest.mark.parametrize("precision", ["torch-cpu", "fa2-cuda"])
def test_training_is_bit_identical_with_and_without_the_c_kernels(precision, monkeypatch):
    """Three AdamW steps of the micro GPT in bf16 autocast through a preset that uses the C
    kernels (torch-cpu: fexp_u20; fa2-cuda: fma32 in its exp2 step): the losses and every weight
    bit for bit the same with the C path and with the PyTorch fallback."""
    from flashguard.model import GPT, AttentionSpec, model_config

    def train():
        torch.manual_seed(0)
        cfg = model_config("micro")
        model = GPT(cfg, AttentionSpec(backend="flash", precision=precision))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(x, torch.roll(x, -1, 1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses, [p.detach().clone() for p in model.parameters()]

    losses_c, params_c = train()
    monkeypatch.setenv("FLASHGUARD_NATIVE", "0")
    losses_py, params_py = train()
    assert losses_c == losses_py
    assert all(torch.equal(a, b) for a, b in zip(params_c, params_py))
