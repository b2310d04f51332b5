"""Keep freed memory in the process for reuse, instead of handing it back to the kernel each time.

torch's CPU tensors come from the C library's malloc. glibc serves a request above its mmap
threshold (128 KiB, raised at run time up to 32 MiB) with a fresh mapping and unmaps it on free,
and it trims a free top of the heap beyond its trim threshold. An attention forward+backward
frees and allocates the same tile-sized tensors (12 MiB at T = 1024) over and over, so each one
comes back as new pages: one page fault and one zeroed page every 4 KiB. Measured on one CPU
thread (benchmarks/allocator.py; benchmarks/results/): the study's arithmetic at T = 1024
spent a tenth of its time in the kernel on ~15,000 page faults a call.

``retain_freed_memory()`` sets both thresholds to ``limit`` (1 GiB): requests below it come
from the heap, and up to that much free memory stays mapped for the next request. The numbers
computed do not change (the same arithmetic on memory from another place); the process's
resident memory stays near its high-water mark instead of dropping between steps. flashguard's
own command line calls it for its process (``FLASHGUARD_RETAIN_MEMORY=0`` turns it off); a
library user may call it in their own training script. Only glibc has these settings; elsewhere
it does nothing and says so.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

__all__ = ["retain_freed_memory", "retention_status", "DEFAULT_LIMIT"]

DEFAULT_LIMIT = 1 << 30            # 1 GiB
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # glibc's mallopt parameters (malloc.h)
_ENV = "FLASHGUARD_RETAIN_MEMORY"

_status = "default: the C library's own thresholds"


def _disabled() -> bool:
    return os.environ.get(_ENV, "1").strip().lower() in ("0", "false", "no", "off")


def retain_freed_memory(limit: int = DEFAULT_LIMIT) -> str:
    """Set glibc's mmap and trim thresholds to ``limit`` bytes in this process (both: setting one
    alone turns off glibc's dynamic adjustment of the other, and measured slower than neither).
    Returns and records the status string (``retention_status()``). Nothing happens with
    ``FLASHGUARD_RETAIN_MEMORY=0``, or where the C library is not glibc."""
    global _status
    if not isinstance(limit, int) or not 0 < limit < 2 ** 31:
        raise ValueError(f"retain_freed_memory: limit must be a positive int below 2 GiB, got {limit!r}")
    if _disabled():
        _status = f"off ({_ENV}=0): the C library's own thresholds"
        return _status
    if platform.libc_ver()[0] != "glibc":
        _status = "not glibc: the C library's own thresholds"
        return _status
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = (libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(limit)) == 1
              and libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(limit)) == 1)
    except (OSError, AttributeError) as exc:
        _status = f"not set ({exc}): the C library's own thresholds"
        return _status
    _status = (f"glibc: freed memory kept up to {limit / 2 ** 30:g} GiB" if ok
               else "not set (mallopt refused): the C library's own thresholds")
    return _status


def retention_status() -> str:
    """What ``retain_freed_memory`` did in this process (or that it was not called)."""
    return _status
