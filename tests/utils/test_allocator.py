"""utils/allocator.py: freed memory kept for reuse. Each check runs in a child process, since the
setting is the process's own: a 64 MiB tensor (above any mmap threshold glibc sets by itself)
comes back as fresh pages every time by default and from kept memory with the setting; training
computes the same bits either way; the command line sets it; a bad limit is refused by name."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

import flashguard.cli as cli
from flashguard.utils.allocator import retain_freed_memory

TESTS = Path(__file__).resolve().parents[1]
glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")

_FAULTS = """
import resource, torch
from flashguard.utils.allocator import retain_freed_memory
status = retain_freed_memory()
def churn(n):
    for _ in range(n):
        x = torch.ones(16 << 20)   # 64 MiB of fp32, written whole
        del x
churn(12)   # until the heap's free chunks fit the request (fragmentation settles in a few)
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn(10)
print(status)
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / 10)
"""

_HASHES = """
import sys, torch
sys.path.insert(0, {train!r})
from flashguard.utils.allocator import retain_freed_memory
print(retain_freed_memory())
torch.set_num_threads(1)
from test_loss_hash import SPECS, _run
print(*(_run(SPECS[name]) for name in ("paper", "fa2", "sdpa")))
"""


def _child(code: str, keep: bool) -> list[str]:
    env = {**os.environ, "FLASHGUARD_RETAIN_MEMORY": "1" if keep else "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()


@glibc
def test_a_large_tensor_reuses_kept_memory_and_faults_fresh_pages_by_default():
    status, faults = _child(_FAULTS, keep=True)
    assert status == "glibc: freed memory kept up to 1 GiB"
    assert float(faults) < 200            # the 64 MiB come from memory kept since the warm-up
    status, faults = _child(_FAULTS, keep=False)
    assert status.startswith("off (FLASHGUARD_RETAIN_MEMORY=0)")
    assert float(faults) > 8000           # 16,384 pages of 4 KiB, mapped anew on each allocation


@glibc
def test_training_computes_the_same_bits_with_memory_kept():
    # recycled memory holds old values where fresh pages hold zeros: a read of memory that was
    # never written would show here as a different loss or parameter hash
    code = _HASHES.format(train=str(TESTS / "train"))
    kept, default = _child(code, keep=True), _child(code, keep=False)
    assert kept[0].startswith("glibc") and default[0].startswith("off")
    assert kept[1] == default[1]


def test_the_command_line_sets_it_up_once(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(cli, "retain_freed_memory", lambda: calls.append(1))
    assert cli.main(["report", "no-such-run-dir"]) == 2   # a command that fails fast, after the set-up
    assert calls == [1]


@pytest.mark.parametrize("limit", [0, -5, 2 ** 31, 1.5])
def test_a_bad_limit_is_refused_by_name(limit):
    with pytest.raises(ValueError, match="limit must be a positive int"):
        retain_freed_memory(limit)
