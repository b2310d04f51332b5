"""Fixtures for the data pipeline tests: fake tokenizers, a network trap, small corpora."""
from __future__ import annotations

import socket

import pytest


class WideTokenizer:
    """A fake tokenizer with a vocabulary larger than uint16: every character -> 65536 + code point."""

    name = "wide-fake"
    vocab_size = 65_536 + 0x110000 + 1
    eot = 65_536 + 0x110000

    def encode(self, text):
        return [65_536 + ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i - 65_536) for i in ids if i != self.eot)


class ExplodingTokenizer:
    """Byte-level, but raises on the ``fail_at``-th call to encode (an interrupted prepare)."""

    name = "exploding"
    vocab_size = 256
    eot = None
    doc_separator = 0

    def __init__(self, fail_at=3, exc=RuntimeError):
        self.calls = 0
        self.fail_at = fail_at
        self.exc = exc

    def encode(self, text):
        self.calls += 1
        if self.calls >= self.fail_at:
            raise self.exc("injected failure mid-write")
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", "replace")


@pytest.fixture
def wide_tokenizer():
    return WideTokenizer()


@pytest.fixture
def exploding_tokenizer():
    return ExplodingTokenizer


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test loudly."""

    def refuse(*args, **kwargs):
        raise AssertionError("the test tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    try:
        import requests
    except ImportError:
        pass
    else:
        monkeypatch.setattr(requests, "get", refuse)
        monkeypatch.setattr(requests.Session, "request", refuse)
    return refuse


@pytest.fixture
def empty_tiktoken_cache(tmp_path, monkeypatch):
    """tiktoken's cache pointed at an empty folder: the GPT-2 files are not available."""
    cache = tmp_path / "tiktoken-cache"
    cache.mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    monkeypatch.delenv("DATA_GYM_CACHE_DIR", raising=False)
    return cache


@pytest.fixture
def text_corpus(tmp_path):
    """A small folder of UTF-8 files (nested, plus a hidden one that must be ignored)."""
    root = tmp_path / "corpus"
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("hidden, never read\n")
    (root / ".hidden.txt").write_text("hidden file\n")
    docs = {
        "a.txt": "Alpha document.\nSecond line.\n",
        "b.md": "# Béta\n\nüñíçødé — and emoji 🙂\n",
        "sub/c.txt": "def f(x):\n    return x * 2\n",
        "sub/deeper/d.txt": "Delta " * 50 + "\n",
        "sub/e.txt": "",  # empty: dropped
        "z.txt": "Last one, CRLF kept\r\nhere\r\n",
    }
    for rel, text in docs.items():
        p = root / rel
        p.write_bytes(text.encode("utf-8"))
    return root, docs


@pytest.fixture
def gpt2_standin(monkeypatch):
    """Make ``GPT2Tokenizer`` build offline from a stand-in tiktoken encoding.

    The real GPT-2 BPE files cannot be fetched here, so tiktoken's ``get_encoding("gpt2")``
    returns an encoding with GPT-2's shape (byte-level ranks, ``<|endoftext|>`` = 50256,
    n_vocab 50257) but no merges. This exercises flashguard's wrapper and every "gpt2" code
    path, not GPT-2's merges.
    """
    tiktoken = pytest.importorskip("tiktoken")
    from flashguard.data import tiktoken_cache

    enc = tiktoken.Encoding(
        name="gpt2-standin",
        pat_str=r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
        mergeable_ranks={bytes([b]): b for b in range(256)},
        special_tokens={"<|endoftext|>": 50256},
    )

    def get_encoding(name):
        assert name == "gpt2"
        return enc

    monkeypatch.setattr(tiktoken_cache, "gpt2_unavailable_reason", lambda: None)
    monkeypatch.setattr(tiktoken, "get_encoding", get_encoding)
    return enc
