"""`llmopt spec-tune`'s training data, from the target itself (`build_data`; the head trains on it in
train.py).

Prompts made from a text (`llmopt.data.read_dataset`: passages of the text, as chat prompts with an
instruction when the tokenizer has a chat template, else the plain passage); the target's own greedy
answers to them (the engine, batched); and one forward of the target over prompt + answer with
`capture_hidden`, keeping per token the target's feature (EAGLE-1: the final hidden state; EAGLE-3:
the hidden states entering layers 2, L/2, L-3, concatenated) and its greedy choice (the argmax of its
logits: what verification accepts); the same for sequences of the text itself (no answer: the
target's choices on real text, cheap). Written in parts under `DIR/data/` as they are made, so an
interrupted run keeps what it made.
"""

from __future__ import annotations

import io
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from llmopt import defaults, fsutil
from llmopt.engine.llm import LLM
from llmopt.core.sampling_params import SamplingParams
from llmopt.errors import DataError, UserInputError
from llmopt.models.attention import DenseCausalAttention
from llmopt.speculative.eagle import eagle3_layers

# progress(phase, total, advance): a new phase starts with its total (None: unknown), then advances
Progress = Callable[[str, "int | None", int], None]
DATA_DIR = "data"
TEXT_PART = 64          # text sequences per data part
CHECKPOINT = "checkpoint.pt"


def _noop(phase: str, total: int | None = None, advance: int = 0) -> None:
    pass


# -- prompts ------------------------------------------------------------------------------------------

def paragraphs(text: str, min_chars: int) -> list[str]:
    """The text's paragraphs (lines, headings skipped), a short one joined with the next until it has
    at least `min_chars` characters."""
    paras, cur = [], ""
    for line in text.split("\n"):
        s = line.strip()
        if not s or (s.startswith("=") and s.endswith("=")):
            continue
        cur = f"{cur} {s}".strip()
        if len(cur) >= min_chars:
            paras.append(cur)
            cur = ""
    if cur:
        paras.append(cur)
    return paras


def pick_passages(text: str, tokenizer, n: int, tokens: int, seed: int) -> list[tuple[int, str]]:
    """`n` passages of the text of about `tokens` tokens each, from distinct paragraphs (cut at `tokens`
    tokens), shuffled by `seed`: (paragraph index, passage)."""
    paras = paragraphs(text, 4 * tokens)     # about 4 characters a token: long enough to cut
    order = list(range(len(paras)))
    random.Random(seed).shuffle(order)
    out = []
    for i in order:
        ids = tokenizer(paras[i], add_special_tokens=False).input_ids[:tokens]
        if len(ids) >= max(8, tokens // 2):
            out.append((i, tokenizer.decode(ids).strip()))
        if len(out) == n:
            break
    if len(out) < n:
        raise DataError(f"the data holds {len(out)} passages of about {tokens} tokens, fewer than the {n} prompts "
                        "asked for: give a longer text, fewer prompts or shorter passages")
    return out


def passages(text: str, tokenizer, n: int, tokens: int, seed: int) -> list[str]:
    """The passages of `pick_passages`, without their paragraph indices."""
    return [p for _, p in pick_passages(text, tokenizer, n, tokens, seed)]


def text_sequences(text: str, tokenizer, n: int, tokens: int, prompt_tokens: int, skip: set[int],
                   seed: int) -> list[list[int]]:
    """Up to `n` token sequences of `tokens` tokens of the text itself, for features read without an
    answer (the target run over the text): whole paragraphs (as `pick_passages` splits them for
    `prompt_tokens`), those in `skip` left out (the held-out prompts' own), in an order shuffled by
    `seed`, joined and cut at `tokens`."""
    paras = paragraphs(text, 4 * prompt_tokens)
    order = [i for i in range(len(paras)) if i not in skip]
    random.Random(seed + 1).shuffle(order)
    out, cur = [], []
    for i in order:
        cur += tokenizer(paras[i] + "\n\n", add_special_tokens=False).input_ids
        while len(cur) >= tokens:
            out.append(cur[:tokens])
            cur = cur[tokens:]
            if len(out) == n:
                return out
    if len(cur) >= 16:
        out.append(cur)
    return out


def chat_prompt(tokenizer, content: str) -> list[int]:
    """Token ids of one user turn with `content` in the chat template, the generation prompt included
    (the template's text, its special tokens not added again)."""
    s = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    return list(tokenizer(s, add_special_tokens=False).input_ids)


def make_prompts(tokenizer, texts: list[str], chat: bool, offset: int = 0) -> list[list[int]]:
    """Token ids of a prompt per passage: a chat turn (an instruction of SPEC_TUNE_INSTRUCTIONS, in turn,
    then the passage) with the generation prompt, or the plain passage."""
    out = []
    for i, t in enumerate(texts):
        if chat:
            inst = defaults.SPEC_TUNE_INSTRUCTIONS[(offset + i) % len(defaults.SPEC_TUNE_INSTRUCTIONS)]
            out.append(chat_prompt(tokenizer, f"{inst}\n\n{t}"))
        else:
            out.append(list(tokenizer(t).input_ids))
    return out


# -- training data --------------------------------------------------------------------------------------

@dataclass
class DataSummary:
    prompts: int                 # training prompts answered
    sequences: int               # prompt + answer sequences kept (an answer of < 2 tokens is dropped)
    answer_tokens: int           # tokens the target generated
    tokens: int                  # prompt + answer tokens, and text-sequence tokens
    text_sequences: int          # sequences of the text itself, read without an answer (prompt_len 0)
    text_tokens: int
    feature_width: int           # floats per token (EAGLE-1: hidden; EAGLE-3: 3 x hidden)
    seconds: float               # spent making data in this run (0 when all of it was there)
    reused_parts: int            # parts found on disk (--resume)


def feature_layers(method: str, num_layers: int) -> tuple[int, ...]:
    """The target layers whose input hidden states a head reads (EAGLE-1: none, the final state)."""
    if method != "eagle3":
        return ()
    if num_layers < 3:
        raise UserInputError(f"EAGLE-3 reads the hidden states entering layers 2, L/2 and L-3: the target has "
                             f"{num_layers} layers, so use --method eagle")
    return eagle3_layers(num_layers)


@torch.inference_mode()
def capture(loaded, seqs: list[list[int]], layers: tuple[int, ...], batch: int = 8,
            keep_final: bool = False) -> list[dict]:
    """One forward of the target per sequence (batched, right-padded) with capture: per sequence the
    token ids, its feature per token (float16) and its greedy choice per token; with `keep_final`
    also its final hidden state per token (float16: the target's distribution there is
    softmax(lm_head(final)), for soft labels)."""
    model, dev = loaded.model, loaded.device
    old = model.capture_hidden
    model.capture_hidden = tuple(layers)
    uniq = sorted(set(layers))
    out = []
    try:
        for s in range(0, len(seqs), batch):
            group = seqs[s:s + batch]
            T = max(len(g) for g in group)
            ids = torch.zeros(len(group), T, dtype=torch.long, device=dev)
            for b, g in enumerate(group):
                ids[b, :len(g)] = torch.tensor(g)
            pos = torch.arange(T, device=dev).expand(len(group), T)
            final = model(ids, pos, DenseCausalAttention())
            aux = model.captured[1]
            feats = torch.cat([aux[uniq.index(i)] for i in layers], -1) if layers else final
            for b, g in enumerate(group):
                n = len(g)
                am = torch.cat([model.compute_logits(final[b, c:min(c + 512, n)]).argmax(-1) for c in range(0, n, 512)])
                out.append({"tokens": torch.tensor(g, dtype=torch.int32), "feats": feats[b, :n].half().cpu(),
                            "argmax": am.to(torch.int32).cpu()})
                if keep_final:
                    out[-1]["final"] = final[b, :n].half().cpu()
    finally:
        model.capture_hidden, model.captured = old, None
    return out


def _save_torch(path: Path, obj) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    fsutil.write_atomic(path, buf.getvalue())


def build_data(loaded, prompts: list[list[int]], folder: Path, method: str, max_new_tokens: int, gen_batch: int,
               meta: dict, progress: Progress = _noop, texts: list[list[int]] = (),
               keep_final: bool = False) -> tuple[list[dict], DataSummary]:
    """Answer `prompts` with the target (greedy, batched) and capture its features, in parts of
    `gen_batch` prompts written to `folder` (data/part-NNNNN.pt, atomically); then capture the
    features of `texts` (sequences of the text itself, no answer: every position is the target's
    own prediction on real text, about 6x cheaper per token than an answer) in parts of 64
    (data/text-NNNNN.pt, rows with prompt_len 0). `keep_final`: rows also hold the target's final
    hidden states (soft labels). Parts already there (a resumed run with the same `meta`) are read
    instead of made again."""
    folder.mkdir(exist_ok=True)
    mfile = folder / "meta.json"
    if mfile.is_file():
        old = json.loads(mfile.read_text())
        if old != meta:
            diff = sorted(k for k in set(old) | set(meta) if old.get(k) != meta.get(k))
            raise UserInputError(f"--resume: {folder.parent} holds training data made with other settings "
                                 f"({', '.join(diff)}): give the same settings or a new --output")
    else:
        fsutil.write_atomic(mfile, json.dumps(meta, indent=2) + "\n")
    layers = feature_layers(method, loaded.config.num_hidden_layers)
    parts = math.ceil(len(prompts) / gen_batch)
    progress("answers + features", len(prompts) + len(texts), 0)
    t0, reused, made, llm, rows = time.perf_counter(), 0, 0, None, []

    def part(f: Path, n: int, make: Callable[[], list[dict]]) -> None:
        """Read part f if it is there (a resumed run), else make and write it."""
        nonlocal reused, made
        if f.is_file():
            rows.extend(torch.load(f, weights_only=True))
            reused += 1
        else:
            new = make()
            _save_torch(f, new)
            rows.extend(new)
            made += 1
        progress("answers + features", None, n)

    def answer(chunk: list[list[int]]) -> list[dict]:
        nonlocal llm
        if llm is None:
            length = min(max(map(len, prompts)) + max_new_tokens, loaded.config.max_position_embeddings)
            llm = LLM(loaded=loaded, model=str(loaded.path), detokenize=False, max_num_seqs=gen_batch,
                      kv_cache_memory=kv_bytes(loaded, gen_batch, length), max_model_len=length,
                      enable_prefix_caching=False)
        outs = llm.generate(chunk, SamplingParams(temperature=0.0, max_tokens=max_new_tokens))
        seqs, plens = [], []
        for pr, o in zip(chunk, outs):
            ans = list(o.outputs[0].token_ids)
            if len(ans) >= 2:
                seqs.append(pr + ans)
                plens.append(len(pr))
        new = capture(loaded, seqs, layers, keep_final=keep_final)
        for r, pl in zip(new, plens):
            r["prompt_len"] = pl
        return new

    def read(chunk: list[list[int]]) -> list[dict]:
        new = capture(loaded, chunk, layers, keep_final=keep_final)
        for r in new:
            r["prompt_len"] = 0
        return new

    for p in range(parts):
        chunk = prompts[p * gen_batch:(p + 1) * gen_batch]
        part(folder / f"part-{p:05d}.pt", len(chunk), lambda: answer(chunk))
    for p in range(math.ceil(len(texts) / TEXT_PART)):
        chunk = texts[p * TEXT_PART:(p + 1) * TEXT_PART]
        part(folder / f"text-{p:05d}.pt", len(chunk), lambda: read(chunk))
    if not rows:
        raise DataError("the target answered every prompt with fewer than 2 tokens: nothing to train on")
    answers = [r for r in rows if r["prompt_len"]]
    text_tokens = sum(len(r["tokens"]) for r in rows if not r["prompt_len"])
    summary = DataSummary(len(prompts), len(answers), sum(len(r["tokens"]) - r["prompt_len"] for r in answers),
                          sum(len(r["tokens"]) for r in rows), len(rows) - len(answers), text_tokens,
                          rows[0]["feats"].shape[-1], time.perf_counter() - t0 if made else 0.0, reused)
    return rows, summary


def kv_bytes(loaded, seqs: int, length: int) -> int:
    """KV cache bytes for `seqs` sequences of `length` tokens (and a margin of blocks)."""
    c = loaded.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * loaded.dtype.itemsize
    return per_token * (seqs * (length + 2 * defaults.BLOCK_SIZE) + 8 * defaults.BLOCK_SIZE)


def draft_vocab(rows: list[dict], size: int, vocab_size: int) -> list[int]:
    """EAGLE-3's draft vocabulary: the `size` target ids chosen most often on the answers and the text
    sequences (ties and the rest by id), ascending."""
    size = min(size, vocab_size)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in rows:
        counts += torch.bincount(r["argmax"][max(0, r["prompt_len"] - 1):].long(), minlength=vocab_size)[:vocab_size]
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))
    return sorted(order[:size])
