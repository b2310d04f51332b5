"""The short-document corpus: separators between documents, never inside; statistics in meta.json."""
import json
import re

import numpy as np
import pytest

from flashguard.data import Document, SeparatorInDocument, TokenDataset, prepare_documents, prepare_embedded_docs, prepare_text
from flashguard.data.command import main as prepare_main
from flashguard.data.short_documents import short_documents, source_of


def synthetic_sources(n_files=40):
    """Files of short paragraphs, like source code: documents of 100-400 bytes once cut."""
    return [Document(f"file{i:02d}.py", "\n\n".join(f"def f{i}_{j}(x):\n    return x + {j}  # " + "pad " * (j * 7 % 60)
                                                     for j in range(12)) + "\n")
            for i in range(n_files)]


def split_documents(path):
    data = np.fromfile(path, dtype=np.uint16)
    assert data.size and data[-1] == 0       # every document is followed by the separator
    return bytes(data.astype(np.uint8)).decode("utf-8").split("\0")[:-1]


def test_documents_are_separated_and_the_separator_never_occurs_inside(tmp_path):
    sources = synthetic_sources()
    docs = list(short_documents(sources))
    meta = prepare_documents(short_documents(sources), tmp_path / "d", tokenizer="byte", progress=False,
                             group_of=source_of)
    train, val = split_documents(tmp_path / "d" / "train.bin"), split_documents(tmp_path / "d" / "val.bin")
    assert sorted(train + val) == sorted(d.text for d in docs)
    assert all(doc and "\0" not in doc for doc in train + val)
    assert meta["doc_separator"] == 0 and meta["splits"]["train"]["documents"] == len(train)
    lengths = [len(t.encode()) for t in train]
    stats = meta["document_tokens"]["train"]
    assert (stats["count"], stats["min"], stats["max"], stats["median"]) == \
        (len(train), min(lengths), max(lengths), float(np.median(lengths)))
    assert 100 <= stats["median"] <= 400
    assert json.loads((tmp_path / "d" / "meta.json").read_text())["document_tokens"] == meta["document_tokens"]


def test_val_holds_whole_source_files(tmp_path):
    prepare_documents(short_documents(synthetic_sources()), tmp_path / "d", tokenizer="byte", progress=False,
                      group_of=source_of)
    val = split_documents(tmp_path / "d" / "val.bin")
    names = {f"def f{i}_" for i in range(40) if f"def f{i}_0(" in "".join(val)}
    assert names == {"def f19_", "def f39_"}   # every 20th file, all its documents
    assert sum(v.startswith(("def f19_", "def f39_")) for v in val) == len(val)


def test_a_document_holding_the_separator_is_refused_naming_it(tmp_path):
    docs = [Document("a.txt", "fine text"), Document("b.txt", "bad \0 byte"), Document("c.txt", "more")]
    with pytest.raises(SeparatorInDocument, match="0x00") as e:   # the byte tokenizer's separator, named as a byte
        prepare_documents(docs, tmp_path / "d", tokenizer="byte", progress=False)
    assert (e.value.separator, e.value.document, e.value.position) == (0, "b.txt", 4)
    assert list((tmp_path / "d").iterdir()) == []   # nothing written
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("ok\n")
    (tmp_path / "src" / "nul.txt").write_bytes(b"a\x00b\n")
    with pytest.raises(SeparatorInDocument) as e:
        prepare_text(tmp_path / "src", tmp_path / "t", tokenizer="byte", progress=False)
    assert e.value.document.endswith("nul.txt") and e.value.position == 1


def test_prepare_embedded_docs_small(tmp_path):
    meta = prepare_embedded_docs(tmp_path / "d", max_bytes=60_000, progress=False)
    assert meta["source"]["kind"] == "embedded-docs" and meta["tokenizer"] == "byte"
    assert meta["recipe"]["doc_min_bytes"] == 100 and meta["recipe"]["doc_max_bytes"] == 250
    assert meta["document_tokens"]["train"]["count"] > 100
    ds = TokenDataset(tmp_path / "d")
    assert ds.doc_separator == 0 and len(ds.document_starts("train")) == meta["splits"]["train"]["documents"] - 1


def test_prepare_command_embedded_docs(tmp_path, capsys):
    out = tmp_path / "o"
    args = ["embedded-docs", "--out", str(out), "--max-bytes", "20000", "--no-progress"]
    assert prepare_main(args) == 0
    assert "separator id 0" in capsys.readouterr().out
    assert prepare_main(args) == 0 and "nothing to do" in capsys.readouterr().err   # same recipe
    assert prepare_main(args + ["--doc-max-bytes", "300"]) == 2                      # another recipe
    assert prepare_main(["embedded-docs", "x.txt", "--out", str(out)]) == 2
    assert "takes no paths" in capsys.readouterr().err
    assert prepare_main(["embedded-docs", "--out", str(tmp_path / "p"), "--doc-min-bytes", "500"]) == 2
    assert re.search(r"max_bytes\W+250\b.*min_bytes\W+500\b", capsys.readouterr().err)   # both keys, both values
    assert not (tmp_path / "p").exists()                                            # refused before writing
