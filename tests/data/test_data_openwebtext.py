"""The OpenWebText code path (nanoGPT split, datasets.map, shard writing) on a local fixture.

The GPT-2 BPE files are not available offline, so the byte tokenizer stands in for it;
everything else is the code that prepares the real OpenWebText.
"""
import inspect
import json
import multiprocessing

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")

from flashguard.data import TokenDataset, prepare_openwebtext  # noqa: E402
from flashguard.data.openwebtext import NANOGPT_SEED, NANOGPT_TEST_SIZE  # noqa: E402

N_DOCS = 60


@pytest.fixture
def jsonl(tmp_path):
    rng = np.random.default_rng(0)
    words = ["flash", "attention", "rounding", "bias", "ünïcode", "🙂", "loss", "spike", "\n"]
    path = tmp_path / "owt-fixture.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i in range(N_DOCS):
            text = f"doc {i}: " + " ".join(rng.choice(words, size=rng.integers(5, 40)))
            f.write(json.dumps({"text": text, "id": i}) + "\n")
    return path


def docs_of(path):
    data = np.fromfile(path, dtype=np.uint16)
    assert data[-1] == 0
    return bytes(data.astype(np.uint8)).decode("utf-8").split("\0")[:-1]


def test_defaults_are_nanogpts():
    params = inspect.signature(prepare_openwebtext).parameters
    assert params["dataset"].default == "openwebtext"
    assert params["test_size"].default == NANOGPT_TEST_SIZE == 0.0005
    assert params["seed"].default == NANOGPT_SEED == 2357
    assert params["tokenizer"].default == "gpt2"


def test_openwebtext_path_on_local_jsonl(tmp_path, jsonl):
    out = tmp_path / "owt"
    cache = tmp_path / "hf-cache"
    meta = prepare_openwebtext(
        out, dataset="json", data_files=str(jsonl), tokenizer="byte", num_proc=2,
        test_size=0.1, num_shards=7, cache_dir=cache, progress=False,
    )
    # the split nanoGPT's recipe gives, recomputed independently
    full = datasets.load_dataset("json", data_files=str(jsonl), cache_dir=str(cache))["train"]
    parts = full.train_test_split(test_size=0.1, seed=2357, shuffle=True)
    assert docs_of(out / "train.bin") == list(parts["train"]["text"])
    assert docs_of(out / "val.bin") == list(parts["test"]["text"])
    assert len(parts["test"]) == 6

    assert meta["tokenizer"] == "byte" and meta["dtype"] == "uint16"
    assert meta["splits"]["train"]["documents"] == 54 and meta["splits"]["val"]["documents"] == 6
    assert meta["source"]["kind"] == "huggingface" and "seed=2357" in meta["split_rule"]
    ds = TokenDataset(out)
    assert ds.num_tokens("train") + ds.num_tokens("val") == sum(
        len(t.encode()) + 1 for t in full["text"]
    )


def test_openwebtext_path_on_dataset_object(tmp_path):
    texts = [f"document number {i} " * (i % 5 + 1) for i in range(30)]
    ds = datasets.Dataset.from_dict({"text": texts})
    out = tmp_path / "o"
    meta = prepare_openwebtext(out, dataset=ds, tokenizer="byte", num_proc=1, test_size=0.2,
                               num_shards=1024, progress=False)
    parts = ds.train_test_split(test_size=0.2, seed=2357, shuffle=True)
    assert docs_of(out / "val.bin") == list(parts["test"]["text"])
    assert docs_of(out / "train.bin") == list(parts["train"]["text"])
    assert meta["splits"]["val"]["documents"] == 6


def test_openwebtext_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    from flashguard.data import writer as W

    ds = datasets.Dataset.from_dict({"text": [f"t{i}" for i in range(20)]})
    calls = {"n": 0}
    original = W.SplitWriter.write

    def failing(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure mid-write")
        return original(self, *a, **k)

    monkeypatch.setattr(W.SplitWriter, "write", failing)
    out = tmp_path / "o"
    with pytest.raises(RuntimeError, match="injected"):
        prepare_openwebtext(out, dataset=ds, tokenizer="byte", num_proc=1, test_size=0.2,
                            num_shards=4, progress=False)
    assert list(out.iterdir()) == []


def test_missing_text_column(tmp_path):
    ds = datasets.Dataset.from_dict({"body": ["a", "b", "c"]})
    with pytest.raises(ValueError, match="'text'"):
        prepare_openwebtext(tmp_path / "o", dataset=ds, tokenizer="byte", num_proc=1, progress=False)


@pytest.mark.skipif(multiprocessing.get_start_method() != "fork",
                    reason="the stand-in encoding reaches worker processes only by fork")
def test_openwebtext_default_tokenizer_in_worker_processes(tmp_path, jsonl, gpt2_standin):
    out = tmp_path / "owt"
    meta = prepare_openwebtext(out, dataset="json", data_files=str(jsonl), num_proc=2,
                               test_size=0.1, cache_dir=tmp_path / "hf", progress=False)
    assert meta["tokenizer"] == "gpt2" and meta["eot"] == 50256
    val = np.fromfile(out / "val.bin", dtype=np.uint16)
    assert (val == 50256).sum() == 6 and val[-1] == 50256
