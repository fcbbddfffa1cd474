"""Sizes and token counts typed on the command line: one parser for every flag that takes bytes
(`parse_bytes`), one for every flag that takes a number of tokens (`parse_tokens`, `parse_list`).

Byte sizes accept what vLLM's `--kv-cache-memory-bytes` accepts, with the same meaning, and the
spelled-out units:
  plain bytes                       1073741824
  KB MB GB TB   (any case)          powers of 10:  8GB = 8 * 10^9
  KiB MiB GiB TiB   (any case)      powers of 2:   8GiB = 8 * 2^30
  k m g t   (lower case letter)     powers of 10, as vLLM:  8g = 8 * 10^9, 1.5g = 1.5 * 10^9
  K M G T   (upper case letter)     powers of 2, as vLLM:   8G = 8 * 2^30 (whole numbers only, as vLLM)
Decimals are exact (1.001k is 1,001 bytes) and a fractional byte is dropped.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from llmopt.errors import UserInputError

KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

# spelled-out units, matched in any case
_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": KIB, "mib": MIB, "gib": GIB, "tib": TIB}
# vLLM's single letters (vllm/utils/argparse_utils.py: human_readable_int), case-sensitive
_DECIMAL_LETTERS = {"k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12}
_BINARY_LETTERS = {"K": KIB, "M": MIB, "G": GIB, "T": TIB}

SIZE_HELP = "8GiB or 8G = 8x2^30 bytes, 8GB or 8g = 8x10^9 (vLLM's letters), or plain bytes"

_TOKEN_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20}


def _split(text: str | int, what: str, units: str, example: str) -> tuple[str, str] | int:
    """An int as it is; else `(number, unit)` from text such as `1.5 GiB` (units: a regex)."""
    if isinstance(text, bool):
        raise UserInputError(f"bad {what} {text!r}: give {example}")
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(" + units + r")\s*", str(text))
    if not m:
        raise UserInputError(f"bad {what} {text!r}: give {example}")
    return m.group(1), m.group(2)


def parse_bytes(text: str | int, what: str = "size") -> int:
    """A positive number of bytes from `text` (see the module docstring for the units)."""
    parts = _split(text, what, "[A-Za-z]*", "a size such as 8GiB, 512MiB or 8G, or plain bytes")
    if isinstance(parts, int):
        value = parts
    else:
        number, unit = parts
        if unit in _BINARY_LETTERS and "." in number:
            raise UserInputError(f"bad {what} {text!r}: K, M, G and T take whole numbers (as in vLLM); "
                                 f"write {number}{unit}iB, or {number}{unit.lower()} for powers of 10")
        if unit in _DECIMAL_LETTERS or unit in _BINARY_LETTERS:
            mult = _DECIMAL_LETTERS.get(unit) or _BINARY_LETTERS[unit]
        elif unit.lower() in _UNITS:
            mult = _UNITS[unit.lower()]
        else:
            raise UserInputError(f"bad {what} {text!r}: unknown unit {unit!r}; use KB/MB/GB/TB (10^3..), "
                                 "KiB/MiB/GiB/TiB (2^10..), vLLM's k/m/g/t (10^3..) or K/M/G/T (2^10..)")
        if mult == 1 and "." in number:
            raise UserInputError(f"bad {what} {text!r}: plain bytes are a whole number")
        value = math.floor(Fraction(number) * mult)
    if value <= 0:
        raise UserInputError(f"bad {what} {text!r}: must be positive")
    return value


def parse_tokens(text: str | int, what: str = "length") -> int:
    """`32768`, `32k` (= 32 * 1024), `1m`, `1.5k` -> a positive token count."""
    parts = _split(text, what, "[kKmM]?", "a number of tokens such as 4096, 2k or 32k")
    if isinstance(parts, int):
        value = parts
    else:
        fraction = Fraction(parts[0]) * _TOKEN_SUFFIX[parts[1].lower()]
        if fraction.denominator != 1:
            raise UserInputError(f"bad {what} {text!r}: not a whole number of tokens")
        value = int(fraction)
    if value < 1:
        raise UserInputError(f"bad {what} {text!r}: must be at least 1")
    return value


def parse_list(text: str, what: str) -> list[int]:
    """`1,8,32` or `2k,8k` -> token counts (see parse_tokens)."""
    parts = [p for p in str(text).split(",") if p.strip()]
    if not parts:
        raise UserInputError(f"bad {what} {text!r}: give a comma-separated list such as 1,8,32")
    return [parse_tokens(p, what) for p in parts]
