"""Evaluation text: `llmopt.data` reads it (the reader quantize's calibration uses too); this module
adds eval-ppl's defaults (WikiText-2 test, split test) and lm-evaluation-harness's wikitext helpers.

A dataset is one evaluation text (what `sliding`, `chunks` and `llamacpp` tokenize as one stream)
plus its documents (what `rolling` scores one by one, as lm-evaluation-harness does).
"""

from __future__ import annotations

import re

from llmopt import defaults
from llmopt.data import TextDataset, read_dataset, wikitext_documents

__all__ = ["TextDataset", "load_text_dataset", "wikitext_detokenize", "wikitext_documents", "word_count"]


def load_text_dataset(spec: str | None = None, text_field: str = defaults.TEXT_FIELD) -> TextDataset:
    """eval-ppl's --dataset: `spec` (default WikiText-2 test) read by llmopt.data, split test by default."""
    return read_dataset(spec or defaults.PPL_DATASET, text_field, defaults.PPL_SPLIT)


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
