"""Start offsets right after a document separator: windows that begin where a document does.

Why: the study's windows hold several end-of-text tokens, and a window that starts at a
document start sees each document from its first token, as a model does at inference. The
offsets are drawn like the uniform ones (:meth:`TokenDataset.sample_indices`): one
``torch.randint`` call on the caller's generator, here over the list of usable document starts,
so a saved generator state reproduces them and every arithmetic of a matched set of runs
trains on the same windows.
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["separator_follows", "usable_starts", "draw_doc_starts"]


def separator_follows(tokens: np.ndarray, separator: int) -> np.ndarray:
    """Every offset ``i`` with ``tokens[i - 1] == separator`` (int64, ascending): a document starts there."""
    return np.flatnonzero(np.asarray(tokens[:-1]) == separator).astype(np.int64) + 1


def usable_starts(starts: np.ndarray, num_tokens: int, block_size: int) -> np.ndarray:
    """The document starts a window of ``block_size`` (+1 for the targets) fits after."""
    return starts[: int(np.searchsorted(starts, num_tokens - block_size - 1, side="right"))]


def draw_doc_starts(usable: np.ndarray, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """``batch_size`` offsets drawn uniformly (with replacement) from ``usable``, by ``generator`` only."""
    pick = torch.randint(0, len(usable), (int(batch_size),), generator=generator, dtype=torch.int64)
    return torch.from_numpy(usable)[pick]
