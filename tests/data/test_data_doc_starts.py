"""Windows that start at document starts (TokenDataset.sample_indices(..., doc_starts=True))."""
import random

import numpy as np
import pytest
import torch

from flashguard.data import Document, TokenDataset, prepare_documents

from run_helpers import prepare_without_separator


@pytest.fixture(scope="module")
def docs_dir(tmp_path_factory):
    rng = random.Random(0)
    docs = [Document(f"d{i}", "".join(rng.choice("abcdefgh \n") for _ in range(rng.randint(20, 120))))
            for i in range(200)]
    out = tmp_path_factory.mktemp("docs")
    prepare_documents(docs, out, tokenizer="byte", progress=False)
    return out


def test_windows_start_right_after_a_separator(docs_dir):
    ds = TokenDataset(docs_dir)
    data = ds.tokens("train")
    idx = ds.sample_indices("train", 256, 64, torch.Generator().manual_seed(0), doc_starts=True)
    assert idx.dtype == torch.int64 and idx.shape == (256,)
    assert all(data[i - 1] == 0 for i in idx.tolist())
    assert idx.max().item() <= len(data) - 64 - 1        # room for the window and its targets
    x, _ = ds.batch("train", idx, 64)
    assert (x[:, 0] != 0).all()                          # a window opens with its document's first token
    assert len(set(idx.tolist())) > 100                  # many documents, not a few
    starts = ds.document_starts("train")
    assert np.array_equal(starts, np.flatnonzero(np.asarray(data[:-1]) == 0) + 1)


def test_doc_start_draws_are_reproducible_from_the_generator(docs_dir):
    ds = TokenDataset(docs_dir)
    g = torch.Generator().manual_seed(7)
    ds.sample_indices("train", 3, 32, g, doc_starts=True)
    state = g.get_state()
    a = ds.sample_indices("train", 16, 32, g, doc_starts=True)
    b = ds.sample_indices("train", 16, 32, g, doc_starts=True)
    g.set_state(state)
    assert torch.equal(ds.sample_indices("train", 16, 32, g, doc_starts=True), a)
    assert torch.equal(ds.sample_indices("train", 16, 32, g, doc_starts=True), b)
    assert torch.equal(TokenDataset(docs_dir).sample_indices("train", 16, 32, torch.Generator().manual_seed(7),
                                                             doc_starts=True),
                       TokenDataset(docs_dir).sample_indices("train", 16, 32, torch.Generator().manual_seed(7),
                                                             doc_starts=True))


def test_default_draws_are_the_uniform_ones_of_before(tiny_data):
    """doc_starts off: the offsets recorded before the option existed (the tiny training corpus,
    generator seeded as the trainer seeds its sampler), and plain torch.randint over the range."""
    ds = TokenDataset(tiny_data)
    assert ds.num_tokens("train") == 97_800
    assert ds.sample_indices("train", 8, 64, torch.Generator().manual_seed(1338)).tolist() == \
        [85272, 40866, 32868, 15428, 43757, 94664, 37309, 4962]
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(ds.sample_indices("val", 32, 16, g1, doc_starts=False),
                       torch.randint(0, ds.num_tokens("val") - 16, (32,), generator=g2, dtype=torch.int64))


def test_no_separator_or_no_room_is_a_clear_error(tmp_path, docs_dir):
    ds = TokenDataset(prepare_without_separator(tmp_path, 3, "text " * 30))
    assert ds.doc_separator is None
    ds.sample_indices("train", 2, 8, torch.Generator())  # the uniform draw needs none
    with pytest.raises(ValueError, match=r"doc_starts.*meta\.json.*doc_separator"):
        ds.sample_indices("train", 2, 8, torch.Generator(), doc_starts=True)
    big = TokenDataset(docs_dir)
    n = big.num_tokens("val")
    with pytest.raises(ValueError, match=rf"'val'.*block_size\W+{n - 2}\b"):
        big.sample_indices("val", 2, n - 2, torch.Generator(), doc_starts=True)
