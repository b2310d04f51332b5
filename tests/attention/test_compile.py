"""torch.compile: flashguard's attention as custom operators (flashguard.attention.ops).

Compiling is slow on a small CPU, so the fast tests use the ``aot_eager`` backend: it runs
dynamo, the fake (meta) implementations and AOT autograd - everything that must work for the
operators to be captured - and then executes the graph op by op, so the comparison with eager
mode is exact. The inductor test (generated C++ for the rest of the model) is marked slow.
"""
from __future__ import annotations

import pytest
import torch

from flashguard.attention import flash_attention
from flashguard.attention.dropout import draw_seed
from flashguard.attention.ops import flash_attention_op
from flashguard.model import GPT, AttentionSpec, model_config
from flashguard.numerics import get_policy

FWD = torch.ops.flashguard.flash_attention_fwd.default
BWD = torch.ops.flashguard.flash_attention_bwd.default


def _qkv(shape=(1, 2, 9, 4), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]


def test_opcheck_forward_and_backward_ops():
    q, k, v = _qkv()
    keep = torch.rand(9, 9, generator=torch.Generator().manual_seed(1)) > 0.3
    seed = torch.tensor([12345, 678], dtype=torch.int64)
    cases = [
        (q, k, v, None, None, None, True, 0.5, "fa2", "none", 4, 4, None, 0.0),
        # mask, dropout, soft-cap, high-precision O for delta, a stabilizer with options
        (q, k, v, keep, None, seed, False, 0.5, "paper[delta_source=o_highp]", "paper:beta=7.0,tol=0.001", 4, 8,
         3.0, 0.3),
    ]
    for args in cases:
        result = torch.library.opcheck(FWD, args)
        assert set(result.values()) == {"SUCCESS"}, result
    # the backward op on the forward's outputs (it has no autograd of its own: no double backward)
    args = cases[1]
    with torch.no_grad():
        outs = FWD(*args)
    plain = [t.detach() for t in (q, k, v)]
    bwd_args = (torch.randn_like(outs[0]), *plain, *outs, keep, None, seed, False, 0.5,
                "paper[delta_source=o_highp]", 4, 8, 3.0, 0.3)
    result = torch.library.opcheck(BWD, bwd_args, test_utils=("test_schema", "test_faketensor",
                                                               "test_aot_dispatch_dynamic"))
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("precision", ["fa2", "fa2-e4m3", get_policy("paper").replace(delta_source="dp_p")])
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_operators_called_eagerly_match_flash_attention_bit_for_bit(precision, dropout_p):
    """The operators and the eager autograd.Function run the same code: same bits."""
    q, k, v = _qkv((2, 2, 13, 8))
    do = torch.randn(2, 2, 13, 8, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(7)
    ref = flash_attention(q, k, v, is_causal=True, precision=precision, block_q=4, block_k=8, dropout_p=dropout_p)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    torch.manual_seed(7)
    seed = draw_seed() if dropout_p else None
    out = flash_attention_op(q, k, v, seed=seed, causal=True, scale=8 ** -0.5, precision=get_policy(precision),
                             block_q=4, block_k=8, dropout_p=dropout_p)
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


def _gpt_step(model, fn, idx, tgt):
    model.zero_grad(set_to_none=True)
    _, loss = fn(idx, tgt)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _micro_gpt(precision):
    torch.manual_seed(0)
    model = GPT(model_config("micro"), AttentionSpec(backend="flash", precision=precision, block_q=16, block_k=16))
    g = torch.Generator().manual_seed(1)
    return model, torch.randint(0, 256, (2, 32), generator=g), torch.randint(0, 256, (2, 32), generator=g)


def test_compiled_gpt_fullgraph_matches_eager_bit_for_bit():
    """The micro GPT with flash attention (bf16 "fa2" arithmetic inside an fp32 model, 2 layers)
    captures as one graph, and its loss and every parameter gradient equal eager mode's exactly."""
    torch._dynamo.reset()
    model, idx, tgt = _micro_gpt("fa2")
    loss, grads = _gpt_step(model, model, idx, tgt)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    c_loss, c_grads = _gpt_step(model, compiled, idx, tgt)
    assert torch.equal(c_loss, loss)
    assert all(torch.equal(a, b) for a, b in zip(c_grads, grads))


def test_compiled_dropout_draws_the_eager_seed_and_is_reproducible():
    """Under aot_eager the seed is drawn by the same aten op from torch's default generator as in
    eager mode, so even dropout matches eager bit for bit (inductor draws with its own generator:
    reproducible from torch.manual_seed, but other bits)."""
    torch._dynamo.reset()
    q, k, v = _qkv((1, 2, 16, 8))

    def f(q, k, v):
        return flash_attention(q, k, v, is_causal=True, precision="fp32", block_q=8, block_k=8, dropout_p=0.4)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    runs = []
    for fn in (f, compiled, compiled):
        torch.manual_seed(11)
        out = fn(q, k, v)
        runs.append((out.detach(), *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0]))


def test_triton_kernel_is_refused_under_compile():
    q, k, v = _qkv()
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: flash_attention(q, k, v, kernel="triton"), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="kernel='triton'"):
        f(q, k, v)


@pytest.mark.slow
def test_inductor_compiled_gpt_matches_eager():
    """The default backend (inductor; about 3.5 minutes of C++ compilation on 2 CPU cores). The
    attention operators run the same code, but inductor fuses the rest of the model (layer norms,
    GELU, the loss and their backward) with its own reduction order: the loss agrees exactly
    here and the gradients to fp32 rounding (measured: max abs difference 4.9e-7)."""
    torch._dynamo.reset()
    model, idx, tgt = _micro_gpt("fa2")
    loss, grads = _gpt_step(model, model, idx, tgt)
    compiled = torch.compile(model, fullgraph=True)
    c_loss, c_grads = _gpt_step(model, compiled, idx, tgt)
    torch.testing.assert_close(c_loss, loss, rtol=1e-6, atol=1e-6)
    for a, b in zip(c_grads, grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
