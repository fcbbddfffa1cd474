"""The wheel users `pip install`: built from this checkout, it holds every C++ source and header that
kernels/cpu_quant.py compiles at run time, and, pip-installed into a fresh venv, its `llmopt` command
runs `generate` on the default model with the C++ decode step, from its own files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from conftest import REPO

from llmopt.kernels import cpu_quant


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # from the tracked files alone, as on a fresh clone: an editable install's llmopt.egg-info in the
    # checkout lists every file and would hide a missing package-data entry
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    tracked = subprocess.run(["git", "ls-files", "-z", "pyproject.toml", "README.md", "llmopt"], cwd=REPO,
                             capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, tracked):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(out), str(src)], capture_output=True, text=True, cwd=out)
    assert r.returncode == 0, r.stderr[-3000:]
    (whl,) = out.glob("llmopt-*.whl")
    return whl


def test_the_wheel_ships_every_source_the_kernels_compile(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    compiled = {f"llmopt/kernels/{p.name}" for p in cpu_quant.SOURCES + cpu_quant.HEADERS}
    assert compiled <= names, sorted(compiled - names)
    # and nothing the package builds from is left behind: every .cpp/.h in the source tree
    native = {f"llmopt/kernels/{p.name}" for p in (REPO / "llmopt" / "kernels").iterdir() if p.suffix in (".cpp", ".h")}
    assert native <= names, sorted(native - names)
    assert "llmopt/estimate/model_presets.json" in names
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    requires = [line for line in zipfile.ZipFile(wheel).read(meta).decode().splitlines()
                if line.startswith("Requires-Dist: torch")]
    assert requires == ["Requires-Dist: torch>=2.13"], requires   # a range: installing never downgrades torch


def _fresh_venv(wheel: Path, root: Path) -> Path:
    """A new venv with the wheel pip-installed in it, as a user gets it. Its dependencies come from this
    interpreter's site-packages through a .pth line (installing torch and transformers again would take
    minutes and the network): a path added by a .pth file has its own .pth files left unprocessed, so
    this checkout's editable install (a .pth finder) stays out and `llmopt` can only be the wheel's."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
                        "-q", str(wheel)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "_llmopt_test_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return venv


def test_the_wheel_installed_in_a_fresh_venv_generates_with_the_cpp_decode_step(wheel, tmp_path):
    venv = _fresh_venv(wheel, tmp_path)
    py, cli = venv / "bin" / "python", venv / "bin" / "llmopt"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    # every declared dependency resolves in it, and llmopt is the wheel's files with its C++ kernels
    code = ("import importlib.metadata as md, sys, llmopt, llmopt.kernels.cpu_quant as q; "
            "from packaging.requirements import Requirement; "
            "missing = [r for r in md.requires('llmopt') if 'extra ==' not in r "
            "           and md.version(Requirement(r).name) not in Requirement(r).specifier]; "
            "assert not missing, missing; "
            "assert llmopt.__file__.startswith(sys.prefix), llmopt.__file__; "
            "assert q.ops() is not None, 'no C++ kernels'")
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    # the console script pip wrote, as a user types it
    r = subprocess.run([str(cli), "generate", "Hi", "--max-tokens", "6", "--temperature", "0", "--ignore-eos",
                        "--json", "--max-model-len", "256"], capture_output=True, text=True, cwd=tmp_path,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.splitlines()[0])
    # the same greedy tokens as this checkout's engine (the editable install) on the same prompt
    from llmopt import LLM, SamplingParams
    want = LLM("smollm2-135m", max_model_len=256).generate("Hi", SamplingParams(max_tokens=6, temperature=0,
                                                                                ignore_eos=True))
    assert got["num_output_tokens"] == 6 and got["token_ids"] == want[0].outputs[0].token_ids
