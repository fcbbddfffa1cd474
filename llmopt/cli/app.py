"""The `llmopt` command: one Typer app, one thin module per subcommand."""

from __future__ import annotations

import typer

from llmopt import __version__
from llmopt.cli import output

app = typer.Typer(name="llmopt", help="LLM inference optimization toolkit: quantize, estimate, serve, "
                  "benchmark and evaluate Llama-family models.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"llmopt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks instead of one-line errors."),
) -> None:
    if debug:
        output.DEBUG["on"] = True


# Subcommands register themselves on `app` when imported; each appears only once it works.
# (one import line per subcommand module, below)
from llmopt.cli import kv_estimate  # noqa: E402,F401
from llmopt.cli import eval_ppl  # noqa: E402,F401
from llmopt.cli import generate  # noqa: E402,F401
from llmopt.cli import quantize  # noqa: E402,F401


def main() -> None:
    app()

