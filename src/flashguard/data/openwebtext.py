"""Prepare OpenWebText (or any Hugging Face text dataset) the way nanoGPT does.

* load: ``datasets.load_dataset(dataset, data_files=..., num_proc=...)``, its ``train``
  split (OpenWebText has only that one);
* split: ``train_test_split(test_size=0.0005, seed=2357, shuffle=True)``, the test part
  renamed ``val`` -- the same split as nanoGPT's ``data/openwebtext/prepare.py``;
* tokenize: ``Dataset.map(num_proc=...)``, GPT-2 BPE (``encode_ordinary``) with the
  end-of-text token 50256 appended to every document;
* write: each split in contiguous shards, in dataset order, into ``train.bin`` /
  ``val.bin`` (uint16), then ``meta.json``, under the transaction protocol of
  :mod:`flashguard.data.writer`.

The same code runs offline on a local file -- ``dataset="json"``,
``data_files="docs.jsonl"`` -- or on a ``datasets.Dataset`` passed in, and the
tokenizer can be any tokenizer object (the tests use the byte tokenizer, whose document
separator is byte 0). Needs ``pip install 'flashguard[data]'`` (datasets, tiktoken);
the real OpenWebText needs the Hugging Face hub (about 54 GB download and cache;
about 9B train tokens, 17 GB train.bin, per nanoGPT).
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator

from tqdm.auto import tqdm

from .tokenizers import Tokenizer, doc_separator_of, resolve_tokenizer
from .writer import build_meta, check_existing, dataset_transaction, write_meta

__all__ = ["prepare_openwebtext", "NANOGPT_TEST_SIZE", "NANOGPT_SEED"]

log = logging.getLogger("flashguard.data")

NANOGPT_TEST_SIZE = 0.0005
NANOGPT_SEED = 2357


def _import_datasets():
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            "prepare_openwebtext needs the `datasets` package: pip install 'flashguard[data]' "
            "(or pip install datasets tiktoken)"
        ) from e
    return datasets


def default_num_proc() -> int:
    """Half the CPU cores, at most 8 (nanoGPT uses 8)."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


class _EncodeBatch:
    """The ``Dataset.map`` function: a picklable object so ``num_proc > 1`` works."""

    def __init__(self, tokenizer: Tokenizer, text_column: str, separator: int | None):
        self.tokenizer = tokenizer
        self.text_column = text_column
        self.tail = [] if separator is None else [int(separator)]

    def __call__(self, batch: dict) -> dict:
        ids_out, lens = [], []
        for text in batch[self.text_column]:
            ids = list(self.tokenizer.encode(text))
            ids.extend(self.tail)
            ids_out.append(ids)
            lens.append(len(ids))
        return {"ids": ids_out, "len": lens}


@contextlib.contextmanager
def _hf_progress(enabled: bool, datasets: Any) -> Iterator[None]:
    """Turn the datasets library's own progress bars off for the block when ``enabled`` is false."""
    if enabled:
        yield
        return
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def _train_part(ds: Any, datasets: Any) -> Any:
    if isinstance(ds, datasets.DatasetDict):
        if "train" in ds:
            return ds["train"]
        if len(ds) == 1:
            return next(iter(ds.values()))
        raise ValueError(f"dataset has splits {list(ds)}; expected a 'train' split")
    if isinstance(ds, datasets.Dataset):
        return ds
    raise TypeError(f"expected a datasets.Dataset or DatasetDict, got {type(ds).__name__}")


def _id_features(datasets: Any, vocab_size: int) -> Any:
    value = datasets.Value("uint32" if vocab_size <= 1 << 32 else "uint64")
    seq = datasets.List(value) if hasattr(datasets, "List") else datasets.Sequence(value)
    return datasets.Features({"ids": seq, "len": datasets.Value("int64")})


def prepare_openwebtext(
    out_dir: str | os.PathLike[str],
    *,
    dataset: str | Any = "openwebtext",
    data_files: Any = None,
    tokenizer: str | Tokenizer = "gpt2",
    num_proc: int | None = None,
    progress: bool = True,
    overwrite: bool = False,
    test_size: float = NANOGPT_TEST_SIZE,
    seed: int = NANOGPT_SEED,
    text_column: str = "text",
    num_shards: int = 1024,
    cache_dir: str | os.PathLike[str] | None = None,
    load_kwargs: dict | None = None,
) -> dict:
    """Prepare a Hugging Face text dataset with nanoGPT's OpenWebText recipe; return the meta.

    ``dataset`` is a name or builder for ``load_dataset`` (``"openwebtext"``, ``"json"``,
    ``"text"``, ...) or a ``datasets.Dataset``/``DatasetDict`` already loaded.
    ``num_proc`` (default: half the cores, at most 8) is used for loading and tokenizing.
    ``num_shards`` is how many contiguous pieces each split is written in.
    """
    datasets = _import_datasets()
    started = time.perf_counter()
    out = Path(out_dir)
    if not 0 < test_size < 1:
        raise ValueError(f"test_size must be in (0, 1), got {test_size}")
    tok, note = resolve_tokenizer(tokenizer)
    log.info("tokenizer: %s (%s)", tok.name, note)
    nproc = default_num_proc() if num_proc is None else max(1, int(num_proc))
    recipe = _recipe(dataset, data_files, text_column, test_size, seed, tok)
    check_existing(out, recipe, overwrite)

    with _hf_progress(progress, datasets):
        if isinstance(dataset, str):
            loaded = _load(datasets, dataset, data_files, cache_dir, nproc, load_kwargs)
        else:
            loaded = dataset
        full = _train_part(loaded, datasets)
        splits = _split(full, text_column, test_size, seed)
        tokenized = _tokenize(datasets, splits, tok, text_column, nproc)

    with dataset_transaction(out, tok.vocab_size) as writer:
        for name in ("train", "val"):
            _write_split(writer, name, tokenized[name], num_shards, progress)

    source = {
        "kind": "huggingface",
        "dataset": recipe["dataset"],
        "data_files": recipe["data_files"],
        "documents": len(full),
        "split": (
            f"datasets train_test_split(test_size={test_size}, seed={seed}, shuffle=True), "
            "'test' renamed 'val' (nanoGPT's OpenWebText split)"
        ),
        "datasets_version": datasets.__version__,
    }
    meta = build_meta(
        tokenizer=tok,
        tokenizer_note=note,
        writer=writer,
        source=source,
        split_rule=source["split"],
        recipe=recipe,
        started=started,
    )
    return write_meta(out, meta)


def _recipe(dataset: str | Any, data_files: Any, text_column: str, test_size: float, seed: int,
            tok: Tokenizer) -> dict:
    """What the prepared folder is made from (a rerun with another recipe is refused unless overwrite)."""
    if isinstance(dataset, str):
        dataset_id: Any = dataset
    else:
        dataset_id = f"<{type(dataset).__name__} fingerprint {getattr(dataset, '_fingerprint', '?')}>"
    return {
        "kind": "huggingface",
        "dataset": dataset_id,
        "data_files": data_files if data_files is None else _jsonable(data_files),
        "text_column": text_column,
        "test_size": test_size,
        "seed": seed,
        "tokenizer": str(tok.name),
        "vocab_size": int(tok.vocab_size),
    }


def _load(datasets: Any, dataset: str, data_files: Any, cache_dir: Any, nproc: int, load_kwargs: dict | None) -> Any:
    """``datasets.load_dataset(dataset, ...)`` with the data files, cache folder and processes asked for."""
    kwargs = dict(load_kwargs or {})
    if data_files is not None:
        kwargs["data_files"] = data_files
    if cache_dir is not None:
        kwargs["cache_dir"] = str(cache_dir)
    if nproc > 1:
        kwargs["num_proc"] = nproc
    return datasets.load_dataset(dataset, **kwargs)


def _split(full: Any, text_column: str, test_size: float, seed: int) -> dict:
    """nanoGPT's split of the documents: {"train": ..., "val": ...} (its 'test' renamed 'val')."""
    if text_column not in full.column_names:
        raise ValueError(f"dataset has columns {full.column_names}; no {text_column!r} column")
    if len(full) < 2:
        raise ValueError(f"need at least 2 documents to split, got {len(full)}")
    parts = full.train_test_split(test_size=test_size, seed=seed, shuffle=True)
    return {"train": parts["train"], "val": parts["test"]}


def _tokenize(datasets: Any, splits: dict, tok: Tokenizer, text_column: str, nproc: int) -> dict:
    """Each split's documents as token ids (the tokenizer's document separator, if any, after each)."""
    encode = _EncodeBatch(tok, text_column, doc_separator_of(tok))
    features = _id_features(datasets, tok.vocab_size)
    tokenized = {}
    for name, part in splits.items():
        tokenized[name] = part.map(
            encode,
            batched=True,
            remove_columns=part.column_names,
            features=features,
            num_proc=nproc if nproc > 1 and len(part) > 1 else None,
            desc=f"tokenizing {name}",
        )
    return tokenized


def _write_split(writer, split: str, data: Any, num_shards: int, progress: bool) -> None:
    import pyarrow.compute as pc

    n_docs = len(data)
    expected = int(pc.sum(data.with_format("arrow")[:].column("len")).as_py() or 0) if n_docs else 0
    shards = max(1, min(int(num_shards), n_docs))
    before = writer.tokens[split]
    for index in tqdm(range(shards), desc=f"writing {split}.bin", disable=not progress or n_docs == 0):
        if n_docs == 0:
            break
        piece = data.shard(num_shards=shards, index=index, contiguous=True)
        table = piece.with_format("arrow")[:]
        flat = pc.list_flatten(table.column("ids")).to_numpy()
        writer.write(split, flat, documents=len(piece), where=f" in {split} shard {index}")
    written = writer.tokens[split] - before
    if written != expected:
        raise RuntimeError(f"{split}: wrote {written} tokens but the lengths add up to {expected}")


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return repr(value)

