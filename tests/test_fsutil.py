"""llmopt.fsutil: temporaries named by PID and cleaned only when their process is gone, output
folders replaced only when llmopt wrote them and never the input, atomic swaps, the umask."""

import os
import stat
import subprocess
import sys

import pytest

from llmopt import fsutil
from llmopt.errors import UserInputError


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_clean_stale_removes_only_dead_processes_leftovers(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        dead = _dead_pid()
        (tmp_path / f".out.tmp{dead}").mkdir()
        (tmp_path / f".out.tmp{dead}" / "shard.safetensors").write_bytes(b"x" * 10)
        (tmp_path / f".f.json.tmp{dead}").write_text("{}")
        (tmp_path / f".out.tmp{live.pid}").mkdir()
        (tmp_path / f".mine.tmp{os.getpid()}").mkdir()
        (tmp_path / "keep.tmp123").write_text("not ours: no leading dot")
        removed = fsutil.clean_stale(tmp_path)
        assert sorted(p.name for p in removed) == sorted([f".out.tmp{dead}", f".f.json.tmp{dead}"])
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [f".out.tmp{live.pid}", f".mine.tmp{os.getpid()}", "keep.tmp123"])
    finally:
        live.kill()
        live.wait()


def test_clean_stale_puts_back_a_folder_caught_between_two_renames(tmp_path):
    dead = _dead_pid()
    old = tmp_path / f".model.old{dead}"
    old.mkdir()
    (old / "weights").write_text("user data")
    fsutil.clean_stale(tmp_path)
    assert (tmp_path / "model" / "weights").read_text() == "user data" and not old.exists()
    # with the target present the leftover is the replaced copy: removed
    old.mkdir()
    fsutil.clean_stale(tmp_path)
    assert not old.exists() and (tmp_path / "model" / "weights").read_text() == "user data"


def test_write_atomic_needs_the_parent_and_leaves_no_temp(tmp_path):
    with pytest.raises(UserInputError, match="does not exist"):
        fsutil.write_atomic(tmp_path / "missing" / "r.json", "{}")
    assert not (tmp_path / "missing").exists()
    fsutil.write_atomic(tmp_path / "r.json", "{\"a\": 1}")
    assert (tmp_path / "r.json").read_text() == "{\"a\": 1}"
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    with pytest.raises(UserInputError, match="is a folder"):
        fsutil.write_atomic(tmp_path, "x")


def test_atomic_folder_uses_the_umask_and_marks_the_folder(tmp_path):
    old = os.umask(0o027)
    try:
        with fsutil.atomic_folder(tmp_path / "out", {"command": "test"}) as tmp:
            (tmp / "sub").mkdir()
            f = tmp / "sub" / "w.bin"
            f.write_bytes(b"123")
            os.chmod(f, 0o600)   # as safetensors writes its files
    finally:
        os.umask(old)
    out = tmp_path / "out"
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    assert stat.S_IMODE((out / "sub").stat().st_mode) == 0o750
    assert stat.S_IMODE((out / "sub" / "w.bin").stat().st_mode) == 0o640
    assert fsutil.is_ours(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("exchange", [True, False])
def test_atomic_folder_replaces_only_on_success(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(fsutil, "_exchange", lambda a, b: False)
    out = tmp_path / "out"
    with fsutil.atomic_folder(out) as tmp:
        (tmp / "a").write_text("first")
    with pytest.raises(RuntimeError):
        with fsutil.atomic_folder(out) as tmp:
            (tmp / "a").write_text("second, half done")
            raise RuntimeError("boom")
    assert (out / "a").read_text() == "first"
    with pytest.raises(KeyboardInterrupt):
        with fsutil.atomic_folder(out) as tmp:
            raise fsutil.Terminated()
    with fsutil.atomic_folder(out) as tmp:
        (tmp / "b").write_text("third")
    assert sorted(p.name for p in out.iterdir()) == ["b", fsutil.MARKER]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_check_output_folder_refusals(tmp_path, monkeypatch):
    src = tmp_path / "model"
    src.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (src / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    cases = [
        (src, True, "contains, or is inside"),
        (src / "sub", True, "the input"),
        (tmp_path, True, "the input"),
        (tmp_path / "x" / "..", True, "the input"),
        (".", False, "the input"),
        (src / "config.json", True, "the input"),
    ]
    for out, ow, msg in cases:
        with pytest.raises(UserInputError, match=msg):
            fsutil.check_output_folder(out, ow, [src])
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserInputError, match="not a folder"):
        fsutil.check_output_folder(tmp_path / "afile", True, [src])
    with pytest.raises(UserInputError, match="is a file"):
        fsutil.check_output_folder(tmp_path / "afile" / "out", True, [src])
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(UserInputError, match="working directory"):
        fsutil.check_output_folder(tmp_path, True, [])
    monkeypatch.chdir(tmp_path)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    with pytest.raises(UserInputError, match="pass --overwrite"):
        fsutil.check_output_folder(notes, False, [src])
    with pytest.raises(UserInputError, match="not written by llmopt"):
        fsutil.check_output_folder(notes, True, [src])
    assert (notes / "todo.txt").read_text() == "mine"
    (notes / fsutil.MARKER).write_text("{}")
    assert fsutil.check_output_folder(notes, True, [src]) == notes.resolve()
    (tmp_path / "empty").mkdir()
    assert fsutil.check_output_folder("empty", False, [src]) == (tmp_path / "empty").resolve()
    assert fsutil.check_output_folder("new/deeper", False, [src]) == (tmp_path / "new" / "deeper").resolve()
