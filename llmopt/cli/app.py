"""The `llmopt` command: one Typer app, and the one place where subcommands are registered.

Command modules define plain functions (Typer options as defaults, the body calling the library),
an EXAMPLES list and, for flags that take several values as argparse's nargs, a COMMAND_CLS; they
never import `app`. Each is registered here once, wrapped by `output.guarded`, which turns
LLMOptError and friends into one red line and an exit code."""

from __future__ import annotations

import os

import typer

from llmopt import __version__
from llmopt.cli import bench, eval_ppl, evaluate, generate, kv_estimate, output, quantize, serve, spec_tune

app = typer.Typer(name="llmopt", help="LLM inference optimization toolkit: quantize, estimate, serve, "
                  "benchmark and evaluate Llama-family models.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False, cls=output.Group,
                  rich_markup_mode=None)   # click's plain help: option names and lists wrap, never cut


def _version(value: bool) -> None:
    if value:
        typer.echo(f"llmopt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
    debug: bool = typer.Option(False, "--debug", help="Also show the traceback of an error (the exit code stays 2, 1 or 3)."),
) -> None:
    output.DEBUG["on"] = debug or bool(os.environ.get("LLMOPT_DEBUG"))


# (name, module, function): the order of `llmopt --help`.
COMMANDS = [
    ("eval-ppl", eval_ppl, eval_ppl.eval_ppl),
    ("eval", evaluate, evaluate.eval_tasks),
    ("quantize", quantize, quantize.quantize),
    ("kv-estimate", kv_estimate, kv_estimate.kv_estimate),
    ("generate", generate, generate.generate),
    ("serve", serve, serve.serve),
    ("bench", bench, bench.bench),
    ("spec-tune", spec_tune, spec_tune.spec_tune),
]

for _name, _module, _function in COMMANDS:
    app.command(_name, epilog=output.examples_epilog(_module.EXAMPLES), cls=getattr(_module, "COMMAND_CLS", None),
                short_help=(_function.__doc__ or "").strip())(output.guarded(_function))   # whole, not cut


def main() -> None:
    app()
