"""numerics/bf16_gemm.py: torch's bf16 matmul in C, bit for bit, where torch's is ATen's portable gemm.

The three summation orders are checked against torch's own matmul on this machine where it
uses them (AVX2 without oneDNN bf16 kernels); everywhere the probe must show why the C path is
off, and ``matmul`` must then be torch's own. The probe is tested for power: it tells each order
from the other two.
"""
from __future__ import annotations

import pytest
import torch

from flashguard.numerics import bf16_gemm, native

needs_c = pytest.mark.skipif(native.library() is None, reason="no C compiler: the C kernels are not built")
on_avx2 = pytest.mark.skipif(not bf16_gemm.verified(),
                             reason="torch's bf16 matmul here is not ATen's portable gemm (oneDNN bf16 kernels, "
                                    "or no C kernels): the C path is off")


def _bits(x):
    return x.contiguous().view(torch.int16)


@needs_c
@pytest.mark.parametrize("batch,m,k,n", [(2, 37, 130, 45), (1, 64, 64, 64), (3, 20, 257, 33)])
def test_the_probe_tells_each_order_from_the_others(batch, m, k, n):
    """On the probe's operands any two orders disagree in most outputs, so a probe that passes
    pins the order (random operands alone differ in ~1e-4 of them: a pass would say nothing)."""
    a, b = bf16_gemm._probe_operands(torch.Generator().manual_seed(k), batch, m, k, n)
    outs = {how: _bits(bf16_gemm.product(a, b, how)) for how in bf16_gemm.ORDERS}
    for x in bf16_gemm.ORDERS:
        for y in bf16_gemm.ORDERS:
            if x < y:
                assert (outs[x] != outs[y]).float().mean() > 0.3, (x, y)


@needs_c
def test_below_one_chunk_dot8_is_seq():
    """With k < 64 the dot product's registers stay zero and every product is added one at a
    time: dot8 is seq there, bit for bit, and ilp4 is not."""
    a, b = bf16_gemm._probe_operands(torch.Generator().manual_seed(7), 1, 130, 7, 70)
    outs = {how: _bits(bf16_gemm.product(a, b, how)) for how in bf16_gemm.ORDERS}
    assert torch.equal(outs["dot8"], outs["seq"])
    assert (outs["ilp4"] != outs["seq"]).float().mean() > 0.3


def test_orders_follow_the_layouts():
    a = torch.zeros(2, 8, 6, dtype=torch.bfloat16)
    b = torch.zeros(2, 6, 5, dtype=torch.bfloat16)
    col = bf16_gemm._laid_out
    assert bf16_gemm.order(a, b) == "ilp4"
    assert bf16_gemm.order(col(a, "col"), col(b, "col")) == "ilp4"
    assert bf16_gemm.order(a, col(b, "col")) == "dot8"
    assert bf16_gemm.order(col(a, "col"), b) == "seq"
    assert bf16_gemm.order(a[..., :1], b[..., :1, :]) is None  # k = 1: no layout to read
    assert bf16_gemm.order(a[..., ::2], b[..., :3, :]) is None  # strided: torch copies it first


@on_avx2
@pytest.mark.parametrize("la", ["row", "col"])
@pytest.mark.parametrize("lb", ["row", "col"])
@pytest.mark.parametrize("shape", [(2, 3, 200, 64, 70), (1, 2, 65, 129, 64), (24, 1, 31, 64, 33)])
def test_matmul_is_torchs_own_bit_for_bit(la, lb, shape):
    *batch, m, k, n = shape
    a, b = bf16_gemm._probe_operands(torch.Generator().manual_seed(m + k), 1, m * int(torch.tensor(batch).prod()), k, n)
    a = bf16_gemm._laid_out(a.view(*batch, m, k), la)
    b = bf16_gemm._laid_out(b.expand(int(torch.tensor(batch).prod()), k, n).reshape(*batch, k, n), lb)
    assert torch.equal(_bits(bf16_gemm.matmul(a, b)), _bits(torch.matmul(a, b)))


@on_avx2
def test_every_contraction_length_in_every_layout():
    """k from 2 to 140: no chunk, chunks, the tail register and the scalar tail in every mix
    (a first model that put the tail into the main register missed k = 59 and 100)."""
    g = torch.Generator().manual_seed(11)
    for k in range(2, 141):
        a, b = bf16_gemm._probe_operands(g, 1, 17, k, 19)
        for la in ("row", "col"):
            for lb in ("row", "col"):
                a3, b3 = bf16_gemm._laid_out(a, la), bf16_gemm._laid_out(b, lb)
                got = bf16_gemm.product(a3, b3, bf16_gemm.order(a3, b3))
                assert torch.equal(_bits(got), _bits(torch.matmul(a3, b3))), (k, la, lb)


@on_avx2
def test_flash_attention_outputs_are_unchanged_by_the_c_path(monkeypatch):
    """The paper preset's forward and gradients with the C path and with torch's own matmul."""
    from flashguard import flash_attention
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 3, 200, 64, generator=g).bfloat16().requires_grad_() for _ in range(3))
    do = torch.randn(1, 3, 200, 64, generator=g).bfloat16()

    def run():
        o = flash_attention(q, k, v, is_causal=True, precision="paper", block_q=64, block_k=64)
        grads = torch.autograd.grad(o, (q, k, v), do)
        return [_bits(t) for t in (o, *grads)]

    fast = run()
    monkeypatch.setattr(bf16_gemm, "verified", lambda: False)
    slow = run()
    assert all(torch.equal(x, y) for x, y in zip(fast, slow))


def test_off_where_unverified(monkeypatch):
    """Without the verification (another CPU, no compiler), matmul is torch's own call."""
    monkeypatch.setattr(bf16_gemm, "verified", lambda: False)
    called = []
    monkeypatch.setattr(bf16_gemm, "product", lambda *a: called.append(a))
    a = torch.randn(2, 64, 64).bfloat16()
    assert torch.equal(bf16_gemm.matmul(a, a), a @ a)
    assert not called


def test_not_avx2_is_not_verified(monkeypatch):
    bf16_gemm.verified.cache_clear()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    try:
        assert bf16_gemm.verified() is False
    finally:
        bf16_gemm.verified.cache_clear()


def test_a_dispatch_mode_sees_torchs_own_product():
    """Under a TorchDispatchMode (the exactness certificate, FakeTensor tracing) the product is
    torch's aten op, which the mode observes; outside one, on AVX2, it is the C kernel's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    bf16_gemm.verified()  # the probe runs outside the mode
    a = torch.randn(2, 64, 64).bfloat16()
    with Seen() as seen:
        out = bf16_gemm.matmul(a, a)
    assert any(op.startswith(("bmm", "mm")) for op in seen.ops), seen.ops
    assert torch.equal(_bits(out), _bits(a @ a))


def _linear_grads(x, w, fast: bool, monkeypatch):
    """(out, grad x, grad w) of a linear layer under CPU bf16 autocast, the C path on or off;
    w is used twice (a tied weight: an embedding gather and the linear) as in the GPT."""
    monkeypatch.setattr(bf16_gemm, "verified", (lambda: True) if fast else (lambda: False))
    from flashguard.model.linear import Linear
    lin = Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    xx = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lin(xx)
        loss = (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum() + lin.weight[:3].sum()
    loss.backward()
    return [t.detach().contiguous() for t in (out, xx.grad, lin.weight.grad)]


@on_avx2
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 33, 72), (130, 72)])
def test_autocast_linear_is_torchs_bit_for_bit(dtype, shape, monkeypatch):
    """The model's Linear under bf16 autocast: output, input grad and (tied) weight grad equal
    torch's F.linear path to the bit, fp32 and bf16 inputs, 3D and 2D; and the C path ran."""
    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(*shape, generator=g).to(dtype)
    w = torch.randn(96, 72, generator=g) * 0.1
    calls = []
    real = bf16_gemm.product
    monkeypatch.setattr(bf16_gemm, "product", lambda *a: calls.append(a[2]) or real(*a))
    fast = _linear_grads(x, w, True, monkeypatch)
    assert sorted(set(calls)) == ["dot8", "ilp4", "seq"]  # forward, grad x, grad w
    slow = _linear_grads(x, w, False, monkeypatch)
    for a, b in zip(fast, slow):
        assert a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


def test_autocast_linear_applies_only_where_modelled(monkeypatch):
    monkeypatch.setattr(bf16_gemm, "verified", lambda: True)
    x, w = torch.randn(8, 16), torch.randn(4, 16)
    assert not bf16_gemm.autocast_linear_applies(x, w, None)  # no autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert bf16_gemm.autocast_linear_applies(x, w, None)
        assert not bf16_gemm.autocast_linear_applies(x, w, torch.zeros(4))  # a bias: torch adds it in the gemm
        assert not bf16_gemm.autocast_linear_applies(x.double(), w, None)
    with torch.autocast("cpu", dtype=torch.float16):
        assert not bf16_gemm.autocast_linear_applies(x, w, None)


@on_avx2
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("batch", [1, 2, 5])
def test_threads_split_the_outputs_not_the_sums(threads, batch, monkeypatch):
    """On several threads each output is still summed whole by one call: the bits of one thread."""
    monkeypatch.setattr(bf16_gemm, "_MIN_PARALLEL", 0)
    a, b = bf16_gemm._probe_operands(torch.Generator().manual_seed(batch), batch, 37, 100, 45)
    n = torch.get_num_threads()
    try:
        for how in bf16_gemm.ORDERS:
            torch.set_num_threads(1)
            one = bf16_gemm.product(a, b, how)
            torch.set_num_threads(threads)
            many = bf16_gemm.product(a, b, how)
            assert torch.equal(_bits(one), _bits(many)), how
    finally:
        torch.set_num_threads(n)


def test_pieces_cover_every_output_once():
    for batch, m, threads in [(1, 10, 2), (3, 7, 2), (2, 5, 4), (8, 3, 3), (1, 1, 4)]:
        seen = torch.zeros(batch, m, dtype=torch.int64)
        for b0, b1, i0, i1 in bf16_gemm._pieces(batch, m, threads):
            seen[b0:b1, i0:i1] += 1
        assert bool((seen == 1).all()), (batch, m, threads)
