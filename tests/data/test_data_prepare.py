import json
import warnings

import numpy as np
import pytest

from flashguard import __version__
from flashguard.data import (
    DatasetExistsError,
    InvalidTextFile,
    TokenDataset,
    ValSplitter,
    embedded_documents,
    prepare_embedded,
    prepare_text,
    token_dtype,
)
from flashguard.data.command import main as prepare_main
from flashguard.data.sources import SourceStats, embedded_files, stdlib_dir, text_files

SMALL = 1_000_000  # bytes of the embedded corpus used by these tests (46 documents)


def read_docs(path, dtype=np.uint16):
    data = np.fromfile(path, dtype=dtype)
    assert data.size and data[-1] == 0  # every document ends with the separator
    return bytes(data.astype(np.uint8)).decode("utf-8").split("\0")[:-1]


def expected_split(docs, val_fraction=0.05):
    plan = ValSplitter(val_fraction).assign(len(docs))
    train = [d.text for d, s in zip(docs, plan, strict=True) if s == "train"]
    val = [d.text for d, s in zip(docs, plan, strict=True) if s == "val"]
    return train, val


def test_embedded_small_roundtrip(tmp_path):
    out = tmp_path / "emb"
    meta = prepare_embedded(out, tokenizer="byte", max_bytes=SMALL, progress=False)
    stats = SourceStats()
    docs = list(embedded_documents(max_bytes=SMALL, stats=stats))
    assert stats.bytes == SMALL and stats.truncated == docs[-1].name  # cut exactly at the cap
    train, val = expected_split(docs)
    assert len(docs) >= 40 and len(val) == len(docs) // 20
    assert read_docs(out / "train.bin") == train
    assert read_docs(out / "val.bin") == val

    assert meta == json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == "byte" and meta["vocab_size"] == 256 and meta["dtype"] == "uint16"
    assert meta["doc_separator"] == 0 and meta["eot"] is None
    assert meta["flashguard_version"] == __version__ and meta["created"]
    assert meta["source"]["kind"] == "embedded" and meta["source"]["sha256"] == stats.sha256
    for split in ("train", "val"):
        info = meta["splits"][split]
        assert (out / info["file"]).stat().st_size == 2 * info["tokens"]
    assert meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"] == SMALL + len(docs)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]

    ds = TokenDataset(out)
    assert ds.tokenizer_name == "byte" and ds.num_tokens("val") == meta["splits"]["val"]["tokens"]


def test_embedded_corpus_order_and_contents():
    files = embedded_files()
    rels = [p.relative_to(stdlib_dir()).as_posix() for p in files]
    assert len(files) > 500 and rels == sorted(rels)
    parts = {part for r in rels for part in r.split("/")[:-1]}
    assert not parts & {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    assert "asyncio/base_events.py" in rels and "os.py" in rels
    with_tests = embedded_files(include_tests=True)
    assert len(with_tests) > len(files)
    names = [d.name for d in embedded_documents(max_bytes=SMALL)]
    assert names == sorted(names) and names[0].startswith("stdlib/")


def test_auto_tokenizer_choice_is_recorded(tmp_path, empty_tiktoken_cache):
    meta = prepare_embedded(tmp_path / "o", max_bytes=20_000, progress=False)
    assert meta["tokenizer"] == "byte"
    from flashguard.data.tiktoken_cache import gpt2_unavailable_reason
    note = meta["tokenizer_note"]   # the auto choice, with why gpt2 was not taken
    assert note.startswith("auto:") and "byte" in note and note.endswith(gpt2_unavailable_reason())
    assert meta["recipe"]["tokenizer"] == "byte"


def test_existing_dataset_needs_overwrite(tmp_path):
    out = tmp_path / "o"
    first = prepare_embedded(out, tokenizer="byte", max_bytes=30_000, progress=False)
    with pytest.raises(DatasetExistsError, match="same recipe") as same:
        prepare_embedded(out, tokenizer="byte", max_bytes=30_000, progress=False)
    assert same.value.same_recipe and same.value.meta["created"] == first["created"]
    with pytest.raises(DatasetExistsError, match="val_fraction") as diff:
        prepare_embedded(out, tokenizer="byte", max_bytes=30_000, val_fraction=0.1, progress=False)
    assert not diff.value.same_recipe
    meta = prepare_embedded(out, tokenizer="byte", max_bytes=30_000, val_fraction=0.1,
                            progress=False, overwrite=True)
    assert meta["recipe"]["val_fraction"] == 0.1
    assert TokenDataset(out).meta == meta


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_interrupted_prepare_leaves_no_files(tmp_path, exploding_tokenizer, exc):
    out = tmp_path / "o"
    with pytest.raises(exc, match="injected"):
        prepare_embedded(out, tokenizer=exploding_tokenizer(fail_at=25, exc=exc),
                         max_bytes=SMALL, progress=False)
    assert list(out.iterdir()) == []  # no train.bin, no val.bin, no meta.json, no temp file


def test_interrupted_overwrite_keeps_the_old_dataset(tmp_path, exploding_tokenizer):
    out = tmp_path / "o"
    old = prepare_embedded(out, tokenizer="byte", max_bytes=50_000, progress=False)
    old_train = (out / "train.bin").read_bytes()
    with pytest.raises(RuntimeError):
        prepare_embedded(out, tokenizer=exploding_tokenizer(fail_at=25), max_bytes=SMALL,
                         overwrite=True, progress=False)
    assert TokenDataset(out).meta == old
    assert (out / "train.bin").read_bytes() == old_train
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_leftovers_of_a_killed_run_are_cleaned(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / ".train.bin.x1y2.tmp").write_bytes(b"\0" * 100)  # as left by kill -9
    (out / "train.bin").write_bytes(b"\1" * 10)  # half-made output without meta.json
    prepare_embedded(out, tokenizer="byte", max_bytes=20_000, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    TokenDataset(out)


def test_prepare_text_folder(tmp_path, text_corpus):
    root, docs = text_corpus
    out = tmp_path / "o"
    meta = prepare_text(root, out, tokenizer="byte", val_fraction=0.25, progress=False)
    order = ["a.txt", "b.md", "sub/c.txt", "sub/deeper/d.txt", "z.txt"]  # sorted, hidden + empty dropped
    assert [p.relative_to(root).as_posix() for p in text_files([root])] == order[:4] + ["sub/e.txt", "z.txt"]
    plan = ValSplitter(0.25).assign(len(order))
    assert plan == ["train", "train", "train", "val", "train"]
    assert read_docs(out / "train.bin") == [docs[n] for n, s in zip(order, plan, strict=True) if s == "train"]
    assert read_docs(out / "val.bin") == [docs[n] for n, s in zip(order, plan, strict=True) if s == "val"]
    assert meta["source"]["kind"] == "text" and meta["source"]["skipped_empty"] == 1
    assert meta["source"]["documents"] == 5


def test_prepare_text_rejects_non_utf8_naming_the_file(tmp_path, text_corpus):
    root, _ = text_corpus
    bad = root / "sub" / "latin1.txt"
    bad.write_bytes("café crème".encode("latin-1"))
    out = tmp_path / "o"
    with pytest.raises(InvalidTextFile, match="latin1.txt") as err:
        prepare_text(root, out, tokenizer="byte", progress=False)
    assert err.value.path == bad and "--skip-invalid" in str(err.value)
    assert not out.exists() or list(out.iterdir()) == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = prepare_text(root, out, tokenizer="byte", skip_invalid=True, progress=False)
    assert any("latin1.txt" in str(w.message) for w in caught)
    assert meta["source"]["skipped_invalid"] == [str(bad)]


def test_prepare_text_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        prepare_text(tmp_path / "nope", tmp_path / "o", tokenizer="byte", progress=False)


def test_uint32_for_large_vocab(tmp_path, text_corpus, wide_tokenizer):
    root, docs = text_corpus
    out = tmp_path / "o"
    meta = prepare_text(root, out, tokenizer=wide_tokenizer, val_fraction=0.25, progress=False)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == wide_tokenizer.vocab_size
    assert meta["doc_separator"] == wide_tokenizer.eot
    ds = TokenDataset(out)
    train = np.asarray(ds.tokens("train"))
    assert train.dtype == np.uint32 and train.max() > 65_535
    assert wide_tokenizer.decode(train.tolist()) == docs["a.txt"] + docs["b.md"] + docs["sub/c.txt"] + docs["z.txt"]
    assert (out / "train.bin").stat().st_size == 4 * ds.num_tokens("train")


def test_out_of_range_token_ids_are_rejected(tmp_path, text_corpus, wide_tokenizer):
    wide_tokenizer.vocab_size = 1000  # ids now exceed the declared vocabulary
    with pytest.raises(ValueError, match="out of range"):
        prepare_text(text_corpus[0], tmp_path / "o", tokenizer=wide_tokenizer, progress=False)
    assert list((tmp_path / "o").iterdir()) == []


def test_token_dtype_bounds():
    assert token_dtype(256) == np.uint16
    assert token_dtype(50257) == np.uint16
    assert token_dtype(65536) == np.uint16  # ids 0..65535 fit
    assert token_dtype(65537) == np.uint32
    with pytest.raises(ValueError):
        token_dtype(0)


def test_val_splitter():
    s = ValSplitter(0.05)
    assert [i for i in range(100) if s.is_val(i)] == [19, 39, 59, 79, 99]
    assert ValSplitter(0.05).assign(3) == ["train", "train", "val"]  # fallback: last doc
    assert ValSplitter(0.5).assign(4) == ["train", "val", "train", "val"]
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError):
            ValSplitter(bad)


def test_needs_two_documents(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("only one")
    with pytest.raises(ValueError, match="at least 2"):
        prepare_text(f, tmp_path / "o", tokenizer="byte", progress=False)
    assert list((tmp_path / "o").iterdir()) == []


def test_prepare_command(tmp_path, capsys):
    out = tmp_path / "o"
    args = ["embedded", "--out", str(out), "--tokenizer", "byte", "--max-bytes", "20000", "--no-progress"]
    assert prepare_main(args) == 0
    assert "train" in capsys.readouterr().out
    assert prepare_main(args) == 0  # same recipe: nothing to do
    assert "nothing to do" in capsys.readouterr().err
    assert prepare_main(args[:-1] + ["--val-fraction", "0.1", "--no-progress"]) == 2  # different recipe over existing output: refused, exit code 2 (bad input)


def test_prepare_with_gpt2_tokenizer(tmp_path, text_corpus, gpt2_standin):
    out = tmp_path / "o"
    meta = prepare_text(text_corpus[0], out, tokenizer="gpt2", val_fraction=0.25, progress=False)
    assert (meta["tokenizer"], meta["vocab_size"], meta["eot"], meta["dtype"]) == ("gpt2", 50257, 50256, "uint16")
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    assert (train == 50256).sum() == meta["splits"]["train"]["documents"] == 4 and train[-1] == 50256
