"""Prepare the embedded corpus or local text files into ``train.bin`` / ``val.bin`` / ``meta.json``.

Each document is tokenized, followed by the tokenizer's document separator, and
appended to the split chosen by :class:`~flashguard.data.writer.ValSplitter`
(every 20th document to val for the default ``val_fraction=0.05``). Writing follows the
transaction protocol of :mod:`flashguard.data.writer`: an interrupted prepare leaves the
folder as it was. OpenWebText lives in :mod:`flashguard.data.openwebtext`.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Iterable, Iterator

from tqdm.auto import tqdm

from .sources import (
    Document,
    SourceStats,
    embedded_description,
    embedded_documents,
    embedded_files,
    text_documents,
    text_files,
)
from .tokenizers import Tokenizer, doc_separator_of, resolve_tokenizer
from .writer import ValSplitter, build_meta, check_existing, dataset_transaction, write_meta

__all__ = ["prepare_embedded", "prepare_text", "prepare_documents"]

log = logging.getLogger("flashguard.data")


def prepare_documents(
    documents: Iterable[Document],
    out_dir: str | os.PathLike[str],
    *,
    tokenizer: str | Tokenizer = "auto",
    val_fraction: float = 0.05,
    source: dict | None = None,
    stats: SourceStats | None = None,
    recipe: dict | None = None,
    overwrite: bool = False,
    progress: bool = True,
    total_bytes: int | None = None,
    desc: str = "tokenizing",
) -> dict:
    """Tokenize ``documents`` into a dataset folder; return its meta (also in ``meta.json``).

    The lower-level entry used by :func:`prepare_embedded` and :func:`prepare_text`;
    ``source`` describes the text, ``stats`` (filled by the source while it is read) adds
    counts and a content hash, ``recipe`` (the inputs) decides whether an existing
    dataset is "the same".
    """
    started = time.perf_counter()
    out = Path(out_dir)
    splitter = ValSplitter(val_fraction)
    tok, note = resolve_tokenizer(tokenizer)
    log.info("tokenizer: %s (%s)", tok.name, note)
    full_recipe = dict(recipe or {})
    full_recipe.update(
        tokenizer=str(tok.name), vocab_size=int(tok.vocab_size), val_fraction=float(val_fraction)
    )
    check_existing(out, full_recipe, overwrite)
    sep = doc_separator_of(tok)
    tail = [] if sep is None else [sep]

    with dataset_transaction(out, tok.vocab_size) as writer, tqdm(
        total=total_bytes, unit="B", unit_scale=True, desc=desc, disable=not progress
    ) as bar:
        pending = None  # the latest train document, held back for the empty-val fallback
        index = -1
        done = 0
        for index, doc in enumerate(documents):
            ids = list(tok.encode(doc.text))
            ids.extend(tail)
            if splitter.is_val(index):
                writer.write("val", ids, where=f" in {doc.name}")
            else:
                if pending is not None:
                    writer.write("train", pending[0], where=pending[1])
                pending = (ids, f" in {doc.name}")
            now = stats.bytes if stats is not None else done + len(doc.text.encode("utf-8"))
            bar.update(now - done)
            done = now
        n_docs = index + 1
        if n_docs < 2:
            raise ValueError(
                f"need at least 2 non-empty documents to make a train and a val split, got {n_docs}"
            )
        if writer.documents["val"] == 0:
            writer.write("val", pending[0], where=pending[1])
        else:
            writer.write("train", pending[0], where=pending[1])

    src = dict(source or {})
    if stats is not None:
        src.update(stats.as_dict())
    meta = build_meta(
        tokenizer=tok,
        tokenizer_note=note,
        writer=writer,
        source=src,
        split_rule=splitter.describe(),
        recipe=full_recipe,
        started=started,
    )
    return write_meta(out, meta)


def prepare_embedded(
    out_dir: str | os.PathLike[str],
    *,
    tokenizer: str | Tokenizer = "auto",
    val_fraction: float = 0.05,
    max_bytes: int | None = None,
    include_tests: bool = False,
    include_pydoc: bool = True,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Prepare the embedded corpus: Python's standard library sources (+ pydoc topics).

    See :mod:`flashguard.data.sources` for what is included and in which order
    (12.6 MB of text, 810 documents, on CPython 3.11 by default). ``max_bytes`` caps the text size.
    """
    description = embedded_description(include_tests, include_pydoc)
    files = embedded_files(include_tests)
    total = sum(p.stat().st_size for p in files)
    if include_pydoc:
        total += 500_000  # rough size of the pydoc topics, for the progress bar only
    if max_bytes is not None:
        total = min(total, max_bytes)
    stats = SourceStats()
    docs = embedded_documents(
        max_bytes=max_bytes, include_tests=include_tests, include_pydoc=include_pydoc, stats=stats
    )
    recipe = dict(description, max_bytes=max_bytes)
    return prepare_documents(
        docs,
        out_dir,
        tokenizer=tokenizer,
        val_fraction=val_fraction,
        source=description,
        stats=stats,
        recipe=recipe,
        overwrite=overwrite,
        progress=progress,
        total_bytes=total,
        desc="embedded corpus",
    )


def _files_digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def prepare_text(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    tokenizer: str | Tokenizer = "auto",
    val_fraction: float = 0.05,
    max_bytes: int | None = None,
    skip_invalid: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Prepare local UTF-8 files and folders (recursive, sorted; see :mod:`flashguard.data.sources`).

    A file that is not UTF-8 raises :class:`~flashguard.data.sources.InvalidTextFile`
    naming it (nothing is written), unless ``skip_invalid=True``.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = list(paths)
    files = text_files(paths)
    if not files:
        raise ValueError(f"no files found in {', '.join(map(str, paths))}")
    total = sum(p.stat().st_size for p in files)
    if max_bytes is not None:
        total = min(total, max_bytes)
    description = {
        "kind": "text",
        "paths": [str(Path(p).resolve()) for p in paths],
        "files": len(files),
    }
    recipe = dict(
        description,
        files_digest=_files_digest(files),
        max_bytes=max_bytes,
        skip_invalid=skip_invalid,
    )
    stats = SourceStats()
    docs: Iterator[Document] = text_documents(
        files, skip_invalid=skip_invalid, max_bytes=max_bytes, stats=stats
    )
    return prepare_documents(
        docs,
        out_dir,
        tokenizer=tokenizer,
        val_fraction=val_fraction,
        source=description,
        stats=stats,
        recipe=recipe,
        overwrite=overwrite,
        progress=progress,
        total_bytes=total,
        desc="text files",
    )
