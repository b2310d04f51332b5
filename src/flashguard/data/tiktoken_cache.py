"""tiktoken's cache of the GPT-2 BPE files, managed without the network.

tiktoken downloads ``vocab.bpe`` and ``encoder.json`` the first time the ``gpt2`` encoding
is built. flashguard never lets that happen: :func:`gpt2_available` only looks at tiktoken's
cache folder (the files must exist and have the expected SHA-256, or tiktoken would fetch
them again), and :class:`~flashguard.data.tokenizers.GPT2Tokenizer` builds the encoding
under :func:`offline`, with tiktoken's file reader swapped for one that refuses URLs, so a
cache that changed between the check and the load raises :class:`TokenizerUnavailable`
instead of going online. See :func:`install_gpt2_bpe` to put the two files into the cache
from local copies.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Iterator

from ..utils.atomic import atomic_output

__all__ = [
    "GPT2_BPE_FILES",
    "TokenizerUnavailable",
    "tiktoken_cache_dir",
    "gpt2_cache_files",
    "gpt2_unavailable_reason",
    "gpt2_available",
    "install_gpt2_bpe",
    "offline",
]

# The two files tiktoken's "gpt2" encoding reads, with the SHA-256 tiktoken checks.
# tiktoken caches a URL under sha1(url) in its cache folder (tiktoken/load.py).
_GPT2_BASE = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
GPT2_BPE_FILES: dict[str, tuple[str, str]] = {
    "vocab.bpe": (
        _GPT2_BASE + "vocab.bpe",
        "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    ),
    "encoder.json": (
        _GPT2_BASE + "encoder.json",
        "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    ),
}

class TokenizerUnavailable(RuntimeError):
    """The requested tokenizer cannot be built on this machine without the network."""


def tiktoken_cache_dir() -> Path | None:
    """The folder tiktoken reads cached files from, resolved as tiktoken does; ``None`` if caching is off."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        d = os.environ["TIKTOKEN_CACHE_DIR"]
    elif "DATA_GYM_CACHE_DIR" in os.environ:
        d = os.environ["DATA_GYM_CACHE_DIR"]
    else:
        d = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    return Path(d) if d else None


def gpt2_cache_files(cache_dir: str | os.PathLike[str] | None = None) -> dict[str, Path]:
    """Where tiktoken expects the cached GPT-2 files: ``{"vocab.bpe": path, "encoder.json": path}``."""
    folder = Path(cache_dir) if cache_dir is not None else tiktoken_cache_dir()
    if folder is None:
        return {}
    return {
        name: folder / hashlib.sha1(url.encode()).hexdigest()
        for name, (url, _sha256) in GPT2_BPE_FILES.items()
    }


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _tiktoken_installed() -> bool:
    return importlib.util.find_spec("tiktoken") is not None


def _gpt2_already_loaded() -> bool:
    """tiktoken keeps built encodings in memory; once built, no file is read again."""
    import sys

    registry = sys.modules.get("tiktoken.registry")
    return registry is not None and "gpt2" in getattr(registry, "ENCODINGS", {})


def gpt2_unavailable_reason() -> str | None:
    """``None`` if the GPT-2 tokenizer can be built offline, else why not and how to fix it.

    Never touches the network: it only checks that tiktoken is importable and that both
    BPE files sit in tiktoken's cache with the SHA-256 tiktoken expects.
    """
    if not _tiktoken_installed():
        return (
            "tiktoken is not installed; install it with `pip install tiktoken` "
            "(or `pip install 'flashguard[data]'`)"
        )
    if _gpt2_already_loaded():
        return None
    folder = tiktoken_cache_dir()
    if folder is None:
        return (
            "tiktoken's cache is disabled (TIKTOKEN_CACHE_DIR is set to an empty string), "
            "so it would download the GPT-2 BPE files; set TIKTOKEN_CACHE_DIR to a folder "
            "holding them"
        )
    problems = []
    for name, path in gpt2_cache_files(folder).items():
        expected = GPT2_BPE_FILES[name][1]
        if not path.is_file():
            problems.append(f"{name} missing (expected at {path})")
        elif _sha256_file(path) != expected:
            problems.append(f"{name} at {path} has the wrong SHA-256 (tiktoken would download it again)")
    if not problems:
        return None
    return (
        "the GPT-2 BPE files are not in tiktoken's cache folder " + str(folder) + ": "
        + "; ".join(problems)
        + ". flashguard never downloads them. Provide them by either (a) calling "
        "flashguard.data.install_gpt2_bpe('path/to/vocab.bpe', 'path/to/encoder.json') with "
        "local copies of GPT-2's vocab.bpe and encoder.json, or (b) on a machine with internet "
        "access running `TIKTOKEN_CACHE_DIR=DIR python -c \"import tiktoken; "
        "tiktoken.get_encoding('gpt2')\"` and copying DIR here, then setting TIKTOKEN_CACHE_DIR=DIR"
    )


def gpt2_available() -> bool:
    """True if :class:`GPT2Tokenizer` can be built without the network (never downloads)."""
    return gpt2_unavailable_reason() is None


def install_gpt2_bpe(
    vocab_bpe: str | os.PathLike[str],
    encoder_json: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Copy local ``vocab.bpe`` and ``encoder.json`` into tiktoken's cache under the names it looks for.

    The files are checked against the SHA-256 tiktoken expects. ``cache_dir`` defaults to
    tiktoken's cache folder (``TIKTOKEN_CACHE_DIR``, else ``DATA_GYM_CACHE_DIR``, else
    ``<tmp>/data-gym-cache``); if you pass another folder, point ``TIKTOKEN_CACHE_DIR`` at it.
    Returns the cache folder.
    """
    folder = Path(cache_dir) if cache_dir is not None else tiktoken_cache_dir()
    if folder is None:
        raise ValueError("tiktoken's cache is disabled (TIKTOKEN_CACHE_DIR=''); pass cache_dir")
    sources = {"vocab.bpe": Path(vocab_bpe), "encoder.json": Path(encoder_json)}
    for name, src in sources.items():
        if not src.is_file():
            raise FileNotFoundError(f"{name}: {src} does not exist")
        digest = _sha256_file(src)
        if digest != GPT2_BPE_FILES[name][1]:
            raise ValueError(
                f"{src} is not GPT-2's {name}: SHA-256 {digest}, expected {GPT2_BPE_FILES[name][1]}"
            )
    for name, dst in gpt2_cache_files(folder).items():
        with atomic_output(dst, "wb") as out, open(sources[name], "rb") as src_f:
            shutil.copyfileobj(src_f, out)
    return folder


_NO_NETWORK_LOCK = threading.Lock()


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """Make tiktoken's file reader refuse URLs while an encoding is being built (the guard
    :class:`~flashguard.data.tokenizers.GPT2Tokenizer` builds under)."""
    import tiktoken.load as tl

    original = getattr(tl, "read_file", None)
    if original is None:  # a tiktoken without this hook: rely on the cache check alone
        yield
        return

    def read_local_only(blobpath: str) -> bytes:
        if "://" in blobpath:
            raise TokenizerUnavailable(
                f"tiktoken tried to download {blobpath}; flashguard does not download "
                f"tokenizer files. {gpt2_unavailable_reason() or ''}".strip()
            )
        return original(blobpath)

    with _NO_NETWORK_LOCK:
        tl.read_file = read_local_only
        try:
            yield
        finally:
            tl.read_file = original
