"""Small helpers shared by every layer (no torch, no project imports)."""
from .allocator import retain_freed_memory, retention_status
from .atomic import (
    atomic_output,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    remove_stale_temp_files,
)

__all__ = [
    "atomic_output",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "remove_stale_temp_files",
    "retain_freed_memory",
    "retention_status",
]
