"""Data pipeline: text -> nanoGPT-compatible token files -> reproducible batches.

Prepare (each returns the dataset's meta, also written to ``<out_dir>/meta.json``)::

    prepare_embedded(out_dir, tokenizer="auto", val_fraction=0.05, max_bytes=None, ...)
    prepare_embedded_docs(out_dir, doc_min_bytes=100, doc_max_bytes=250, ...)   # short documents
    prepare_text(paths, out_dir, tokenizer="auto", skip_invalid=False, ...)
    prepare_openwebtext(out_dir, dataset="openwebtext", data_files=None, tokenizer="gpt2", ...)

Read::

    ds = TokenDataset(out_dir)
    idx = ds.sample_indices("train", batch_size, block_size, generator)
    idx = ds.sample_indices("train", batch_size, block_size, generator, doc_starts=True)  # after separators
    x, y = ds.batch("train", idx, block_size)

Tokenizers: ``get_tokenizer("byte" | "gpt2" | "auto")`` (:mod:`.tokenizers`); ``gpt2_available()``
never downloads (tiktoken's cache of the GPT-2 files: :mod:`.tiktoken_cache`).
Atomic file writes live in :mod:`flashguard.utils.atomic`.
"""
from .batches import TokenDataset
from .meta import FORMAT_VERSION, META_FILE, SPLITS, read_meta, token_dtype, validate_dataset
from .openwebtext import prepare_openwebtext
from .prepare import prepare_documents, prepare_embedded, prepare_embedded_docs, prepare_text
from .separator_check import SeparatorInDocument
from .sources import Document, InvalidTextFile, embedded_documents, text_documents
from .tiktoken_cache import TokenizerUnavailable, gpt2_available, gpt2_unavailable_reason, install_gpt2_bpe
from .tokenizers import ByteTokenizer, GPT2Tokenizer, Tokenizer, get_tokenizer
from .writer import DatasetExistsError, ValSplitter

__all__ = [
    "TokenDataset",
    "prepare_embedded",
    "prepare_embedded_docs",
    "SeparatorInDocument",
    "prepare_text",
    "prepare_openwebtext",
    "prepare_documents",
    "Document",
    "InvalidTextFile",
    "embedded_documents",
    "text_documents",
    "ByteTokenizer",
    "GPT2Tokenizer",
    "Tokenizer",
    "TokenizerUnavailable",
    "get_tokenizer",
    "gpt2_available",
    "gpt2_unavailable_reason",
    "install_gpt2_bpe",
    "DatasetExistsError",
    "ValSplitter",
    "FORMAT_VERSION",
    "META_FILE",
    "SPLITS",
    "read_meta",
    "validate_dataset",
    "token_dtype",
]
