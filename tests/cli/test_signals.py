"""Interrupted commands leave nothing behind and lose nothing: `python -m llmopt quantize` stopped by
SIGINT (exit 130) or SIGTERM (exit 143) while it writes its shards prints one line, removes its
`.NAME.tmp<PID>` folder and keeps the source, the previous output and unrelated files byte-identical;
after SIGKILL (which nothing can catch) the leftover is removed by the next run, which succeeds.

The interrupted run is the real CLI in a child process whose `save_shard` is wrapped to stop after
two shards until a signal comes: the signal lands mid-write on any machine, fast or loaded."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, make_tiny
from fs_snapshot import tree
from llmopt import fsutil


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory) -> Path:
    """A random Llama deep enough that quantize spends a few seconds writing shards."""
    return make_tiny(tmp_path_factory.mktemp("slow") / "model", tokenizer=True, num_hidden_layers=16,
                     hidden_size=128, intermediate_size=512)


def _args(model: Path, tmp: Path) -> list[str]:
    return ["quantize", "--model", str(model), "--output", str(tmp / "out"), "--overwrite", "--method", "gptq",
            "--group-size", "32", "--num-samples", "16", "--seq-len", "256", "--calib-data", str(tmp / "calib.txt"),
            "--quiet", "--json"]


def _command(model: Path, tmp: Path) -> list[str]:
    return [sys.executable, "-m", "llmopt", *_args(model, tmp)]


# The child: the real `llmopt` entry point, with the pipeline's shard writer wrapped so that after two
# finished shards it touches READY and sleeps until the test's signal (a loaded machine cannot race it).
_PAUSING_CHILD = """
import sys, time
from pathlib import Path
import llmopt.quant.pipeline as pipeline
ready, written, save = Path(sys.argv[1]), [], pipeline.save_shard
def pausing_save(path, tensors):
    out = save(path, tensors)
    written.append(path)
    if len(written) == 2:
        ready.touch()
        while True:
            time.sleep(0.05)
    return out
pipeline.save_shard = pausing_save
from llmopt.cli.app import main
sys.argv = ["llmopt", *sys.argv[2:]]
main()
"""


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _temporaries(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if re.fullmatch(r"\..+\.(tmp|old)\d+", p.name)]


def _wait_until_paused(proc: subprocess.Popen, ready: Path, timeout: float = 600) -> None:
    """Until the child has written two shards into its `.out.tmp<PID>` folder and paused there."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if ready.exists():
            return
        if proc.poll() is not None:
            raise AssertionError(f"quantize ended (rc {proc.returncode}) before writing two shards: "
                                 f"{proc.stderr.read()}")
        time.sleep(0.02)
    proc.kill()
    raise AssertionError("quantize did not write two shards in time")


@pytest.mark.parametrize("sig, code, word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated"),
                                             (signal.SIGKILL, -9, None)])
def test_quantize_interrupted_loses_nothing_and_leaves_nothing(slow_model, tmp_path, sig, code, word):
    (tmp_path / "calib.txt").write_text(" ".join(f"Line {i} of a calibration text about rivers and hills."
                                                 for i in range(1500)))
    (tmp_path / "notes.txt").write_text("the user's unrelated file\n")
    previous = tmp_path / "out"                   # a folder an earlier run wrote: what --overwrite replaces
    previous.mkdir()
    (previous / "model.safetensors").write_bytes(os.urandom(4096))
    fsutil.write_marker(previous, {"command": "quantize", "method": "rtn"})
    source, before = tree(slow_model), tree(tmp_path)
    ready = tmp_path.parent / f"{tmp_path.name}.ready"       # outside tmp_path: not part of its tree

    proc = subprocess.Popen([sys.executable, "-c", _PAUSING_CHILD, str(ready), *_args(slow_model, tmp_path)],
                            cwd=tmp_path, env=_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _wait_until_paused(proc, ready)
    shards = sorted(p.name for p in (tmp_path / f".out.tmp{proc.pid}").iterdir() if p.suffix == ".safetensors")
    assert shards == ["model-00001-of-00017.safetensors", "model-00002-of-00017.safetensors"]   # mid-write
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=300)

    assert proc.returncode == code, stderr
    assert tree(slow_model) == source                       # the source, byte for byte
    if sig != signal.SIGKILL:
        lines = [ln for ln in stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and word in lines[0] and "Traceback" not in stderr, stderr
        assert json.loads(stdout)["error"]["exit_code"] == code   # --json: the error object, no result
        assert tree(tmp_path) == before                     # previous output, notes, no temporary
        return
    # SIGKILL: the partial folder stays behind until the next start, which removes it and succeeds
    assert _temporaries(tmp_path) == [f".out.tmp{proc.pid}"]
    rerun = subprocess.run(_command(slow_model, tmp_path), cwd=tmp_path, env=_env(), text=True,
                           capture_output=True, timeout=900)
    assert rerun.returncode == 0, rerun.stderr
    assert json.loads(rerun.stdout)["method"] == "gptq"
    assert _temporaries(tmp_path) == []
    assert json.loads((previous / fsutil.MARKER).read_text())["method"] == "gptq"
    assert tree(slow_model) == source
    assert (tmp_path / "notes.txt").read_text() == "the user's unrelated file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt", "notes.txt", "out"]
