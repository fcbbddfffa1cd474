"""The GGUF conversion cache: one entry per file content (copies share it, the hash is memoized), a
manifest of sizes and sha256 recorded at conversion, a damaged entry rebuilt with one notice, the
user's umask, and no leftover of an interrupted conversion (SIGTERM cleans up; after SIGKILL the
next start does). A tiny GGUF written here stands for the 100 MB default model."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from conftest import REPO
from fs_snapshot import tree
from gguf_util import write_tiny_gguf
from llmopt import defaults
from llmopt.models import gguf_convert
from llmopt.models.gguf_convert import MANIFEST, cache_problem
from llmopt.models.loader import load_model, resolve_checkpoint

CFG = dict(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.25,
           rms_norm_eps=1e-5, bos_token_id=95, eos_token_id=96)
TEXT = "the cat sat on the mat. " * 40


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**CFG)).eval()
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, hf)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setattr(defaults, "CACHE_DIR", tmp_path / "cache")
    return tmp_path / "cache" / "gguf"


def _temporaries(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if re.fullmatch(r"\..+\.(tmp|old)\d+", p.name)]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_conversion_records_a_manifest_and_keeps_the_umask(gguf_file, cache):
    old = os.umask(0o027)
    try:
        folder = resolve_checkpoint(str(gguf_file))
    finally:
        os.umask(old)
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["written_by"] == "llmopt" and manifest["converter_version"] == gguf_convert.CONVERTER_VERSION
    files = {p.name for p in folder.iterdir()} - {MANIFEST}
    assert {"config.json", "tokenizer.json"} <= files == set(manifest["files"])
    assert not [f for f in files if f.endswith(".safetensors")]   # no weights: they are read from the GGUF
    snapshot = tree(folder)
    for name, rec in manifest["files"].items():
        assert rec["size"] == (folder / name).stat().st_size and rec["sha256"] == snapshot[name]
    assert stat.S_IMODE(folder.stat().st_mode) == 0o750
    assert {stat.S_IMODE((folder / f).stat().st_mode) for f in files} == {0o640}
    assert sorted(p.name for p in cache.iterdir()) == sorted([folder.name, gguf_convert.HASH_INDEX])
    assert cache_problem(folder) is None


def test_copies_of_one_gguf_share_one_entry_and_the_hash_is_memoized(gguf_file, cache, tmp_path, monkeypatch):
    copies = [tmp_path / "a" / "tiny.gguf", tmp_path / "b" / "renamed-copy.gguf"]
    for c in copies:
        c.parent.mkdir()
        shutil.copy2(gguf_file, c)
    conversions, hashed = [], []
    convert, sha = gguf_convert.convert_gguf, gguf_convert.file_sha256
    monkeypatch.setattr(gguf_convert, "convert_gguf", lambda *a, **k: conversions.append(a[0]) or convert(*a, **k))
    monkeypatch.setattr(gguf_convert, "file_sha256", lambda p, *a: hashed.append(Path(p)) or sha(p, *a))

    folders = {resolve_checkpoint(str(c)) for c in copies}
    assert len(folders) == 1 and conversions == [copies[0]]
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [folders.pop().name]
    index = json.loads((cache / gguf_convert.HASH_INDEX).read_text())
    assert sorted(index) == sorted(str(c.resolve()) for c in copies)

    hashed.clear()
    first = resolve_checkpoint(str(copies[0]))
    assert not [p for p in hashed if p.suffix == ".gguf"]          # the 100 MB file is not read again
    os.utime(copies[0], ns=(time.time_ns(), time.time_ns() + 10**9))  # touched: hashed again, same entry
    assert resolve_checkpoint(str(copies[0])) == first and copies[0] in hashed
    assert conversions == [copies[0]]


def _truncate_tokenizer(f: Path) -> None:
    with open(f / "tokenizer.json", "r+b") as fh:
        fh.truncate(fh.seek(0, 2) // 2)


def _edit_config(f: Path) -> None:
    text = (f / "config.json").read_text()
    assert '"num_hidden_layers": 2' in text
    (f / "config.json").write_text(text.replace('"num_hidden_layers": 2', '"num_hidden_layers": 1'))


@pytest.mark.parametrize("damage, reason", [
    (_truncate_tokenizer, "tokenizer.json has"),
    (lambda f: (f / "tokenizer.json").unlink(), "tokenizer.json is missing"),
    (_edit_config, "config.json was modified"),
    (lambda f: (f / MANIFEST).unlink(), "missing or unreadable"),
])
def test_a_damaged_entry_is_rebuilt_with_one_notice(gguf_file, cache, caplog, damage, reason):
    folder = resolve_checkpoint(str(gguf_file))
    good = tree(folder)
    damage(folder)
    assert cache_problem(folder) is not None
    with caplog.at_level(logging.WARNING, logger="llmopt"):
        assert resolve_checkpoint(str(gguf_file)) == folder
    notices = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(notices) == 1 and "damaged" in notices[0] and reason in notices[0] and "\n" not in notices[0]
    assert tree(folder) == good                                   # rebuilt byte for byte
    assert _temporaries(cache) == []
    lm = load_model(str(gguf_file), dtype="float32", device="cpu")
    assert lm.config.num_hidden_layers == 2
    caplog.clear()
    resolve_checkpoint(str(gguf_file))
    assert not caplog.records                                     # sound again: no notice, no conversion


def test_the_command_line_shows_the_rebuild_notice_as_one_line(gguf_file, cache, tmp_path):
    folder = resolve_checkpoint(str(gguf_file))
    _truncate_tokenizer(folder)
    (tmp_path / "t.txt").write_text(TEXT)
    env = {**os.environ, "LLMOPT_CACHE": str(cache.parent), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "llmopt", "eval-ppl", "--model", str(gguf_file), "--dataset",
                        str(tmp_path / "t.txt"), "--ctx", "32", "--limit", "128", "--quiet", "--json"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "damaged" in lines[0] and "tokenizer.json" in lines[0], r.stderr
    assert json.loads(r.stdout)["scored_tokens"] > 0 and cache_problem(folder) is None


def test_leftovers_of_dead_conversions_are_removed_never_a_live_ones(gguf_file, cache):
    cache.mkdir(parents=True)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = cache / f".gguf-0123-v{gguf_convert.CONVERTER_VERSION}.tmp{_dead_pid()}"
        running = cache / f".gguf-4567-v{gguf_convert.CONVERTER_VERSION}.tmp{live.pid}"
        legacy_old, legacy_new = cache / ".SmolLM2-135M.Q4_1-59becacf442e.k3j_9x0a", cache / ".Other-0123.ab12cd34"
        v3 = cache / "gguf-0123456789abcdef01234567-v3"     # converter 3's float weights: removed
        for d in (dead, running, legacy_old, legacy_new, v3):
            d.mkdir()
            (d / "model.safetensors").write_bytes(b"partial")
        os.utime(legacy_old, (time.time() - 7200, time.time() - 7200))   # converter 2's, two hours old
        folder = resolve_checkpoint(str(gguf_file))
        assert sorted(p.name for p in cache.iterdir()) == sorted(
            [folder.name, gguf_convert.HASH_INDEX, running.name, legacy_new.name])
    finally:
        live.kill()
        live.wait()


_SLOW_CONVERSION = """
import pathlib, sys, time
from llmopt.models import gguf_convert
model, ready, text = sys.argv[1:4]
real = gguf_convert._convert_tokenizer
def slow(path, dest):          # the weights are written; wait here to be signalled
    real(path, dest)
    pathlib.Path(ready).write_text("converting")
    time.sleep(300)
gguf_convert._convert_tokenizer = slow
from llmopt.cli.app import main
sys.argv = ["llmopt", "eval-ppl", "--model", model, "--dataset", text, "--ctx", "32", "--quiet"]
main()
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_an_interrupted_conversion_leaves_nothing(gguf_file, cache, tmp_path, sig):
    ready, text = tmp_path / "ready", tmp_path / "t.txt"
    text.write_text(TEXT)
    env = {**os.environ, "LLMOPT_CACHE": str(cache.parent), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_CONVERSION, str(gguf_file), str(ready), str(text)],
                            env=env, cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    end = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < end, "the conversion did not start"
        time.sleep(0.02)
    assert len(_temporaries(cache)) == 1                              # the half-built folder
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    if sig == signal.SIGKILL:
        left = _temporaries(cache)
        assert proc.returncode == -9 and len(left) == 1 and left[0].endswith(f".tmp{proc.pid}")
        folder = resolve_checkpoint(str(gguf_file))                   # the next start cleans and converts
        assert cache_problem(folder) is None
    else:
        lines = [ln for ln in stderr.splitlines() if ln.strip()]
        word, code = ("terminated", 143) if sig == signal.SIGTERM else ("interrupted", 130)
        assert proc.returncode == code and len(lines) == 1 and word in lines[0], stderr
        assert not [p for p in cache.iterdir() if p.is_dir()]        # no temporary, no half entry
    assert _temporaries(cache) == []
