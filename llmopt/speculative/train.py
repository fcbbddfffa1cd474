"""`llmopt spec-tune`'s training half: training data from the target itself, and the EAGLE / EAGLE-3
head trained on it, with checkpoints that `--resume` continues.

Data (`build_data`): prompts made from a text (`llmopt.data.read_dataset`: passages of the text,
as chat prompts with an instruction when the tokenizer has a chat template, else the plain
passage); the target's own greedy answers to them (the engine, batched); and one forward of the
target over prompt + answer with `capture_hidden`, keeping per token the target's feature (EAGLE-1:
the final hidden state; EAGLE-3: the hidden states entering layers 2, L/2, L-3, concatenated) and
its greedy choice (the argmax of its logits: what verification accepts); the same for sequences
of the text itself (no answer: the target's choices on real text, cheap). Written in parts under
`DIR/data/` as they are made, so an interrupted run keeps what it made.

Training (`train_head`): the head at position i reads the token at i+1 and the feature at i and
predicts the target's choice at i+1 (the token at i+2), at every position with a next token
(`prompt_loss`; else on the answers' positions only).
- EAGLE-1: SmoothL1(head output, the target's final hidden state at i+1) + 0.1 x cross-entropy
  of the head's logits (through the target's LM head) against the target's distribution there.
- EAGLE-3 with training-time test: step 0 as above (fc over the three features); step j feeds
  the head its own output of step j-1 with the token j positions further and predicts the choice
  j positions further; a query at step j sits at position i+j and attends to the step-0 keys at
  positions <= i and to its own chain's keys of steps 1..j, as when drafting. Loss: sum over steps
  of decay^j x cross-entropy over the draft vocabulary (the target's most frequent choices;
  the head's lm_head and norm start as the target's rows of them), against the target's choice
  (hard labels) or its distribution there (`soft_labels`, as EAGLE-3 trains: the data then keeps
  the target's final hidden states).
AdamW, constant learning rate after a linear warmup, gradient clipping. The batch order of epoch
e is a permutation seeded by (seed, e), so a run resumed from a checkpoint (head, optimizer, step,
RNG, loss curve) takes the same steps as one that was never stopped.
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
import torch.nn.functional as F

from llmopt import defaults, fsutil
from llmopt.errors import DataError, UserInputError

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
    from llmopt.speculative.eagle import eagle3_layers
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
    from llmopt.models.attention import DenseCausalAttention
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
    from llmopt.engine.llm import LLM
    from llmopt.engine.sampling_params import SamplingParams
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


# -- the loss ---------------------------------------------------------------------------------------------

class TTTAttention:
    """Attention for training-time test: step 0 is causal over the sequence; at step j the query of
    position i attends to the step-0 keys at positions <= i and to its own chain's keys of steps
    1..j (the keys drafting would have cached)."""

    def __init__(self) -> None:
        self.k0 = self.v0 = None
        self.chain: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, layer_idx, q, k, v, window):
        g = q.shape[2] // k.shape[2]
        q = q.transpose(1, 2)                                  # [B, Hq, n, D]
        k, v = (x.transpose(1, 2).repeat_interleave(g, 1) for x in (k, v))
        if self.k0 is None:
            self.k0, self.v0 = k, v
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return o.transpose(1, 2)
        self.chain.append((k, v))
        n, scale = q.shape[2], q.shape[-1] ** -0.5
        s0 = (q @ self.k0.transpose(-1, -2)) * scale
        s0 = s0.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        sd = [(q * kc).sum(-1, keepdim=True) * scale for kc, _ in self.chain]
        p = torch.softmax(torch.cat([s0, *sd], -1), -1)
        o = p[..., :n] @ self.v0
        for c, (_, vc) in enumerate(self.chain):
            o = o + p[..., n + c:n + c + 1] * vc
        return o.transpose(1, 2)


def collate(rows: list[dict], steps: int, device) -> dict:
    """Right-padded tensors for a batch: tokens, features, choices, prompt and total lengths (with
    `steps` extra padding, so step j can read j positions further), and the target's final hidden
    states where the rows hold them (soft labels)."""
    B, T = len(rows), max(len(r["tokens"]) for r in rows)
    W = T + steps + 1
    tok = torch.zeros(B, W, dtype=torch.long)
    am = torch.zeros(B, W, dtype=torch.long)
    feats = torch.zeros(B, T, rows[0]["feats"].shape[-1])
    final = torch.zeros(B, W, rows[0]["final"].shape[-1]) if "final" in rows[0] else None
    for b, r in enumerate(rows):
        n = len(r["tokens"])
        tok[b, :n], am[b, :n], feats[b, :n] = r["tokens"].long(), r["argmax"].long(), r["feats"].float()
        if final is not None:
            final[b, :n] = r["final"].float()
    lens = torch.tensor([len(r["tokens"]) for r in rows])
    plens = torch.tensor([r["prompt_len"] for r in rows])
    out = {"tokens": tok.to(device), "argmax": am.to(device), "feats": feats.to(device), "lens": lens.to(device),
           "plens": plens.to(device)}
    if final is not None:
        out["final"] = final.to(device)
    return out


def _valid(batch: dict, n: int, j: int, prompts: bool = False) -> torch.Tensor:
    """[B, n]: query i at step j has a label: the choice at p = i + 1 + j lies on the answer
    (p >= prompt_len - 1; anywhere with `prompts`) and is followed by a token of the sequence
    (p <= len - 2)."""
    p = torch.arange(n, device=batch["lens"].device)[None, :] + 1 + j
    last = p <= batch["lens"][:, None] - 2
    return last if prompts else last & (p >= batch["plens"][:, None] - 1)


def eagle3_loss(head, target, batch: dict, steps: int, decay: float, prompts: bool = False,
                soft: bool = False) -> tuple[torch.Tensor, list[float], int]:
    """Training-time-test loss of an EAGLE-3 head: sum_j decay^j x CE(step j), over the answers'
    positions (and the prompts' with `prompts`) where the target's choice is in the draft vocabulary;
    CE against the target's choice, or with `soft` against the target's distribution restricted to
    the draft vocabulary and renormalized (softmax of its logits there, from the final hidden states
    in `batch`), as EAGLE-3 trains; returns (loss, each step's mean CE, rows counted at step 0)."""
    t2d = head.t2d
    dmap = torch.cumsum(t2d.long(), 0) - 1                       # target id -> draft id (where t2d)
    if soft:
        if "final" not in batch:
            raise DataError("soft labels need the target's final hidden states in the training data")
        with torch.no_grad():    # the target's distribution on the draft vocabulary per position, once for all steps
            target_p = torch.softmax(batch["final"] @ target.lm_head.weight.detach()[t2d].float().T, -1)
    n = batch["feats"].shape[1] - 1
    attn = TTTAttention()
    hidden, total, parts, rows0 = batch["feats"][:, :n], 0.0, [], 0
    pos0 = torch.arange(n, device=hidden.device)[None, :].expand(hidden.shape[0], n)
    for j in range(steps):
        tok = batch["tokens"][:, 1 + j:1 + j + n]
        with torch.no_grad():
            emb = target.embed(tok)
        out = head(emb, hidden, pos0 + j, attn, fuse=j == 0)
        lab = batch["argmax"][:, 1 + j:1 + j + n]
        m = _valid(batch, n, j, prompts) & t2d[lab]
        if not m.any():
            break
        logits = head.lm_head(head.norm(out[m]))
        if soft:
            ce = -(target_p[:, 1 + j:1 + j + n][m] * torch.log_softmax(logits.float(), -1)).sum(-1).mean()
        else:
            ce = F.cross_entropy(logits, dmap[lab[m]])
        total = total + (decay ** j) * ce
        parts.append(ce.item())
        rows0 = rows0 or int(m.sum())
        hidden = out
    return total, parts, rows0


def eagle1_loss(head, target, batch: dict, ce_weight: float, noise: float = 0.0,
                prompts: bool = False) -> tuple[torch.Tensor, list[float], int]:
    """EAGLE-1: SmoothL1(head output, the target's feature at i+1) + ce_weight x cross-entropy
    against the target's distribution at i+1 (both through the target's LM head)."""
    n = batch["feats"].shape[1] - 1
    feats = batch["feats"][:, :n]
    if noise:
        feats = feats + (torch.rand_like(feats) - 0.5) * 2 * noise
    with torch.no_grad():
        emb = target.embed(batch["tokens"][:, 1:1 + n])
    pos = torch.arange(n, device=feats.device)[None, :].expand(feats.shape[0], n)
    out = head(emb, feats, pos, TTTAttention())
    m = _valid(batch, n, 0, prompts)
    if not m.any():
        return out.sum() * 0.0, [0.0, 0.0], 0
    pred, want = out[m], batch["feats"][:, 1:1 + n][m]
    vloss = F.smooth_l1_loss(pred, want)
    ce = 0.0
    for c in range(0, pred.shape[0], 1024):                      # [rows, vocab] logits, a slice at a time
        with torch.no_grad():
            p = torch.softmax(target.compute_logits(want[c:c + 1024]).float(), -1)
        lp = torch.log_softmax(target.compute_logits(pred[c:c + 1024]).float(), -1)
        ce = ce - (p * lp).sum()
    ce = ce / pred.shape[0]
    return vloss + ce_weight * ce, [vloss.item(), ce.item()], int(m.sum())


# -- training -----------------------------------------------------------------------------------------------

@dataclass
class TrainSettings:
    method: str
    epochs: int = defaults.SPEC_TUNE_EPOCHS
    lr: float = defaults.SPEC_TUNE_LR
    batch_size: int = defaults.SPEC_TUNE_BATCH_SIZE
    warmup_steps: int = defaults.SPEC_TUNE_WARMUP_STEPS
    grad_clip: float = defaults.SPEC_TUNE_GRAD_CLIP
    ttt_steps: int = defaults.SPEC_TUNE_TTT_STEPS
    ttt_decay: float = defaults.SPEC_TUNE_TTT_DECAY
    ce_weight: float = defaults.SPEC_TUNE_EAGLE1_CE_WEIGHT
    draft_vocab_size: int = defaults.SPEC_TUNE_DRAFT_VOCAB
    checkpoint_every: int = defaults.SPEC_TUNE_CHECKPOINT_EVERY
    prompt_loss: bool = defaults.SPEC_TUNE_PROMPT_LOSS   # the loss counts the prompts' positions too
    seed: int = defaults.SPEC_TUNE_SEED
    max_seconds: float | None = None     # stop (with a checkpoint) after this much training in this run
    max_steps: int | None = None         # stop (with a checkpoint) at this global step (tests, chunks)
    init_from: str | None = None         # start from this head (its weights and draft vocabulary), not a new one
    soft_labels: bool = defaults.SPEC_TUNE_SOFT_LABELS   # EAGLE-3: CE against the target's distribution, not its choice


@dataclass
class TrainSummary:
    steps: int                   # optimizer steps done in all runs
    total_steps: int             # epochs x steps per epoch
    steps_per_epoch: int
    resumed_from_step: int       # 0: a fresh head
    finished: bool               # all epochs done (False: stopped by a time or step budget; --resume continues)
    first_loss: float | None
    last_loss: float | None      # mean over the last epoch's steps (or the steps this run made)
    epoch_losses: list[float]    # mean loss per finished epoch
    step_losses: list[float]     # every step's loss, all runs
    step_parts: list[list[float]]  # every step's parts (EAGLE-3: CE per TTT step; EAGLE-1: SmoothL1, CE)
    seconds: float               # training time in this run
    tokens_per_step: float       # answer positions the loss counted per step (mean)
    draft_vocab_size: int | None
    soft_labels: bool = False    # EAGLE-3 trained against the target's distribution (else its choice)


def init_head(loaded, method: str, rows: list[dict], settings: TrainSettings):
    """A new head for the target; EAGLE-3 with the draft vocabulary of `rows` and its lm_head and norm
    started from the target's."""
    from llmopt.speculative.eagle import new_head
    cfg = loaded.config
    vocab = draft_vocab(rows, settings.draft_vocab_size, cfg.vocab_size) if method == "eagle3" else None
    head = new_head(cfg, method, vocab, seed=settings.seed).float()
    if method == "eagle3":
        with torch.no_grad():
            head.lm_head.weight.copy_(loaded.model.lm_head.weight.float()[torch.tensor(vocab)])
            head.norm.weight.copy_(loaded.model.model.norm.weight.float())
    return head.to(loaded.device)


def train_head(loaded, rows: list[dict], folder: Path, settings: TrainSettings, resume: bool,
               progress: Progress = _noop):
    """Train (or continue training) the head on `rows`; checkpoints go to folder/checkpoint.pt
    (atomically). Returns (head, TrainSummary)."""
    method, dev = settings.method, loaded.device
    target = loaded.model
    ckpt = folder / CHECKPOINT
    state = None
    if resume and ckpt.is_file():
        state = torch.load(ckpt, weights_only=False, map_location="cpu")
        if state["method"] != method:
            raise UserInputError(f"--resume: {folder} holds an {state['method']} checkpoint, not {method}")
    if state is not None and method == "eagle3":
        from llmopt.speculative.eagle import new_head
        head = new_head(loaded.config, method, state["draft_vocab"], seed=settings.seed).float().to(dev)
    elif state is None and settings.init_from:
        from llmopt.speculative.eagle import load_eagle_head
        head = load_eagle_head(settings.init_from, method, loaded.config, torch.float32, dev)
    else:
        head = init_head(loaded, method, rows, settings)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step, losses, parts = 0, [], []
    if state is not None:
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        step, losses, parts = state["step"], state["losses"], state["parts"]
        torch.set_rng_state(state["rng"])
    start = step
    B = settings.batch_size
    per_epoch = math.ceil(len(rows) / B)
    total = settings.epochs * per_epoch
    stop_at = min(total, settings.max_steps) if settings.max_steps is not None else total
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["tokens"]))   # similar lengths batch together
    batches = [order[i:i + B] for i in range(0, len(order), B)]
    dvocab = state["draft_vocab"] if state is not None else (
        torch.nonzero(head.t2d).flatten().tolist() if method == "eagle3" else None)

    def save() -> None:
        _save_torch(ckpt, {"method": method, "head": head.state_dict(), "optimizer": opt.state_dict(), "step": step,
                           "losses": losses, "parts": parts, "rng": torch.get_rng_state(), "draft_vocab": dvocab,
                           "per_epoch": per_epoch})

    progress("train", total, start)
    t0, rows_seen = time.perf_counter(), []
    head.train()
    try:
        while step < stop_at:
            if settings.max_seconds is not None and time.perf_counter() - t0 >= settings.max_seconds:
                break
            epoch, k = divmod(step, per_epoch)
            perm = torch.randperm(per_epoch, generator=torch.Generator().manual_seed(settings.seed * 1000 + epoch))
            batch = collate([rows[i] for i in batches[int(perm[k])]], settings.ttt_steps, dev)
            for g in opt.param_groups:
                g["lr"] = settings.lr * min(1.0, (step + 1) / max(1, settings.warmup_steps))
            if method == "eagle3":
                loss, lp, nrows = eagle3_loss(head, target, batch, settings.ttt_steps, settings.ttt_decay,
                                              settings.prompt_loss, settings.soft_labels)
            else:
                loss, lp, nrows = eagle1_loss(head, target, batch, settings.ce_weight, prompts=settings.prompt_loss)
            opt.zero_grad(set_to_none=True)
            if nrows:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
                opt.step()
            losses.append(float(loss.detach()) if torch.is_tensor(loss) else float(loss))
            parts.append(lp)
            rows_seen.append(nrows)
            step += 1
            progress("train", None, 1)
            if step % settings.checkpoint_every == 0 or step % per_epoch == 0:
                save()
    except KeyboardInterrupt:
        save()       # Ctrl-C / SIGTERM: keep the steps made (--resume continues), then exit as interrupted
        raise
    if step > start:
        save()
    head.eval()
    epochs_done = step // per_epoch
    epoch_losses = [sum(losses[e * per_epoch:(e + 1) * per_epoch]) / per_epoch for e in range(epochs_done)]
    recent = losses[max(0, (epochs_done - 1) * per_epoch) if epochs_done else start:] or losses[-1:]
    summary = TrainSummary(step, total, per_epoch, start, step >= total, losses[0] if losses else None,
                           sum(recent) / len(recent) if recent else None, epoch_losses, losses, parts,
                           time.perf_counter() - t0, sum(rows_seen) / len(rows_seen) if rows_seen else 0.0,
                           len(dvocab) if dvocab else None, settings.soft_labels and method == "eagle3")
    return head, summary
