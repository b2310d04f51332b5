"""The plain-language summary: its advice follows the lab's measured answers, in each direction."""
from __future__ import annotations

import html
import json
import re

import pytest

import flashguard.experiments.report.summary_text as st
from flashguard.experiments.report.summary_text import (advice_from_lab, build_summary, fix_arguments, recipe_hf,
                                                        recipe_pytorch, render_text, summary_from_repro)
from md_helpers import headings, numbers, section


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


def _blocks(lab, **kw) -> list[tuple]:
    return build_summary(st._Inputs("`flashguard demo`", lab=lab, **kw))


def _flat(text: str) -> str:
    """Console text with its line wrapping undone."""
    return " ".join(text.split())


def _text(lab, **kw) -> str:
    """The console text with its line wrapping undone."""
    return _flat(render_text(_blocks(lab, **kw)))


def _code(blocks) -> list[str]:
    return [body for kind, body in blocks if kind == "code"]


def _items(blocks) -> list[str]:
    return [item for kind, body in blocks if kind == "list" for item in body]


def _paragraphs(blocks) -> list[str]:
    return [body for kind, body in blocks if kind == "p"]


def _claim_item(c: dict) -> str:
    """A claim as a summary lists it, from the claim's own fields."""
    return f"{c['id']} {c['title']}: {c['verdict']}" + (f" ({c['evidence']})" if "evidence" in c else "")


def test_fix_arguments_round_trip_the_labs_labels():
    assert fix_arguments("paper-fp32fwd / none") == ("paper-fp32fwd", "none")
    assert fix_arguments("paper / paper(beta=7,tol=0.001)") == ("paper", "paper:beta=7,tol=0.001")
    assert fix_arguments("fa2 / safe") == ("fa2", "safe")
    assert fix_arguments("fa2[row_sum_rounded=True] / none") == ("fa2[row_sum_rounded=True]", "none")
    for bad in ("paper-fp32fwd", "papr / none", "paper / saf"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):   # names the label it cannot read
            fix_arguments(bad)


def test_a_biased_arithmetic_gets_a_recipe_naming_the_measured_fix():
    lab = _lab({"paper": _answer(["k=2"], ["paper / paper(beta=7,tol=0.001)"],
                                 {"paper / safe": ["k=2: leans"]})})
    (a,) = advice_from_lab(lab)
    assert a.biased and a.fix == ("paper", "paper:beta=7,tol=0.001") and a.failed == ("safe",)
    blocks = _blocks(lab)
    assert a.text() in _items(blocks)                         # the advice, a list item
    assert all(f'"{arg}"' in a.text() for arg in a.fix)       # naming the measured fix's arguments
    assert a.measured in a.text()                             # and quoting the lab's own verdict
    assert _code(blocks) == [recipe_pytorch(*a.fix), recipe_hf(*a.fix)]   # plain PyTorch and Hugging Face
    text = _text(lab)
    from flashguard.integrations.hf import DEFAULT_NAME      # and its registry name, one transformers 5 accepts
    assert f'attn_implementation="{DEFAULT_NAME}"' in text and "flash" not in DEFAULT_NAME
    assert text.count("override_sdpa(") == 2                # plain PyTorch and Hugging Face
    # a remover the recipe cannot name (a kernel label) is skipped for the next one, never replaced by a guess
    lab = _lab({"paper": _answer(["k=2"], ["paper / none 64x64 [triton]", "paper-fp32fwd / none"])})
    assert advice_from_lab(lab)[0].fix == ("paper-fp32fwd", "none")
    lab = _lab({"paper": _answer(["k=2"], ["paper / none 64x64 [triton]"])})
    (a,) = advice_from_lab(lab)
    assert a.fix is None and a.removed_by and not _code(_blocks(lab)) and "lab.md" in a.text()   # no recipe
    # another fix measured: the recipe follows the measurement, nothing is hand-written
    lab = _lab({"paper": _answer(["k=2"], ["paper-fp32fwd / none"])})
    assert _code(_blocks(lab)) == [recipe_pytorch("paper-fp32fwd", "none"), recipe_hf("paper-fp32fwd", "none")]
    assert "beta=7" not in _text(lab)


def test_an_unbiased_arithmetic_needs_no_fix_and_gets_no_recipe():
    lab = _lab({"fa2": _answer([], ["fa2[row_sum_rounded=True] / none"])})
    (a,) = advice_from_lab(lab)
    assert not a.biased and a.fix is None
    text = _text(lab)
    assert "`fa2`" in text and "no fix needed" in text and "override_sdpa" not in text
    assert "row_sum_rounded" not in text     # a harmless candidate is not advice
    assert not _code(_blocks(lab))            # and no recipe


def test_a_bias_nothing_removes_points_to_the_unbiased_arithmetics():
    lab = _lab({"fa2": _answer([], []), "fa2-e4m3": _answer(["k=2", "k=3"], [])})
    blocks = _blocks(lab)
    e4m3 = {a.arithmetic: a for a in advice_from_lab(lab)}["fa2-e4m3"]
    assert e4m3.biased and e4m3.fix is None and not e4m3.removed_by and e4m3.text() in _items(blocks)
    assert e4m3.text().startswith(f"`fa2-e4m3` ({st.ABOUT['fa2-e4m3']})") and "no measured fix" in e4m3.text()
    (pointer,) = [p for p in _paragraphs(blocks) if "`fa2-e4m3`" in p]   # points to the unbiased arithmetic
    assert "`fa2`" in pointer
    assert not _code(blocks) and "override_sdpa" not in _text(lab)


def test_the_hf_registry_is_mentioned_only_when_installed(monkeypatch):
    lab = _lab({"paper": _answer(["k=2"], ["paper-fp32fwd / none"])})
    monkeypatch.setattr(st, "_hf_registry", lambda: False)
    assert "integrations.hf" not in _text(lab)
    monkeypatch.setattr(st, "_hf_registry", lambda: True)
    text = _text(lab)
    assert "flashguard.integrations.hf.register(" in text and 'register(precision="paper-fp32fwd"' in text


def test_what_ran_what_held_and_why_no_explosion():
    runs = [st._Run("fp32", "fp32 attention", {"diverged_at": None}),
            st._Run("paper", "flash, paper, no fix", {"diverged_at": None})]
    claims = [{"id": "C1", "title": "training diverges", "verdict": "not held"}]
    blocks = _blocks(_lab({}), runs=runs, claims=claims, steps=200, model="the tiny-cpu model", tokens_per_step=2048)
    what_ran, *rest = _paragraphs(blocks)
    assert what_ran.startswith("What ran:") and "the tiny-cpu model" in what_ran and "same seed" in what_ran
    assert numbers(what_ran) == [1024, 2, 200]              # lab rows; runs, steps
    assert _claim_item(claims[0]) in _items(blocks) and "(i) tied maxima" in _text(_lab({}), claims=claims)
    (why,) = [p for p in rest if st.STUDY_SCALE in p]       # why no explosion: this length against the study's
    assert numbers(why)[:2] == [200, 409600] and "tiny-cpu model" in why
    assert "(C1)" in why                                     # the claim that needs a diverging run, named
    # a lab result without answers advises nothing and says where the answers come from
    assert advice_from_lab(_lab({})) == [] and not _code(blocks) and "`flashguard lab`" in " ".join(rest)
    runs[1] = st._Run("paper", "flash, paper, no fix", {"diverged_at": 150})
    paragraphs = _paragraphs(_blocks(None, runs=runs, claims=claims, steps=200))
    (diverged,) = [p for p in paragraphs if p.startswith("Diverged")]
    assert "paper" in diverged and numbers(diverged) == [150]
    assert not any(st.STUDY_SCALE in p for p in paragraphs)


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
    blocks = summary_from_repro(repro, lab, tmp_path)
    assert blocks[0] == ("h2", "Summary") and blocks[1][0] == "p"
    what_ran = blocks[1][1]   # the lab (quick, its rows), then the run of the config's model
    assert what_ran.startswith("What ran:") and "`flashguard demo`" in what_ran and "quick" in what_ran
    assert "tiny-cpu" in what_ran and numbers(what_ran) == [1024, 1, 4, 256, 3.3, 200]   # layers, width, M weights
    assert any(409600 in numbers(p) for p in _paragraphs(blocks))   # 200 steps x 8 x 256 tokens
    assert _claim_item(repro["claims"][0]) in _items(blocks)   # C6, its title, held
    assert recipe_pytorch("paper-fp32fwd", "none") in _code(blocks)


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
    assert md.startswith("# ") and headings(md)[0] == "Summary"
    assert section(md, "Summary").lstrip().startswith("What ran:")
    assert md.index("## Summary") < md.index("Produced by") < md.index("## Claims")
    recipe = recipe_pytorch("paper-fp32fwd", "none")
    assert f"```python\n{recipe}\n```" in md
    page = paths["html"].read_text()
    assert page.index("<h2>Summary</h2>") < page.index("<h2>Claims</h2>")
    assert f"<pre><code>{html.escape(recipe)}</code></pre>" in page


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
    text = _flat("\n".join(lines))
    assert text.startswith(_flat(st.intro_text(20)))        # what runs, for how many steps
    start = text.index("Summary -------")
    stage = [text.index(f"[{n}/6]") for n in range(1, 7)]    # the six stages in order, then the summary
    assert stage == sorted(stage) and stage[-1] < start < text.index("demo done in")
    assert "paper 2/2 diverged" in text                      # the edge sample's count
    summary = text[start:]   # the demo's final lines: the advice, the recipe and the causal comparison, as measured
    assert all(_flat(a.text()) in summary for a in advice_from_lab(lab))
    assert "`fa2` (" in summary and "no fix needed" in summary
    assert _flat(recipe_pytorch("paper-fp32fwd", "none")) in summary
    assert all(_flat(item) in summary for item in _items(st.injection_blocks(_injection("held"))))
    # the real report writer ran on the stored results
    assert headings(res["report"]["md"].read_text())[0] == "Summary"


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
    result = _injection(verdict)
    blocks = injection_blocks(result)
    arms = {re.match(r"`([\w-]+)`", item)[1]: item for item in blocks[1][1]}   # the arms' list
    assert list(arms) == [r["name"] for r in result["runs"]]
    # diverged at 420, W_Q from 0.3 to a peak of 40, the monitor's warning at 300: 120 steps ahead
    assert "diverged" in arms["coherent-p1-a10"] and numbers(arms["coherent-p1-a10"]) == [420, 0.3, 40, 300, 120]
    assert "trained on" in arms["zero-mean-a100"] and numbers(arms["zero-mean-a100"])[0] == 2.1   # its final loss
    assert [_claim_item(c) for c in result["claims"]] == _items(blocks)[len(arms):]
    text = _flat(render_text(blocks))
    assert says in text and result["margin"]["text"] in text


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
    result = _natural(*verdicts)
    blocks = natural_blocks(result)
    where = blocks[0][1]   # where it was measured: the command, the preset, the steps and the arms
    assert "`flashguard natural`" in where and "nat512" in where and numbers(where) == [1000]
    assert re.findall(r"`([\w-]+)`", where) == [a["name"] for a in result["arms"]]
    assert _items(blocks) == [_claim_item(c) for c in result["claims"]]
    text = _flat(render_text(blocks))
    for s in says:
        assert s in text
    for s in not_says:
        assert s not in text


def test_the_demo_shows_the_natural_result_where_it_is_and_says_where_it_is_not(tmp_path):
    import json

    from flashguard.experiments.demo import _natural_result
    said = []
    assert _natural_result(tmp_path / "out", tmp_path / "missing.json", said.append) is None
    assert "not found" in said[-1] and "flashguard natural" in said[-1]
    src = tmp_path / "natural.json"
    src.write_text(json.dumps(_natural("held", "held", "not held", "not held")))
    got = _natural_result(tmp_path / "out", src, said.append)
    assert got["claims"][0]["verdict"] == "held"
    assert json.loads((tmp_path / "out" / "natural" / "natural.json").read_text()) == got
    (tmp_path / "bad.json").write_text("{")
    assert _natural_result(tmp_path / "out2", tmp_path / "bad.json", said.append) is None and "not valid JSON" in said[-1]
