"""Tokenizers: UTF-8 bytes (always available) and GPT-2 BPE (tiktoken, offline only).

Every tokenizer has ``name``, ``vocab_size``, ``eot``, ``doc_separator``,
``encode(str) -> list[int]`` and ``decode(list[int]) -> str``.

Document separators (what the data pipeline appends after every document):

* ``gpt2``: the end-of-text token 50256 (``eot``), as nanoGPT does for OpenWebText.
* ``byte``: the vocabulary is exactly the 256 byte values, so there is no spare id
  for an end-of-text token (``eot`` is ``None``). Documents are followed by the NUL
  byte 0x00 instead (``doc_separator == 0``). NUL does not occur in text files (the
  prepare checks it, :mod:`.separator_check`), so the boundaries stay recoverable
  (``decode(ids).split("\\0")`` gives the documents back) and the model can learn where a
  document ends; a newline would be indistinguishable from the blank lines inside source files.

GPT-2 and the network: flashguard never lets tiktoken download the BPE files;
:mod:`flashguard.data.tiktoken_cache` checks and fills tiktoken's cache offline, and
:class:`GPT2Tokenizer` builds its encoding under that module's guard that refuses URLs
(:class:`TokenizerUnavailable` instead of going online).
"""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from . import tiktoken_cache
from .tiktoken_cache import TokenizerUnavailable

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "GPT2Tokenizer",
    "TokenizerUnavailable",
    "TOKENIZER_NAMES",
    "get_tokenizer",
    "resolve_tokenizer",
    "doc_separator_of",
]

TOKENIZER_NAMES = ("byte", "gpt2", "auto")

GPT2_VOCAB_SIZE = 50257
GPT2_EOT = 50256


@runtime_checkable
class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def doc_separator_of(tokenizer: object) -> int | None:
    """The id appended after each document: ``doc_separator`` if set, else ``eot``."""
    sep = getattr(tokenizer, "doc_separator", None)
    if sep is None:
        sep = getattr(tokenizer, "eot", None)
    return None if sep is None else int(sep)


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, lossless for every ``str`` without lone surrogates."""

    name = "byte"
    vocab_size = 256
    eot: int | None = None
    doc_separator = 0  # NUL byte, see the module docstring

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], errors: str = "replace") -> str:
        """Bytes back to text; ids that do not form valid UTF-8 (e.g. sampled ones) become U+FFFD."""
        return bytes(int(i) for i in ids).decode("utf-8", errors=errors)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class GPT2Tokenizer:
    """GPT-2 BPE (tiktoken ``gpt2``): vocabulary 50257, end-of-text token 50256.

    Raises :class:`TokenizerUnavailable` (never downloads) if tiktoken or its cached
    BPE files are missing. ``encode`` treats special-token text such as
    ``"<|endoftext|>"`` as ordinary text (tiktoken's ``encode_ordinary``).
    Pickles by name, so it can be sent to worker processes.
    """

    name = "gpt2"
    vocab_size = GPT2_VOCAB_SIZE
    eot: int | None = GPT2_EOT
    doc_separator = GPT2_EOT

    def __init__(self) -> None:
        reason = tiktoken_cache.gpt2_unavailable_reason()
        if reason is not None:
            raise TokenizerUnavailable("GPT-2 tokenizer unavailable: " + reason)
        import tiktoken

        with tiktoken_cache.offline():
            enc = tiktoken.get_encoding("gpt2")
        if enc.n_vocab != GPT2_VOCAB_SIZE or enc.eot_token != GPT2_EOT:
            raise TokenizerUnavailable(
                f"tiktoken's gpt2 encoding has n_vocab={enc.n_vocab}, eot={enc.eot_token}; "
                f"expected {GPT2_VOCAB_SIZE}, {GPT2_EOT}"
            )
        self._enc = enc

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str], num_threads: int = 8) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts, num_threads=num_threads)

    def decode(self, ids: Sequence[int], errors: str = "replace") -> str:
        return self._enc.decode([int(i) for i in ids], errors=errors)

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def __repr__(self) -> str:
        return "GPT2Tokenizer()"


def resolve_tokenizer(spec: str | Tokenizer) -> tuple[Tokenizer, str]:
    """Turn a name (or a ready tokenizer object) into a tokenizer plus a note on how it was chosen.

    The note is recorded in ``meta.json`` so that an ``auto`` choice is never silent.
    """
    if not isinstance(spec, str):
        for attr in ("name", "vocab_size", "encode", "decode"):
            if not hasattr(spec, attr):
                raise TypeError(f"tokenizer object {spec!r} has no {attr!r}")
        return spec, f"tokenizer object {type(spec).__name__} passed in"
    if spec == "byte":
        return ByteTokenizer(), "byte requested"
    if spec == "gpt2":
        return GPT2Tokenizer(), "gpt2 requested"
    if spec == "auto":
        reason = tiktoken_cache.gpt2_unavailable_reason()
        if reason is None:
            return GPT2Tokenizer(), "auto: GPT-2 BPE files found offline, using gpt2"
        return ByteTokenizer(), "auto: using byte because " + reason
    raise ValueError(f"unknown tokenizer {spec!r}; choose one of {', '.join(TOKENIZER_NAMES)}")


def get_tokenizer(name: str = "auto") -> Tokenizer:
    """``"byte"``, ``"gpt2"`` or ``"auto"`` (gpt2 when its files are available offline, else byte)."""
    return resolve_tokenizer(name)[0]
