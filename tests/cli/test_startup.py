"""The command line starts without torch: importing `llmopt.cli.app` (every subcommand registered)
loads only the torch-free top-level modules, and `llmopt --help` and a bad flag answer without it.
That is why the modules of llmopt/cli import the library inside each command."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

PROBE = """
import sys
from typer.testing import CliRunner
from llmopt.cli.app import app
runner = CliRunner()
codes = [runner.invoke(app, ["--help"]).exit_code, runner.invoke(app, ["serve", "--max-num-seqs", "x"]).exit_code]
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.") or m.startswith("llmopt."))
print(codes, [m for m in loaded if not m.startswith("llmopt.cli")])
"""


def test_the_command_line_starts_without_torch():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, cwd=REPO).stdout
    codes, loaded = out.strip().split("] [")
    assert codes == "[0, 2"                                           # help, then a usage error
    assert "torch" not in loaded and "llmopt.engine" not in loaded, loaded
