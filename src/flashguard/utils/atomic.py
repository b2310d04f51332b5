"""Atomic file writes: a reader sees the old file or the complete new one, never a half file.

Every writer goes through :func:`atomic_output`: it writes a temporary file in the
*same folder* as the target (so the final rename never crosses a file system),
flushes and fsyncs it, and renames it over the target with :func:`os.replace`
(atomic on POSIX and on Windows). If the body raises -- any exception, including
``KeyboardInterrupt`` -- the temporary file is deleted and the old target (if any)
is left untouched.

A process killed with SIGKILL (or a power cut) cannot run the clean-up, so it may
leave a temporary file behind. Such files are named ``.<target name>.<random>.tmp``
and are never mistaken for the target; :func:`remove_stale_temp_files` deletes them.

Used by the data pipeline (``train.bin``, ``val.bin``, ``meta.json``) and meant to be
reused for checkpoints and reports.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator

__all__ = [
    "atomic_output",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "remove_stale_temp_files",
    "temp_prefix",
]

_TEMP_SUFFIX = ".tmp"


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# Read once: os.umask can only be read by setting it, which is not thread safe.
_UMASK = _current_umask()


def temp_prefix(path: str | os.PathLike[str]) -> str:
    """The name prefix of the temporary files that :func:`atomic_output` makes for ``path``."""
    return "." + Path(path).name + "."


def _fsync_dir(folder: Path) -> None:
    """Make a rename durable (POSIX). Best effort: some systems cannot open folders."""
    flags = getattr(os, "O_DIRECTORY", None)
    if flags is None:  # Windows
        return
    try:
        fd = os.open(folder, os.O_RDONLY | flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_output(
    path: str | os.PathLike[str],
    mode: str = "wb",
    *,
    encoding: str | None = None,
    newline: str | None = None,
    fsync: bool = True,
    make_parents: bool = True,
) -> Iterator[IO[Any]]:
    """Open a temporary file next to ``path``; on success rename it over ``path``.

    ``mode`` is ``"wb"`` (binary, default) or ``"w"`` (text; ``encoding`` defaults to
    UTF-8). The yielded object is an ordinary open file; ``f.name`` is the temporary
    path (useful e.g. to ``np.memmap`` it). On a clean exit the file is flushed,
    fsynced (unless ``fsync=False``), closed, given the permissions a plain ``open``
    would have given it, and renamed over ``path``; the folder is then fsynced too.
    On an exception the temporary file is removed and the exception propagates.
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_output supports modes 'wb' and 'w', not {mode!r}")
    binary = "b" in mode
    if binary and (encoding is not None or newline is not None):
        raise ValueError("encoding/newline only apply to text mode 'w'")
    target = Path(path)
    folder = target.parent
    if make_parents:
        folder.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=temp_prefix(target), suffix=_TEMP_SUFFIX, dir=folder)
    tmp = Path(tmp_name)
    os.close(fd)  # reopened by name so that f.name is the temporary path
    try:
        if binary:
            f = open(tmp, "wb")
        else:
            f = open(tmp, "w", encoding=encoding or "utf-8", newline=newline)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        with f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        # mkstemp makes the file 0600; give it what open() would have given it.
        try:
            os.chmod(tmp, 0o666 & ~_UMASK)
        except OSError:
            pass
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        _fsync_dir(folder)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, fsync: bool = True) -> Path:
    """Write ``data`` to ``path`` atomically; returns the path."""
    with atomic_output(path, "wb", fsync=fsync) as f:
        f.write(data)
    return Path(path)


def atomic_write_text(
    path: str | os.PathLike[str], text: str, *, encoding: str = "utf-8", fsync: bool = True
) -> Path:
    """Write ``text`` to ``path`` atomically (no newline translation); returns the path."""
    with atomic_output(path, "w", encoding=encoding, newline="", fsync=fsync) as f:
        f.write(text)
    return Path(path)


def atomic_write_json(
    path: str | os.PathLike[str], obj: Any, *, indent: int | None = 2, fsync: bool = True
) -> Path:
    """Write ``obj`` as JSON (keys in the given order, trailing newline) atomically."""
    text = json.dumps(obj, indent=indent, ensure_ascii=False, allow_nan=False) + "\n"
    return atomic_write_text(path, text, fsync=fsync)


def remove_stale_temp_files(path: str | os.PathLike[str]) -> list[Path]:
    """Delete temporary files left next to ``path`` by a killed :func:`atomic_output`.

    Only call this when no other process is writing ``path`` at the same time.
    Returns the removed paths.
    """
    target = Path(path)
    if not target.parent.is_dir():
        return []
    prefix = temp_prefix(target)
    removed = []
    for p in sorted(target.parent.iterdir()):
        if p.name.startswith(prefix) and p.name.endswith(_TEMP_SUFFIX) and p.is_file():
            try:
                p.unlink()
                removed.append(p)
            except FileNotFoundError:
                pass
    return removed
