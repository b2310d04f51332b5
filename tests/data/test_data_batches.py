import json
import pickle

import numpy as np
import pytest
import torch

from flashguard.data import TokenDataset, prepare_text


@pytest.fixture
def dataset_dir(tmp_path, text_corpus):
    out = tmp_path / "ds"
    prepare_text(text_corpus[0], out, tokenizer="byte", val_fraction=0.25, progress=False)
    return out


def test_accessors(dataset_dir):
    ds = TokenDataset(dataset_dir)
    assert ds.vocab_size == 256 and ds.tokenizer_name == "byte" and ds.doc_separator == 0
    assert ds.num_tokens("val") == len(ds.tokens("val")) == (dataset_dir / "val.bin").stat().st_size // 2
    assert ds.tokenizer().name == "byte"
    with pytest.raises(ValueError, match="unknown split"):
        ds.num_tokens("test")


def test_batch_shapes_and_shift(dataset_dir):
    ds = TokenDataset(dataset_dir)
    data = np.fromfile(dataset_dir / "train.bin", dtype=np.uint16).astype(np.int64)
    g = torch.Generator().manual_seed(1)
    idx = ds.sample_indices("train", 8, 16, g)
    assert idx.dtype == torch.int64 and idx.shape == (8,)
    x, y = ds.batch("train", idx, 16)
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
    for b, i in enumerate(idx.tolist()):
        assert x[b].tolist() == data[i:i + 16].tolist()
        assert y[b].tolist() == data[i + 1:i + 17].tolist()


def test_sample_indices_reproducible_from_generator_state(dataset_dir):
    ds = TokenDataset(dataset_dir)
    g = torch.Generator().manual_seed(1234)
    ds.sample_indices("train", 4, 8, g)  # advance a bit
    state = g.get_state()
    a = ds.sample_indices("train", 32, 8, g)
    b = ds.sample_indices("train", 32, 8, g)
    assert not torch.equal(a, b)
    g2 = torch.Generator()
    g2.set_state(state)
    assert torch.equal(ds.sample_indices("train", 32, 8, g2), a)
    assert torch.equal(ds.sample_indices("train", 32, 8, g2), b)


def test_sample_range_covers_both_ends(dataset_dir):
    ds = TokenDataset(dataset_dir)
    n = ds.num_tokens("val")
    T = n - 3  # start offsets 0, 1, 2 only
    idx = ds.sample_indices("val", 400, T, torch.Generator().manual_seed(0))
    assert set(idx.tolist()) == {0, 1, 2}
    x, y = ds.batch("val", torch.tensor([2]), T)
    assert y[0, -1].item() == ds.tokens("val")[-1]  # the last token is reachable
    assert set(ds.sample_indices("val", 50, n - 1, torch.Generator()).tolist()) == {0}


def test_block_size_too_large(dataset_dir):
    ds = TokenDataset(dataset_dir)
    n = ds.num_tokens("val")
    with pytest.raises(ValueError, match=rf"block_size\W+{n}\b.*'val'.*\b{n}\b"):
        ds.sample_indices("val", 1, n, torch.Generator())
    with pytest.raises(ValueError, match="block_size"):
        ds.batch("val", [0], n)


def test_bad_indices(dataset_dir):
    ds = TokenDataset(dataset_dir)
    n = ds.num_tokens("train")
    with pytest.raises(ValueError, match="indices must lie in"):
        ds.batch("train", [n - 8], 8)
    with pytest.raises(ValueError, match="indices must lie in"):
        ds.batch("train", [-1], 8)


def test_missing_folder_and_files(tmp_path, dataset_dir):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        TokenDataset(tmp_path / "nowhere")
    (dataset_dir / "train.bin").unlink()
    with pytest.raises(FileNotFoundError, match="train.bin"):
        TokenDataset(dataset_dir)
    (dataset_dir / "meta.json").unlink()
    with pytest.raises(FileNotFoundError, match="meta.json"):
        TokenDataset(dataset_dir)


def test_meta_mismatch(dataset_dir):
    val = dataset_dir / "val.bin"
    val.write_bytes(val.read_bytes()[:-2])  # one token short
    with pytest.raises(ValueError, match="val.bin"):
        TokenDataset(dataset_dir)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"dtype": "float32"}, "dtype"),
        ({"vocab_size": 100_000}, r"dtype.*vocab_size\W+100000"),   # the dtype, the vocabulary it cannot hold
        ({"format_version": 99}, "format_version"),
        ({"splits": {"train": {"file": "train.bin", "tokens": 1}}}, "'val'"),
    ],
)
def test_meta_inconsistent(dataset_dir, change, match):
    path = dataset_dir / "meta.json"
    meta = json.loads(path.read_text())
    meta.update(change)
    path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=match) as err:
        TokenDataset(dataset_dir)
    assert "meta.json" in str(err.value)


def test_meta_not_json(dataset_dir):
    (dataset_dir / "meta.json").write_text("{half")
    with pytest.raises(ValueError, match="meta.json"):
        TokenDataset(dataset_dir)


def test_pickles_by_path(dataset_dir):
    ds = TokenDataset(dataset_dir)
    blob = pickle.dumps(ds)
    assert len(blob) < 1000  # the token arrays are not copied
    ds2 = pickle.loads(blob)
    assert np.array_equal(ds2.tokens("train"), ds.tokens("train"))
