"""Bad input through the real CLI, table-driven: damaged checkpoints, text that is not UTF-8, numbers
out of range, usage errors. Each case asserts the exit code, one line on stderr (no traceback) that
names what was given, and with --json one parseable {"error": {...}} object on stdout. In-process
(CliRunner) except stdin / stdout, which need a real process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from conftest import REPO
from llmopt.cli import generate as generate_module
from llmopt.cli.app import app

LATIN1 = "caf\xe9 au lait\n".encode("latin-1")     # not UTF-8: 0xe9 then a space


@pytest.fixture(scope="module")
def env(tiny_factory, tmp_path_factory):
    """The tiny model (2 layers, hidden 64, context 512, SmolLM2's tokenizer), damaged copies of it,
    a small text and files that are not UTF-8."""
    tiny = tiny_factory(tokenizer=True)
    root = tmp_path_factory.mktemp("bad")

    def copy(name, damage):
        d = root / name
        shutil.copytree(tiny, d)
        damage(d)
        return str(d)

    def truncate(d):
        f = d / "model.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])

    def drop_key(d):
        cfg = json.loads((d / "config.json").read_text())
        del cfg["hidden_size"]
        (d / "config.json").write_text(json.dumps(cfg))

    def set_key(key, value):
        def damage(d):
            cfg = json.loads((d / "config.json").read_text())
            cfg[key] = value
            (d / "config.json").write_text(json.dumps(cfg))   # NaN is written as NaN, as Python's json reads it
        return damage

    def drop_tokenizer(d):
        for f in d.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
                f.unlink()

    (root / "empty.gguf").write_bytes(b"")
    text = root / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    (root / "latin1.txt").write_bytes(LATIN1)
    (root / "latin1.yaml").write_bytes(b"method: rtn\n# " + LATIN1)
    (root / "broken.yaml").write_text("method: [rtn\noutput: o\n")
    return {"tiny": str(tiny), "root": root, "text": str(text),
            "truncated": copy("truncated", truncate),
            "garbage": copy("garbage", lambda d: (d / "model.safetensors").write_bytes(b"\x00not safetensors" * 64)),
            "nokey": copy("nokey", drop_key),
            "strkey": copy("strkey", set_key("hidden_size", "64")),
            "naneps": copy("naneps", set_key("rms_norm_eps", float("nan"))),
            "empty_gguf": str(root / "empty.gguf"),
            "notok": copy("notok", drop_tokenizer)}


def invoke(args: list[str]):
    return CliRunner().invoke(app, args, env={"COLUMNS": "200"})


def assert_one_error_line(res, code: int, fragment: str) -> str:
    assert res.exit_code == code, (res.exit_code, res.output)
    assert "Traceback" not in res.output, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


# (id, command line with {placeholders} from the env fixture, exit code, fragment of the message)
COMMANDS = {
    "eval-ppl": ["eval-ppl", "--model", "{model}", "--dataset", "{text}", "--limit", "64", "--ctx", "32", "-q"],
    "base-model": ["eval-ppl", "--model", "{tiny}", "--base-model", "{model}", "--dataset", "{text}",
                   "--limit", "64", "--ctx", "32", "-q"],
    "generate": ["generate", "--model", "{model}", "hi", "--max-tokens", "2", "--kv-cache-memory", "4MiB", "-q"],
    "quantize": ["quantize", "--model", "{model}", "--method", "rtn", "--calib-data", "{text}", "--seq-len", "16",
                 "--num-samples", "2", "--output", "{root}/q-{model_name}", "-q"],
    "kv-estimate": ["kv-estimate", "--model", "{model}"],
}
DAMAGED = [  # (model, fragment, commands that read it)
    ("truncated", "is a damaged safetensors file: truncated", list(COMMANDS)),
    ("garbage", "is a damaged safetensors file", list(COMMANDS)),
    # the same parser for every command (kv-estimate too): one line naming the field and the file
    ("nokey", "nokey/config.json: hidden_size is missing", list(COMMANDS)),
    ("strkey", "strkey/config.json: hidden_size must be an integer, got '64'", list(COMMANDS)),
    ("naneps", "naneps/config.json: rms_norm_eps must be a positive finite number, got nan", list(COMMANDS)),
    ("empty_gguf", "empty.gguf is not", list(COMMANDS)),
    ("notok", "has no tokenizer", [c for c in COMMANDS if c != "kv-estimate"]),      # kv-estimate needs none
]
CASES = [(f"{model}-{cmd}", [a.replace("{model}", "{%s}" % model).replace("{model_name}", model)
                             for a in COMMANDS[cmd]], 2, fragment)
         for model, fragment, cmds in DAMAGED for cmd in cmds]
CASES += [
    # text that is not UTF-8, YAML that does not parse
    ("file-latin1", ["generate", "--model", "{tiny}", "--file", "{root}/latin1.txt"], 2, "is not UTF-8 text"),
    ("recipe-latin1", ["quantize", "--recipe", "{root}/latin1.yaml", "-o", "{root}/o"], 2, "is not UTF-8 text"),
    ("recipe-yaml", ["quantize", "--recipe", "{root}/broken.yaml", "-o", "{root}/o"], 2, "but got ':' at line 2, column 7"),
    # numbers out of their documented range, refused while parsing (nothing is loaded)
    ("kv-cache-memory-10T", ["generate", "--model", "{tiny}", "hi", "--kv-cache-memory", "10T", "-q"], 2,
     "--kv-cache-memory 10.0 TiB is more than the"),
    ("logprobs", ["generate", "hi", "--logprobs", "100000"], 2, "100000 is out of range: use 0 to 20"),
    ("seed-65-bits", ["generate", "hi", "--seed", str(2 ** 64)], 2, f"{2 ** 64} is out of range"),
    ("quantize-seed", ["quantize", "-o", "{root}/o", "--seed", str(-2 ** 70)], 2, "is out of range"),
    ("num-samples", ["quantize", "-o", "{root}/o", "--num-samples", "100000000"], 2,
     "100000000 is out of range: use 1 to 4096"),
    ("num-completions", ["generate", "hi", "--num-completions", "100000000"], 2, "use 1 to 1024"),
    ("max-length-0", ["eval-ppl", "--method", "sliding", "--max-length", "0"], 2, "'--max-length': 0 is out of range"),
    ("ctx-0", ["eval-ppl", "--ctx", "0"], 2, "'--ctx': 0 is out of range: use >= 2"),
    ("gpu-memory-utilization", ["generate", "hi", "--gpu-memory-utilization", "2"], 2, "use (0, 1]"),
    ("top-p-0", ["generate", "hi", "--top-p", "0"], 2, "use (0, 1]"),
    ("temperature-nan", ["generate", "hi", "--temperature", "nan"], 2, "nan is out of range"),
    ("group-size-0", ["quantize", "-o", "{root}/o", "--group-size", "0"], 2, "use -1 or >= 1"),
    ("kv-group-size-7", ["kv-estimate", "--model", "{tiny}", "--weight-format", "int4", "--group-size", "7"], 2,
     "--group-size 7 does not divide the model's layer width 64"),
    ("tp-0", ["kv-estimate", "--tensor-parallel-size", "0"], 2, "0 is out of range: use >= 1"),
    # the engine's limits, the same in kv-estimate's plans
    ("block-size-2**70", ["kv-estimate", "--block-size", str(2 ** 70)], 2,
     f"--block-size {2 ** 70}: give an integer from 1 to 65,536"),
    ("generate-block-size-2**70", ["generate", "--model", "{tiny}", "hi", "--block-size", str(2 ** 70)], 2,
     f"--block-size {2 ** 70}: give an integer from 1 to 65,536"),
    ("max-num-seqs-2**70", ["kv-estimate", "--max-num-seqs", str(2 ** 70)], 2,
     f"--max-num-seqs {2 ** 70}: give an integer from 1 to 2,147,483,647"),
    ("generate-max-num-seqs-2**70", ["generate", "--model", "{tiny}", "hi", "--max-num-seqs", str(2 ** 70)], 2,
     f"--max-num-seqs {2 ** 70}: give an integer from 1 to 2,147,483,647"),
    # a path the system cannot take is bad input, shown short
    ("path-5000", ["kv-estimate", "--model", "a" * 5000], 2, "File name too long: aaaa"),
    ("generate-path-5000", ["generate", "--model", "a" * 5000, "hi"], 2, "(5,000 characters)"),
    # lengths past the model's context (512), refused as vLLM refuses them
    ("generate-max-model-len", ["generate", "--model", "{tiny}", "hi", "--max-model-len", "100000",
                                "--kv-cache-memory", "4MiB", "-q"], 2,
     "--max-model-len 100,000 is longer than the model's context of 512 tokens"),
    ("kv-estimate-max-model-len", ["kv-estimate", "--model", "{tiny}", "--max-model-len", "100000"], 2,
     "--max-model-len 100,000 is longer than the model's context of 512 tokens"),
    ("eval-ppl-ctx", ["eval-ppl", "--model", "{tiny}", "--dataset", "{text}", "--ctx", "4096", "-q"], 2,
     "--ctx 4,096 is longer than the model's context of 512 tokens"),
    ("quantize-seq-len", ["quantize", "--model", "{tiny}", "--method", "rtn", "--calib-data", "{text}",
                          "--seq-len", "4096", "-o", "{root}/o", "-q"], 2, "--seq-len 4,096 is longer than"),
    # usage errors
    ("not-a-number", ["generate", "hi", "--max-tokens", "abc"], 2, "Invalid value for '--max-tokens'"),
    ("unknown-option", ["kv-estimate", "--bogus"], 2, "No such option: --bogus"),
]


def _fill(args: list[str], env: dict) -> list[str]:
    return [a.format(**{k: v for k, v in env.items()}) for a in args]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_the_documented_exit_code(env, case):
    _, args, code, fragment = case
    args = _fill(args, env)
    assert_one_error_line(invoke(args), code, fragment)
    res = invoke(args + ["--json"])        # the same, plus the error object on stdout
    line = assert_one_error_line(res, code, fragment)
    err = json.loads(res.stdout.strip().splitlines()[-1])["error"]
    assert err["exit_code"] == code and "error: " + err["message"] == line and err["type"]


def test_kv_estimate_does_not_fit_what_generate_refuses_on_this_cpu(env):
    """A 1 TiB KV cache on this machine: generate refuses it (exit 2) and kv-estimate's plan for the
    CPU says it does not fit, in the same words (exit 3 with --require-fit)."""
    big = ["--kv-cache-memory", "1TiB", "--device", "cpu"]
    refused = assert_one_error_line(invoke(_fill(["generate", "--model", "{tiny}", "hi", "-q", *big], env)), 2,
                                    "--kv-cache-memory 1.0 TiB is more than the")
    res = invoke(_fill(["kv-estimate", "--model", "{tiny}", "--json", *big], env))
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)
    assert plan["fits"] is False and refused.removeprefix("error: ") in plan["problems"], plan["problems"]
    gate = invoke(_fill(["kv-estimate", "--model", "{tiny}", "--require-fit", *big], env))
    assert_one_error_line(gate, 3, refused.removeprefix("error: "))


def test_json_error_types_name_the_kind(env):
    res = invoke(_fill(["kv-estimate", "--model", "{garbage}", "--json"], env))
    assert json.loads(res.stdout)["error"]["type"] == "ModelLoadError"
    res = invoke(["generate", "hi", "--logprobs", "-1", "--json"])
    assert json.loads(res.stdout) == {"error": {"message": res.stderr.strip()[len("error: "):],
                                                "type": "UsageError", "exit_code": 2}}


def test_debug_shows_the_traceback_and_keeps_the_exit_code(env):
    res = invoke(_fill(["--debug", "generate", "--model", "{truncated}", "hi"], env))
    assert res.exit_code == 2
    assert "Traceback (most recent call last)" in res.stderr and "ModelLoadError" in res.stderr
    assert res.stderr.rstrip().splitlines()[-1].startswith("error: ")


def test_quantize_defaults_work_on_a_model_128_does_not_divide(env):
    """hidden 64: --group-size auto picks 64 and says why; fp8 shows no group size."""
    out = env["root"] / "auto"
    res = invoke(_fill(["quantize", "--model", "{tiny}", "--method", "rtn", "--calib-data", "{text}", "--seq-len",
                        "16", "--num-samples", "2", "-o", str(out), "-q"], env))
    assert res.exit_code == 0, res.output
    assert "64 (auto: 128 does not divide 64)" in res.stdout
    assert json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"][
        "weights"]["group_size"] == 64
    res = invoke(_fill(["quantize", "--model", "{tiny}", "--method", "fp8", "--calib-data", "{text}", "--seq-len",
                        "16", "--num-samples", "2", "-o", str(env["root"] / "fp8"), "-q", "--json"], env))
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout.strip().splitlines()[-1])
    assert d["group_size"] is None and d["group_size_reason"] is None
    res = invoke(_fill(["quantize", "--model", "{tiny}", "--method", "fp8", "--calib-data", "{text}", "--seq-len",
                        "16", "--num-samples", "2", "-o", str(env["root"] / "fp8"), "-q", "--overwrite"], env))
    assert res.exit_code == 0 and "group size" not in res.stdout and "method" in res.stdout


def test_generate_separates_plain_completions_and_prints_json_lines(env):
    args = _fill(["generate", "--model", "{tiny}", "one", "two", "--max-tokens", "3", "--kv-cache-memory", "4MiB",
                  "--ignore-eos", "-q"], env)
    res = invoke(args)
    assert res.exit_code == 0, res.output
    assert res.stdout.count(generate_module.SEPARATOR + "\n") == 1       # between the two, not after
    res = invoke(args + ["--num-completions", "2", "--temperature", "1", "--seed", "3", "--json"])
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(rows) == 4 and [r["index"] for r in rows] == [0, 1, 0, 1]
    assert all(k == k.lower() and " " not in k and "-" not in k for r in rows for k in r)   # snake_case


def test_every_option_of_every_command_has_help_and_help_fits_80_columns():
    group = get_command(app)
    for name, command in group.commands.items():
        for param in command.params:
            assert (getattr(param, "help", None) or "").strip(), f"{name} {param.opts}: no help"
        res = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
        assert res.exit_code == 0
        long = [ln for ln in res.stdout.splitlines() if len(ln) > 80 or "…" in ln]
        assert not long, f"{name}: {long}"


# --- stdin and stdout: a real process -------------------------------------------------------------

def _llmopt(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmopt", *args], capture_output=True, cwd=REPO, timeout=300, **kw)


def test_stdin_not_utf8_empty_or_closed_gives_one_line(env):
    r = _llmopt(["generate", "--model", env["tiny"]], input=LATIN1)
    assert r.returncode == 2 and r.stderr.decode().strip().startswith("error: stdin is not UTF-8 text"), r.stderr
    r = _llmopt(["generate", "--model", env["tiny"]], stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and r.stderr.decode().strip() == "error: no prompt: the input is empty", r.stderr
    r = subprocess.run(f"{sys.executable} -m llmopt generate --json <&-", shell=True, capture_output=True,
                       cwd=REPO, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.decode().strip().startswith("error: no prompt: pass prompts as arguments")
    assert json.loads(r.stdout)["error"]["exit_code"] == 2


def test_stdout_closed_by_its_reader_or_by_the_shell_is_quiet(env):
    proc = subprocess.Popen([sys.executable, "-m", "llmopt", "kv-estimate", "--model", env["tiny"], "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    proc.stdout.close()                    # `| head` that has already left
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141 and stderr == ""
    r = subprocess.run(f"{sys.executable} -m llmopt kv-estimate --model {env['tiny']} --json >&-", shell=True,
                       capture_output=True, cwd=REPO, timeout=300)
    assert r.returncode == 0 and r.stderr == b""
