"""Calibration data: token windows for the algorithms that look at activations.

A source is a text file (.txt, .raw, .tokens, ...), a .jsonl file (the "text" field of each line,
else its first string field), or a Hugging Face dataset spec `name[:config][:split]` (read from
the local cache: llmopt works offline). The texts are joined and tokenized once; `num_samples`
windows of `seq_len` tokens start at random offsets drawn with `seed` (as GPTQ samples WikiText).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from llmopt.errors import DataError, UserInputError


@dataclass
class Calibration:
    ids: torch.Tensor        # [num_samples, seq_len] int64
    source: str
    total_tokens: int        # tokens in the whole source, before sampling


def read_texts(source: str) -> list[str]:
    p = Path(source).expanduser()
    if p.is_file():
        if p.suffix == ".jsonl":
            return _jsonl_texts(p)
        return [p.read_text(encoding="utf-8", errors="replace")]
    if p.exists():
        raise DataError(f"calibration data {p} is not a file")
    if source.startswith((".", "/", "~")) or source.endswith((".txt", ".jsonl", ".raw", ".tokens")):
        raise DataError(f"calibration data {source} not found")
    return _dataset_texts(source)


def _jsonl_texts(p: Path) -> list[str]:
    texts = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{p}:{n} is not valid JSON: {e}") from e
        if isinstance(row, str):
            texts.append(row)
            continue
        text = row.get("text") if isinstance(row, dict) else None
        if text is None and isinstance(row, dict):
            text = next((v for v in row.values() if isinstance(v, str)), None)
        if text is None:
            raise DataError(f"{p}:{n} has no text field")
        texts.append(text)
    if not texts:
        raise DataError(f"{p} has no rows")
    return texts


def _dataset_texts(spec: str) -> list[str]:
    parts = spec.split(":")
    name, config = parts[0], (parts[1] or None) if len(parts) > 1 else None
    split = parts[2] if len(parts) > 2 else "train"
    try:
        import datasets
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:
        raise DataError(f"cannot load the dataset {spec!r} ({e.__class__.__name__}): give a text or .jsonl file, "
                        f"or a dataset in the local cache as name[:config][:split]") from e
    column = "text" if "text" in ds.column_names else next(
        (c for c in ds.column_names if isinstance(ds[0][c], str)), None)
    if column is None:
        raise DataError(f"dataset {spec!r} has no text column")
    return [t for t in ds[column] if t]


def load_calibration(source: str, tokenizer, num_samples: int, seq_len: int, seed: int) -> Calibration:
    if num_samples < 1 or seq_len < 2:
        raise UserInputError("--num-samples must be >= 1 and --seq-len >= 2")
    text = "\n\n".join(read_texts(source))
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    if ids.numel() < seq_len:
        raise DataError(f"calibration data {source} has {ids.numel()} tokens, fewer than --seq-len {seq_len}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len + 1, (num_samples,), generator=g)
    windows = torch.stack([ids[s:s + seq_len] for s in starts.tolist()])
    return Calibration(ids=windows.long(), source=source, total_tokens=int(ids.numel()))
