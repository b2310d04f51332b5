import hashlib
import importlib.util
import pickle
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashguard.data import tiktoken_cache as C
from flashguard.data import tokenizers as T
from flashguard.data import (
    ByteTokenizer,
    GPT2Tokenizer,
    TokenizerUnavailable,
    get_tokenizer,
    gpt2_available,
    install_gpt2_bpe,
)

HAVE_TIKTOKEN = importlib.util.find_spec("tiktoken") is not None


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_roundtrip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_attributes_and_lossy_decode_of_sampled_ids():
    tok = get_tokenizer("byte")
    assert (tok.name, tok.vocab_size, tok.eot, tok.doc_separator) == ("byte", 256, None, 0)
    assert tok.decode([0xFF, 0x41]) == "\ufffdA"  # invalid UTF-8 from a sampler does not raise
    assert tok.decode(tok.encode("a\0b")).split("\0") == ["a", "b"]
    assert pickle.loads(pickle.dumps(tok)).encode("é") == [0xC3, 0xA9]


def test_unknown_tokenizer_name():
    with pytest.raises(ValueError, match="byte, gpt2, auto"):
        get_tokenizer("sentencepiece")


def test_gpt2_unavailable_offline_without_downloading(empty_tiktoken_cache, no_network):
    assert gpt2_available() is False
    reason = C.gpt2_unavailable_reason()
    assert "vocab.bpe missing" in reason and str(empty_tiktoken_cache) in reason
    assert "install_gpt2_bpe" in reason
    with pytest.raises(TokenizerUnavailable, match="vocab.bpe"):   # names what is missing
        GPT2Tokenizer()
    with pytest.raises(TokenizerUnavailable):
        get_tokenizer("gpt2")
    tok, note = T.resolve_tokenizer("auto")
    assert tok.name == "byte" and note.startswith("auto:") and note.endswith(reason)   # the choice, and why
    assert list(empty_tiktoken_cache.iterdir()) == []  # nothing was fetched into the cache


def test_gpt2_unavailable_when_cache_disabled_or_tiktoken_missing(monkeypatch, no_network):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    assert not gpt2_available()
    assert "disabled" in C.gpt2_unavailable_reason()
    monkeypatch.setattr(C, "_tiktoken_installed", lambda: False)
    assert "pip install tiktoken" in C.gpt2_unavailable_reason()
    assert get_tokenizer("auto").name == "byte"


def test_gpt2_cached_file_with_wrong_hash_is_unavailable(empty_tiktoken_cache, no_network):
    for path in C.gpt2_cache_files().values():
        path.write_bytes(b"not the real file")
    assert not gpt2_available()
    assert "wrong SHA-256" in C.gpt2_unavailable_reason()


@pytest.mark.skipif(not HAVE_TIKTOKEN, reason="tiktoken not installed")
def test_gpt2_load_guard_refuses_urls_even_if_the_check_is_fooled(
    empty_tiktoken_cache, no_network, monkeypatch
):
    # Pretend the cache check passed: tiktoken itself must still not go online.
    monkeypatch.setattr(C, "gpt2_unavailable_reason", lambda: None)
    with pytest.raises(TokenizerUnavailable, match="tried to download"):
        GPT2Tokenizer()
    import tiktoken.load

    assert tiktoken.load.read_file.__name__ == "read_file"  # the hook is restored


@pytest.mark.skipif(not HAVE_TIKTOKEN, reason="tiktoken not installed")
def test_cache_names_match_the_installed_tiktoken():
    """Our URL/hash constants must be the ones tiktoken's gpt2 encoding uses, and the cache
    file names must follow tiktoken's sha1(url) rule."""
    spec = importlib.util.find_spec("tiktoken_ext.openai_public")
    source = Path(spec.origin).read_text()
    load_source = Path(importlib.util.find_spec("tiktoken.load").origin).read_text()
    assert "hashlib.sha1(blobpath.encode()).hexdigest()" in load_source
    assert "TIKTOKEN_CACHE_DIR" in load_source and "data-gym-cache" in load_source
    for name, (url, sha) in C.GPT2_BPE_FILES.items():
        assert url in source and sha in source
        assert C.gpt2_cache_files("/c")[name] == Path("/c") / hashlib.sha1(url.encode()).hexdigest()


def test_install_gpt2_bpe_checks_files(tmp_path):
    fake = tmp_path / "vocab.bpe"
    fake.write_text("#version: 0.2\n")
    enc = tmp_path / "encoder.json"
    enc.write_text("{}")
    digest = hashlib.sha256(fake.read_bytes()).hexdigest()
    with pytest.raises(ValueError, match=f"{re.escape(str(fake))}.*vocab.bpe.*{digest}"):   # the file, its hash
        install_gpt2_bpe(fake, enc, cache_dir=tmp_path / "cache")
    with pytest.raises(FileNotFoundError):
        install_gpt2_bpe(tmp_path / "missing", enc, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


@pytest.mark.skipif(not gpt2_available(), reason="GPT-2 BPE files not in tiktoken's cache (offline)")
def test_gpt2_roundtrip_when_available(no_network):
    tok = get_tokenizer("gpt2")
    assert (tok.vocab_size, tok.eot, tok.doc_separator) == (50257, 50256, 50256)
    text = "Hello world! <|endoftext|> is ordinary text here. Ünïcödé."
    ids = tok.encode(text)
    assert 50256 not in ids and tok.decode(ids) == text
    assert pickle.loads(pickle.dumps(tok)).encode(text) == ids


def test_gpt2_wrapper_with_standin_encoding(gpt2_standin):
    assert gpt2_available()
    tok = get_tokenizer("auto")
    assert isinstance(tok, GPT2Tokenizer)
    assert (tok.name, tok.vocab_size, tok.eot, tok.doc_separator) == ("gpt2", 50257, 50256, 50256)
    text = "x <|endoftext|> y é"
    ids = tok.encode(text)
    assert 50256 not in ids  # special-token text is ordinary text
    assert tok.decode(ids) == text
    assert tok.decode([50256]) == "<|endoftext|>"
    assert pickle.loads(pickle.dumps(tok)).encode(text) == ids
