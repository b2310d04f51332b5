"""The check's parts on their own: torch's dispatch as torch decides it, the verdict rule and
the choice of the fix."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashguard.attention.error_stats import bias_stats, leans_beyond_floor
from flashguard.check.capture import _as_received
from flashguard.check.dispatch import torch_choice
from flashguard.check.verdict import HIGH_BIAS_RATIO, TIE_RATE_LOW, choose_fix, layer_verdict, overall_verdict


def _qkv(dtype=torch.bfloat16, d_v=16):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 8, 16, generator=g, dtype=dtype) for _ in range(2))
    return q, k, torch.randn(1, 2, 8, d_v, generator=g, dtype=dtype)


def test_cpu_dispatch_follows_torch_rules():
    q, k, v = _qkv()
    assert torch_choice(q, k, v, is_causal=True) == "flash"
    assert torch_choice(*_qkv(torch.float32), is_causal=True) == "flash"
    assert torch_choice(q, k, v, dropout_p=0.1) == "math"             # the CPU flash kernel takes no dropout
    assert torch_choice(*_qkv(d_v=8)) == "math"                       # q, k and v need one head dim
    with sdpa_kernel(SDPBackend.MATH):
        assert torch_choice(q, k, v, is_causal=True) == "math"       # the caller's enable flags count


def test_autocast_casts_the_arguments_before_the_kernel_sees_them():
    q, k, v = _qkv(torch.float32)
    v = v.bfloat16()                      # a Llama under autocast: RoPE leaves q, k in fp32
    assert torch_choice(q, k, v, is_causal=True) == "math"           # mixed dtypes, as called outside autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _as_received(q, k, v, None)
    assert [t.dtype for t in got[:3]] == [torch.bfloat16] * 3 and got[3] is None
    assert torch_choice(*got[:3], is_causal=True) == "flash"


def _measurement(own_mean: float, vs_mean: float, *, bad_rows=0, n=400):
    """A stand-in for the lab's Measurement: O with the given lean, delta without one."""
    noise = torch.linspace(-1, 1, n, dtype=torch.float64)[torch.randperm(n, generator=torch.Generator().manual_seed(1))]
    own, vs = bias_stats(own_mean + noise, "sequence"), bias_stats(vs_mean + noise, "sequence")
    flat = bias_stats(noise, "sequence")
    return SimpleNamespace(o=own, o_vs_floor=vs, delta=flat, delta_vs_floor=flat, bad_rows=bad_rows,
                           o_leans=leans_beyond_floor(own, vs), delta_leans=False)


def test_the_verdict_rule():
    high = _measurement(-1.0, -1.0)
    assert high.o_vs_floor.bias_ratio <= -HIGH_BIAS_RATIO and layer_verdict(high, 0.0)[0] == "high"
    small = _measurement(-0.02, -0.02, n=20000)     # ratio about 0.04, z about -5
    assert small.o_leans and abs(small.o_vs_floor.bias_ratio) < HIGH_BIAS_RATIO
    risk, reason = layer_verdict(small, 0.0)
    assert risk == "low" and "O leans" in reason
    calm = _measurement(0.0, 0.0)
    assert layer_verdict(calm, 0.0)[0] == "none"
    risk, reason = layer_verdict(calm, 2 * TIE_RATE_LOW)
    assert risk == "low" and "tie" in reason and f"{2 * TIE_RATE_LOW:.2%}" in reason   # names the tie rate
    assert layer_verdict(_measurement(0.0, 0.0, bad_rows=3), 0.0)[0] == "high"
    assert layer_verdict(None, None)[0] == "unmeasured"
    assert overall_verdict(["none", "low", "unmeasured"]) == "low" and overall_verdict(["unmeasured"]) == "unmeasured"


def _fix(ratio, leans=(), plain=True):
    return {"leans_on": list(leans), "refused_on": [], "measured_on": 2, "ratio": ratio,
            "switch": {"plain": "with ..." if plain else None, "hf": None, "note": "cast"}}


@pytest.mark.parametrize("fixes, want", [
    ({"fa2": _fix(3.0), "paper-fp32fwd": _fix(2.0)}, ("paper-fp32fwd", None)),
    ({"fa2": _fix(3.0), "paper-fp32fwd": _fix(2.0, leans=[1])}, ("fa2", None)),
    ({"fa2": _fix(3.0), "torch": _fix(1.2, plain=False)}, ("fa2", "torch")),
    ({"fa2": _fix(3.0, leans=[0]), "torch": _fix(1.2, plain=False)}, (None, "torch")),
])
def test_the_fix_is_the_cheapest_that_leans_nowhere(fixes, want):
    assert choose_fix(fixes) == want
