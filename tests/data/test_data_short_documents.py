"""Cutting documents into short ones (flashguard.data.short_documents)."""
import pytest

from flashguard.data import Document
from flashguard.data.short_documents import paragraph_spans, short_documents, source_of


def cut(text, **kw):
    return list(short_documents([Document("src.py", text)], **kw))


def test_paragraphs_are_the_text_between_blank_lines():
    text = "a = 1\nb = 2\n\n\n    \ndef f():\n    return 1\n\t\nlast"
    spans = paragraph_spans(text)
    assert [text[s:e] for s, e in spans] == ["a = 1\nb = 2\n", "def f():\n    return 1\n", "last"]
    assert paragraph_spans("\n\n  \n") == []


def test_short_paragraphs_are_joined_until_min_bytes_verbatim():
    paras = [f"x{i} = {i}" for i in range(10)]  # 6-7 bytes each
    text = "\n\n".join(paras) + "\n"
    docs = cut(text, min_bytes=20, max_bytes=100)
    assert all(len(d.text.encode()) >= 20 for d in docs[:-1])
    for d in docs:  # every document is a verbatim slice of its source, named by its offset
        offset = int(d.name.rpartition("@")[2])
        assert text[offset:offset + len(d.text)] == d.text and source_of(d) == "src.py"
    assert "".join(d.text for d in docs).replace("\n", "") == "".join(paras)


def test_long_paragraphs_are_cut_at_line_ends():
    lines = [f"line_{i:03d} = {'z' * 20}\n" for i in range(39)]  # 32 bytes a line, one paragraph
    docs = cut("".join(lines), min_bytes=50, max_bytes=100)
    assert "".join(d.text for d in docs) == "".join(lines)
    assert all(50 <= len(d.text.encode()) <= 100 and d.text.endswith("\n") for d in docs)
    one_long_line = "y" * 500
    assert [d.text for d in cut(one_long_line, min_bytes=10, max_bytes=100)] == [one_long_line]


def test_a_short_rest_is_kept_and_utf8_bytes_are_counted():
    docs = cut("é" * 30 + "\n\nend", min_bytes=60, max_bytes=400)  # 60 bytes but 30 characters
    assert [d.text for d in docs] == ["é" * 30 + "\n", "end"]


def test_deterministic_and_in_source_order():
    sources = [Document(f"f{i}", "\n\n".join(f"p{i}_{j} " * 8 for j in range(5))) for i in range(3)]
    a = list(short_documents(sources, min_bytes=30, max_bytes=60))
    assert a == list(short_documents(sources, min_bytes=30, max_bytes=60))
    assert [source_of(d) for d in a] == sorted(source_of(d) for d in a)


@pytest.mark.parametrize("kw,match", [
    ({"min_bytes": 0}, r"^min_bytes.*\b1\b.*\b0$"),                    # the key, its bound, the value
    ({"min_bytes": 100, "max_bytes": 50}, r"^max_bytes\W+50\b.*min_bytes\W+100\b"),
    ({"min_bytes": 1.5}, r"^min_bytes.*1\.5$"),
    ({"max_bytes": True}, "^max_bytes.*True$"),
])
def test_bad_sizes_are_named_at_the_call(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        short_documents(iter(()), **kw)       # before any document is read
