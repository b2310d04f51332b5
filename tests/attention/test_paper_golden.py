"""The ``paper`` preset equals the study's reference code bit for bit (output and gradients).

Golden hashes were made by tools/make_paper_golden.py from the public reference
implementation (not vendored). Two kinds, so that the claim is checked on every platform:

* **exact cases** (``test_paper_preset_matches_reference_on_any_platform``): inputs whose
  every matmul and sum is exact in fp32 (or rounds alike in every summation order) and whose
  every exp / log is far from a bf16 rounding boundary, so the bits cannot depend on the CPU's
  or GPU's kernels. Each run re-certifies that on the actual arguments (tests/attention/
  exact_arith.py) and then compares with the reference's hashes: on any CPU, and on CUDA
  when there is one.
* **random cases** (``test_paper_preset_matches_reference_hashes``): normal random inputs,
  several tiles of the reference's own size, T = 1100. Their bf16 gemms round differently with
  each kernel family (oneDNN's AMX, AVX512-BF16, AVX512 and AVX2 kernels all differ), so the
  golden file holds one hash set per platform, matched by ``paper_cases.arith_fingerprint()``
  (a hash of this machine's bf16 arithmetic). Sets not made on this platform skip and say so
  in the short test summary (-ra), naming the platform they belong to.

Set FLASHGUARD_REFERENCE_ATTENTION=/path/to/attention.py to compare live as well.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
from pathlib import Path

import pytest
import torch

from flashguard.attention import flash_attention

import exact_arith
import paper_cases

GOLDEN = json.loads((Path(__file__).parent / "data" / "paper_golden.json").read_text())
EXACT = GOLDEN["exact"]["cases"]
PLATFORMS = GOLDEN["platforms"]
NAMES = ["output", "dq", "dk", "dv"]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _ours(case, stabilizer=None, device="cpu", certificate=None):
    q, k, v, do = (t.to(device) for t in paper_cases.make_inputs(case))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    stab = stabilizer or ("paper" if case["stable"] else "none")
    with certificate or contextlib.nullcontext():
        o = flash_attention(*leaves, is_causal=case["causal"], precision="paper", stabilizer=stab,
                            block_q=case["block"], block_k=case["block"], kernel="pytorch")
        o.backward(do.to(device))
    return [o.detach()] + [t.grad for t in leaves]


@pytest.fixture
def full_precision_reductions():
    # cuBLAS may reduce bf16 split-K partial sums in bf16; the exact cases assume fp32 sums
    if not torch.cuda.is_available():
        yield
        return
    flag = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = flag


# one_thread (tests/conftest.py): many small ops, where on a shared 2-core machine intra-op threads
# cost more than they give (the exact cases' bits do not depend on it: that is what is certified)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", EXACT, ids=paper_cases.case_id)
def test_paper_preset_matches_reference_on_any_platform(case, device, full_precision_reductions, one_thread):
    cert = exact_arith.OrderIndependence()
    got = _ours(case, device=device, certificate=cert)
    assert not cert.problems, ("the case is no longer certified order-independent, so its hashes cannot "
                               f"hold everywhere: {cert.problems[:5]}")
    bad = [n for n, t, want in zip(NAMES, got, case["sha256"]) if paper_cases.digest(t.cpu()) != want]
    assert not bad, f"paper preset differs from the reference code in {bad} ({cert.report()})"


def _platform_id(p):
    return p["fingerprint"][:8]


@pytest.mark.parametrize("platform", PLATFORMS, ids=_platform_id)
def test_paper_preset_matches_reference_hashes(platform):
    here = paper_cases.arith_fingerprint()
    if platform["fingerprint"] != here:
        known = [p["label"] for p in PLATFORMS if p["fingerprint"] == here]
        this = known[0] if known else f"unrecorded: {paper_cases.platform_tag()}, fingerprint {here}"
        pytest.skip(f"random-case hashes of [{platform['label']}]; this machine is [{this}] "
                    "(the exact cases ran here)")
    bad = []
    for case in platform["cases"]:
        got = [paper_cases.digest(t) for t in _ours(case)]
        bad += [f"{paper_cases.case_id(case)}:{n}" for n, a, b in zip(NAMES, got, case["sha256"]) if a != b]
    assert not bad, f"paper preset differs from the reference code ({platform['label']}) in {bad}"


def test_golden_file_covers_each_case_once():
    # the cases the hashes were made for are the ones paper_cases defines today
    spec = [{k: v for k, v in c.items() if k != "seed"} for c in paper_cases.EXACT_CASES]
    assert [{k: v for k, v in c.items() if k not in ("seed", "sha256")} for c in EXACT] == spec
    for p in PLATFORMS:
        assert [{k: v for k, v in c.items() if k != "sha256"} for c in p["cases"]] == paper_cases.CASES
    assert len({p["fingerprint"] for p in PLATFORMS}) == len(PLATFORMS)


def test_exact_cases_exercise_ties_and_the_stabilizer():
    # A golden test that passes whether or not the fix runs would prove nothing: on the exact
    # cases rows hold repeated maxima, and the paper stabilizer must change the bits.
    tied_rows = 0
    for case in EXACT:
        if case["t"] > 1:
            q, k, v, _ = paper_cases.make_inputs(case)
            s = (q.double() @ k.double().transpose(-2, -1)) / case["d"] ** 0.5
            if case["causal"]:
                s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
            tied_rows += int(((s == s.amax(-1, keepdim=True)).sum(-1) > 1).sum())
        if case["stable"]:
            plain = [paper_cases.digest(t) for t in _ours(case, stabilizer="none")]
            assert plain[0] != case["sha256"][0], paper_cases.case_id(case)
    assert tied_rows > 1000


def test_certificate_rejects_random_inputs():
    # the certificate is not vacuous: the random cases' sums depend on the summation order
    case = dict(b=1, h=2, t=40, d=32, causal=True, stable=False, block=16, seed=5, amp=1.0, ties=False)
    cert = exact_arith.OrderIndependence()
    _ours(case, certificate=cert)
    assert any("summation order" in p for p in cert.problems)


def test_certificate_known_answers():
    small = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.bfloat16)
    with exact_arith.OrderIndependence() as cert:
        small @ small.transpose(0, 1)             # 14: exact in any order
        torch.exp(small - 3)                       # exp(-2), exp(-1), 1: far from a bf16 boundary
    assert not cert.problems, cert.problems
    x = torch.tensor([[1.0, 2.0 ** -30, -1.0]])
    e = torch.tensor([-0.224609375], dtype=torch.bfloat16)  # exp lands within 4 fp32 ulps of a bf16 midpoint
    t = torch.ones(2)
    with exact_arith.OrderIndependence() as cert:
        x.sum(dim=-1)                              # 2^-30 or 0, by order
        torch.exp(e)
        t.tanh()                                   # not a certified op
    problems = " | ".join(cert.problems)
    assert len(cert.problems) == 3, problems
    by_op = {re.search(r"aten\.(\w+)", p)[1]: p for p in cert.problems}   # one problem per op, named
    assert sorted(by_op) == ["exp", "sum", "tanh"], problems
    assert "summation order" in by_op["sum"] and "rounding boundary" in by_op["exp"], problems
    assert "uncertified" in by_op["tanh"], problems


@pytest.mark.skipif(not os.environ.get("FLASHGUARD_REFERENCE_ATTENTION"),
                    reason="set FLASHGUARD_REFERENCE_ATTENTION to the reference attention.py")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("stable", [False, True])
@pytest.mark.parametrize("t,block", [(1, 512), (513, 512), (200, 48)])
def test_paper_preset_matches_reference_live(causal, stable, t, block, monkeypatch):
    path = os.environ["FLASHGUARD_REFERENCE_ATTENTION"]
    spec = importlib.util.spec_from_file_location("reference_attention_module", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setenv("STABLE", "1" if stable else "0")
    case = dict(b=2, h=2, t=t, d=32, causal=causal, stable=stable, block=block, seed=t, amp=3.0, ties=True)
    q, k, v, do = paper_cases.make_inputs(case)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = mod.FlashAttentionFunction.apply(*leaves, None, causal, block, block)
    o.backward(do)
    ref = [o.detach()] + [x.grad for x in leaves]
    for name, a, b in zip(NAMES, _ours(case), ref):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name
