import json
import os
import stat
import sys

import pytest

from flashguard.utils.atomic import (
    atomic_output,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    remove_stale_temp_files,
)


def test_write_and_replace(tmp_path):
    p = tmp_path / "deep" / "f.bin"
    atomic_write_bytes(p, b"one")
    assert p.read_bytes() == b"one"
    atomic_write_bytes(p, b"two!")
    assert p.read_bytes() == b"two!"
    assert sorted(x.name for x in p.parent.iterdir()) == ["f.bin"]


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permissions")
def test_permissions_are_those_of_a_plain_open(tmp_path):
    atomic_write_bytes(tmp_path / "a", b"x")
    with open(tmp_path / "b", "wb") as f:
        f.write(b"x")
    mode = lambda n: stat.S_IMODE(os.stat(tmp_path / n).st_mode)  # noqa: E731
    assert mode("a") == mode("b")


def test_text_and_json(tmp_path):
    atomic_write_text(tmp_path / "t.txt", "é\r\nline\n")
    assert (tmp_path / "t.txt").read_bytes() == "é\r\nline\n".encode("utf-8")
    atomic_write_json(tmp_path / "m.json", {"b": 1, "a": [1, 2]})
    assert json.loads((tmp_path / "m.json").read_text()) == {"b": 1, "a": [1, 2]}


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_failure_midway_keeps_old_file_and_leaves_no_temp(tmp_path, exc):
    p = tmp_path / "ckpt.pt"
    p.write_bytes(b"old complete content")
    with pytest.raises(exc):
        with atomic_output(p) as f:
            f.write(b"new partial")
            f.flush()
            assert os.path.dirname(f.name) == str(tmp_path)  # temp lives next to the target
            assert os.path.getsize(f.name) > 0
            raise exc("writer died midway")
    assert p.read_bytes() == b"old complete content"
    assert [x.name for x in tmp_path.iterdir()] == ["ckpt.pt"]


def test_failure_without_old_file_leaves_nothing(tmp_path):
    with pytest.raises(ValueError):
        with atomic_output(tmp_path / "new.txt", "w") as f:
            f.write("half")
            raise ValueError
    assert list(tmp_path.iterdir()) == []


def test_bad_mode(tmp_path):
    with pytest.raises(ValueError):
        with atomic_output(tmp_path / "x", "ab"):
            pass
    with pytest.raises(ValueError):
        with atomic_output(tmp_path / "x", "wb", encoding="utf-8"):
            pass


def test_remove_stale_temp_files(tmp_path):
    target = tmp_path / "train.bin"
    stale = tmp_path / ".train.bin.abc123.tmp"
    other = tmp_path / ".val.bin.abc123.tmp"
    stale.write_bytes(b"left by kill -9")
    other.write_bytes(b"someone else's")
    target.write_bytes(b"real")
    assert remove_stale_temp_files(target) == [stale]
    assert sorted(x.name for x in tmp_path.iterdir()) == [".val.bin.abc123.tmp", "train.bin"]
