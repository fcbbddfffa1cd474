"""SpeculativeConfig: vLLM's `--speculative-config` keys and defaults, plus our per-batch-size K.

vLLM's keys: method (ngram | draft_model | eagle | eagle3; inferred as draft_model when only a model
is given), model (the draft model or head folder), num_speculative_tokens (required, as vLLM),
prompt_lookup_min / prompt_lookup_max (n-gram; both default to 5 when neither is given, else each
to the other, as vLLM), disable_by_batch_size (speculation off while at least that many requests
run; >= 2). Ours: num_speculative_tokens_by_batch_size, a {batch size: K} map that `llmopt
spec-tune` writes (the entry with the largest batch size <= the running batch applies; 0 = off),
since vLLM has only disable_by_batch_size.

`parse_speculative_config` takes a dict, a JSON string, or the path of a spec_config.json.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmopt import defaults
from llmopt.errors import UserInputError

METHODS = ("ngram", "draft_model", "eagle", "eagle3")


@dataclass
class SpeculativeConfig:
    method: str | None = None
    model: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None
    num_speculative_tokens_by_batch_size: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method is None and self.model is not None:
            self.method = "draft_model"
        if self.method not in METHODS:
            raise UserInputError(f"speculative method {self.method!r}: choose one of {', '.join(METHODS)}")
        if self.num_speculative_tokens is None:
            raise UserInputError("the speculative config needs num_speculative_tokens (draft tokens per step), "
                                 "as vLLM's does")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise UserInputError(f"num_speculative_tokens {self.num_speculative_tokens!r}: give an integer >= 1")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo = hi = defaults.SPEC_PROMPT_LOOKUP
            self.prompt_lookup_min = lo if lo is not None else hi
            self.prompt_lookup_max = hi if hi is not None else lo
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                raise UserInputError(f"prompt_lookup_min {self.prompt_lookup_min} and prompt_lookup_max "
                                     f"{self.prompt_lookup_max}: need 1 <= min <= max")
        elif self.model is None:
            raise UserInputError(f"speculative method {self.method} needs a model (the draft model or head folder)")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 2:
            raise UserInputError(f"disable_by_batch_size {self.disable_by_batch_size}: give at least 2, as vLLM")
        try:
            self.num_speculative_tokens_by_batch_size = {
                int(b): int(k) for b, k in (self.num_speculative_tokens_by_batch_size or {}).items()}
        except (TypeError, ValueError):
            raise UserInputError("num_speculative_tokens_by_batch_size: map batch sizes to K (integers)") from None
        bad = [(b, k) for b, k in self.num_speculative_tokens_by_batch_size.items()
               if b < 1 or not 0 <= k <= self.num_speculative_tokens]
        if bad:
            raise UserInputError(f"num_speculative_tokens_by_batch_size {bad[0][0]}: {bad[0][1]}: batch sizes >= 1, "
                                 f"K in [0, num_speculative_tokens={self.num_speculative_tokens}]")

    def num_tokens_for_batch(self, batch_size: int) -> int:
        """K for a step with `batch_size` running requests (0: speculation off)."""
        if self.disable_by_batch_size is not None and batch_size >= self.disable_by_batch_size:
            return 0
        table = self.num_speculative_tokens_by_batch_size
        if table:
            fits = [b for b in table if b <= batch_size]
            return table[max(fits)] if fits else table[min(table)]
        return self.num_speculative_tokens

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["num_speculative_tokens_by_batch_size"] = {str(b): k for b, k in sorted(
            self.num_speculative_tokens_by_batch_size.items())}
        return {k: v for k, v in d.items() if v is not None and v != {}}


def parse_speculative_config(value: "SpeculativeConfig | dict | str | Path | None") -> SpeculativeConfig | None:
    """A SpeculativeConfig from a dict, a JSON object string or a spec_config.json path (None: None).
    A relative `model` in a file is taken relative to the file's folder when it exists there."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    base = None
    if isinstance(value, (str, Path)):
        text = str(value).strip()
        if not text.startswith("{"):
            p = Path(text).expanduser()
            if p.is_dir():
                p = p / defaults.SPEC_CONFIG_FILE
            if not p.is_file():
                raise UserInputError(f"--speculative-config {text!r}: neither a JSON object nor a spec_config.json file")
            base, text = p.parent, p.read_text()
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserInputError(f"--speculative-config is not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(value, dict):
        raise UserInputError("--speculative-config must be a JSON object")
    known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise UserInputError(f"--speculative-config: unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}")
    value = dict(value)
    if base is not None and value.get("model") and not Path(value["model"]).is_absolute() \
            and (base / value["model"]).exists():
        value["model"] = str(base / value["model"])
    return SpeculativeConfig(**value)


def bench_speculative_config(method: str = "none", model: str | None = None, num_speculative_tokens: int | None = None,
                             config: str | None = None) -> SpeculativeConfig | None:
    """`llmopt bench`'s speculative flags as one config: --speculative-config (JSON or a
    spec_config.json) wins; else --spec METHOD with --spec-model and --num-speculative-tokens
    (default BENCH_SPEC_NUM_TOKENS). None: plain decoding."""
    if config is not None:
        cfg = parse_speculative_config(config)
        if method not in ("none", cfg.method):
            raise UserInputError(f"--spec {method} but --speculative-config says method {cfg.method}: give one")
        return cfg
    if method == "none":
        if model is not None or num_speculative_tokens is not None:
            raise UserInputError("--spec-model and --num-speculative-tokens need --spec METHOD")
        return None
    return SpeculativeConfig(method=method, model=model,
                             num_speculative_tokens=num_speculative_tokens or defaults.BENCH_SPEC_NUM_TOKENS)
