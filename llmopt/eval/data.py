"""Evaluation text: a local text file, a .jsonl with a text field, or a Hugging Face dataset
(`path:config:split`, read offline from the local cache).

A dataset is one evaluation text (what `sliding`, `chunks` and `llamacpp` tokenize as one stream)
plus its documents (what `rolling` scores one by one, as lm-evaluation-harness does).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from llmopt import defaults
from llmopt.errors import DataError


@dataclass
class TextDataset:
    name: str
    text: str                                   # the whole evaluation text
    documents: list[str] = field(default_factory=list)


def resolve_default_path(spec: str) -> Path:
    """A relative path is taken from the working directory, else from the project root (so the
    default `../shared/data/...` works wherever llmopt is run from inside a checkout)."""
    p = Path(spec).expanduser()
    if p.exists() or p.is_absolute():
        return p
    alt = Path(__file__).resolve().parents[2] / spec
    return alt if alt.exists() else p


def load_text_dataset(spec: str | None = None, text_field: str = "text") -> TextDataset:
    spec = spec or defaults.PPL_DATASET
    p = resolve_default_path(spec)
    if p.is_dir():
        raise DataError(f"{p} is a folder: give a text file, a .jsonl file or a Hugging Face dataset name")
    if p.is_file():
        if p.suffix == ".jsonl":
            return _from_rows(str(p), _jsonl_rows(p), text_field)
        text = _read_text(p)
        return TextDataset(str(p), text, wikitext_documents(text))
    looks_local = spec.startswith((".", "/", "~")) or Path(spec).suffix in (".txt", ".raw", ".jsonl", ".tokens")
    if looks_local or spec.count(":") > 2:
        raise DataError(f"dataset file {spec!r} not found: give a text file, a .jsonl file (with --text-field) "
                        "or a Hugging Face dataset as path:config:split")
    return _from_rows(spec, _hf_rows(spec), text_field)


def _read_text(p: Path) -> str:
    try:
        with open(p, encoding="utf-8", newline=None) as f:  # universal newlines: CRLF -> LF
            text = f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{p} is not UTF-8 text ({e.reason} at byte {e.start})") from e
    if not text.strip():
        raise DataError(f"{p} is empty")
    return text


def _jsonl_rows(p: Path) -> list[dict]:
    rows = []
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{n} is not valid JSON: {e.msg}") from e
    return rows


def _hf_rows(spec: str):
    parts = spec.split(":")
    name, config, split = parts[0], (parts[1] if len(parts) > 1 and parts[1] else None), \
        (parts[2] if len(parts) > 2 and parts[2] else "test")
    # llmopt works offline: only the local Hugging Face cache is consulted.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
        return datasets.load_dataset(name, config, split=split)
    except Exception as e:  # datasets raises many types (ConnectionError, FileNotFoundError, ValueError)
        raise DataError(f"dataset {spec!r} is not a local file and could not be loaded from the local Hugging Face "
                        f"cache ({e.__class__.__name__}); give a text file or download the dataset first") from e


def _from_rows(name: str, rows, text_field: str) -> TextDataset:
    texts = []
    for i, row in enumerate(rows):
        if text_field not in row:
            keys = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
            raise DataError(f"{name}: row {i} has no field {text_field!r} (fields: {keys}); use --text-field")
        texts.append(str(row[text_field]))
    if not any(t.strip() for t in texts):
        raise DataError(f"{name}: no text in field {text_field!r}")
    # GPTQ / the HF perplexity guide join rows with a blank line; rolling scores each row as a
    # document, except WikiText's line rows, which are regrouped into pages at their headings
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


def wikitext_detokenize(s: str) -> str:
    """lm-evaluation-harness's wikitext detokenizer (applied to the text that is scored)."""
    s = s.replace("s '", "s'")
    s = re.sub(r"/' [0-9]/", r"/'[0-9]/", s)
    for a, b in ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."), (" : ", ": "), (" ; ", "; "),
                 (" . ", ". "), (" ! ", "! "), (" ? ", "? "), (" , ", ", ")):
        s = s.replace(a, b)
    s = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", s)
    s = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", s)
    s = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", s)
    s = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', s)
    s = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", s)
    for a, b in (("= = = =", "===="), ("= = =", "==="), ("= =", "=="), (" \u00b0 ", "\u00b0"),
                 (" \n", "\n"), ("\n ", "\n"), (" N ", " 1 "), (" 's", "'s")):
        s = s.replace(a, b)
    return s


def word_count(page: str) -> int:
    """Words as lm-evaluation-harness counts them on the raw page (before detokenizing)."""
    return len(re.split(r"\s+", page))
