"""`llmopt spec-tune`'s training half: the EAGLE / EAGLE-3 head trained on the target's own data
(train_data.py makes it), with checkpoints that `--resume` continues.

`train_head`: the losses of train_loss.py, AdamW, constant learning rate after a linear warmup,
gradient clipping. The batch order of epoch e is a permutation seeded by (seed, e), so a run resumed
from a checkpoint (head, optimizer, step, RNG, loss curve) takes the same steps as one that was never
stopped.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from llmopt import defaults
from llmopt.errors import UserInputError
from llmopt.speculative.eagle import load_eagle_head, new_head
from llmopt.spec_tune.train_data import Progress, _noop, _save_torch, draft_vocab
from llmopt.spec_tune.train_loss import collate, eagle1_loss, eagle3_loss

CHECKPOINT = "checkpoint.pt"


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
    cfg = loaded.config
    vocab = draft_vocab(rows, settings.draft_vocab_size, cfg.vocab_size) if method == "eagle3" else None
    head = new_head(cfg, method, vocab, seed=settings.seed).float()
    if method == "eagle3":
        with torch.no_grad():
            head.lm_head.weight.copy_(loaded.model.lm_head.weight.float()[torch.tensor(vocab)])
            head.norm.weight.copy_(loaded.model.model.norm.weight.float())
    return head.to(loaded.device)


def _start(loaded, rows: list[dict], folder: Path, settings: TrainSettings, resume: bool):
    """The head and its optimizer: continued from folder/checkpoint.pt (`resume`, with the RNG state), started
    from `settings.init_from`, or new. Returns (head, trained parameters, optimizer, checkpoint or None)."""
    method, dev = settings.method, loaded.device
    ckpt = folder / CHECKPOINT
    state = None
    if resume and ckpt.is_file():
        state = torch.load(ckpt, weights_only=False, map_location="cpu")
        if state["method"] != method:
            raise UserInputError(f"--resume: {folder} holds an {state['method']} checkpoint, not {method}")
    if state is not None and method == "eagle3":
        head = new_head(loaded.config, method, state["draft_vocab"], seed=settings.seed).float().to(dev)
    elif state is None and settings.init_from:
        head = load_eagle_head(settings.init_from, method, loaded.config, torch.float32, dev)
    else:
        head = init_head(loaded, method, rows, settings)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    if state is not None:
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
    return head, params, opt, state


def _loss(head, target, batch: dict, settings: TrainSettings) -> tuple[torch.Tensor, list[float], int]:
    if settings.method == "eagle3":
        return eagle3_loss(head, target, batch, settings.ttt_steps, settings.ttt_decay, settings.prompt_loss,
                           settings.soft_labels)
    return eagle1_loss(head, target, batch, settings.ce_weight, prompts=settings.prompt_loss)


def _summary(settings: TrainSettings, step: int, start: int, total: int, per_epoch: int, losses: list[float],
             parts: list[list[float]], seconds: float, rows_seen: list[int], dvocab: list[int] | None) -> TrainSummary:
    epochs_done = step // per_epoch
    epoch_losses = [sum(losses[e * per_epoch:(e + 1) * per_epoch]) / per_epoch for e in range(epochs_done)]
    recent = losses[max(0, (epochs_done - 1) * per_epoch) if epochs_done else start:] or losses[-1:]
    return TrainSummary(step, total, per_epoch, start, step >= total, losses[0] if losses else None,
                        sum(recent) / len(recent) if recent else None, epoch_losses, losses, parts, seconds,
                        sum(rows_seen) / len(rows_seen) if rows_seen else 0.0, len(dvocab) if dvocab else None,
                        settings.soft_labels and settings.method == "eagle3")


def train_head(loaded, rows: list[dict], folder: Path, settings: TrainSettings, resume: bool,
               progress: Progress = _noop):
    """Train (or continue training) the head on `rows`; checkpoints go to folder/checkpoint.pt
    (atomically). Returns (head, TrainSummary)."""
    method, dev, target = settings.method, loaded.device, loaded.model
    head, params, opt, state = _start(loaded, rows, folder, settings, resume)
    step, losses, parts = (state["step"], state["losses"], state["parts"]) if state is not None else (0, [], [])
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
        _save_torch(folder / CHECKPOINT, {"method": method, "head": head.state_dict(), "optimizer": opt.state_dict(),
                                          "step": step, "losses": losses, "parts": parts, "rng": torch.get_rng_state(),
                                          "draft_vocab": dvocab, "per_epoch": per_epoch})

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
            loss, lp, nrows = _loss(head, target, batch, settings)
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
    return head, _summary(settings, step, start, total, per_epoch, losses, parts, time.perf_counter() - t0, rows_seen,
                          dvocab)
