"""flashguard.watch: the trainer's probes on any model that calls F.scaled_dot_product_attention."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flashguard
from flashguard import keys
from flashguard.attention.error_stats import bias_stats, unit_means
from flashguard.attention.trace import Arithmetic, trace
from flashguard.diagnostics.capture import CaptureHooks
from flashguard.diagnostics.watch import Watch, watch
from flashguard.model import GPT, AttentionSpec
from flashguard.model.presets import model_config
from flashguard.utils.jsonl import read_metrics

PER_HEAD = (keys.MAX_LOGIT, keys.SINK_MASS, keys.TIE_RATE, keys.PBAR_ONE, keys.PBAR_ONE_MULTI, keys.EXACT_TIE_RATE,
            keys.TIE_AT_SINK, keys.TIE_AT_SINK_CHANCE, keys.V_SIGN_AGREE)
PER_LAYER = (keys.SINK_TOP_FRAC, keys.O_ERR_Z_ROW, keys.O_ERR_RATIO_ROW, keys.DELTA_ERR_Z_ROW,
             keys.DELTA_ERR_RATIO_ROW, keys.O_ERR_BIAS, keys.O_ERR_ABS, keys.O_ERR_BIAS_ABSMAX,
             keys.O_ERR_BIAS_VSIGN, keys.O_ERR_Z, keys.DELTA_ERR_MEAN, keys.DELTA_ERR_ABS, keys.DELTA_ERR_REL,
             keys.DELTA_ERR_POS_FRAC, keys.DELTA_ERR_CUMSUM, keys.DELTA_ERR_Z, keys.DELTA_FROM_O_MEAN,
             keys.DELTA_FROM_O_Z, keys.DELTA_OWN_MEAN, keys.DELTA_OWN_Z, keys.TIED_ROW_FRAC)
# written only where the layer has such rows (tied: several Pbar == 1 in one tile)
WHERE_ROWS = (keys.DELTA_FROM_O_TIED, keys.DELTA_FROM_O_UNTIED, keys.DELTA_OWN_TIED, keys.DELTA_OWN_UNTIED)


def expected_keys(layers, n_head, *extra, weights=True):
    """A probe step's keys; ``weights``: with the W_Q / W_K norms (found in flashguard's GPT), whose
    growth keys (``growth_keys``) come from the second probe on."""
    out = {keys.STEP, keys.DIAGNOSTICS_TIME, keys.MONITOR_STATE, *extra}
    for layer in layers:
        for m in PER_HEAD:
            out |= {m.key(layer)} | {m.key(layer, h) for h in range(n_head)}
        out |= {m.key(layer) for m in PER_LAYER}
        if weights:
            out |= {m.key(layer, h) for m in (keys.WQ_NORM, keys.WK_NORM) for h in range(n_head)}
            out |= {keys.WQ_NORM_MAX.key(layer), keys.WK_NORM_MAX.key(layer)}
    return out


def growth_keys(layers, n_head):
    return {m.key(layer, h) for m in (keys.WQ_GROWTH, keys.WK_GROWTH) for layer in layers for h in range(n_head)} \
        | {m.key(layer) for m in (keys.WQ_GROWTH_MAX, keys.WK_GROWTH_MAX) for layer in layers}


def micro_gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(model_config("micro"), attention=AttentionSpec(backend="sdpa"))


def train_steps(model, w, steps, *, seed=1, batch=8, on_step=None, call_step=True):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    T, V = model.config.block_size, model.config.vocab_size
    for s in range(steps):
        if on_step is not None:
            on_step(s)
        x = torch.randint(0, V, (batch, T), generator=g)
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if call_step:
            w.step(loss=loss)
    return opt


def test_top_level_name_is_the_module_function():
    assert flashguard.watch is watch


def test_logs_the_trainer_keys_at_the_probe_steps_only_and_installs_nothing_elsewhere():
    model = micro_gpt()
    original = F.scaled_dot_product_attention
    seen = []

    def check(s):  # before the step's forward: the capture is in only on probe steps
        hooked = F.scaled_dot_product_attention is not original
        seen.append((s, hooked, bool(model._forward_pre_hooks or model._forward_hooks)))

    with watch(model, every=3, precision="paper") as w:
        train_steps(model, w, 7, on_step=check)
    assert seen == [(s, s % 3 == 0, s % 3 == 0) for s in range(7)]
    assert F.scaled_dot_product_attention is original and not model._forward_pre_hooks and not model._forward_hooks
    assert [r[keys.STEP] for r in w.records] == [0, 3, 6]
    want = expected_keys([0, 1], model.config.n_head, keys.LOSS_TRAIN)
    optional = {m.key(layer) for m in WHERE_ROWS for layer in (0, 1)} | growth_keys([0, 1], model.config.n_head)
    for r in w.records:
        assert want <= set(r) <= want | optional
        assert all(keys.parse(k) is not None for k in r if keys.is_probe_key(k))   # the schema knows them
        assert all(isinstance(v, float) and math.isfinite(v) for k, v in r.items() if k != keys.STEP)
    # the running sum spans the probes, as in the trainer
    d = keys.DELTA_ERR_MEAN.key(1)
    assert w.records[2][keys.DELTA_ERR_CUMSUM.key(1)] == pytest.approx(sum(r[d] for r in w.records))


def test_layers_by_call_order_and_stepping_by_the_optimizer():
    model = micro_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with watch(model, layers=[1], every=2, precision="fa2", optimizer=opt) as w:
        x = torch.randint(0, 256, (4, 64))
        for _ in range(5):
            _, loss = model(x, x)
            loss.backward()
            opt.step()        # the watch steps with the optimizer; no w.step()
            opt.zero_grad()
    assert [r[keys.STEP] for r in w.records] == [0, 2, 4]
    want = expected_keys([1], model.config.n_head, keys.GRAD_NORM)   # the optimizer's gradient norm
    assert want <= set(w.records[0]) <= want | {m.key(1) for m in WHERE_ROWS}
    opt.step()                # closed: the optimizer hook is gone
    assert len(w.records) == 3


def test_values_are_the_direct_probe_computation_of_the_step():
    """Known answer: the trainer's own capture (CaptureHooks, the layer's attend) of the same step,
    measured directly with trace and error_stats on the first ``subsample`` sequences."""
    model = micro_gpt()
    sub = 4
    direct = {}

    def capture_too(s):
        direct["hooks"] = CaptureHooks(model, [0, 1]).install()

    with watch(model, every=5, precision="paper", subsample=sub) as w:
        train_steps(model, w, 1, on_step=capture_too)
    direct["hooks"].remove()
    caps = direct["hooks"].captures()
    (rec,) = w.records
    for layer, cap in caps.items():
        q, k, v, do = (t[:sub] for t in (cap.q, cap.k, cap.v, cap.do))
        t = trace(q, k, v, do, Arithmetic.of("paper", "none"), causal=True, grads=False)
        assert rec[keys.O_ERR_BIAS.key(layer)] == pytest.approx(float(t.o_err.mean()), rel=1e-12, abs=0)
        assert rec[keys.O_ERR_ABS.key(layer)] == pytest.approx(float(t.o_err.abs().mean()), rel=1e-12)
        assert rec[keys.DELTA_ERR_MEAN.key(layer)] == pytest.approx(float(t.delta_err.mean()), rel=1e-12, abs=0)
        assert rec[keys.O_ERR_Z.key(layer)] == pytest.approx(
            bias_stats(unit_means(t.o_err, "sequence"), "sequence").z, rel=1e-9)
        assert rec[keys.DELTA_ERR_Z.key(layer)] == pytest.approx(
            bias_stats(unit_means(t.delta_err, "sequence", feature_dim=False), "sequence").z, rel=1e-9)
        ties = t.ties
        assert rec[keys.TIE_RATE.key(layer)] == pytest.approx(float(ties.tied.sum() / ties.tiles.sum()), rel=1e-12)
        assert rec[keys.PBAR_ONE.key(layer)] == pytest.approx(float(ties.pbar_one.sum() / ties.entries.sum()),
                                                              rel=1e-12)
        # max |logit| and the sink from scratch, in fp64 on the inputs as the arithmetic received them
        qi, ki = (x.to(torch.float64) for x in t.inputs[:2])
        s = qi @ ki.transpose(-2, -1) / math.sqrt(qi.shape[-1])
        hide = torch.ones(64, 64, dtype=torch.bool).tril().logical_not()
        assert rec[keys.MAX_LOGIT.key(layer)] == pytest.approx(float(s.masked_fill(hide, 0).abs().max()), rel=1e-12)
        p = torch.softmax(s.masked_fill(hide, float("-inf")), dim=-1)
        for h in range(q.shape[1]):
            assert rec[keys.SINK_MASS.key(layer, h)] == pytest.approx(float(p[:, h, 1:, 0].mean()), rel=1e-9)


def test_named_modules_are_the_same_layers_as_the_call_order():
    def one_step(layers):
        model = micro_gpt()
        with watch(model, layers=layers, every=1, precision="paper") as w:
            train_steps(model, w, 1)
        return w.records[0]

    by_order = one_step([1])
    by_name = one_step(["transformer.h.1.attn"])
    renamed = {k.replace("/L0", "/L1"): v for k, v in by_name.items() if k != keys.DIAGNOSTICS_TIME}
    assert renamed == {k: v for k, v in by_order.items() if k != keys.DIAGNOSTICS_TIME}
    by_dict = one_step({3: "transformer.h.0.attn"})
    assert keys.TIE_RATE.key(3) in by_dict and not any("/L0" in k for k in by_dict)
    with pytest.raises(ValueError, match="'transformer.h.9.attn'"):
        watch(micro_gpt(), layers=["transformer.h.9.attn"])
    with pytest.raises(ValueError, match="not a mix"):
        watch(micro_gpt(), layers=[0, "transformer.h.0.attn"])


class Toy(nn.Module):
    """Not a GPT: attention over given q, k, v, whose loss has the gradient ``do`` at the output."""

    def __init__(self, q, k, v, do, **sdpa):
        super().__init__()
        self.q, self.k, self.v = (nn.Parameter(t.clone()) for t in (q, k, v))
        self.register_buffer("do", do)
        self.sdpa = sdpa

    def forward(self):
        o = F.scaled_dot_product_attention(self.q, self.k, self.v, **self.sdpa)
        return (o * self.do).sum()


def toy_record(q, k, v, do, precision="paper", **sdpa):
    model = Toy(q, k, v, do, **sdpa)
    w = Watch(model, every=1, precision=precision, subsample=None, log_fn=lambda m: None)
    model().backward()
    rec = w.step()
    w.close()
    return rec, w


def test_a_planted_tie_raises_the_tie_rate():
    g = torch.Generator().manual_seed(0)
    B, H, T, D = 2, 2, 32, 16
    q, k, v, do = (torch.randn(B, H, T, D, generator=g) for _ in range(4))
    base, _ = toy_record(q, k, v, do)
    # half the query rows equal to four key rows (and those keys equal to each other): the row's
    # largest score q.k = |u|^2 is there four times; |u| = 6 puts it far above the random keys
    u = torch.randn(D, generator=g)
    u = 6.0 * u / u.norm()
    q2, k2 = q.clone(), k.clone()
    q2[:, :, : T // 2] = u
    k2[:, :, 4:8] = u
    planted, _ = toy_record(q2, k2, v, do)
    key = keys.TIE_RATE.key(0)
    assert base[key] < 0.1
    assert planted[key] >= 0.5 and planted[key] > base[key] + 0.4
    assert planted[keys.PBAR_ONE_MULTI.key(0)] >= 0.5    # four V rows enter PV with weight exactly 1


def test_a_causal_mask_is_measured_as_causal_and_padding_is_skipped():
    g = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(2, 2, 16, 8, generator=g) for _ in range(4))
    causal, _ = toy_record(q, k, v, do, is_causal=True)
    tril = torch.ones(16, 16, dtype=torch.bool).tril()
    additive = torch.zeros(16, 16).masked_fill(~tril, torch.finfo(torch.float32).min)   # as transformers builds it
    as_bool, _ = toy_record(q, k, v, do, attn_mask=tril)
    as_add, _ = toy_record(q, k, v, do, attn_mask=additive)
    drop = {keys.DIAGNOSTICS_TIME}
    strip = lambda r: {k_: x for k_, x in r.items() if k_ not in drop}  # noqa: E731
    assert strip(as_bool) == strip(causal) and strip(as_add) == strip(causal)
    pad = tril.clone().expand(2, 1, 16, 16).clone()
    pad[1, :, :, :3] = False
    said = []
    model = Toy(q, k, v, do, attn_mask=pad)
    w = Watch(model, every=1, precision="paper", log_fn=said.append)
    model().backward()
    rec = w.step()
    w.close()
    assert set(rec) == {keys.STEP, keys.DIAGNOSTICS_TIME, keys.MONITOR_STATE} and "not measured" in said[0]


def test_logs_are_json_lines_the_package_reader_reads(tmp_path):
    model = micro_gpt()
    log_dir = tmp_path / "watch"
    with watch(model, every=2, log_dir=log_dir, precision="paper") as w:
        train_steps(model, w, 3)
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 and all(isinstance(json.loads(line), dict) for line in lines)   # a record every step
    assert [r for r in read_metrics(log_dir) if keys.DIAGNOSTICS_TIME in r] == w.records
    meta = json.loads((log_dir / "watch.json").read_text())
    assert meta["every"] == 2 and meta["precision"] == "paper" and meta["subsample_sequences"] == 8
    assert meta["kind"] == "flashguard.watch"
    with watch(model, every=2, log_dir=log_dir, precision="paper") as w2:   # appends, as the trainer's log
        train_steps(model, w2, 1)
    assert [r[keys.STEP] for r in read_metrics(log_dir)] == [0, 1, 2, 0]


def test_failing_probes_never_stop_training(monkeypatch):
    import flashguard.diagnostics.watch as watch_module

    def boom(*a, **kw):
        raise RuntimeError("probe broke")

    monkeypatch.setattr(watch_module, "probe_layer", boom)
    said = []
    model = micro_gpt()
    with watch(model, every=1, precision="paper", log_fn=said.append) as w:
        train_steps(model, w, 2)
    assert [r[keys.DIAGNOSTICS_FAILED] for r in w.records] == [1.0, 1.0]
    said, lines = [m for m in said if not m.startswith("step ")], [m for m in said if m.startswith("step ")]
    assert len(said) == 1 and "probe broke" in said[0]
    assert len(lines) == 2 and all("probes failed" in m for m in lines)     # the summary line says so too


def test_default_precision_follows_the_input_dtype_and_bad_arguments_fail_early():
    model = micro_gpt()
    with watch(model, layers=[0], every=1) as w:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(torch.randint(0, 256, (2, 64)), torch.randint(0, 256, (2, 64)))
        loss.backward()
        rec = w.step()
    assert keys.TIE_RATE.key(0) in rec and keys.DIAGNOSTICS_FAILED not in rec   # bf16 inputs: fa2
    for bad, match in (({"every": 0}, "every"), ({"subsample": 0}, "subsample"),
                       ({"precision": "nope"}, "nope"), ({"layers": [-1]}, "from 0")):
        with pytest.raises(ValueError, match=match):
            watch(model, **bad)


def test_what_it_cannot_see_is_said_once():
    said = []
    lin = nn.Linear(4, 4)
    w = Watch(lin, every=1, log_fn=said.append)
    for _ in range(2):
        lin(torch.randn(2, 4)).sum().backward()
        assert set(w.step()) == {keys.STEP, keys.DIAGNOSTICS_TIME, keys.MONITOR_STATE}
    w.close()
    said = [m for m in said if not m.startswith("step ")]     # the probe steps' summary lines aside
    assert len(said) == 1 and "no SDPA call" in said[0]
    said.clear()
    model = micro_gpt()
    with watch(model, layers=[1, 5], every=1, precision="paper", log_fn=said.append) as w:
        train_steps(model, w, 1, batch=2)
    said = [m for m in said if not m.startswith("step ")]
    assert keys.TIE_RATE.key(1) in w.records[0] and len(said) == 1
    assert "layer(s) [5]" in said[0] and "2 call(s)" in said[0]
