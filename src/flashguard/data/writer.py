"""Writing a dataset folder as one transaction, shared by every prepare function.

Protocol (what makes an interrupted prepare harmless):

1. If the folder already holds a complete dataset, stop with :class:`DatasetExistsError`
   unless ``overwrite=True``. Leftover temporary files of a killed run are removed.
2. ``train.bin`` and ``val.bin`` are written to temporary files next to their targets.
   An exception (or Ctrl-C) here deletes them: the folder is as it was before, an old
   dataset included.
3. When all tokens are written: the old ``meta.json`` is removed, both temporary files
   are renamed over ``train.bin``/``val.bin``, and the new ``meta.json`` is written
   atomically, last. Between these steps the folder has no ``meta.json`` and so is
   never mistaken for a complete dataset.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .. import __version__
from ..utils.atomic import atomic_output, atomic_write_json, remove_stale_temp_files
from .meta import FORMAT, FORMAT_VERSION, META_FILE, SPLIT_FILES, SPLITS, token_dtype, validate_dataset
from .tokenizers import doc_separator_of

__all__ = ["DatasetExistsError", "SplitWriter", "dataset_transaction", "check_existing", "ValSplitter"]

log = logging.getLogger("flashguard.data")


class DatasetExistsError(FileExistsError):
    """``out_dir`` already holds a complete dataset and ``overwrite`` was not set.

    ``same_recipe`` tells whether it was made from the same inputs (then there is
    nothing to do); ``meta`` is its ``meta.json``.
    """

    def __init__(self, out_dir: Path, meta: dict, same_recipe: bool, differences: Sequence[str] = ()):
        self.out_dir = Path(out_dir)
        self.meta = meta
        self.same_recipe = same_recipe
        splits = meta.get("splits", {})
        summary = (
            f"tokenizer {meta.get('tokenizer')}, "
            f"{splits.get('train', {}).get('tokens', '?')} train / "
            f"{splits.get('val', {}).get('tokens', '?')} val tokens, created {meta.get('created', '?')}"
        )
        if same_recipe:
            msg = (
                f"{out_dir} already holds a complete dataset with the same recipe ({summary}); "
                "nothing to do. Pass overwrite=True (--overwrite) to prepare it again."
            )
        else:
            msg = (
                f"{out_dir} already holds a different complete dataset ({summary}; differs in: "
                f"{', '.join(differences) or 'recipe'}). Pass overwrite=True (--overwrite) to "
                "replace it, or choose another output folder."
            )
        super().__init__(msg)


def normalize_recipe(recipe: dict) -> dict:
    """JSON round trip, so a fresh recipe compares equal to one read back from meta.json."""
    return json.loads(json.dumps(recipe, sort_keys=True))


def check_existing(out_dir: Path, recipe: dict, overwrite: bool) -> None:
    """Step 1 of the protocol. Incomplete or broken leftovers are replaced without asking."""
    if not (out_dir / META_FILE).exists():
        return
    try:
        meta = validate_dataset(out_dir)
    except (FileNotFoundError, ValueError) as e:
        log.warning("%s holds an incomplete or inconsistent dataset (%s); replacing it", out_dir, e)
        return
    if overwrite:
        log.info("overwriting the dataset in %s", out_dir)
        return
    old = meta.get("recipe") or {}
    new = normalize_recipe(recipe)
    differences = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    raise DatasetExistsError(out_dir, meta, same_recipe=not differences, differences=differences)


class SplitWriter:
    """Appends token arrays to the open temporary split files, checking the id range."""

    def __init__(self, files: dict, dtype: np.dtype, vocab_size: int):
        self._files = files
        self.dtype = np.dtype(dtype)
        self.vocab_size = int(vocab_size)
        self.tokens = {s: 0 for s in SPLITS}
        self.documents = {s: 0 for s in SPLITS}

    def write(self, split: str, ids, *, documents: int = 1, where: str = "") -> None:
        arr = np.asarray(ids)
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        if arr.size:
            if not np.issubdtype(arr.dtype, np.integer):
                raise TypeError(f"token ids must be integers, got {arr.dtype}{where}")
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(
                    f"token id out of range [0, {self.vocab_size}): min {lo}, max {hi}{where}"
                )
            self._files[split].write(arr.astype(self.dtype, copy=False).tobytes())
        self.tokens[split] += int(arr.size)
        self.documents[split] += documents


@contextlib.contextmanager
def dataset_transaction(out_dir: Path, vocab_size: int) -> Iterator[SplitWriter]:
    """Steps 2 and 3 of the protocol, except writing meta.json (the caller does that after)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in (*SPLIT_FILES.values(), META_FILE):
        for p in remove_stale_temp_files(out_dir / name):
            log.info("removed %s left by an interrupted run", p)
    with contextlib.ExitStack() as stack:
        files = {s: stack.enter_context(atomic_output(out_dir / SPLIT_FILES[s], "wb")) for s in SPLITS}
        writer = SplitWriter(files, token_dtype(vocab_size), vocab_size)
        yield writer
        # All tokens are written: the old dataset stops being complete before its files change.
        (out_dir / META_FILE).unlink(missing_ok=True)
    # leaving the ExitStack renamed the temporary files over val.bin and train.bin


def build_meta(
    *,
    tokenizer,
    tokenizer_note: str,
    writer: SplitWriter,
    source: dict,
    split_rule: str,
    recipe: dict,
    started: float,
) -> dict:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tokenizer": str(tokenizer.name),
        "vocab_size": int(tokenizer.vocab_size),
        "eot": None if getattr(tokenizer, "eot", None) is None else int(tokenizer.eot),
        "doc_separator": doc_separator_of(tokenizer),
        "tokenizer_note": tokenizer_note,
        "dtype": writer.dtype.name,
        "splits": {
            s: {"file": SPLIT_FILES[s], "tokens": writer.tokens[s], "documents": writer.documents[s]}
            for s in SPLITS
        },
        "split_rule": split_rule,
        "source": source,
        "recipe": normalize_recipe(recipe),
        "flashguard_version": __version__,
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "prepare_seconds": round(time.perf_counter() - started, 3),
    }


def write_meta(out_dir: Path, meta: dict) -> dict:
    """Write meta.json last (it marks the dataset complete), log the token counts, return meta."""
    atomic_write_json(out_dir / META_FILE, meta)
    logging.getLogger("flashguard.data").info(
        "wrote %s: %d train / %d val tokens (%s)",
        out_dir, meta["splits"]["train"]["tokens"], meta["splits"]["val"]["tokens"], meta["dtype"],
    )
    return meta


class ValSplitter:
    """The document-level split of local and embedded text.

    Document ``i`` (0-based, in source order) goes to val when
    ``floor((i + 1) * f) > floor(i * f)`` with ``f = val_fraction`` taken as an exact
    fraction: val documents are spread evenly, e.g. ``f = 0.05`` sends documents
    19, 39, 59, ... (every 20th) to val. If that leaves val empty (too few documents), the
    last document goes to val instead. At least two documents are needed.
    """

    def __init__(self, val_fraction: float):
        if not 0.0 < float(val_fraction) < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.fraction = Fraction(val_fraction).limit_denominator(1_000_000)

    def is_val(self, index: int) -> bool:
        p, q = self.fraction.numerator, self.fraction.denominator
        return (index + 1) * p // q > index * p // q

    def assign(self, n_documents: int) -> list[str]:
        """The split of each of ``n_documents`` documents (with the empty-val fallback)."""
        out = ["val" if self.is_val(i) else "train" for i in range(n_documents)]
        if n_documents >= 2 and "val" not in out:
            out[-1] = "val"
        return out

    def describe(self, unit: str = "document") -> str:
        """The rule in words; ``unit`` is what is counted (documents, or source files of short ones)."""
        tail = "" if unit == "document" else "; a source file's documents stay together"
        return (
            f"by {unit}: {unit} i goes to val when floor((i+1)*f) > floor(i*f), "
            f"f = {self.fraction} (1 in {float(1 / self.fraction):g} {unit}s){tail}; if no "
            "document lands in val, the last one does"
        )
