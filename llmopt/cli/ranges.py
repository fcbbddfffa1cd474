"""Ranges of numeric flags, checked while the command line is parsed: a value outside is a usage
error (exit 2) that says what was given and what is allowed, before any model is loaded.

`in_range(...)` makes a Typer option callback; `RANGE` texts go into the flags' help, so --help
documents each range. Ranges that depend on the model (a context length, a group size that must
divide the layers) are checked by the library once the model is known."""

from __future__ import annotations

import math
from typing import Any, Callable

import typer


def describe(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False,
             allow: tuple = ()) -> str:
    """The allowed values in words: `1 to 20`, `> 0`, `(0, 1]`, `-1 or >= 1`..."""
    if lo is not None and hi is not None:
        text = f"{lo} to {hi}" if not (lo_open or hi_open) else \
            f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    elif lo is not None:
        text = f"{'>' if lo_open else '>='} {lo}"
    elif hi is not None:
        text = f"{'<' if hi_open else '<='} {hi}"
    else:
        text = "any finite number"
    return " or ".join([*(str(a) for a in allow), text])


def in_range(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False,
             allow: tuple = ()) -> Callable[[Any], Any]:
    """A Typer callback accepting None, the values in `allow`, and finite numbers in the range
    (each element of a repeatable option); anything else is typer.BadParameter."""
    allowed = describe(lo, hi, lo_open=lo_open, hi_open=hi_open, allow=allow)

    def check(value: Any) -> Any:
        if value is None:
            return value
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v in allow and not isinstance(v, bool):
                continue
            bad = (isinstance(v, float) and not math.isfinite(v)) \
                or (lo is not None and (v <= lo if lo_open else v < lo)) \
                or (hi is not None and (v >= hi if hi_open else v > hi))
            if bad:
                raise typer.BadParameter(f"{v} is out of range: use {allowed}")
        return value

    return check
