"""The optional C kernels (numerics/csrc/), compiled on first use; PyTorch is the fallback.

Emulating one fused multiply-add in PyTorch takes about a dozen fp64 elementwise passes
(``fast_exp.fma32``), and torch's CPU exponential ``fexp_u20`` chains four of them: that chain
made the ``torch-cpu`` preset 20-30x slower than the kernel it models. In C each is one
``fmaf``, exact by IEEE 754, in one pass over the data.

The same holds for torch's bf16 matrix products where oneDNN has no bf16 kernel for the CPU
(AVX2): ATen's portable gemm sums each output one scalar at a time, 10-30x slower than an fp32
product of the same size; ``csrc/bf16_gemm.c`` sums in the same orders, vectorised across the
outputs (numerics/bf16_gemm.py).

``library()`` compiles ``csrc/*.c`` with the system's C compiler (``$CC``, else ``cc``) into
one library in a per-user cache, once per sources and flags, and loads it with ctypes. Nothing is
compiled at install time and nothing is required: without a compiler, on a failed build, on
tensors that are not on the CPU, or with ``FLASHGUARD_NATIVE=0``, the same functions run in
PyTorch, bit for bit the same (tests/numerics/test_native.py pins one against the other).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

__all__ = ["library", "enabled", "status", "cache_dir"]

log = logging.getLogger("flashguard")

_SOURCES = sorted((Path(__file__).with_name("csrc")).glob("*.c"))
# no FMA contraction: every fused multiply-add in the source is an explicit fmaf
_FLAGS = ["-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno"]
_CLONES = ["-DFG_CLONES"]  # per-CPU variants (x86-64 gcc); tried first, then without

_lib: Optional[ctypes.CDLL] = None
_tried = False
_status = "not loaded yet"
_loaded = "not loaded yet"   # what the one attempt to load gave (status() again once re-enabled)


def enabled() -> bool:
    """False when ``FLASHGUARD_NATIVE=0`` asks for the PyTorch fallback."""
    return os.environ.get("FLASHGUARD_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    """Where built libraries are kept: ``$FLASHGUARD_CACHE``, else ``$XDG_CACHE_HOME/flashguard``,
    else ``~/.cache/flashguard``."""
    if os.environ.get("FLASHGUARD_CACHE"):
        return Path(os.environ["FLASHGUARD_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flashguard"


def status() -> str:
    """What ``library()`` did: the loaded file, or why the PyTorch fallback is used."""
    return _status


def _compile(out: Path, cc: str, flags: list) -> Optional[str]:
    """Build into a temporary file and rename it into place (atomic: a concurrent or killed build
    never leaves a half-written library). Returns the compiler's complaint on failure."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, *map(str, _SOURCES), "-o", tmp, "-lm"],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            return (proc.stderr or proc.stdout).strip() or f"{cc} exited with {proc.returncode}"
        os.replace(tmp, out)
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, n = ctypes.c_void_p, ctypes.c_int64
    lib.fg_fma32.argtypes = [p, p, p, p, n]
    lib.fg_fma32.restype = None
    lib.fg_fexp_u20.argtypes = [p, p, n]
    lib.fg_fexp_u20.restype = None
    for name in ("fg_bf16_gemm_ilp4", "fg_bf16_gemm_seq", "fg_bf16_gemm_dot8"):
        getattr(lib, name).argtypes = [p, p, p, n, n, n, n]
        getattr(lib, name).restype = ctypes.c_int
    for name in ("fg_bf16_softmax_set_exp", "fg_f32_softmax_set_exp"):
        getattr(lib, name).argtypes = [p]
        getattr(lib, name).restype = ctypes.c_int
    # the fused softmax passes exist in x86-64 builds only (numerics/fused_softmax.py asks)
    f, i, u16 = ctypes.c_float, ctypes.c_int, ctypes.c_uint16
    optional = {"fg_bf16_p_from_lse": [p, p, p, n, f, i, n, n, n], "fg_bf16_p_from_max": [p, p, p, n, n, n, n],
                "fg_bf16_ds": [p, p, p, f, i, n, n, n], "fg_bf16_add": [p, p, n, n, n],
                "fg_bf16_scale_fill": [p, p, n, f, u16, p, n, n, n],
                "fg_f32_p": [p, p, p, n, f, i, i, i, p, n, n, n], "fg_f32_ds": [p, p, p, f, i, i, n, n, n],
                "fg_f32_scale_fill": [p, p, n, f, f, p, n, n, n],
                "fg_bf16_count_cmp": [p, p, i, p, n, n, n], "fg_f32_count_cmp": [p, p, i, p, n, n, n]}
    for name, args in optional.items():
        if hasattr(lib, name):
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = None
    return lib


def library() -> Optional[ctypes.CDLL]:
    """The loaded C library, or None (then the PyTorch fallback runs; ``status()`` says why)."""
    global _lib, _tried, _status, _loaded
    if not enabled():
        _status = "disabled by FLASHGUARD_NATIVE=0"
        return None
    if _tried:
        _status = _loaded
        return _lib
    _tried = True
    _status = _loaded = _load()
    return _lib


def _load() -> str:
    """Build (unless cached) and load the library into ``_lib``: the status that says how it went."""
    global _lib
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        status = f"no C compiler ({cc!r} not found): PyTorch fallback"
        log.info("flashguard: %s", status)
        return status
    source = b"".join(f.name.encode() + f.read_bytes() for f in _SOURCES)
    errors = []
    for flags in (_FLAGS + _CLONES, _FLAGS):
        key = hashlib.sha256(source + " ".join([cc, *flags, sys.platform]).encode()).hexdigest()[:16]
        path = cache_dir() / f"flashguard-native-{key}.so"
        if not path.exists():
            err = _compile(path, cc, flags)
            if err is not None:
                errors.append(err)
                continue
        try:
            _lib = _declare(ctypes.CDLL(str(path)))
            return f"loaded {path.name} (in cache_dir())"
        except (OSError, AttributeError) as exc:
            errors.append(str(exc))
    status = "C build failed, PyTorch fallback: " + (errors[-1] if errors else "unknown")
    log.warning("flashguard: %s", status)
    return status
