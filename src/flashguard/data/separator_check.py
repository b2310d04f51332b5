"""The document separator must never occur inside a document.

Why: the separator marks where one document ends and the next begins (``doc_starts``
windows start right after one; ``decode(ids).split("\\0")`` gives byte-level documents
back). For the byte tokenizer it is the NUL byte, an id the text itself could hold: a
document containing it would split in two where nothing ends. So every document is checked
while it is prepared, and one that holds the separator stops the prepare, naming it.
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["SeparatorInDocument", "check_separator_absent"]


class SeparatorInDocument(ValueError):
    """A document holds the id its dataset uses as the document separator."""

    def __init__(self, separator: int, document: str, position: int, tokenizer: str):
        self.separator, self.document, self.position = separator, document, position
        what = " (the NUL byte 0x00)" if tokenizer == "byte" and separator == 0 else ""
        super().__init__(
            f"document separator id {separator}{what} of tokenizer {tokenizer} occurs inside document "
            f"{document} (token {position}): document boundaries would be ambiguous; remove that "
            "character from the text or choose a tokenizer whose separator is a special token (gpt2)"
        )


def check_separator_absent(ids: Sequence[int], separator: int | None, document: str, tokenizer: str) -> None:
    """Raise :class:`SeparatorInDocument` if ``separator`` is one of the document's ``ids``."""
    if separator is None:
        return
    try:
        position = ids.index(separator)  # list.index: one C-speed scan, no copy
    except ValueError:
        return
    raise SeparatorInDocument(separator, document, position, tokenizer)
