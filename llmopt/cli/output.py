"""One output helper for every command: a rich table for people, one JSON object for pipelines,
a progress bar on stderr, and errors as one red line (traceback with --debug / LLMOPT_DEBUG=1)."""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import math
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import typer
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table
from typer.core import TyperCommand, TyperGroup

from llmopt import fsutil
from llmopt.errors import LLMOptError

# click's exceptions as the installed Typer raises them (recent Typer vendors click as typer._click)
_click = sys.modules[typer.BadParameter.__module__]
_ABORTS = tuple({typer.Abort, getattr(_click, "Abort", typer.Abort)})

out = Console(soft_wrap=True)
err = Console(stderr=True)
DEBUG = {"on": bool(os.environ.get("LLMOPT_DEBUG"))}
EMITTED = {"json": False}   # the command printed its JSON result: an error after it (--require-fit) adds none


def to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    return obj


def dumps(obj: Any) -> str:
    return json.dumps(to_jsonable(obj), ensure_ascii=False)


def emit(result: Any, *, as_json: bool, table: Callable[[Any], Table | Iterable[Table]] | None = None,
         output: str | Path | None = None) -> None:
    """Render a result: JSON (one object on stdout) or the rich table(s); `output` saves the JSON."""
    if output:
        fsutil.write_atomic(output, json.dumps(to_jsonable(result), indent=2, ensure_ascii=False) + "\n")
    if as_json or table is None:
        sys.stdout.write(dumps(result) + "\n")
        sys.stdout.flush()
        EMITTED["json"] = True
        return
    rendered = table(result)
    for t in ([rendered] if isinstance(rendered, Table) else rendered):
        out.print(t)


def kv_table(title: str, rows: Iterable[tuple[str, Any]]) -> Table:
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column("key", style="bold")
    t.add_column("value", justify="right")
    for k, v in rows:
        t.add_row(k, fmt(v))
    return t


def fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e6 or abs(v) < 1e-3):
            return f"{v:.4e}"
        return f"{v:,.4f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


class Advance:
    """What `progress` yields: advance(n) moves the bar; advance.set_total(n) sizes it once the library
    knows (both are plain callbacks, so library functions need no rich)."""

    def __init__(self, bar: Progress | None = None, task: Any = None):
        self._bar, self._task = bar, task

    def __call__(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def set_total(self, total: int | None) -> None:
        if self._bar is not None:
            self._bar.update(self._task, total=total)


@contextmanager
def progress(description: str, total: int | None, *, enabled: bool = True) -> Iterator[Advance]:
    """A progress bar on stderr; yields `advance(n)` (with `.set_total`). Disabled: does nothing."""
    if not enabled:
        yield Advance()
        return
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TimeRemainingColumn(), console=err, transient=False)
    with bar:
        yield Advance(bar, bar.add_task(description, total=total))


def examples_epilog(examples: Iterable[str]) -> str:
    """The Examples section of a command's --help: a heading and one line per example (click's \\b
    keeps the lines as written); examples are kept short enough not to wrap at 80 columns."""
    return "\b\nExamples:\n" + "\n".join(examples)


def fail(message: str, code: int = 2, *, as_json: bool = False, kind: str = "UserInputError") -> None:
    """One red line on stderr and exit `code`; with as_json (--json) also {"error": {message, type,
    exit_code}} on stdout, so a pipeline parses failures like results."""
    message = " ".join(line.strip() for line in str(message).splitlines() if line.strip())  # one line
    if as_json:
        try:
            sys.stdout.write(dumps({"error": {"message": message, "type": kind, "exit_code": code}}) + "\n")
            sys.stdout.flush()
        except (BrokenPipeError, ValueError, AttributeError):   # stdout gone: the red line still tells
            pass
    err.print("[bold red]error:[/] ", end="", highlight=False)
    err.print(message, markup=False, highlight=False, soft_wrap=True)
    raise SystemExit(code)


def _quiet_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null so the interpreter's final flush stays silent."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):   # no real file descriptor (tests, closed stdout)
        pass


def guarded(command: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a command function so its errors become one red line and an exit code (see run_guarded).
    functools.wraps keeps the signature, so Typer still reads the options from it."""
    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return run_guarded(command, *args, **kwargs)
    return wrapper


def run_guarded(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call fn(*args, **kwargs); LLMOptError (exit 2/1/3 by kind), missing or unreadable files (2),
    Ctrl-C (130) and SIGTERM (143, raised like Ctrl-C so the same cleanup runs) become one red line
    on stderr (and the JSON error object on stdout with --json); a broken stdout pipe exits 141
    quietly; anything else is a bug (exit 1). --debug / LLMOPT_DEBUG=1 adds the traceback."""
    fsutil.handle_sigterm()
    as_json = bool(kwargs.get("json_out") or kwargs.get("as_json"))   # the commands' --json parameter
    EMITTED["json"] = False
    try:
        return fn(*args, **kwargs)
    except LLMOptError as e:
        _failed(str(e), e.exit_code, as_json, type(e).__name__)
    except BrokenPipeError:
        _quiet_stdout()          # stdout's reader left (`| head`): stop quietly, as a killed writer would
        raise SystemExit(EXIT_BROKEN_PIPE) from None
    except fsutil.Terminated:
        fail("terminated", 143, as_json=as_json, kind="Terminated")
    except KeyboardInterrupt:
        fail("interrupted", 130, as_json=as_json, kind="Interrupted")
    except Exception as e:   # noqa: BLE001 - a bad path is bad input (exit 2); anything else a bug (exit 1)
        if _is_bad_path(e):
            _failed(_path_message(e), 2, as_json, "UserInputError")
        else:
            _failed(f"unexpected {type(e).__name__}: {e} (llmopt --debug shows the traceback)", 1, as_json,
                    "InternalError")


def _is_bad_path(e: BaseException) -> bool:
    """A file the user named that is missing, of the wrong kind, not readable, or too long a name."""
    return isinstance(e, (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)) or \
        (isinstance(e, OSError) and e.errno == errno.ENAMETOOLONG)


def _path_message(e: OSError) -> str:
    """`strerror: path`, a path of over 80 characters shortened to its start and its length."""
    name = str(e.filename or "")
    if not name:
        return str(e)
    shown = name if len(name) <= 80 else f"{name[:60]}... ({len(name):,} characters)"
    return f"{e.strerror or e}: {shown}"


EXIT_BROKEN_PIPE = 141   # 128 + SIGPIPE: what a shell reports for a writer whose reader left


def _failed(message: str, code: int, as_json: bool, kind: str) -> None:
    """fail(), after the traceback when --debug / LLMOPT_DEBUG=1 asks for it (the exit code stays);
    the JSON error object only when stdout has no JSON result yet (one object per run)."""
    if DEBUG["on"]:
        import traceback
        traceback.print_exc()
    fail(message, code, as_json=as_json and not EMITTED["json"], kind=kind)


def _wants_json(args: list[str]) -> bool:
    """Whether --json is on the command line (before a `--`), for errors click raises while parsing."""
    return "--json" in (args[:args.index("--")] if "--" in args else args)


class Group(TyperGroup):
    """The app's click group: usage errors (a bad flag value, an unknown option) become the same one
    red line (plus the JSON error object with --json) and exit 2 as errors raised by commands."""

    def main(self, args: Any = None, prog_name: Any = None, complete_var: Any = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        argv = list(sys.argv[1:] if args is None else args)
        for name in ("stdout", "stderr"):    # closed (`>&-`): results are dropped, as print() drops them
            if getattr(sys, name) is None:
                setattr(sys, name, open(os.devnull, "w"))
        try:
            rv = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except _click.UsageError as e:
            if type(e).__name__ == "NoArgsIsHelpError":    # plain `llmopt`: Typer has printed the help
                raise SystemExit(e.exit_code) from None
            hint = f" (see {e.ctx.command_path} --help)" if e.ctx is not None else ""
            fail(e.format_message().rstrip(".") + hint, 2, as_json=_wants_json(argv), kind="UsageError")
        except _click.ClickException as e:
            fail(e.format_message(), e.exit_code, as_json=_wants_json(argv), kind=type(e).__name__)
        except _ABORTS:
            fail("interrupted", 130, as_json=_wants_json(argv), kind="Interrupted")
        raise SystemExit(rv if isinstance(rv, int) else 0)


def spread_values(args: list[str], nargs: dict[str, str]) -> list[str]:
    """argparse's nargs ('*' or '+') for the flags in `nargs`, as vLLM's commands take them:
    `--metadata a=1 b=2` -> `--metadata a=1 --metadata b=2`, the values running up to the next
    option or `--`. A '*' flag with no value is dropped (an empty list); a '+' one is left for click
    to refuse."""
    out: list[str] = []
    i = 0
    while i < len(args):
        flag = args[i]
        i += 1
        if flag == "--":
            return out + args[i - 1:]
        if flag not in nargs:
            out.append(flag)
            continue
        start = i
        while i < len(args) and not (args[i].startswith("-") and len(args[i]) > 1):
            out += [flag, args[i]]
            i += 1
        if i == start and nargs[flag] == "+":
            out.append(flag)
    return out


def nargs_command(nargs: dict[str, str]) -> type[TyperCommand]:
    """A command class whose flags in `nargs` take several values after one flag (spread_values);
    a command module hands it to app.py as COMMAND_CLS."""
    class NargsCommand(TyperCommand):
        def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
            return super().parse_args(ctx, spread_values(list(args), nargs))
    return NargsCommand
