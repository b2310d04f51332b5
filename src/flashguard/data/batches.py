"""Reading batches from a prepared dataset, reproducibly.

Batches are drawn in two steps so the trainer can log and replay them:

1. ``indices = ds.sample_indices(split, batch_size, block_size, generator)``: start offsets,
   uniform over ``[0, len(split) - block_size - 1]``, from ``torch.randint`` with the given
   CPU ``torch.Generator`` -- restoring the generator's state (``get_state``/``set_state``)
   gives the same offsets again, and the offsets themselves can go to ``batches.jsonl``;
   with ``doc_starts=True``, uniform over the offsets right after a document separator
   instead (:mod:`.doc_starts`), from the same generator;
2. ``x, y = ds.batch(split, indices, block_size)``: int64 tensors (B, T), ``y`` is ``x``
   shifted by one token.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .doc_starts import draw_doc_starts, separator_follows, usable_starts
from .meta import META_FILE, SPLITS, numpy_dtype, split_path, validate_dataset

__all__ = ["TokenDataset"]


class TokenDataset:
    """The ``train``/``val`` token files of a dataset folder, opened read-only as ``np.memmap``.

    Raises ``FileNotFoundError`` (missing folder, ``meta.json`` or ``.bin`` file) or
    ``ValueError`` (meta.json inconsistent with itself or with the file sizes), naming the
    file. Pickles by path (the memmaps are reopened), so it can go to worker processes.
    """

    def __init__(self, data_dir: str | Path):
        self.data_dir = Path(data_dir)
        self.meta = validate_dataset(self.data_dir)
        self.dtype = numpy_dtype(self.meta)
        self._arrays: dict[str, np.ndarray] = {}
        self._doc_starts: dict[str, np.ndarray] = {}  # per split, found on first use
        self._open()

    def _open(self) -> None:
        for split in SPLITS:
            path = split_path(self.data_dir, self.meta, split)
            n = self.meta["splits"][split]["tokens"]
            if n == 0:  # np.memmap cannot map an empty file
                self._arrays[split] = np.empty(0, dtype=self.dtype)
            else:
                self._arrays[split] = np.memmap(path, dtype=self.dtype, mode="r", shape=(n,))

    def __getstate__(self) -> dict:
        return {"data_dir": self.data_dir}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["data_dir"])

    # --------------------------------------------------------------- accessors
    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def tokenizer_name(self) -> str:
        return str(self.meta["tokenizer"])

    @property
    def doc_separator(self) -> int | None:
        return self.meta.get("doc_separator")

    @property
    def splits(self) -> tuple[str, ...]:
        return SPLITS

    def _check_split(self, split: str) -> None:
        if split not in self._arrays:
            raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")

    def num_tokens(self, split: str) -> int:
        """Number of tokens in ``split``."""
        self._check_split(split)
        return int(self._arrays[split].shape[0])

    def tokens(self, split: str) -> np.ndarray:
        """The read-only memmap of ``split`` (``len(ds.tokens("val"))`` is its length)."""
        self._check_split(split)
        return self._arrays[split]

    def tokenizer(self):
        """The tokenizer the dataset was made with (for decoding); may raise ``TokenizerUnavailable``."""
        from .tokenizers import get_tokenizer

        return get_tokenizer(self.tokenizer_name)

    def __repr__(self) -> str:
        return (
            f"TokenDataset({str(self.data_dir)!r}, tokenizer={self.tokenizer_name}, "
            f"vocab_size={self.vocab_size}, train={self.num_tokens('train')}, "
            f"val={self.num_tokens('val')})"
        )

    # --------------------------------------------------------------- sampling
    def _check_block(self, split: str, block_size: int) -> int:
        self._check_split(split)
        if int(block_size) < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        n = self.num_tokens(split)
        if n < block_size + 1:
            path = split_path(self.data_dir, self.meta, split)
            raise ValueError(
                f"block_size {block_size} needs at least {block_size + 1} tokens, but split "
                f"{split!r} ({path}) has only {n}"
            )
        return n

    def document_starts(self, split: str) -> np.ndarray:
        """Offsets right after each document separator of ``split`` (int64, ascending).

        ``ValueError`` if the dataset's meta.json records no separator.
        """
        self._check_split(split)
        sep = self.doc_separator
        if sep is None:
            raise ValueError(
                f"doc_starts needs a document separator, but {self.data_dir / META_FILE} records "
                "none (doc_separator); prepare the data with a tokenizer that has one "
                "(e.g. flashguard prepare embedded-docs)"
            )
        if split not in self._doc_starts:
            self._doc_starts[split] = separator_follows(self._arrays[split], int(sep))
        return self._doc_starts[split]

    def usable_doc_starts(self, split: str, block_size: int) -> np.ndarray:
        """The document starts of ``split`` a window of ``block_size`` fits after (what
        ``doc_starts=True`` draws from); ``ValueError`` if there is none, or no separator."""
        n = self._check_block(split, block_size)
        starts = self.document_starts(split)
        usable = usable_starts(starts, n, int(block_size))
        if usable.size == 0:
            raise ValueError(
                f"doc_starts: no document of split {split!r} ({split_path(self.data_dir, self.meta, split)}) "
                f"starts early enough for a window of block_size {block_size} ({n} tokens, "
                f"{starts.size} separators before the last token)"
            )
        return usable

    def sample_indices(
        self, split: str, batch_size: int, block_size: int, generator: torch.Generator,
        *, doc_starts: bool = False,
    ) -> torch.Tensor:
        """``batch_size`` start offsets, uniform in ``[0, len(split) - block_size - 1]`` (int64).

        Drawn by ``torch.randint`` from ``generator`` only, so its saved state reproduces them.
        ``doc_starts=True``: uniform over the document starts (:meth:`document_starts`) that
        leave room for a window, so every window begins right after a separator.
        """
        n = self._check_block(split, block_size)
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if doc_starts:
            return draw_doc_starts(self.usable_doc_starts(split, block_size), batch_size, generator)
        return torch.randint(
            0, n - block_size, (int(batch_size),), generator=generator, dtype=torch.int64
        )

    def batch(
        self,
        split: str,
        indices: torch.Tensor | Sequence[int] | np.ndarray,
        block_size: int,
        device: torch.device | str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``: int64 (B, T) with ``x[b] = data[i_b : i_b + T]``, ``y[b] = data[i_b + 1 : i_b + T + 1]``.

        ``device``: if given, the tensors are moved there (pinned and non-blocking for CUDA).
        """
        n = self._check_block(split, block_size)
        if isinstance(indices, torch.Tensor):
            starts = indices.detach().to("cpu", torch.int64).numpy()
        else:
            starts = np.asarray(indices, dtype=np.int64)
        if starts.ndim != 1:
            raise ValueError(f"indices must be 1-D, got shape {tuple(starts.shape)}")
        if starts.size and (starts.min() < 0 or starts.max() > n - block_size - 1):
            raise ValueError(
                f"indices must lie in [0, {n - block_size - 1}] for block_size {block_size} on "
                f"split {split!r} ({n} tokens); got min {starts.min()}, max {starts.max()}"
            )
        window = starts[:, None] + np.arange(block_size + 1, dtype=np.int64)[None, :]
        chunk = torch.from_numpy(self._arrays[split][window].astype(np.int64))
        x = chunk[:, :-1].contiguous()
        y = chunk[:, 1:].contiguous()
        if device is not None:
            device = torch.device(device)
            if device.type == "cuda":
                x = x.pin_memory().to(device, non_blocking=True)
                y = y.pin_memory().to(device, non_blocking=True)
            else:
                x, y = x.to(device), y.to(device)
        return x, y
