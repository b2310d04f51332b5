"""The plain-language summary: its advice follows the lab's measured answers, in each direction."""
from __future__ import annotations

import json

import pytest

import flashguard.experiments.report.summary_text as st
from flashguard.experiments.report.summary_text import (advice_from_lab, build_summary, fix_arguments,
                                                        render_text, summary_from_repro)


def _answer(biased: list[str], removed_by: list[str], failures: dict | None = None) -> dict:
    """An answer as experiments.run_lab writes it (the line is what the lab prints)."""
    if biased:
        line = (f"biased under ties: yes ({len(biased)} of 10 conditions); "
                f"removed by: {', '.join(removed_by) if removed_by else 'nothing the lab tried'}")
    else:
        line = "biased under ties: no; nothing to fix (no stabilizer needed); harmless candidates: " + \
            (", ".join(removed_by) or "none")
    return {"line": line, "biased_conditions": biased, "removed_by": removed_by, "failures": failures or {}}


def _lab(answers: dict) -> dict:
    return {"quick": True, "policy": "paper", "seed": 0, "n_rows": 1024, "rows": [],
            "verdicts": {"i_tie_bias": "held", "iv_worked_example": "held"}, "details": {}, "answers": answers}


def _text(lab, **kw) -> str:
    """The console text with its line wrapping undone."""
    inp = st._Inputs("`flashguard demo`", lab=lab, **kw)
    return " ".join(render_text(build_summary(inp)).split())


def test_fix_arguments_round_trip_the_labs_labels():
    assert fix_arguments("paper-fp32fwd / none") == ("paper-fp32fwd", "none")
    assert fix_arguments("paper / paper(beta=7,tol=0.001)") == ("paper", "paper:beta=7,tol=0.001")
    assert fix_arguments("fa2 / safe") == ("fa2", "safe")
    assert fix_arguments("fa2[row_sum_rounded=True] / none") == ("fa2[row_sum_rounded=True]", "none")
    for bad in ("paper-fp32fwd", "papr / none", "paper / saf"):
        with pytest.raises(ValueError, match="lab arithmetic label"):
            fix_arguments(bad)


def test_a_biased_arithmetic_gets_a_recipe_naming_the_measured_fix():
    lab = _lab({"paper": _answer(["k=2"], ["paper / paper(beta=7,tol=0.001)"],
                                 {"paper / safe": ["k=2: leans"]})})
    (a,) = advice_from_lab(lab)
    assert a.biased and a.fix == ("paper", "paper:beta=7,tol=0.001") and a.failed == ("safe",)
    text = _text(lab)
    assert 'use precision="paper", stabilizer="paper:beta=7,tol=0.001"' in text
    assert 'flashguard.override_sdpa(precision="paper", stabilizer="paper:beta=7,tol=0.001")' in text
    assert 'attn_implementation="sdpa"' in text            # the Hugging Face recipe
    from flashguard.integrations.hf import DEFAULT_NAME      # and its registry name, one transformers 5 accepts
    assert f'attn_implementation="{DEFAULT_NAME}"' in text and "flash" not in DEFAULT_NAME
    assert text.count("override_sdpa(") == 2                # plain PyTorch and Hugging Face
    assert "removed by: paper / paper(beta=7,tol=0.001)" in text   # the lab's own verdict, quoted
    # a remover the recipe cannot name (a kernel label) is skipped for the next one, never replaced by a guess
    lab = _lab({"paper": _answer(["k=2"], ["paper / none 64x64 [triton]", "paper-fp32fwd / none"])})
    assert advice_from_lab(lab)[0].fix == ("paper-fp32fwd", "none")
    lab = _lab({"paper": _answer(["k=2"], ["paper / none 64x64 [triton]"])})
    assert advice_from_lab(lab)[0].fix is None and "see lab.md for the measured fix" in _text(lab)
    # another fix measured: the recipe follows the measurement, nothing is hand-written
    text = _text(_lab({"paper": _answer(["k=2"], ["paper-fp32fwd / none"])}))
    assert 'override_sdpa(precision="paper-fp32fwd", stabilizer="none")' in text and "beta=7" not in text


def test_an_unbiased_arithmetic_needs_no_fix_and_gets_no_recipe():
    lab = _lab({"fa2": _answer([], ["fa2[row_sum_rounded=True] / none"])})
    (a,) = advice_from_lab(lab)
    assert not a.biased and a.fix is None
    text = _text(lab)
    assert "`fa2`" in text and "no fix needed" in text and "override_sdpa" not in text
    assert "row_sum_rounded" not in text     # a harmless candidate is not advice
    assert "no fix is needed, so there is no recipe" in text


def test_a_bias_nothing_removes_points_to_the_unbiased_arithmetics():
    lab = _lab({"fa2": _answer([], []), "fa2-e4m3": _answer(["k=2", "k=3"], [])})
    text = _text(lab)
    assert "`fa2-e4m3` (the production arithmetic with fp8 (e4m3) inputs, emulated): no measured fix" in text
    assert "For `fa2-e4m3` the lab found no fix; the arithmetics it found unbiased under ties are `fa2`" in text
    assert "override_sdpa" not in text and "no recipe to copy" in text


def test_the_hf_registry_is_mentioned_only_when_installed(monkeypatch):
    lab = _lab({"paper": _answer(["k=2"], ["paper-fp32fwd / none"])})
    monkeypatch.setattr(st, "_hf_registry", lambda: False)
    assert "integrations.hf" not in _text(lab)
    monkeypatch.setattr(st, "_hf_registry", lambda: True)
    text = _text(lab)
    assert 'flashguard.integrations.hf.register(precision="paper-fp32fwd", stabilizer="none")' in text


def test_what_ran_what_held_and_why_no_explosion():
    runs = [st._Run("fp32", "fp32 attention", {"diverged_at": None}),
            st._Run("paper", "flash, paper, no fix", {"diverged_at": None})]
    claims = [{"id": "C1", "title": "training diverges", "verdict": "not held"}]
    text = _text(_lab({}), runs=runs, claims=claims, steps=200, model="the tiny-cpu model", tokens_per_step=2048)
    assert "2 training runs of the tiny-cpu model for 200 steps, same seed and batches" in text
    assert "C1 training diverges: not held" in text and "(i) tied maxima" in text
    assert "No run diverged, and none was expected to: 200 steps of the tiny-cpu model, 409,600 tokens" in text
    assert "thousands of steps of GPT-2" in text
    assert 'a claim that needs a diverging run (C1) reads "not held" or "inconclusive" here; the lab looks' in text
    assert "no per-arithmetic answers" in text    # a lab result without answers says so, advises nothing
    runs[1] = st._Run("paper", "flash, paper, no fix", {"diverged_at": 150})
    text = _text(None, runs=runs, claims=claims, steps=200)
    assert "Diverged: paper at step 150." in text and "none was expected" not in text


def test_summary_from_a_stored_repro_and_lab(tmp_path):
    """As the demo calls it: repro.json's dict, a lab.json, the run folders' config.toml."""
    from flashguard.train import config_to_toml, load_config
    from flashguard.train.shipped import find_config
    cfg = load_config(find_config("tiny-cpu"), ["data.batch_size=8"])
    (tmp_path / "runs" / "paper").mkdir(parents=True)
    (tmp_path / "runs" / "paper" / "config.toml").write_text(config_to_toml(cfg))
    repro = {"preset": "demo", "steps": 200, "claims": [{"id": "C6", "title": "delta biased", "verdict": "held"}],
             "runs": [{"name": "paper", "dir": "runs/paper", "title": "flash, paper, no fix",
                       "summary": {"diverged_at": None, "status": "done"}}]}
    lab = json.loads(json.dumps(_lab({"paper": _answer(["k=2"], ["paper-fp32fwd / none"])})))
    text = " ".join(render_text(summary_from_repro(repro, lab, tmp_path)).split())
    assert text.startswith("Summary ------- What ran: `flashguard demo` ran the rounding-bias lab (quick, 1,024")
    assert "the tiny-cpu model (4 layers, width 256, 3.3 M weights) for 200 steps" in text
    assert "409,600 tokens in all" in text and "C6 delta biased: held" in text
    assert 'override_sdpa(precision="paper-fp32fwd", stabilizer="none")' in text


def test_the_recipes_run(monkeypatch):
    """The plain PyTorch recipe, executed: the attention inside goes through flashguard."""
    import torch
    import torch.nn.functional as F

    import flashguard
    calls = []
    real = flashguard.attention.function.scaled_dot_product_attention
    monkeypatch.setattr(flashguard.attention.function, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(k) or real(*a, **k))

    class Model(torch.nn.Module):
        def forward(self, x):
            return type("Out", (), {"loss": F.scaled_dot_product_attention(x, x, x, is_causal=True).sum()})

    model, x = Model(), torch.randn(1, 2, 16, 8, dtype=torch.bfloat16, requires_grad=True)
    exec(st.recipe_pytorch("paper-fp32fwd", "none"), {"model": model, "x": x})
    assert calls and calls[0]["options"].precision.name == "paper-fp32fwd" and x.grad is not None


def _repro_folder(d, lab: dict):
    """A minimal demo folder: repro.json, one run's metrics, lab/lab.json."""
    (d / "runs" / "paper").mkdir(parents=True)
    (d / "runs" / "paper" / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss/train": 3.0 - s / 100, "grad/norm": 1.0}) + "\n" for s in range(20)))
    (d / "lab").mkdir()
    (d / "lab" / "lab.json").write_text(json.dumps(lab))
    repro = {"preset": "demo", "steps": 20, "seed": 1, "lab": "lab",
             "claims": [{"id": "C1", "title": "training diverges", "verdict": "not held", "evidence": "-"}],
             "runs": [{"name": "paper", "dir": "runs/paper", "title": "flash, paper, no fix",
                       "summary": {"steps": 20, "diverged_at": None, "status": "done"}}]}
    (d / "repro.json").write_text(json.dumps(repro))
    return repro


def test_report_md_and_html_begin_with_the_summary(tmp_path):
    from flashguard.experiments.report import write_report
    _repro_folder(tmp_path / "demo", _lab({"paper": _answer(["k=2"], ["paper-fp32fwd / none"])}))
    paths = write_report([tmp_path / "demo"], tmp_path / "demo" / "report")
    md = paths["md"].read_text()
    assert md.startswith("# flashguard report: demo\n\n## Summary\n\nWhat ran: `flashguard demo` ran")
    assert md.index("## Summary") < md.index("Produced by") < md.index("## Claims")
    assert '```python\nimport flashguard\nwith flashguard.override_sdpa(precision="paper-fp32fwd", ' in md
    html = paths["html"].read_text()
    assert html.index("<h2>Summary</h2>") < html.index("<h2>Claims</h2>")
    assert '<pre><code>import flashguard\nwith flashguard.override_sdpa(precision=&quot;paper-fp32fwd&quot;' in html


def test_demo_console_starts_with_what_runs_and_ends_with_the_summary(tmp_path, monkeypatch):
    """run_demo with its stages replaced by stored results (the real demo takes minutes)."""
    import flashguard.data as data
    import flashguard.experiments.lab as lab_pkg
    import flashguard.experiments.lab.report as lab_report
    import flashguard.experiments.repro as repro_pkg
    from flashguard.experiments.demo import run_demo
    lab = _lab({"paper": _answer(["k=2"], ["paper-fp32fwd / none"]), "fa2": _answer([], [])})
    out = tmp_path / "demo"
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.json").write_text("{}")
    monkeypatch.setattr(data, "prepare_embedded", lambda *a, **k: pytest.fail("corpus is there"))
    monkeypatch.setattr(lab_pkg, "run_lab", lambda **kw: lab)
    monkeypatch.setattr(lab_report, "write_lab", lambda result, d: None)
    import flashguard.experiments.edge as edge_pkg
    import flashguard.experiments.injection as injection_pkg
    monkeypatch.setattr(repro_pkg, "run_repro", lambda *a, **kw: _repro_folder(out, lab))
    monkeypatch.setattr(injection_pkg, "run_injection", lambda *a, **kw: _injection("held"))
    edge = {"by_lr": [{"lr": 0.139, "arms": [{"arm": "paper", "label": "paper", "diverged": 2, "finished": 2}]}]}
    monkeypatch.setattr(edge_pkg, "run_edge", lambda *a, **kw: edge)
    lines = []
    res = run_demo(out, data_dir=tmp_path / "data", steps=20, progress=False, log=lines.append)
    text = " ".join("\n".join(lines).split())
    assert text.startswith("flashguard demo: the rounding-bias lab, then matched training runs of the tiny-cpu "
                           "model (20 steps each), then a report. No explosion is expected at this length")
    start = text.index("Summary -------")
    assert text.index("[4/6] causal comparison") < text.index("[5/6] edge attribution") < text.index("[6/6] report") \
        < start < text.index("demo done in")
    assert "paper 2/2 diverged (2 seeds decide nothing)" in text
    summary = text[start:]
    assert "`paper` (the study's reference code: every intermediate bf16): use precision=\"paper-fp32fwd\"" in summary
    assert "`fa2` (" in summary and "no fix needed" in summary
    assert 'override_sdpa(precision="paper-fp32fwd", stabilizer="none")' in summary
    assert "`coherent-p1-a10` diverged at step 420" in summary and "I1 " in summary
    # the real report writer ran on the stored results
    assert res["report"]["md"].read_text().startswith("# flashguard report: demo\n\n## Summary")


def test_the_hugging_face_recipe_runs(tmp_path, monkeypatch):
    """The Hugging Face recipe, executed on a tiny Llama saved and loaded offline."""
    transformers = pytest.importorskip("transformers")
    import torch

    import flashguard
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tiny")
    calls = []
    real = flashguard.attention.function.scaled_dot_product_attention
    monkeypatch.setattr(flashguard.attention.function, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(k) or real(*a, **k))
    x = torch.randint(0, 64, (2, 16))
    scope = {"NAME": str(tmp_path / "tiny"), "batch": {"input_ids": x, "labels": x}}
    exec(st.recipe_hf("paper-fp32fwd", "none"), scope)
    assert calls and calls[0]["options"].precision.name == "paper-fp32fwd"
    assert scope["model"].dtype == torch.bfloat16 and torch.isfinite(scope["loss"])


def _injection(verdict):
    def run(name, status, step=None, final=None):
        return {"name": name, "title": f"the {name} arm", "seed": 1, "dir": f"runs/s1/{name}",
                "summary": {"status": status, "diverged_at": step, "final_loss": final},
                "wq_norm": {"0": [[0, 0.3], [25, 0.4]]}, "wq_norm_peak": {"0": 40.0 if step else 1.5},
                "max_logit_peak": {"0": 9.0}}
    return {"repro_preset": "micro", "steps": 1500, "seeds": [1], "about": "three arms",
            "divergence_rule": "loss >= 2 x its running minimum",
            "runs": [run("real-a1", "done", final=1.9), {**run("coherent-p1-a10", "diverged", step=420), "first_warning": 300},
                     run("zero-mean-a100", "done", final=2.1)],
            "claims": [{"id": "I1", "title": "A coherent delta error explodes where a zero-mean one does not",
                        "verdict": verdict, "evidence": "measured"}],
            "margin": {"text": "the real run sits at least 9.3x below the boundary at this scale"}}


@pytest.mark.parametrize("verdict, says", [("held", "its lean is"), ("not held", "no reason to fear a lean"),
                                           ("inconclusive", "decided nothing yet")])
def test_injection_blocks_say_what_the_verdict_supports(verdict, says):
    from flashguard.experiments.report.summary_text import injection_blocks, render_text
    text = " ".join(render_text(injection_blocks(_injection(verdict))).split())
    assert "`coherent-p1-a10` diverged at step 420, W_Q spectral norm 0.3 -> peak 40; the monitor warned at step " \
           "300, 120 steps ahead" in text
    assert "`zero-mean-a100` trained on (final loss 2.1" in text
    assert f"I1 A coherent delta error explodes where a zero-mean one does not: {verdict} (measured)" in text
    assert says in text and "9.3x below the boundary" in text


def _natural(n1, n3, n4, n5):
    claims = [{"id": cid, "title": f"claim {cid}", "verdict": v, "evidence": f"evidence {cid}"}
              for cid, v in (("N1", n1), ("N2", "held"), ("N3", n3), ("N4", n4), ("N5", n5))]
    return {"preset": "nat512", "steps": 1000, "arms": [{"name": n, "label": n, "overrides": [], "dir": f"/r/{n}"}
                                                        for n in ("fp32", "paper", "paper-fix", "paper-fp32fwd")],
            "claims": claims}


@pytest.mark.parametrize("verdicts, says, not_says", [
    (("held", "held", "not held", "not held"), ["the lab's fix removes it", "the study's fix does not",
                                                "did not make the run diverge"], ["decided nothing"]),
    (("held", "held", "held", "held"), ["the lab's fix and the study's fix remove it", "it made the run diverge"],
     ["does not"]),
    (("not held", "inconclusive", "inconclusive", "not held"), ["no delta lean arose"], ["removes it"]),
    (("inconclusive", "inconclusive", "inconclusive", "inconclusive"), ["decided nothing yet"], ["removes it"]),
])
def test_natural_blocks_say_what_the_verdicts_support(verdicts, says, not_says):
    from flashguard.experiments.report.summary_text import natural_blocks, render_text
    text = " ".join(render_text(natural_blocks(_natural(*verdicts))).split())
    assert ("measured apart (`flashguard repro --experiment natural`, preset nat512: 1000 steps an arm, arms `fp32`, "
            "`paper`, `paper-fix`, `paper-fp32fwd`, the same seed") in text
    assert f"N1 claim N1: {verdicts[0]} (evidence N1)" in text
    for s in says:
        assert s in text
    for s in not_says:
        assert s not in text


def test_the_demo_shows_the_natural_result_where_it_is_and_says_where_it_is_not(tmp_path):
    import json

    from flashguard.experiments.demo import _natural_result
    said = []
    assert _natural_result(tmp_path / "out", tmp_path / "missing.json", said.append) is None
    assert "not found" in said[-1] and "--experiment natural" in said[-1]
    src = tmp_path / "natural.json"
    src.write_text(json.dumps(_natural("held", "held", "not held", "not held")))
    got = _natural_result(tmp_path / "out", src, said.append)
    assert got["claims"][0]["verdict"] == "held"
    assert json.loads((tmp_path / "out" / "natural" / "natural.json").read_text()) == got
    (tmp_path / "bad.json").write_text("{")
    assert _natural_result(tmp_path / "out2", tmp_path / "bad.json", said.append) is None and "not valid JSON" in said[-1]
