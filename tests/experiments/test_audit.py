"""flashguard audit: black-box kernels measured like the lab's arithmetics; known answers each way."""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from flashguard.attention.trace import Arithmetic
from flashguard.cli import main
from flashguard.experiments.audit import builtin_kernels, run_audit, write_audit
from flashguard.experiments.lab.measure import BlackBox
from flashguard.experiments.lab.problems import Problem
from md_helpers import headings, numbers


def _exact_bf16(q, k, v):
    # fp32 softmax attention, output rounded once to bf16: the floor itself, so no lean
    o = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    return o.to(torch.bfloat16)


def _leaning(q, k, v):
    # a kernel whose output shrinks |O| by 1 %: a planted coherent error
    return (_exact_bf16(q, k, v).float() * 0.99).to(torch.bfloat16)


def test_known_answers_each_way(monkeypatch):
    import flashguard.experiments.audit as audit
    monkeypatch.setattr(audit, "audit_conditions",
                        lambda quick, seed=0: [Problem(ties=2, n_rows=256), Problem(ties=1, n_rows=256)])
    res = run_audit([BlackBox("exact", _exact_bf16), BlackBox("leaning", _leaning), Arithmetic.of("paper")])
    v = res["verdicts"]
    assert v["exact"].startswith("no lean") and v["leaning"].startswith("leans")
    assert numbers(v["leaning"]) == [1, 1]   # 1 of the 1 tie conditions
    assert v[Arithmetic.of("paper").label()].startswith("leans")
    rows = {(r["kernel"], r["condition"]): r for r in res["rows"]}
    assert rows[("leaning", Problem(ties=2, n_rows=256).label())]["o_vs_floor"]["verdict"] == "biased +"
    assert "independent row" in res["unit"]


def test_refusing_kernel_and_outputs(tmp_path, monkeypatch):
    import flashguard.experiments.audit as audit
    monkeypatch.setattr(audit, "audit_conditions", lambda quick, seed=0: [Problem(ties=2, n_rows=64)])

    def refuses(q, k, v):
        raise RuntimeError("no kernel for these shapes")

    res = run_audit([BlackBox("refuses", refuses), BlackBox("exact", _exact_bf16)])
    assert res["verdicts"]["refuses"].startswith("not measured")
    paths = write_audit(res, tmp_path)
    md = paths["md"].read_text()
    assert "Refused" in headings(md) and res["unit"] in md
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_audit_on_cpu(tmp_path, monkeypatch, capsys):
    import flashguard.experiments.audit as audit
    monkeypatch.setattr(audit, "audit_conditions", lambda quick, seed=0: [Problem(ties=2, n_rows=64)])
    names = [k.label() for k in builtin_kernels("cpu")]
    assert "torch sdpa: flash (CPU)" in names and "paper-fp32fwd / none" in names
    assert main(["audit", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    verdicts = json.loads((tmp_path / "audit.json").read_text())["verdicts"]   # a line per kernel: its verdict
    assert set(verdicts) == set(names) and all(f"{k}: {v}" in out for k, v in verdicts.items())
    assert (tmp_path / "audit.md").is_file()
    assert main(["audit", "--device", "tpu", "--out", str(tmp_path)]) == 2


def test_triton_kernels_audited_in_the_cpu_interpreter(monkeypatch):
    """--triton-interpreter: the Triton kernels' arithmetics join the CPU audit, named as
    interpreted, and measure what the PyTorch path of the same arithmetic measures."""
    import pytest

    import flashguard.experiments.audit as audit
    from flashguard.attention import triton_available
    if not triton_available():
        pytest.skip("triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what use_triton_interpreter sets, undone after the test
    kernels = builtin_kernels("cpu", triton_interpreter=True)
    names = [audit.kernel_name(k, "cpu") for k in kernels]
    label = Arithmetic.of("fa2", block_q=64, block_k=64, kernel="triton").label()
    assert any(n.startswith(label) and "interpreter" in n for n in names)   # named as interpreted
    assert not any("[triton]" in k.label() for k in builtin_kernels("cpu"))  # only when asked
    monkeypatch.setattr(audit, "audit_conditions", lambda quick, seed=0: [Problem(ties=2, n_rows=32)])
    tri = next(k for k in kernels if getattr(k, "kernel", None) == "triton" and k.precision.name == "fa2")
    res = run_audit([tri, Arithmetic.of("fa2", block_q=64, block_k=64)])
    a, b = (r for r in res["rows"])
    assert a["kernel"] == audit.kernel_name(tri, "cpu") and "interpreter" in a["kernel"]
    assert abs(a["o"]["mean"] - b["o"]["mean"]) <= 1e-3 * abs(b["o"]["mean"]) + 1e-9


def test_cli_refuses_the_interpreter_on_cuda(capsys):
    assert main(["audit", "--device", "cuda", "--triton-interpreter"]) == 2
    err = capsys.readouterr().err
    assert "--triton-interpreter" in err and "--device cpu" in err
