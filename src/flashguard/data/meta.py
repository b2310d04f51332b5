"""The on-disk format of a prepared dataset and its checks.

A dataset folder holds (nanoGPT-compatible):

* ``train.bin``, ``val.bin``: every token of the split, flat, native little-endian,
  ``uint16`` when the vocabulary fits (``vocab_size <= 65536``), else ``uint32``;
  each document is followed by the tokenizer's document separator
  (``eot`` for gpt2, byte 0x00 for the byte tokenizer), an id checked never to occur inside
  a document (embedded and text sources, :mod:`.separator_check`).
* ``meta.json``: tokenizer name, vocab size, dtype name, the separator id (``doc_separator``),
  token and document counts per split, document-length statistics per split in tokens
  (``document_tokens``: count, min, p10, median, mean, p90, max; embedded and text sources;
  older datasets lack it), what the text was, how the split was made, the recipe (the inputs
  that define the dataset), the flashguard version and the creation time. No ``meta.pkl``.

``meta.json`` is written last and each file is written atomically, so a folder is a
*complete* dataset exactly when :func:`validate_dataset` accepts it.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "META_FILE",
    "SPLITS",
    "SPLIT_FILES",
    "token_dtype",
    "read_meta",
    "validate_dataset",
]

FORMAT = "flashguard-tokens"
FORMAT_VERSION = 1
META_FILE = "meta.json"
SPLITS = ("train", "val")
SPLIT_FILES = {"train": "train.bin", "val": "val.bin"}
_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` if every id ``< vocab_size`` fits in 16 bits, else ``uint32``."""
    vocab_size = int(vocab_size)
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 32:
        return np.dtype(np.uint32)
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32")


def read_meta(data_dir: str | Path) -> dict:
    """Load and check ``meta.json`` of ``data_dir`` (not the .bin files; see :func:`validate_dataset`).

    Raises ``FileNotFoundError`` for a missing folder or file and ``ValueError``, naming
    the file, for anything inconsistent.
    """
    folder = Path(data_dir)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"data folder {folder} does not exist; create it with `flashguard prepare`"
        )
    path = folder / META_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: {folder} is not a prepared dataset (or its prepare was "
            "interrupted); run `flashguard prepare` again"
        )
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: expected a JSON object")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format is {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: format_version {meta.get('format_version')!r}; this flashguard reads "
            f"version {FORMAT_VERSION}"
        )
    for key in ("tokenizer", "vocab_size", "dtype", "splits"):
        if key not in meta:
            raise ValueError(f"{path}: missing key {key!r}")
    if meta["dtype"] not in _DTYPES:
        raise ValueError(f"{path}: dtype {meta['dtype']!r} is not one of {sorted(_DTYPES)}")
    vocab = meta["vocab_size"]
    if not isinstance(vocab, int) or vocab <= 0:
        raise ValueError(f"{path}: vocab_size {vocab!r} is not a positive integer")
    if np.dtype(_DTYPES[meta["dtype"]]).itemsize < token_dtype(vocab).itemsize:
        raise ValueError(f"{path}: dtype {meta['dtype']} cannot hold vocab_size {vocab}")
    splits = meta["splits"]
    if not isinstance(splits, dict):
        raise ValueError(f"{path}: 'splits' must be an object")
    for split in SPLITS:
        info = splits.get(split)
        if not isinstance(info, dict) or "tokens" not in info or "file" not in info:
            raise ValueError(f"{path}: split {split!r} missing or without 'file'/'tokens'")
        if not isinstance(info["tokens"], int) or info["tokens"] < 0:
            raise ValueError(f"{path}: split {split!r} has token count {info['tokens']!r}")
        if Path(info["file"]).name != info["file"]:
            raise ValueError(f"{path}: split file {info['file']!r} must be a plain file name")
    return meta


def split_path(data_dir: str | Path, meta: dict, split: str) -> Path:
    return Path(data_dir) / meta["splits"][split]["file"]


def validate_dataset(data_dir: str | Path) -> dict:
    """Check that ``data_dir`` is a complete dataset; return its meta.

    Every split file must exist and hold exactly ``tokens * itemsize`` bytes.
    """
    meta = read_meta(data_dir)
    itemsize = np.dtype(_DTYPES[meta["dtype"]]).itemsize
    for split in SPLITS:
        path = split_path(data_dir, meta, split)
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found (listed in {Path(data_dir) / META_FILE})")
        expected = meta["splits"][split]["tokens"] * itemsize
        actual = path.stat().st_size
        if actual != expected:
            raise ValueError(
                f"{path} has {actual} bytes but {META_FILE} says {meta['splits'][split]['tokens']} "
                f"{meta['dtype']} tokens ({expected} bytes): the files do not belong together"
            )
    return meta


def numpy_dtype(meta: dict) -> np.dtype:
    return np.dtype(_DTYPES[meta["dtype"]])
