"""The CLI's shape: one registration point (app.py), one error guard, an Examples section in
every command's --help."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from llmopt.cli import app as app_module
from llmopt.cli import bench, eval_ppl, evaluate, generate, kv_estimate, output, quantize, serve, spec_tune
from llmopt.cli.app import app
from llmopt.errors import DoesNotFitError, LLMOptError, UserInputError

CLI_DIR = Path(app_module.__file__).parent
REPO = CLI_DIR.parents[1]
COMMANDS = {"eval-ppl": (eval_ppl, eval_ppl.eval_ppl), "eval": (evaluate, evaluate.eval_tasks),
            "quantize": (quantize, quantize.quantize),
            "kv-estimate": (kv_estimate, kv_estimate.kv_estimate), "generate": (generate, generate.generate),
            "serve": (serve, serve.serve), "bench": (bench, bench.bench),
            "spec-tune": (spec_tune, spec_tune.spec_tune)}


def _imports(path: Path) -> set[str]:
    """Every module and module.name a file imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


@pytest.mark.parametrize("path", sorted(p for p in CLI_DIR.glob("*.py") if p.name not in ("app.py", "__init__.py")),
                         ids=lambda p: p.name)
def test_modules_do_not_import_app_nor_guard_themselves(path):
    imported = _imports(path)
    assert "llmopt.cli.app" not in imported and "llmopt.cli.app.app" not in imported
    if path.name != "output.py":
        assert "run_guarded" not in path.read_text() and "guarded(" not in path.read_text()


def test_every_command_registered_once_and_guarded():
    names = [c.name for c in app.registered_commands]
    assert sorted(names) == sorted(COMMANDS) and len(names) == len(set(names))
    for c in app.registered_commands:
        module, function = COMMANDS[c.name]
        assert c.callback is not function and c.callback.__wrapped__ is function   # wrapped once, by app.py
        assert c.epilog and all(e in c.epilog for e in module.EXAMPLES)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_shows_each_example_on_one_line(name):
    module, _ = COMMANDS[name]
    res = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert res.exit_code == 0, res.output
    lines = [ln.strip(" │") for ln in res.stdout.splitlines()]
    assert "Examples:" in lines
    assert module.EXAMPLES and all(e in lines for e in module.EXAMPLES), res.stdout
    assert all(e.startswith(("llmopt ", "echo ")) and f"llmopt {name}" in e for e in module.EXAMPLES)


# --- the guard -----------------------------------------------------------------------------------

def _toy_app(exc: BaseException) -> typer.Typer:
    """A throwaway app registered the way app.py does it, whose command raises `exc`."""
    toy = typer.Typer()

    @toy.callback()
    def _root(debug: bool = typer.Option(False, "--debug")) -> None:
        output.DEBUG["on"] = debug

    def boom(count: int = typer.Option(1, "--count")) -> None:
        if count == 0:
            print("count 0")
            return
        raise exc

    toy.command("boom")(output.guarded(boom))
    return toy


@pytest.mark.parametrize("exc,code", [
    (UserInputError("bad --count: use a positive number"), 2),
    (LLMOptError("the engine failed"), 1),
    (DoesNotFitError("does not fit: 90 GiB > 80 GiB"), 3),
    (FileNotFoundError(2, "No such file or directory", "/no/such.txt"), 2),
    (KeyboardInterrupt(), 130),
])
def test_guard_maps_errors_to_exit_codes_and_one_red_line(exc, code):
    res = CliRunner().invoke(_toy_app(exc), ["boom"])
    assert res.exit_code == code, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.output


def test_guard_keeps_the_signature_and_multi_line_messages_become_one_line():
    res = CliRunner().invoke(_toy_app(UserInputError("x")), ["boom", "--count", "0"])
    assert res.exit_code == 0 and res.stdout == "count 0\n"
    res = CliRunner().invoke(_toy_app(UserInputError("first line\n  second [bold]line[/]")), ["boom"])
    assert res.exit_code == 2 and res.stderr.strip() == "error: first line second [bold]line[/]"


def test_debug_shows_the_traceback_keeps_the_exit_code_and_is_not_sticky():
    exc = UserInputError("bad --count")
    res = CliRunner().invoke(_toy_app(exc), ["--debug", "boom"])
    assert res.exit_code == 2 and "Traceback (most recent call last)" in res.stderr
    assert "UserInputError: bad --count" in res.stderr and res.stderr.rstrip().endswith("error: bad --count")
    res = CliRunner().invoke(app, ["generate", "hi", "--file", "prompts.txt"])   # the real app resets it
    assert res.exit_code == 2 and not output.DEBUG["on"]


def test_real_command_bad_input_one_line_then_traceback_with_debug(tmp_path):
    """Through the installed entry point: exit 2 and one red line; --debug: the traceback, still exit 2."""
    cmd = [sys.executable, "-m", "llmopt"]
    args = ["generate", "a prompt", "--file", str(tmp_path / "prompts.txt")]
    r = subprocess.run(cmd + args, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "error: give prompts as arguments or with --file, not both" and r.stdout == ""
    r = subprocess.run(cmd + ["--debug"] + args, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2
    assert "Traceback (most recent call last)" in r.stderr
    assert "UserInputError: give prompts as arguments or with --file, not both" in r.stderr
    assert r.stderr.rstrip().endswith("error: give prompts as arguments or with --file, not both")
