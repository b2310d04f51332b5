"""The top-level API: `import flashguard` is light, and its few names are the subpackages' own."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import flashguard

PUBLIC = ["flash_attention", "scaled_dot_product_attention", "override_sdpa", "FlashOptions", "get_policy",
          "POLICIES", "get_stabilizer", "STABILIZERS", "trace", "Arithmetic", "watch", "check"]


def _python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_public_names_are_the_subpackages_own():
    from flashguard import attention, numerics
    from flashguard.attention import trace as trace_module
    assert sorted(flashguard.__all__) == sorted(PUBLIC)
    assert flashguard.flash_attention is attention.flash_attention
    assert flashguard.scaled_dot_product_attention is attention.scaled_dot_product_attention
    assert flashguard.override_sdpa is attention.override_sdpa
    assert flashguard.FlashOptions is attention.FlashOptions
    assert flashguard.get_policy is numerics.get_policy and flashguard.POLICIES is numerics.POLICIES
    assert flashguard.get_stabilizer is attention.get_stabilizer and flashguard.STABILIZERS is attention.STABILIZERS
    assert flashguard.trace is trace_module.trace and flashguard.Arithmetic is trace_module.Arithmetic
    from flashguard.diagnostics import watch as watch_module
    assert flashguard.watch is watch_module.watch
    from flashguard.check import api as check_api
    assert flashguard.check is check_api.check or flashguard.check.check is check_api.check   # the function, or
    assert callable(flashguard.check)                                 # its package, callable as the function
    assert set(PUBLIC) <= set(dir(flashguard))
    assert not [n for n in dir(flashguard) if not n.startswith("__") and n not in PUBLIC]  # nothing private shows
    with pytest.raises(AttributeError, match="'flash_attn'"):
        flashguard.flash_attn


def test_star_import_and_a_call():
    ns: dict = {}
    exec("from flashguard import *", ns)
    assert set(PUBLIC) <= set(ns)
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    o = ns["flash_attention"](q, k, v, is_causal=True, precision="fp32")
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(o, ref, rtol=1e-5, atol=1e-5)
    t = ns["trace"](q, k, v, torch.randn_like(q), ns["Arithmetic"].of("paper", "safe"))
    assert t.o_err.shape == q.shape


def test_import_is_light():
    """Neither torch, matplotlib nor triton is imported by `import flashguard`; the first use
    of a name imports torch and the attention code, still without matplotlib or triton."""
    code = ("import sys, json, flashguard; a = {m: m in sys.modules for m in ('torch', 'matplotlib', 'triton')}; "
            "flashguard.flash_attention; flashguard.trace; flashguard.POLICIES; "
            "b = {m: m in sys.modules for m in ('torch', 'matplotlib', 'triton')}; print(json.dumps([a, b]))")
    before, after = json.loads(_python(code))
    assert before == {"torch": False, "matplotlib": False, "triton": False}
    assert after == {"torch": True, "matplotlib": False, "triton": False}


def test_works_without_triton():
    """With the triton package unimportable (sys.modules['triton'] = None) the API imports and
    runs, and the triton kernel reports itself unavailable."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, flashguard\n"
            "from flashguard.attention import triton_available\n"
            "q = torch.randn(1, 1, 5, 4)\n"
            "o = flashguard.flash_attention(q, q, q, precision='paper', stabilizer='safe')\n"
            "print(triton_available(), tuple(o.shape))")
    assert _python(code).split() == ["False", "(1,", "1,", "5,", "4)"]
