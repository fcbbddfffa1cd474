"""Benchmark workloads: what each request sends and how many tokens it asks for.

- `random` (vLLM's RandomDataset meaning): input lengths drawn uniformly from
  [len·(1−r), len·(1+r)] (r = --random-range-ratio), the same for outputs, plus
  --random-prefix-len tokens shared by every prompt (added to the drawn length). Prompts are random
  token ids decoded to text and re-encoded until the text is *exactly* the drawn number of tokens
  as the server counts them (`tokenizer(text).input_ids`, special tokens included).
- `sharegpt`: a ShareGPT-format JSON (a list of {"conversations": [{"from", "value"}, ...]}); the
  first human turn is the prompt, the reply's token count the output length (or
  --sharegpt-output-len), filtered as vLLM does (>= 4 tokens each, prompt <= 1024, both <= 2048);
  shuffled by --seed.
- `spec_bench`: Spec-Bench's question.jsonl (first turns, categories kept for per-category
  tables), shuffled by --seed; --spec-bench-output-len tokens each.
- `prefix_repetition` (vLLM's PrefixRepetitionRandomDataset): --prefix-repetition-num-prefixes
  random prefixes of --prefix-repetition-prefix-len tokens, each starting an equal share of the
  prompts (shuffled by --seed), each prompt then --prefix-repetition-suffix-len random tokens of
  its own; --prefix-repetition-output-len tokens each: shared system prompts, for prefix caching.
- `prompts` (vLLM's `custom`): a UTF-8 text file, one prompt a line, or a .jsonl whose rows hold a
  "prompt" string; --custom-output-len tokens each, in file order.
A dataset with fewer usable prompts than --num-prompts is repeated in order.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmopt import defaults
from llmopt.data import read_jsonl, resolve_data_path
from llmopt.errors import DataError, UserInputError
from llmopt.validate import decode_utf8

DATASETS = ("random", "sharegpt", "spec_bench", "prompts", "prefix_repetition")
_ALIASES = {"custom": "prompts", "spec-bench": "spec_bench"}
_MAX_FIT_ROUNDS = 32


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int                 # tokens of `prompt` as the server counts them (special tokens included)
    expected_output_len: int        # max_tokens of the request
    category: str | None = None     # spec_bench's category


@dataclass
class Workload:
    dataset_name: str = defaults.BENCH_DATASET
    dataset_path: str | None = None
    num_prompts: int | None = None            # None: BENCH_NUM_PROMPTS (a prompts file: all of its lines)
    seed: int = defaults.BENCH_SEED
    random_input_len: int = defaults.BENCH_RANDOM_INPUT_LEN
    random_output_len: int = defaults.BENCH_RANDOM_OUTPUT_LEN
    random_range_ratio: float = defaults.BENCH_RANDOM_RANGE_RATIO
    random_prefix_len: int = defaults.BENCH_RANDOM_PREFIX_LEN
    sharegpt_output_len: int | None = None
    spec_bench_output_len: int = defaults.BENCH_SPEC_BENCH_OUTPUT_LEN
    spec_bench_category: str | None = None
    custom_output_len: int = defaults.BENCH_CUSTOM_OUTPUT_LEN
    prefix_repetition: tuple[int, int, int, int] = defaults.BENCH_PREFIX_REPETITION   # prefix, suffix, prefixes, output

    def __post_init__(self) -> None:
        self.dataset_name = _ALIASES.get(self.dataset_name, self.dataset_name)
        if self.dataset_name not in DATASETS:
            raise UserInputError(f"--dataset-name {self.dataset_name!r}: use one of {', '.join(DATASETS)}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise UserInputError("--num-prompts must be at least 1")
        if not 0 <= self.random_range_ratio < 1:
            raise UserInputError(f"--random-range-ratio {self.random_range_ratio}: use a value in [0, 1)")
        if self.random_input_len < 1 or self.random_output_len < 1:
            raise UserInputError("--random-input-len and --random-output-len must be at least 1")
        if self.random_prefix_len < 0:
            raise UserInputError("--random-prefix-len must be >= 0")
        if min(self.prefix_repetition) < 1:
            raise UserInputError("--prefix-repetition-prefix-len, -suffix-len, -num-prefixes and -output-len must be "
                                 "at least 1")
        if self.dataset_name in ("sharegpt", "prompts") and not self.dataset_path:
            raise UserInputError(f"--dataset-name {self.dataset_name} needs --dataset-path FILE")


def load_tokenizer(name: str | None):
    """The tokenizer of a model name as llmopt resolves it (folder, .gguf, HF id in the cache, built-in)."""
    # deferred: llmopt.models imports torch and the model code, which importing llmopt.bench does not need
    from llmopt.models.loader import load_tokenizer as _load, resolve_checkpoint
    return _load(resolve_checkpoint(name))


def num_special_tokens(tokenizer) -> int:
    """Tokens the tokenizer adds around a text (a BOS, say)."""
    return len(tokenizer("hello").input_ids) - len(tokenizer("hello", add_special_tokens=False).input_ids)


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text).input_ids)


def sample_requests(workload: Workload, tokenizer) -> list[SampleRequest]:
    """The requests `workload` describes (see the module doc)."""
    if tokenizer is None:
        raise UserInputError("the workload needs a tokenizer: give --tokenizer (or a --model that has one)")
    name = workload.dataset_name
    if name == "random":
        w = workload
        return random_requests(tokenizer, w.num_prompts or defaults.BENCH_NUM_PROMPTS, w.random_input_len,
                               w.random_output_len, w.random_range_ratio, w.random_prefix_len, w.seed)
    if name == "prefix_repetition":
        return prefix_repetition_requests(tokenizer, workload.num_prompts or defaults.BENCH_NUM_PROMPTS,
                                          *workload.prefix_repetition, workload.seed)
    if name == "sharegpt":
        reqs = sharegpt_requests(tokenizer, _path(workload.dataset_path), workload.sharegpt_output_len, workload.seed)
        return _take(reqs, workload.num_prompts or defaults.BENCH_NUM_PROMPTS, workload.dataset_path)
    if name == "spec_bench":
        path = _path(workload.dataset_path or defaults.BENCH_SPEC_BENCH_PATH)
        reqs = spec_bench_requests(tokenizer, path, workload.spec_bench_output_len, workload.spec_bench_category, workload.seed)
        return _take(reqs, workload.num_prompts or defaults.BENCH_NUM_PROMPTS, str(path))
    reqs = prompt_file_requests(tokenizer, _path(workload.dataset_path), workload.custom_output_len)
    return _take(reqs, workload.num_prompts or len(reqs), workload.dataset_path)


def _path(arg: str) -> Path:
    p = resolve_data_path(arg)
    if not p.is_file():
        raise DataError(f"--dataset-path {arg}: no such file")
    return p


def _take(reqs: list[SampleRequest], n: int, source: str | None) -> list[SampleRequest]:
    if not reqs:
        raise DataError(f"{source}: no usable prompt in it")
    return [reqs[i % len(reqs)] for i in range(n)]


# -- random ------------------------------------------------------------------------------------------
def length_range(length: int, ratio: float) -> tuple[int, int]:
    """[len·(1−r), len·(1+r)] in whole tokens, at least 1."""
    return max(1, math.floor(length * (1 - ratio))), max(1, math.ceil(length * (1 + ratio)))


def _allowed_ids(tokenizer) -> np.ndarray:
    special = set(tokenizer.all_special_ids or [])
    return np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)


def _word_starts(tokenizer, allowed: np.ndarray) -> np.ndarray:
    """Tokens that decode to a space and a word: after a shared prefix, they keep its tokens intact."""
    texts = tokenizer.batch_decode([[int(i)] for i in allowed])
    return np.array([i for i, t in zip(allowed.tolist(), texts) if len(t) > 1 and t[0] == " " and t[1].isalnum()],
                    dtype=np.int64)


def fit_text(tokenizer, ids: list[int], target: int, rng: np.random.Generator, allowed: np.ndarray,
             keep: int = 0) -> tuple[str, list[int]]:
    """A text that encodes (without special tokens) to exactly `target` tokens, starting from the
    token ids `ids`: decode, re-encode, cut or extend with random ids, until stable. The first `keep`
    tokens (a shared prefix) are never replaced."""
    ids = list(ids)
    for _ in range(_MAX_FIT_ROUNDS):
        text = tokenizer.decode(ids)
        enc = list(tokenizer(text, add_special_tokens=False).input_ids)
        if len(enc) == target:
            return text, enc
        if len(enc) > target:
            ids = enc[:target]
        else:
            ids = enc + [int(x) for x in rng.choice(allowed, target - len(enc))]
        if keep and ids[:keep] != enc[:keep]:
            ids[:keep] = enc[:keep]
    raise DataError(f"could not make a prompt of exactly {target} tokens with this tokenizer "
                    f"(decode and re-encode do not settle)")


def random_requests(tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    prefix_len: int = 0, seed: int = 0) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    allowed = _allowed_ids(tokenizer)
    special = num_special_tokens(tokenizer)
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    input_lens = rng.integers(in_lo, in_hi + 1, size=num_prompts)
    output_lens = rng.integers(out_lo, out_hi + 1, size=num_prompts)
    prefix: list[int] = []
    starts = np.array([], dtype=np.int64)
    if prefix_len:
        starts = _word_starts(tokenizer, allowed)
        _, prefix = fit_text(tokenizer, [int(x) for x in rng.choice(allowed, prefix_len)], prefix_len, rng, allowed)
    out = []
    for n_in, n_out in zip(input_lens.tolist(), output_lens.tolist()):
        target = prefix_len + n_in - special     # the server adds the special tokens back
        if target < 1:
            raise UserInputError(f"--random-input-len {input_len}: too short for this tokenizer, which adds "
                                 f"{special} special token(s) to every prompt")
        ids = prefix + [int(x) for x in rng.choice(allowed, target - len(prefix))]
        if prefix and len(ids) > len(prefix) and len(starts):   # a word start after the prefix: no merge across
            ids[len(prefix)] = int(rng.choice(starts))
        text, _ = fit_text(tokenizer, ids, target, rng, allowed, keep=len(prefix))
        out.append(SampleRequest(text, target + special, int(n_out)))
    return out


def prefix_repetition_requests(tokenizer, num_prompts: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                               output_len: int, seed: int = 0) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    allowed = _allowed_ids(tokenizer)
    starts = _word_starts(tokenizer, allowed)
    special = num_special_tokens(tokenizer)
    target = prefix_len + suffix_len - special
    if suffix_len <= special:
        raise UserInputError(f"--prefix-repetition-suffix-len {suffix_len}: too short for this tokenizer, which adds "
                             f"{special} special token(s) to every prompt")
    out = []
    for i in range(num_prefixes):
        share = num_prompts // num_prefixes + (i < num_prompts % num_prefixes)
        _, prefix = fit_text(tokenizer, [int(x) for x in rng.choice(allowed, prefix_len)], prefix_len, rng, allowed)
        for _ in range(share):
            ids = prefix + [int(x) for x in rng.choice(allowed, target - prefix_len)]
            if len(starts):   # a word start after the prefix: no merge across
                ids[prefix_len] = int(rng.choice(starts))
            text, _ = fit_text(tokenizer, ids, target, rng, allowed, keep=prefix_len)
            out.append(SampleRequest(text, target + special, output_len))
    rng.shuffle(out)
    return out


# -- files ---------------------------------------------------------------------------------------------
def _read_text(path: Path) -> str:
    return decode_utf8(path.read_bytes(), str(path))


def _jsonl(path: Path) -> list[dict]:
    rows = []
    for where, row in read_jsonl(path):
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object")
        rows.append(row)
    return rows


def sharegpt_requests(tokenizer, path: Path, output_len: int | None = None, seed: int = 0) -> list[SampleRequest]:
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not a ShareGPT JSON file ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: a ShareGPT file is a JSON list of {{\"conversations\": [...]}} objects")
    convs = [d["conversations"] for d in data if isinstance(d, dict) and isinstance(d.get("conversations"), list)
             and len(d["conversations"]) >= 2]
    random.Random(seed).shuffle(convs)
    out = []
    for conv in convs:
        first, reply = conv[0], conv[1]
        if not (isinstance(first, dict) and isinstance(reply, dict)):
            continue
        prompt, completion = first.get("value"), reply.get("value")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            continue
        p_len = count_tokens(tokenizer, prompt)
        o_len = output_len or len(tokenizer(completion, add_special_tokens=False).input_ids)
        least = defaults.BENCH_SHAREGPT_MIN_LEN
        short = p_len < least or (output_len is None and o_len < least)
        too_long = p_len > defaults.BENCH_SHAREGPT_MAX_PROMPT_LEN or \
            p_len + o_len > defaults.BENCH_SHAREGPT_MAX_TOTAL_LEN
        if short or too_long:
            continue
        out.append(SampleRequest(prompt, p_len, o_len))
    return out


def spec_bench_requests(tokenizer, path: Path, output_len: int, category: str | None = None,
                        seed: int = 0) -> list[SampleRequest]:
    rows = _jsonl(path)
    out = []
    for row in rows:
        turns = row.get("turns")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise DataError(f"{path}: question {row.get('question_id')} has no first turn (a \"turns\" list)")
        cat = row.get("category")
        if category is not None and cat != category:
            continue
        out.append(SampleRequest(turns[0], count_tokens(tokenizer, turns[0]), output_len,
                                 str(cat) if cat is not None else None))
    if category is not None and not out:
        cats = sorted({str(r.get("category")) for r in rows})
        raise UserInputError(f"--spec-bench-category {category!r}: not in {path} (it has {', '.join(cats)})")
    random.Random(seed).shuffle(out)
    return out


def prompt_file_requests(tokenizer, path: Path, output_len: int) -> list[SampleRequest]:
    if path.suffix == ".jsonl":
        prompts = []
        for i, row in enumerate(_jsonl(path), 1):
            if not isinstance(row.get("prompt"), str):
                raise DataError(f"{path}: row {i} has no \"prompt\" string")
            prompts.append(row["prompt"])
    else:
        prompts = [line for line in _read_text(path).splitlines() if line.strip()]
    return [SampleRequest(p, count_tokens(tokenizer, p), output_len) for p in prompts]
