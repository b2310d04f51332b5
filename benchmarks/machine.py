"""What a benchmark ran on, recorded in its JSON: ratios measured on one machine are not moved
to another (bf16 GEMMs run AMX, AVX512-BF16 or AVX2 kernels by the CPU oneDNN finds).

Importing this module sets the benchmark's process up as ``flashguard``'s command line sets up
its own: freed memory kept for reuse (utils/allocator.py; ``FLASHGUARD_RETAIN_MEMORY=0`` runs a
benchmark without it, and benchmarks/allocator.py measures both)."""
from __future__ import annotations

import os
import platform

import torch

from flashguard.numerics import native
from flashguard.utils.allocator import retain_freed_memory, retention_status

retain_freed_memory()


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else what platform knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine() -> dict:
    """The CPU, its cores, torch's vector capability, torch's version, the C kernels' status
    (loaded here if they can be, so that the status says whether the run could use them) and the
    allocator's (whether freed memory was kept)."""
    native.library()
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "native": native.status(),
            "allocator": retention_status()}
