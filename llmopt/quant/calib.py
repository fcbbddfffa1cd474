"""Calibration data: token windows for the algorithms that look at activations.

The source is read by `llmopt.data` (the reader eval-ppl uses: a text file, a .jsonl with its text
field, or a Hugging Face dataset `path[:config[:split]]` from the local cache, split train by
default). Its text is tokenized once; `num_samples` windows of `seq_len` tokens start at random
offsets drawn with `seed` (as GPTQ samples WikiText).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt import defaults
from llmopt.data import TextDataset, read_dataset
from llmopt.errors import DataError, UserInputError


@dataclass
class Calibration:
    ids: torch.Tensor        # [num_samples, seq_len] int64
    source: str
    total_tokens: int        # tokens in the whole source, before sampling


def read_calibration_text(source: str, text_field: str = defaults.TEXT_FIELD) -> TextDataset:
    """quantize's --calib-data: `source` read by llmopt.data, split train by default."""
    return read_dataset(source, text_field, defaults.CALIB_SPLIT)


def load_calibration(source: str, tokenizer, num_samples: int, seq_len: int, seed: int,
                     text_field: str = defaults.TEXT_FIELD) -> Calibration:
    if num_samples < 1 or seq_len < 2:
        raise UserInputError("--num-samples must be >= 1 and --seq-len >= 2")
    text = read_calibration_text(source, text_field).text
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    if ids.numel() < seq_len:
        raise DataError(f"calibration data {source} has {ids.numel()} tokens, fewer than --seq-len {seq_len}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len + 1, (num_samples,), generator=g)
    windows = torch.stack([ids[s:s + seq_len] for s in starts.tolist()])
    return Calibration(ids=windows.long(), source=source, total_tokens=int(ids.numel()))
