"""quantize never loses data: every bad --output is refused before any work (no calibration), with
one line, leaving the source, the user's folders and files byte-identical and no temporary behind;
--overwrite replaces only a folder llmopt wrote, and the result has the user's umask."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fs_snapshot import tree
from llmopt import fsutil
from llmopt.cli.app import app
from llmopt.errors import UserInputError
from llmopt.quant import pipeline
from llmopt.quant.config import QuantConfig


@pytest.fixture
def workspace(tiny_factory, tmp_path, monkeypatch):
    """tmp_path/model (a copy of a tiny Llama with a tokenizer), tmp_path/notes (a user's folder with a
    sub-folder), tmp_path/a-file, tmp_path/calib.txt; the working directory is tmp_path/work."""
    model = tmp_path / "model"
    shutil.copytree(tiny_factory(tokenizer=True), model)
    notes = tmp_path / "notes"
    (notes / "drafts").mkdir(parents=True)
    (notes / "todo.txt").write_text("buy milk\n")
    (notes / "drafts" / "paper.tex").write_text("\\section{Results}\n")
    (tmp_path / "a-file").write_text("not a folder\n")
    (tmp_path / "calib.txt").write_text(" ".join(f"Sentence number {i} is about the weather in town." for i in range(400)))
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    return tmp_path


def _spec(tmp_path: Path, **kw) -> QuantConfig:
    return QuantConfig(**{"method": "rtn", "group_size": 32, "num_samples": 2, "seq_len": 32,
                        "calib_data": str(tmp_path / "calib.txt"), **kw})


def _no_calibration(*_a, **_k):
    raise AssertionError("calibration started although the output should have been refused first")


def _refusals(t: Path):
    """(model, output, overwrite, qconfig changes, words of the message) for each bad --output."""
    m = str(t / "model")
    return [
        (m, m, True, {}, "the input"),                              # --model D --output D --overwrite
        (m, t / "model" / "quantized", True, {}, "the input"),      # inside the source
        (m, t, True, {}, "the input"),                              # around the source
        (m, ".", True, {}, "working directory"),
        (m, "..", True, {}, "the input"),
        (m, t / "notes", False, {}, "pass --overwrite"),
        (m, t / "notes", True, {}, "not written by llmopt"),
        (m, t / "notes" / "drafts", True, {}, "not written by llmopt"),
        (m, t / "a-file", True, {}, "not a folder"),
        (m, t / "a-file" / "out", True, {}, "is a file"),
        (m, "/proc/llmopt-out", True, {}, "not writable"),
        (m, t / "out", True, {"method": "gptq", "act_order": "group", "format": "compressed-tensors"}, "g_idx"),
        (m, t / "out", True, {"method": "fp8", "format": "awq"}, "compressed-tensors only"),
        (m, t / "out", True, {"method": "awq", "format": "gptq"}, "zero point 0 has no place"),
    ]


def test_every_bad_output_is_refused_before_any_work_and_nothing_changes(workspace, monkeypatch):
    t = workspace
    monkeypatch.setattr(pipeline, "load_calibration", _no_calibration)
    before = tree(t)
    for model, out, overwrite, changes, words in _refusals(t):
        with pytest.raises(UserInputError) as e:
            pipeline.quantize_model(model, out, _spec(t, **changes), overwrite=overwrite)
        msg = str(e.value)
        assert words in msg and "\n" not in msg, (out, msg)
        assert tree(t) == before, f"--output {out} changed files"


def test_calibration_data_inside_a_replaceable_output_is_refused(workspace, monkeypatch):
    t = workspace
    monkeypatch.setattr(pipeline, "load_calibration", _no_calibration)
    ours = t / "previous"
    ours.mkdir()
    fsutil.write_marker(ours, {"command": "quantize"})
    shutil.copy(t / "calib.txt", ours / "calib.txt")
    before = tree(t)
    with pytest.raises(UserInputError, match="the input"):
        pipeline.quantize_model(str(t / "model"), ours, _spec(t, calib_data=str(ours / "calib.txt")), overwrite=True)
    assert tree(t) == before


def test_cli_refuses_the_source_as_output_with_exit_2_and_one_line(workspace):
    t = workspace
    before = tree(t)
    for out in (t / "model", t / "notes"):
        res = CliRunner().invoke(app, ["quantize", "--model", str(t / "model"), "--output", str(out), "--overwrite",
                                       "--method", "rtn", "--group-size", "32", "--calib-data", str(t / "calib.txt"),
                                       "--quiet"])
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert res.exit_code == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
        assert tree(t) == before


def test_overwrite_replaces_only_our_folder_with_the_umask(workspace):
    t = workspace
    out = t / "out"
    old_mask = os.umask(0o027)
    try:
        pipeline.quantize_model(str(t / "model"), out, _spec(t))
        (out / "stale-extra-file").write_text("from the first run")
        first_marker = json.loads((out / fsutil.MARKER).read_text())
        model_before, notes_before = tree(t / "model"), tree(t / "notes")
        res = pipeline.quantize_model(str(t / "model"), out, _spec(t, method="fp8"), overwrite=True)
    finally:
        os.umask(old_mask)
    marker = json.loads((out / fsutil.MARKER).read_text())
    assert first_marker["method"] == "rtn" and marker["method"] == "fp8" and res.method == "fp8"
    assert marker["command"] == "quantize" and marker["source"] == str((t / "model").resolve())
    assert not (out / "stale-extra-file").exists()                    # the new folder replaced the old one
    assert tree(t / "model") == model_before and tree(t / "notes") == notes_before
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    for f in out.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o640, f.name    # safetensors writes 0600
    assert sorted(p.name for p in t.iterdir()) == ["a-file", "calib.txt", "model", "notes", "out", "work"]
    assert not any(n.startswith(".") for n in os.listdir(out))       # no shard temporaries left inside


def test_a_failing_run_leaves_the_previous_output_and_no_temporary(workspace, monkeypatch):
    t = workspace
    out = t / "out"
    pipeline.quantize_model(str(t / "model"), out, _spec(t))
    before = tree(t)

    def fail_on_layer_1(report):
        if report.layer == 1:
            raise RuntimeError("disk full")
    with pytest.raises(RuntimeError, match="disk full"):
        pipeline.quantize_model(str(t / "model"), out, _spec(t, method="fp8"), overwrite=True, on_layer=fail_on_layer_1)
    assert tree(t) == before
