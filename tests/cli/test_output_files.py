"""Result files and the command guard: eval-ppl --output is checked before any scoring and never
creates folders or replaces an input; SIGTERM is handled like Ctrl-C by every command (exit 143)."""

from __future__ import annotations

import json
import os
import signal

import pytest
from typer.testing import CliRunner

from fs_snapshot import tree
from llmopt import fsutil
from llmopt.cli import output
from llmopt.cli.app import app
from llmopt.errors import UserInputError

TEXT = "A short text about the sea and the sky, written for a perplexity test. " * 20


def test_check_output_file_refusals(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    (tmp_path / "results").mkdir()
    cases = [
        (tmp_path / "results", [], "is a folder"),
        (tmp_path / "missing" / "r.json", [], "does not exist"),
        (data, [data], "is the input"),
        ("data.txt", [str(data)], "is the input"),
        ("/proc/llmopt-result.json", [], "not writable"),
    ]
    before = tree(tmp_path)
    for out, inputs, words in cases:
        with pytest.raises(UserInputError) as e:
            fsutil.check_output_file(out, inputs)
        assert words in str(e.value) and "\n" not in str(e.value), out
    assert tree(tmp_path) == before                       # no folder made, no probe left
    assert fsutil.check_output_file("results/r.json", [data]) == tmp_path / "results" / "r.json"
    (tmp_path / "results" / "r.json").write_text("{}")     # an earlier result is replaced
    assert fsutil.check_output_file("results/r.json", [data]) == tmp_path / "results" / "r.json"
    assert set(tree(tmp_path)) == set(before) | {"results/r.json"}


def test_output_write_atomic_does_not_create_folders(tmp_path):
    with pytest.raises(UserInputError, match="does not exist"):
        output.emit({"a": 1}, as_json=True, output=tmp_path / "typo" / "r.json")
    assert list(tmp_path.iterdir()) == []
    output.emit({"a": 1}, as_json=True, output=tmp_path / "r.json")
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_eval_ppl_output_is_refused_before_scoring(tiny_factory, tmp_path, monkeypatch):
    model = tiny_factory(tokenizer=True)
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    (tmp_path / "results").mkdir()
    monkeypatch.chdir(tmp_path)

    def no_loading(*_a, **_k):
        raise AssertionError("the model was loaded although --output should have been refused first")
    monkeypatch.setattr("llmopt.models.loader.load_model", no_loading)
    before = tree(tmp_path)
    for out, words in [("results", "is a folder"), ("nope/r.json", "does not exist"), ("data.txt", "is the input")]:
        res = CliRunner().invoke(app, ["eval-ppl", "--model", str(model), "--dataset", str(data), "--ctx", "32",
                                       "--quiet", "--output", out])
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert res.exit_code == 2 and len(lines) == 1 and words in lines[0], res.stderr
        assert tree(tmp_path) == before
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["eval-ppl", "--model", str(model), "--dataset", str(data), "--ctx", "32",
                                   "--limit", "128", "--quiet", "--json", "--output", "results/r.json"])
    assert res.exit_code == 0, res.stderr
    assert json.loads((tmp_path / "results" / "r.json").read_text())["ppl"] == json.loads(res.stdout)["ppl"]
    assert sorted(os.listdir(tmp_path / "results")) == ["r.json"]


@pytest.fixture
def restore_sigterm():
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_the_guard_turns_sigterm_into_one_line_and_exit_143(restore_sigterm, tmp_path, capsys):
    cleaned = []

    def command():
        try:
            os.kill(os.getpid(), signal.SIGTERM)     # as `kill PID` would
            raise AssertionError("SIGTERM did not interrupt the command")
        finally:
            cleaned.append(True)                     # finally blocks (temporaries' cleanup) run
    with pytest.raises(SystemExit) as e:
        output.run_guarded(command)
    err = capsys.readouterr().err
    assert e.value.code == 143 and cleaned == [True]
    assert [ln for ln in err.splitlines() if ln.strip()] == ["error: terminated"]

    def ctrl_c():
        raise KeyboardInterrupt
    with pytest.raises(SystemExit) as e:
        output.run_guarded(ctrl_c)
    assert e.value.code == 130 and "interrupted" in capsys.readouterr().err
