"""The preconditions census (flashguard.diagnostics.census, census_table): known answers each way.

Planted ties at the sink with one-signed V read "present" on every row; a problem without ties
reads "absent" on the tie rows; the V sign agreement, the ties at key 0 and their chance level
are counted by hand on a 4 x 4 example; the row-level z of a planted bias is large and of a
zero-mean error small; `flashguard diagnose --census` on a micro run prints the table and writes
it into its JSON, and `flashguard report` on that run has the section.
"""
from __future__ import annotations

import argparse
import json
import re

import pytest
import torch

from diag_helpers import distinct_problem, tied_problem
from run_helpers import MICRO, micro_overrides
from flashguard import keys
from flashguard.attention.trace import Arithmetic
from flashguard.diagnostics import LayerCapture, probe_layer
from flashguard.diagnostics.census import row_bias, tied_keys
from flashguard.diagnostics.census_table import (ABSENT, PRECONDITIONS, PRESENT, WEAK, Census, census_from_records,
                                                 format_census)
from md_helpers import section, table_dicts, tables
from flashguard.model import AttentionSpec

TIE_ROWS = ("ties", "tie_at_sink", "multi_one", "v_sign")


def _census_of(problem, precision="paper"):
    q, k, v, do = problem
    cap = LayerCapture(layer=0, q=q, k=k, v=v, do=do, spec=AttentionSpec(backend="flash", precision=precision),
                       causal=False)
    return census_from_records([{keys.STEP: 0, **probe_layer(cap, grad=False)}])


def _verdicts(c) -> dict[str, str]:
    return {r.key: r.verdict for r in c.rows}


def test_planted_ties_at_the_sink_with_one_signed_v_read_present_on_every_row():
    # every row: keys 0 and j tied at the maximum, the rest 9-14 below; V all negative; dO ~ V
    c = _census_of(tied_problem(T=64, neg=1.0, sink=True))
    assert _verdicts(c) == dict.fromkeys(("ties", "tie_at_sink", "multi_one", "sink", "v_sign", "o_bias",
                                          "delta_bias"), PRESENT)
    row = {r.key: r for r in c.rows}
    assert row["tie_at_sink"].value == 1.0 and row["v_sign"].value == 1.0
    assert row["sink"].value == pytest.approx(0.5, abs=1e-3)          # half of every row on key 0
    assert row["o_bias"].value < -3.29 < 3.29 < row["delta_bias"].value  # O leans negative, delta positive
    text = format_census(c)   # every precondition's row, next to the study's value, then the legend
    assert all(p.name in text and p.study in text for p in PRECONDITIONS)
    assert "legend:" in text and "-4.71875" in text


def test_no_ties_reads_absent_on_the_tie_rows():
    c = _census_of(distinct_problem(T=32), precision="fa2")
    v = _verdicts(c)
    assert all(v[key] == ABSENT for key in (*TIE_ROWS, "sink")), v
    assert {r.key: r.text for r in c.rows}["v_sign"] == "no tied rows"


def _hand_made(causal: bool):
    """S = q k^T with q = I (scale 1): the rows of S below. V rows (keys) x features."""
    s = torch.tensor([[2., 2., 0., -1.],      # keys 0, 1 tied
                      [0., 3., 3., 3.],       # keys 1, 2, 3 tied
                      [1., 0., -1., -2.],     # no tie
                      [-1., -1., -1., -1.]])  # all four tied
    v = torch.tensor([[1., -1., 2., .5],
                      [3., -2., -1., 0.],
                      [1., -1., -1., 1.],
                      [2., -3., -2., 1.]])
    q = torch.eye(4)[None, None].bfloat16()
    k = s.T.contiguous()[None, None].bfloat16()  # S[i, j] = k_j[i]
    return tied_keys(q, k, v[None, None].bfloat16(), Arithmetic.of("paper"), causal=causal, scale=1.0)


def test_v_sign_agreement_ties_at_key_0_and_their_chance_by_hand():
    c = _hand_made(causal=False)
    # one-signed features: row 0 (keys 0, 1): f0 +, f1 -; f2 mixed, f3 has a 0 -> 2/4
    # row 1 (keys 1-3): f0 +, f1 -, f2 - (-1, -1, -2); f3 (0, 1, 1) -> 3/4; row 3 (all): f0, f1 -> 2/4
    assert (c.pairs.item(), c.tied.item()) == (4, 3)
    assert c.agree.item() == pytest.approx(0.5 + 0.75 + 0.5)
    assert c.at_sink.item() == 2                                       # rows 0 and 3 include key 0
    assert c.at_sink_chance.item() == pytest.approx(2 / 4 + 3 / 4 + 4 / 4)   # k / n per tied row
    # causal: row i sees keys 0..i, so only row 3 (four equal scores) is tied
    c = _hand_made(causal=True)
    assert (c.pairs.item(), c.tied.item(), c.at_sink.item(), c.at_sink_chance.item()) == (4, 1, 1, 1.0)
    assert c.agree.item() == pytest.approx(0.5)


def test_row_z_of_a_planted_bias_is_large_and_of_a_zero_mean_error_small():
    g = torch.Generator().manual_seed(0)
    noise = 1e-3 * torch.randn(4, 2, 64, 16, generator=g, dtype=torch.float64)
    planted, zero_mean = row_bias(noise + 5e-4), row_bias(noise)
    assert planted.z > 20 and planted.bias_ratio > 0.5 and planted.n == 4 * 2 * 64   # one unit per row
    assert abs(zero_mean.z) < 3.29 and abs(zero_mean.bias_ratio) < 0.2
    assert row_bias(noise.mean(-1) - 5e-4, feature_dim=False).z < -20   # delta: (B, H, T)


def _bias_record(z_delta: float, ratio: float = 0.5) -> dict:
    return {keys.STEP: 0, keys.TIE_RATE.key(0): 0.0, keys.DELTA_ERR_Z_ROW.key(0): z_delta,
            keys.DELTA_ERR_RATIO_ROW.key(0): ratio, keys.O_ERR_Z_ROW.key(0): 0.5, keys.O_ERR_RATIO_ROW.key(0): 0.01}


@pytest.mark.parametrize("z,ratio,verdict", [(8.0, 0.5, PRESENT), (-8.0, -0.5, WEAK), (8.0, 0.001, WEAK),
                                             (2.0, 0.5, ABSENT)])
def test_the_delta_verdict_wants_a_positive_lean(z, ratio, verdict):
    c = census_from_records([_bias_record(z, ratio)])
    v = _verdicts(c)
    assert v["delta_bias"] == verdict and v["o_bias"] == ABSENT
    assert v["v_sign"] == "n/a"                     # a record without the census keys: not measured


def test_over_training_counts_the_probes_and_judges_the_latest():
    recs = [_bias_record(8.0), {**_bias_record(9.0), keys.STEP: 5}, {**_bias_record(0.1), keys.STEP: 10},
            {keys.STEP: 11, keys.LOSS_TRAIN: 1.0}]   # a step without probes is not a probe
    row = next(r for r in census_from_records(recs).rows if r.key == "delta_bias")
    assert (row.present, row.probes, row.verdict) == (2, 3, ABSENT)
    assert census_from_records([{keys.STEP: 0, keys.LOSS_TRAIN: 1.0}]) is None


# ---------------------------------------------------------------------------- diagnose and report

@pytest.fixture(scope="module")
def micro_run(tiny_data, tmp_path_factory):
    from flashguard.diagnostics import DiagnosticsHook
    from flashguard.train import load_config, train
    run = tmp_path_factory.mktemp("census") / "run"
    train(load_config(MICRO, micro_overrides(tiny_data, **{"train.diagnostics_every": 3})), run,
          hooks=[DiagnosticsHook()], log_fn=lambda m: None)
    return run


def _diagnose(run, *args) -> int:
    from flashguard.diagnostics.command import add_diagnose_arguments, run_diagnose
    p = argparse.ArgumentParser()
    add_diagnose_arguments(p)
    return run_diagnose(p.parse_args([str(run), "--no-grad-error", *args]))


def test_diagnose_census_prints_the_table_and_writes_it_to_json(micro_run, tmp_path, capsys):
    out = tmp_path / "d.json"
    assert _diagnose(micro_run, "--census", "--heads", "--out", str(out)) == 0
    text = capsys.readouterr().out
    res = json.loads(out.read_text())["census"]
    assert res["step"] == 6 and res["steps"] == [0, 3, 6] and res["layers"] == [0, 1] and len(res["rows"]) == 7
    assert [r["key"] for r in res["rows"]] == [p.key for p in PRECONDITIONS]
    assert all(r["verdict"] in (PRESENT, WEAK, ABSENT) for r in res["rows"]), res["rows"]
    assert format_census(Census.from_dict(res), heads=True) in text   # the table printed is the one written
    assert all(p.name in text for p in PRECONDITIONS) and "L1H1" in text   # with --heads, the per-head table
    counts = re.findall(r"(\d+) (present|weak|absent)", res["summary"])   # the summary line counts the rows
    assert sum(int(n) for n, _ in counts) == 7 and "step 6" in res["summary"] and res["legend"]
    # the trainer's probes wrote the census keys: the census over training is read from metrics.jsonl
    assert keys.V_SIGN_AGREE.key(1, 0) in json.loads((micro_run / "metrics.jsonl").read_text().splitlines()[0])
    # without --census: one summary line
    assert _diagnose(micro_run, "--out", str(tmp_path / "e.json")) == 0
    out = capsys.readouterr().out
    assert res["summary"] in out and "--census" in out and PRECONDITIONS[0].name not in out


def test_report_has_the_census_section_of_the_run(micro_run, tmp_path):
    from flashguard.experiments.report import write_report
    md = write_report([micro_run], tmp_path / "rep")["md"].read_text()
    body = section(md, "Preconditions census")
    assert "metrics.jsonl" in body   # where the census was read from
    (table,) = [t for t in tables(body) if t[0][0] == "precondition"]
    assert table[0] == ["precondition", "the study's GPT-2", "this run", "where", "over training", "verdict"]
    rows = table_dicts(table)
    assert [r["precondition"] for r in rows] == [p.name for p in PRECONDITIONS]
    assert all(r["verdict"].strip("*") in (PRESENT, WEAK, ABSENT) for r in rows), rows   # bold or plain


@pytest.mark.parametrize("precision,stabilizer", [("paper", "none"), ("fa2", "none"), ("paper", "paper")])
def test_the_census_riding_the_trace_forward_counts_what_a_forward_of_its_own_counts(precision, stabilizer):
    """The probes count the tied keys in the trace's own forward (census.TiedKeyCounter as trace's
    observe); tied_keys runs a forward of its own on the trace's rounded inputs: the same counts."""
    from flashguard.diagnostics import shadow
    g = torch.Generator().manual_seed(2)
    q, k, v, do = (torch.randn(2, 3, 80, 16, generator=g).bfloat16() for _ in range(4))
    q[..., :40, :] = 0          # rows whose scores are all equal: every visible key tied, at key 0 too
    cap = LayerCapture(layer=0, q=q, k=k, v=v, do=do, causal=True,
                       spec=AttentionSpec(backend="flash", precision=precision, stabilizer=stabilizer,
                                          block_q=32, block_k=32))
    sh = shadow(cap)
    qi, ki, vi, _ = sh.trace.inputs
    own = tied_keys(qi, ki, vi, sh.arithmetic, causal=True, scale=sh.scale)
    assert float(own.tied.sum()) > 0 and float(own.agree.sum()) > 0
    for field in ("pairs", "tied", "at_sink", "at_sink_chance", "agree"):
        assert torch.equal(getattr(sh.tied_keys, field), getattr(own, field)), field
