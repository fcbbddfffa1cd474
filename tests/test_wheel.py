"""The wheel users `pip install`: built from this checkout, it holds every C++ source and header that
kernels/cpu_quant.py compiles at run time, and, unpacked ahead of the editable install, it runs
`llmopt generate` on the default model with the C++ decode step, from its own files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
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


def test_the_installed_wheel_generates_with_the_cpp_decode_step(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import llmopt, llmopt.kernels.cpu_quant as q, sys; "
            "assert llmopt.__file__.startswith(sys.argv[1]), llmopt.__file__; "
            "assert q.ops() is not None, 'no C++ kernels'; "
            "from llmopt.cli.app import main; sys.argv = ['llmopt', 'generate', 'Hi', '--max-tokens', '6', "
            "'--temperature', '0', '--ignore-eos', '--json', '--max-model-len', '256']; main()")
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", code, str(site)], capture_output=True, text=True, cwd=tmp_path,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.splitlines()[0])
    # the same greedy tokens as this checkout's engine (the editable install) on the same prompt
    from llmopt import LLM, SamplingParams
    want = LLM("smollm2-135m", max_model_len=256).generate("Hi", SamplingParams(max_tokens=6, temperature=0,
                                                                                ignore_eos=True))
    assert got["num_output_tokens"] == 6 and got["token_ids"] == want[0].outputs[0].token_ids
