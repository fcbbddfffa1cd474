"""A fuzz over the CLI's flags: hypothesis draws values for the numeric and path options of every
subcommand (read from the commands' signatures, so a new flag is fuzzed too) and runs the command on
the tiny model. Whatever the values, the outcome is a documented exit code (0 done, 1 failure, 2 bad
input, 3 does not fit), never a traceback, and a failure is one line on stderr that is not an
internal error. At most 50 examples per command, derandomized so CI sees the same ones."""

from __future__ import annotations

import inspect
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from llmopt.cli import eval_ppl, generate, kv_estimate, quantize
from llmopt.cli.app import app

FUNCTIONS = {"eval-ppl": eval_ppl.eval_ppl, "quantize": quantize.quantize, "kv-estimate": kv_estimate.kv_estimate,
             "generate": generate.generate}
EXAMPLES = {"kv-estimate": 50, "eval-ppl": 30, "quantize": 25, "generate": 30}
PATH_FLAGS = {"--model", "--base-model", "--dataset", "--file", "--recipe", "--calib-data", "--output"}
# string flags that hold numbers: sizes (8GiB), token counts (32k), lists (1,8,32)
NUMERIC_TEXT_FLAGS = {"--kv-cache-memory", "--kv-cache-memory-bytes", "--max-model-len", "--max-num-batched-tokens",
                      "--batch-sizes",
                      "--seq-lens"}
EXTREME_INTS = [0, -1, 1, 2, 3, 7, 64, 100, 2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64, -2 ** 63 - 1, 10 ** 30]


def numeric_flags(fn) -> dict[str, str]:
    """flag -> 'int' | 'float' | 'text' | 'path' for the options of a command function."""
    out = {}
    for p in inspect.signature(fn).parameters.values():
        decls = getattr(p.default, "param_decls", None) or ()
        flag = next((d for d in decls if d.startswith("--") and "/" not in d), None)
        ann = str(p.annotation)
        if flag is None or "bool" in ann:
            continue
        if flag in PATH_FLAGS:
            out[flag] = "path"
        elif flag in NUMERIC_TEXT_FLAGS:
            out[flag] = "text"
        elif "float" in ann:
            out[flag] = "float"
        elif "int" in ann:
            out[flag] = "int"
    return out


def value(kind: str, paths: list[str]) -> st.SearchStrategy[str]:
    ints = st.one_of(st.integers(-3, 80), st.sampled_from(EXTREME_INTS))
    if kind == "int":
        return ints.map(str)
    if kind == "float":
        return st.one_of(st.floats(-3, 3), st.sampled_from([0.0, 1.0, 1e-9, -0.0, 1e308, float("inf"), float("nan")]),
                         st.floats(allow_nan=True, allow_infinity=True)).map(repr)
    if kind == "text":
        return st.one_of(ints.map(str), st.sampled_from(["10T", "1.5G", "1.5g", "4MiB", "0", "-1", "1e9", "abc", "",
                                                         "2k", "1,8,32", "0,0", "99999999999999999999k", "8 GB"]))
    return st.sampled_from(paths)


@pytest.fixture(scope="module")
def fuzz_env(tiny_factory, tmp_path_factory):
    tiny = tiny_factory(tokenizer=True)
    root = tmp_path_factory.mktemp("fuzz")
    text = root / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    (root / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (root / "empty.txt").write_text("")
    (root / "garbage.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    (root / "folder").mkdir()
    (root / "recipe.yaml").write_text("method: rtn\n")
    paths = [str(tiny), str(text), str(root / "latin1.txt"), str(root / "empty.txt"), str(root / "garbage.gguf"),
             str(root / "folder"), str(root / "missing"), str(root / "recipe.yaml"), "", "nope/nope"]
    base = {  # fast defaults: the tiny model, a small text, little work; fuzzed flags come after and win
        "eval-ppl": ["--model", str(tiny), "--dataset", str(text), "--limit", "64", "--ctx", "32", "-q"],
        "quantize": ["--model", str(tiny), "--method", "rtn", "--calib-data", str(text), "--seq-len", "16",
                     "--num-samples", "2", "--output", str(root / "q"), "--overwrite", "-q"],
        "kv-estimate": ["--model", str(tiny)],
        "generate": ["--model", str(tiny), "hi", "--max-tokens", "2", "--max-model-len", "64",
                     "--kv-cache-memory", "4MiB", "-q"],
    }
    return {"paths": paths, "base": base, "root": root}


@pytest.mark.parametrize("command", sorted(FUNCTIONS))
def test_fuzzed_flags_never_crash(command, fuzz_env):
    flags = numeric_flags(FUNCTIONS[command])
    assert flags, command

    @settings(max_examples=EXAMPLES[command], deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(st.data())
    def run(data):
        chosen = data.draw(st.lists(st.sampled_from(sorted(flags)), min_size=1, max_size=3, unique=True))
        args = [command, *fuzz_env["base"][command]]
        for flag in chosen:
            args += [flag, data.draw(value(flags[flag], fuzz_env["paths"]), label=flag)]
        as_json = data.draw(st.booleans(), label="--json")
        if as_json:
            args.append("--json")
        cwd = os.getcwd()
        os.chdir(fuzz_env["root"])       # relative paths (`nope/nope` as --output) land in the temp folder
        try:
            res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
        finally:
            os.chdir(cwd)
        note = f"{args}: exit {res.exit_code}\n{res.output[-2000:]}"
        assert res.exit_code in (0, 1, 2, 3), note
        assert "Traceback" not in res.output, note
        if res.exit_code:
            lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
            assert len(lines) == 1 and lines[0].startswith("error: "), note
            assert not lines[0].startswith("error: unexpected"), note     # an internal error is a bug
            if as_json:
                assert json.loads(res.stdout.strip().splitlines()[-1])["error"]["exit_code"] == res.exit_code, note

    run()
