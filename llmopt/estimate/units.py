"""Parsing of token counts (`2k` = 2,048) and byte sizes (`8GiB`, `512MiB`, plain bytes)."""

from __future__ import annotations

import re

from llmopt.errors import UserInputError

_TOKEN_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20}
_BYTE_SUFFIX = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000 ** 2,
                "mib": 1 << 20, "g": 1 << 30, "gb": 1000 ** 3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000 ** 4,
                "tib": 1 << 40}
GIB = 1 << 30


def parse_tokens(text: str | int, what: str = "length") -> int:
    """`32768`, `32k` (= 32 * 1024), `1m`, `1.5k` -> a positive token count."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", str(text))
        if not m:
            raise UserInputError(f"bad {what} {text!r}: use a number of tokens such as 4096, 2k or 32k")
        value = float(m.group(1)) * _TOKEN_SUFFIX[m.group(2).lower()]
        if value != int(value):
            raise UserInputError(f"bad {what} {text!r}: not a whole number of tokens")
        value = int(value)
    if value < 1:
        raise UserInputError(f"bad {what} {text!r}: must be at least 1")
    return value


def parse_list(text: str, what: str) -> list[int]:
    parts = [p for p in str(text).split(",") if p.strip()]
    if not parts:
        raise UserInputError(f"bad {what} {text!r}: give a comma-separated list such as 1,8,32")
    return [parse_tokens(p, what) for p in parts]


def parse_bytes(text: str | int) -> int:
    """`8GiB`, `8g` (GiB), `8GB` (10^9), `512MiB`, `1073741824` -> bytes."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _BYTE_SUFFIX:
            raise UserInputError(f"bad size {text!r}: use bytes or a unit, such as 8GiB, 512MiB")
        value = int(float(m.group(1)) * _BYTE_SUFFIX[m.group(2).lower()])
    if value <= 0:
        raise UserInputError(f"bad size {text!r}: must be positive")
    return value
