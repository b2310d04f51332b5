"""flashguard.check on Hugging Face models: a Llama (grouped-query, rotary: under autocast SDPA
receives fp32 q, k next to a bf16 v, and torch casts them before it picks flash), and a saved
checkpoint with its own tokenizer."""
from __future__ import annotations

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashguard  # noqa: E402
from flashguard.cli import main  # noqa: E402

transformers.utils.logging.set_verbosity_error()


def test_a_llama_under_autocast_is_measured_on_the_kernel_that_ran():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": x, "labels": x} for x in (torch.randint(0, 128, (4, 48), generator=g) for _ in range(2))]
    result = flashguard.check(model, data, repeats=1)
    assert [L["backend"] for L in result.layers] == ["flash", "flash"]
    assert result.info["kernel_dtype"] == "bf16" and result.info["precision_mode"] == "autocast"
    assert result.layers[0]["shape"] == [8, 4, 48, 16]          # k and v repeated to the query heads
    assert result.verdict in ("none", "low", "high")


def _word_tokenizer(words):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def test_a_checkpoint_with_its_own_tokenizer(tmp_path, capsys):
    words = "attention rounds every row of its scores once and then".split()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(words) + 1, n_positions=64)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "m")
    _word_tokenizer(words).save_pretrained(tmp_path / "m")
    (tmp_path / "t.txt").write_text(" ".join(words) * 40)
    rc = main(["check", "--model", str(tmp_path / "m"), "--text", str(tmp_path / "t.txt"), "--out",
               str(tmp_path / "o"), "--seq-len", "32", "--repeats", "1", "--no-fixes"])
    out = capsys.readouterr().out
    tokenizer = re.search(r"tokenizer ([^,]+),", out)[1]   # the header line's tokenizer field
    assert rc == 0 and "own" in tokenizer and "byte" not in tokenizer
    d = json.loads((tmp_path / "o" / "check.json").read_text())
    assert d["fixes"] == {} and len(d["layers"]) == 1 and d["layers"][0]["shape"] == [8, 2, 32, 16]
