"""flashguard.watch made whole (issue 22 item 2): every-step loss and gradient norm, the console line,
the monitor on any model (W_Q / W_K where the projections are found), the kernel torch ran as the
default arithmetic, W&B as an optional extra, and watch folders in diagnose / --monitor / --census /
report, labelled as what they are."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from flashguard import keys
from flashguard.check.dispatch import kernel_label
from flashguard.diagnostics.census_table import PRECONDITIONS
from flashguard.diagnostics.probes import spectral_norms
from flashguard.diagnostics.run_state import WATCH_LABEL
from flashguard.diagnostics.watch import Watch, kernel_precision, summary_line, watch
from flashguard.utils.jsonl import read_metrics

from md_helpers import headings, numbers
from test_watch import Toy, micro_gpt, toy_record

TORCH_FLASH_CPU = kernel_label(torch._C._nn.scaled_dot_product_attention, "flash", "cpu")   # torch's own kernel


def quiet(_):
    pass


# ---- every step: loss, gradient norm, the monitor ---------------------------------------------

def test_loss_and_grad_norm_every_step_and_probes_only_every_n(tmp_path):
    model = micro_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    said = []
    with watch(model, every=3, log_dir=tmp_path / "w", precision="fa2", log_fn=said.append) as w:
        for s in range(5):
            x = torch.randint(0, 256, (2, 64))
            _, loss = model(x, x)
            loss.backward()
            opt.step()
            norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))
            w.step(loss=loss, model=model)            # before zero_grad: the gradient norm is read now
            opt.zero_grad()
            rec = read_metrics(tmp_path / "w")[-1]
            assert rec[keys.STEP] == s and rec[keys.LOSS_TRAIN] == pytest.approx(loss.item())
            assert rec[keys.GRAD_NORM] == pytest.approx(norm, rel=1e-5)
            assert (keys.TIE_RATE.key(0) in rec) == (s % 3 == 0)           # probes every 3 steps only
    assert [r[keys.STEP] for r in w.records] == [0, 3]
    lines = [m for m in said if m.startswith("step ")]
    assert len(lines) == 2 and lines[0].startswith("step 0: loss ") and "max|logit|" in lines[0]
    assert "ties " in lines[0] and "delta lean z" in lines[0] and lines[0].endswith("monitor ok")


def test_a_gradient_spike_between_probes_warns_and_a_healthy_run_does_not():
    def run(spike):
        said = []
        w = Watch(nn.Linear(2, 2), every=1000, start=1, log_fn=said.append)   # no probe step in range
        for s in range(1, 30):
            w.step(loss=2.0, grad_norm=1e6 if spike and s == 20 else 1.0 + 0.01 * (s % 3))
        w.close()
        return w, said

    w, said = run(spike=True)
    warned = [int(numbers(m)[0]) for m in said if m.startswith("step ") and "WARNING" in m]   # the steps it warned at
    assert w.status.name == "warning" and warned[:1] == [20]
    assert not w.records                         # no probe ran: the monitor saw the every-step records
    w, said = run(spike=False)
    assert w.status.name == "ok" and not said


def test_the_optimizer_hook_reads_the_gradient_norm_before_the_step():
    model = micro_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    seen = []
    with watch(model, every=100, precision="fa2", optimizer=opt, log_fn=quiet) as w:
        for _ in range(2):
            x = torch.randint(0, 256, (2, 64))
            _, loss = model(x, x)
            loss.backward()
            seen.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))))
            w.log(loss=loss)
            opt.step()
            opt.zero_grad()
    assert w.records[0][keys.GRAD_NORM] == pytest.approx(seen[0], rel=1e-5)
    assert keys.LOSS_TRAIN in w.records[0]


def test_summary_line_reads_the_largest_values():
    rec = {keys.STEP: 7, keys.LOSS_TRAIN: 3.25, keys.MAX_LOGIT.key(0): 2.0, keys.MAX_LOGIT.key(1): 9.5,
           keys.TIE_RATE.key(0): 0.02, keys.TIE_RATE.key(1): 0.001, keys.DELTA_ERR_Z.key(0): 1.0,
           keys.DELTA_ERR_Z.key(1): -4.0}
    line = summary_line(rec)
    fields = line.split(" | ")   # step and loss, then each signal's largest value and its layer
    assert len(fields) == 4 and numbers(fields[0]) == [7, 3.25]
    assert [re.search(r"(-?[\d.]+%?) \((L\d)", f).groups() for f in fields[1:]] == \
        [("9.5", "L1"), ("2%", "L0"), ("-4.0", "L1")]
    assert [f.split()[0] for f in fields[1:]] == ["max|logit|", "ties", "delta"] and "a lean" in fields[3]


# ---- the arithmetic measured: the kernel torch ran --------------------------------------------

def _bf16_problem(seed=0, B=2, H=2, T=48, D=16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g).to(torch.bfloat16) for _ in range(4)]


def test_the_default_arithmetic_on_cpu_bf16_is_torch_cpu(tmp_path):
    q, k, v, do = _bf16_problem()
    model = Toy(q, k, v, do, is_causal=True)
    w = Watch(model, every=1, subsample=None, log_dir=tmp_path / "w", log_fn=quiet)
    model().backward()
    default = w.step()
    w.close()
    assert w.measured[0]["precision"] == "torch-cpu" and w.measured[0]["kernel"] == TORCH_FLASH_CPU
    meta = json.loads((tmp_path / "w" / "watch.json").read_text())
    assert "kernel" in meta["precision"] and meta["measured"]["L0"]["precision"] == "torch-cpu"   # not one preset
    assert "bit-exact" in meta["measured"]["L0"]["about"]
    strip = lambda r: {a: b for a, b in r.items() if a not in (keys.DIAGNOSTICS_TIME,)}  # noqa: E731
    as_torch_cpu, _ = toy_record(q, k, v, do, precision="torch-cpu", is_causal=True)
    as_fa2, _ = toy_record(q, k, v, do, precision="fa2", is_causal=True)
    assert strip(default) == strip(as_torch_cpu)
    assert default[keys.O_ERR_BIAS.key(0)] != as_fa2[keys.O_ERR_BIAS.key(0)]    # not fa2's arithmetic
    # the user's precision still wins
    assert Watch(model, precision="paper", arm=False).options.precision.name == "paper"


def test_another_backend_or_dtype_is_measured_in_a_labelled_model():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v, do = _bf16_problem(1)
    model = Toy(q, k, v, do, is_causal=True)
    w = Watch(model, every=1, subsample=None, log_fn=quiet)
    with sdpa_kernel([SDPBackend.MATH]):
        model().backward()
    w.step()
    w.close()
    assert w.measured[0]["precision"] == "fa2"
    assert w.measured[0]["kernel"] == kernel_label(torch._C._nn.scaled_dot_product_attention, "math", "cpu")
    assert "as a model" in w.measured[0]["about"]
    # the GPU kernels: their presets (docs/kernels.md), else fa2 as a model
    assert kernel_precision("flash", "cuda", torch.bfloat16)[0] == "torch-flash-cuda"
    assert kernel_precision("efficient", "cuda", torch.bfloat16)[0] == "mem-efficient"
    assert kernel_precision("cudnn", "cuda", torch.bfloat16)[0] == "cudnn"
    name, about = kernel_precision("math", "cuda", torch.bfloat16)
    assert name == "fa2" and "as a model" in about
    assert kernel_precision("flash", "cpu", torch.float16)[0] == "fa2-fp16"
    assert kernel_precision("flash", "cpu", torch.bfloat16, torch_sdpa=False)[0] == "fa2"


# ---- W_Q / W_K on any model ----------------------------------------------------------------------

transformers = pytest.importorskip("transformers")


def tiny_gpt2(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")


def hf_steps(model, w, steps=1, T=16):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randint(0, 64, (2, T), generator=g)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        w.step(loss=loss, model=model)
        opt.zero_grad()


def test_hugging_face_projections_are_found_gpt2_packed_and_llama_grouped():
    gpt2 = tiny_gpt2()
    with watch(gpt2, every=1, precision="fa2", log_fn=quiet) as w:
        hf_steps(gpt2, w)
    # the weights at the end of the probe step (after its update), as the trainer's probes read them
    wq = gpt2.transformer.h[1].attn.c_attn.weight.detach().t()[:32].reshape(2, 16, 32)
    assert "c_attn" in w.projections["L1"] and "packed" in w.projections["L1"]   # one packed q, k, v projection
    assert w.records[0][keys.WQ_NORM.key(1, 1)] == pytest.approx(float(spectral_norms(wq)[1]), rel=1e-9)

    llama = tiny_llama()
    with watch(llama, every=1, precision="fa2", log_fn=quiet) as w:
        hf_steps(llama, w)
    a = llama.model.layers[0].self_attn
    wq, wk = a.q_proj.weight.detach().reshape(4, 8, 32), a.k_proj.weight.detach().reshape(2, 8, 32)
    rec = w.records[0]
    assert w.projections["L0"].endswith("q_proj, k_proj")
    assert rec[keys.WQ_NORM.key(0, 3)] == pytest.approx(float(spectral_norms(wq)[3]), rel=1e-9)
    assert rec[keys.WK_NORM.key(0, 1)] == pytest.approx(float(spectral_norms(wk)[1]), rel=1e-9)
    assert keys.WK_NORM.key(0, 2) not in rec                     # two key heads (grouped-query)
    assert keys.TIE_RATE.key(1) in rec and keys.MAX_LOGIT.key(1) in rec


class Custom(nn.Module):
    """Not a Hugging Face architecture: its projections have names no rule knows."""

    def __init__(self, C=16, H=2):
        super().__init__()
        self.H = H
        self.emb = nn.Embedding(32, C)
        self.wq, self.wk, self.wv = (nn.Linear(C, C, bias=False) for _ in range(3))
        self.out = nn.Linear(C, 32)

    def forward(self, x):
        h = self.emb(x)
        B, T, C = h.shape
        split = lambda t: t.view(B, T, self.H, C // self.H).transpose(1, 2)  # noqa: E731
        o = F.scaled_dot_product_attention(split(self.wq(h)), split(self.wk(h)), split(self.wv(h)), is_causal=True)
        return F.cross_entropy(self.out(o.transpose(1, 2).reshape(B, T, C)).flatten(0, 1), x.flatten())


def test_projections_by_the_names_the_user_passes():
    torch.manual_seed(0)
    model = Custom()
    with watch(model, every=1, precision="fa2", log_fn=quiet) as w:
        loss = model(torch.randint(0, 32, (2, 8)))
        loss.backward()
        w.step(loss=loss)
    assert w.projections == {} and not any(k.startswith("weights/") for k in w.records[0])   # none found: none written
    with watch(model, every=1, precision="fa2", projections=[("wq", "wk")], n_head=2, log_fn=quiet) as w:
        model(torch.randint(0, 32, (2, 8))).backward()
        w.step()
    wq = model.wq.weight.detach().reshape(2, 8, 16)
    assert w.records[0][keys.WQ_NORM.key(0, 1)] == pytest.approx(float(spectral_norms(wq)[1]), rel=1e-9)
    with pytest.raises(ValueError, match="'nope'"):
        watch(model, projections=[("nope", "wk")], n_head=2)
    with pytest.raises(ValueError, match="n_head"):
        watch(model, projections=[("wq", "wk")])


# ---- W&B, an optional extra ----------------------------------------------------------------------

def test_wandb_missing_names_the_extra_and_is_never_imported_unless_asked(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)      # as if not installed
    with pytest.raises(ImportError, match=r"flashguard\[wandb\]"):   # names the extra
        watch(micro_gpt(), wandb=True)
    code = ("import sys, torch, flashguard\n"
            "w = flashguard.watch(torch.nn.Linear(2, 2), every=1, log_fn=lambda m: None)\n"
            "w.step(loss=1.0); w.close(); print('wandb' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_wandb_gets_every_record_through_the_logger_interface(monkeypatch):
    logged, finished = [], []

    class Run:
        def log(self, data, step):
            logged.append((step, data))

        def finish(self):
            finished.append(True)

    fake = types.SimpleNamespace(run=None, init=lambda **kw: (logged.append(("init", kw)), Run())[1])
    monkeypatch.setitem(sys.modules, "wandb", fake)
    w = Watch(nn.Linear(2, 2), every=1000, start=1, wandb={"project": "p"}, log_fn=quiet)
    for _ in range(3):
        w.step(loss=2.0, grad_norm=1.0)
    w.close()
    assert logged[0] == ("init", {"project": "p"}) and [s for s, _ in logged[1:]] == [1, 2, 3]
    assert logged[1][1] == {keys.LOSS_TRAIN: 2.0, keys.GRAD_NORM: 1.0, keys.MONITOR_STATE: 0.0}
    assert finished == [True]


# ---- watch folders in flashguard's commands ---------------------------------------------------------

@pytest.fixture(scope="module")
def watch_folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("mine") / "flashguard"
    model = tiny_gpt2()
    with watch(model, every=2, log_dir=d, log_fn=quiet, tensorboard=False) as w:
        hf_steps(model, w, steps=5)
    return d


def _diagnose(capsys, *argv):
    from flashguard.diagnostics.command import main
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_diagnose_reads_a_watch_folder_as_a_watch_folder(watch_folder, capsys):
    rc, out, _ = _diagnose(capsys, watch_folder)
    res = json.loads((watch_folder / "diagnostics" / "diagnose_0000004.json").read_text())
    assert res["kind"] == "watch" and res["checkpoint"] is None and res["layers"] == [0, 1] and res["step"] == 4
    assert rc == 0 and WATCH_LABEL in out and "no checkpoint" not in out and "step 4" in out
    assert "L0" in out and "L1" in out and TORCH_FLASH_CPU in out
    rc, out, _ = _diagnose(capsys, watch_folder, "--step", "2", "--census")
    res = json.loads((watch_folder / "diagnostics" / "diagnose_0000002.json").read_text())
    assert rc == 0 and res["step"] == 2 and res["census"]["step"] == 2 and "step 2" in out
    assert all(p.name in out for p in PRECONDITIONS)   # --census: the table
    rc, _, err = _diagnose(capsys, watch_folder, "--step", "3")
    assert rc == 2 and "no probe at step 3" in err and "watch folder" in err


def test_monitor_replays_a_watch_folder_with_its_probes(watch_folder, capsys, tmp_path):
    rc, out, _ = _diagnose(capsys, watch_folder, "--monitor", "--out", tmp_path / "monitor.json")
    assert rc == 0 and WATCH_LABEL in out
    ev = json.loads((tmp_path / "monitor.json").read_text())
    assert ev["has_probes"] is True and ev["diverged"] is False and ev["last_step"] == 4
    assert "no probe metrics" not in out


def test_a_watch_folder_without_a_probe_yet_says_so(tmp_path, capsys):
    w = Watch(nn.Linear(2, 2), every=100, start=1, log_dir=tmp_path / "w", log_fn=quiet, tensorboard=False)
    w.step(loss=1.0, grad_norm=1.0)
    w.close()
    rc, _, err = _diagnose(capsys, tmp_path / "w")
    assert rc == 2 and "watch folder" in err and "no probe record yet" in err


def test_report_labels_a_watch_folder(watch_folder, tmp_path):
    from flashguard.experiments.report import write_report
    from flashguard.experiments.report.load import folder_kind
    assert folder_kind(watch_folder) == "watch"
    paths = write_report([watch_folder], tmp_path / "report")
    md = paths["md"].read_text()
    assert "`flashguard.watch`" in md and "GPT2LMHeadModel" in md   # what made the folder, and the model
    assert "`flashguard train`" not in md and "training run of" not in md
    assert "Preconditions census" in headings(md) and (tmp_path / "report" / "figures" / "loss.png").is_file()


def test_the_monitor_knows_which_signals_a_model_gives():
    gpt2 = tiny_gpt2()
    with watch(gpt2, every=1, precision="fa2", log_fn=quiet) as w:
        hf_steps(gpt2, w, steps=2)
    assert w.monitor.signals_seen == {"grad_spike", "wq_growth", "wq_norm_ratio", "max_logit", "delta_bias"}
    torch.manual_seed(0)
    model = Custom()
    with watch(model, every=1, precision="fa2", log_fn=quiet) as w:
        model(torch.randint(0, 32, (2, 8))).backward()
        w.step()
    assert w.monitor.signals_seen == {"max_logit", "delta_bias"}      # no projections found, no gradient norm


def test_a_capture_left_installed_does_not_hide_the_kernel_torch_runs():
    from flashguard.diagnostics.sdpa_capture import SdpaCapture
    q, k, v, do = _bf16_problem(2)
    model = Toy(q, k, v, do, is_causal=True)
    with SdpaCapture(limit=0):                 # another capture, installed first
        w = Watch(model, every=1, subsample=None, log_fn=quiet)
        model().backward()
        w.step()
        w.close()
    assert w.measured[0]["precision"] == "torch-cpu" and w.measured[0]["kernel"] == TORCH_FLASH_CPU
