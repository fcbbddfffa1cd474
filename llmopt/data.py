"""The one dataset reader: what `eval-ppl --dataset` and `quantize --calib-data` read.

A source is
  - a text file (strict UTF-8, universal newlines: CRLF and CR become LF), one text; its text with
    the line ends as stored is kept beside it (`as_stored`: llama.cpp's perplexity reads the bytes);
  - a `.jsonl` file: one JSON object per non-blank line, its `text_field` (default "text") a string;
  - a Hugging Face dataset `path[:config[:split]]`, read offline from the local cache, its
    `text_field` column; the split defaults per command (eval-ppl: test, quantize: train).
A relative path is taken from the working directory, else from the project root, so the default
`../shared/data/...` is found wherever llmopt is run from inside a checkout.

The result is one text (the rows joined with a blank line, as GPTQ and the HF perplexity guide
join them) plus its documents (what lm-evaluation-harness's rolling protocol scores one by one).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from llmopt.errors import DataError

_LOCAL_SUFFIXES = (".txt", ".raw", ".jsonl", ".tokens")


@dataclass
class TextDataset:
    name: str
    text: str                                   # the whole text
    documents: list[str] = field(default_factory=list)
    as_stored: str | None = None                # a text file's text with its line ends as stored


@dataclass
class HubDataset:
    path: str
    config: str | None
    split: str


def resolve_data_path(spec: str) -> Path:
    """A relative path is taken from the working directory, else from the project root."""
    p = Path(spec).expanduser()
    if p.exists() or p.is_absolute():
        return p
    alt = Path(__file__).resolve().parents[1] / spec
    return alt if alt.exists() else p


def hub_dataset(spec: str, default_split: str) -> HubDataset:
    """`path[:config[:split]]` -> its parts; an empty or missing split is `default_split`."""
    parts = spec.split(":")
    if len(parts) > 3 or not parts[0]:
        raise DataError(f"dataset {spec!r}: give a Hugging Face dataset as path[:config[:split]]")
    config = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 and parts[2] else default_split
    return HubDataset(parts[0], config, split)


def read_dataset(spec: str, text_field: str, default_split: str) -> TextDataset:
    """Read `spec` (see the module docstring); `default_split` is the command's Hugging Face split."""
    p = resolve_data_path(spec)
    if p.is_dir():
        raise DataError(f"{p} is a folder: give a text file, a .jsonl file or a Hugging Face dataset name")
    if p.is_file():
        if p.suffix == ".jsonl":
            return _from_rows(str(p), _jsonl_rows(p, text_field), text_field)
        stored = read_text_file(p, universal_newlines=False)
        text = _universal_newlines(stored)
        return TextDataset(str(p), text, wikitext_documents(text), as_stored=stored)
    if spec.startswith((".", "/", "~")) or Path(spec).suffix in _LOCAL_SUFFIXES or spec.count(":") > 2:
        raise DataError(f"dataset file {spec!r} not found: give a text file, a .jsonl file (with --text-field) "
                        "or a Hugging Face dataset as path[:config[:split]]")
    hub = hub_dataset(spec, default_split)
    return _from_rows(spec, _hub_rows(spec, hub, text_field), text_field)


def _decode(p: Path, universal_newlines: bool = True) -> str:
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{p} is not UTF-8 text ({e.reason} at byte {e.start}: 0x{raw[e.start]:02x})") from e
    return _universal_newlines(text) if universal_newlines else text


def _universal_newlines(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read_text_file(p: Path, universal_newlines: bool = True) -> str:
    text = _decode(p, universal_newlines)
    if not text.strip():
        raise DataError(f"{p} is empty")
    return text


def read_jsonl(p: Path) -> list[tuple[str, object]]:
    """(where, value) for each non-empty line of a strict UTF-8 `.jsonl` file; `where` is `file:line`."""
    rows = []
    for n, line in enumerate(_decode(p).split("\n"), 1):
        if not line.strip():
            continue
        try:
            rows.append((f"{p}:{n}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise DataError(f"{p}:{n} is not valid JSON: {e.msg}") from e
    return rows


def _jsonl_rows(p: Path, text_field: str) -> list[str]:
    return [_field(row, text_field, where) for where, row in read_jsonl(p)]


def _field(row, text_field: str, where: str) -> str:
    if not isinstance(row, dict):
        raise DataError(f"{where} is a JSON {type(row).__name__}, not an object with a {text_field!r} field")
    if text_field not in row:
        raise DataError(f"{where} has no field {text_field!r} (fields: {', '.join(sorted(row))}); use --text-field")
    value = row[text_field]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {text_field!r} is a {type(value).__name__}, not a string; use --text-field")
    return value


def _hub_rows(spec: str, hub: HubDataset, text_field: str) -> list[str]:
    # llmopt works offline: only the local Hugging Face cache is consulted.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
        rows = datasets.load_dataset(hub.path, hub.config, split=hub.split)
    except Exception as e:  # datasets raises many types (ConnectionError, FileNotFoundError, ValueError)
        raise DataError(f"dataset {spec!r} (split {hub.split}) is not a local file and could not be loaded from the "
                        f"local Hugging Face cache ({e.__class__.__name__}); give a text file or download the "
                        "dataset first") from e
    return [_field(row, text_field, f"{spec} row {i}") for i, row in enumerate(rows)]


def _from_rows(name: str, texts: list[str], text_field: str) -> TextDataset:
    if not any(t.strip() for t in texts):
        raise DataError(f"{name}: no text in field {text_field!r}")
    # rolling scores each row as a document, except WikiText's line rows, which are regrouped into
    # pages at their headings
    docs = [t for t in texts if t.strip()]
    if "wikitext" in name.lower() and text_field == "text":
        pages = wikitext_documents("".join(texts))
        docs = pages if len(pages) > 1 else docs
    return TextDataset(name, "\n\n".join(texts), docs)


def wikitext_documents(text: str) -> list[str]:
    """Split at top-level ` = Title = ` headings the way EleutherAI/wikitext_document_level builds its
    `page` field (lines joined with LF, the heading line starting its page). Text without such
    headings is one document."""
    pages, cur = [], []
    for line in text.split("\n"):
        r = line.replace("= = =", "===").replace("= =", "==").strip()
        if r.startswith("= ") and r.endswith(" ="):
            page = "\n".join(cur)
            if page.strip():
                pages.append(page)
            cur = []
        cur.append(line)
    pages.append("\n".join(cur))
    return [p for p in pages if p.strip()] or [text]
