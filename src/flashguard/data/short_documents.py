"""Cutting long documents into short ones, so that one training window holds several.

Why: in the study's GPT-2 a window of 1,024 OpenWebText tokens holds several end-of-text
tokens, and attention sinks on those identical tokens give identical scores up to bf16
rounding: the repeated row maxima the failure starts from (Qiu & Yao 2025, arXiv 2510.04212). The embedded
corpus is whole source files (15 kB on average), so a 256- or 512-token window almost never
holds a separator; cut into paragraphs, it does.

The rule, on each source document in order (deterministic, no randomness):

1. Paragraphs: the text between blank lines (a line holding only spaces or tabs is blank).
2. A paragraph longer than ``max_bytes`` (UTF-8) is cut at line ends into pieces of at most
   ``max_bytes``; a single line longer than that stays one piece.
3. Consecutive pieces are joined, with the blank lines between them as in the source, until
   the joined text holds at least ``min_bytes``; a short rest at the end of a source document
   is kept as it is.

Every short document is a verbatim slice of its source (``name`` is the source's name plus
``@`` and the slice's character offset); the blank lines *between* the slices are dropped,
and whitespace-only slices are never emitted. On the default embedded corpus (CPython 3.11.7,
``min_bytes=100``, ``max_bytes=250``): 61,715 documents, median 214 bytes, 99.8 % of the text
in documents of 100-400 bytes; a 512-token window starting at a document start holds a median
of 2 separators (94 % at least 2), a 1,024-token one 4. (With ``max_bytes=400`` the median
document is 271 bytes and a 512-token window holds a median of 1.) The statistics of each
prepared dataset are in its ``meta.json`` (``document_tokens``).
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

from .sources import Document

__all__ = ["short_documents", "paragraph_spans", "source_of"]

_BLANK_LINES = re.compile(r"\n(?:[ \t\r\f\v]*\n)+")


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


def paragraph_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) character offsets of the non-blank paragraphs of ``text`` (rule 1).

    A paragraph ends with its last line's newline (kept) when one follows.
    """
    spans = []
    start = 0
    for gap in _BLANK_LINES.finditer(text):
        spans.append((start, gap.start() + 1))  # the paragraph keeps its own last newline
        start = gap.end()
    spans.append((start, len(text)))
    return [(s, e) for s, e in spans if text[s:e].strip()]


def _cut_at_lines(text: str, start: int, end: int, max_bytes: int) -> list[tuple[int, int]]:
    """Rule 2: ``text[start:end]`` in pieces of at most ``max_bytes``, cut after a newline."""
    if _utf8_len(text[start:end]) <= max_bytes:
        return [(start, end)]
    pieces = []
    piece_start, size, pos = start, 0, start
    for line in text[start:end].splitlines(keepends=True):
        n = _utf8_len(line)
        if size and size + n > max_bytes:
            pieces.append((piece_start, pos))
            piece_start, size = pos, 0
        size += n
        pos += len(line)
    pieces.append((piece_start, end))
    return pieces


def _joined(text: str, pieces: list[tuple[int, int]], min_bytes: int) -> Iterator[tuple[int, int]]:
    """Rule 3: consecutive pieces joined (source text between them kept) until >= ``min_bytes``."""
    first = None
    for start, end in pieces:
        first = start if first is None else first
        if _utf8_len(text[first:end]) >= min_bytes:
            yield first, end
            first = None
    if first is not None:
        yield first, pieces[-1][1]


def short_documents(
    documents: Iterable[Document], *, min_bytes: int = 100, max_bytes: int = 250
) -> Iterator[Document]:
    """Each document of ``documents`` cut into short ones by the module's rule, in order.

    The sizes are checked at the call (``TypeError`` / ``ValueError`` naming them), before any
    document is read, so a prepare with bad sizes fails before it starts writing.
    """
    for name, value in (("min_bytes", min_bytes), ("max_bytes", max_bytes)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an integer, got {value!r}")
    if min_bytes < 1:
        raise ValueError(f"min_bytes must be >= 1, got {min_bytes}")
    if max_bytes < min_bytes:
        raise ValueError(f"max_bytes ({max_bytes}) must be >= min_bytes ({min_bytes})")
    return _cut_all(documents, min_bytes, max_bytes)


def _cut_all(documents: Iterable[Document], min_bytes: int, max_bytes: int) -> Iterator[Document]:
    for doc in documents:
        text = doc.text
        pieces = [p for s, e in paragraph_spans(text) for p in _cut_at_lines(text, s, e, max_bytes)]
        pieces = [(s, e) for s, e in pieces if text[s:e].strip()]
        for start, end in _joined(text, pieces, min_bytes):
            yield Document(f"{doc.name}@{start}", text[start:end])


def source_of(doc: Document) -> str:
    """The name of the source document a short document was cut from (its name before the last ``@``)."""
    source, at, _offset = doc.name.rpartition("@")
    return source if at else doc.name
