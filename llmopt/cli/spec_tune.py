"""`llmopt spec-tune`: train an EAGLE / EAGLE-3 head on the target's own answers, measure its
acceptance, tune num_speculative_tokens per batch size and write spec_config.json (n-gram and
draft models: tuning only)."""

from __future__ import annotations

from contextlib import ExitStack

import typer

from llmopt import defaults
from llmopt.cli import common, output
from llmopt.cli.ranges import in_range
from llmopt.validate import SEED_MAX, SEED_MIN

EXAMPLES = [
    "llmopt spec-tune --method eagle3 -o out/smollm2-eagle3",
    "llmopt spec-tune -o out/smollm2-eagle3 --resume --max-minutes 120",
    "llmopt spec-tune --method ngram --batch-sizes 1,8 -o out/ngram",
    "llmopt spec-tune --method draft_model --self-draft-layers 8 -o out/sd",
]


class _Phases:
    """The library's progress(phase, total, advance) as one bar per phase, one after the other."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.phase, self.stack, self.advance = enabled, None, ExitStack(), None

    def __call__(self, phase: str, total: int | None = None, advance: int = 0) -> None:
        if phase != self.phase:
            self.stack.close()
            self.phase = phase
            self.advance = self.stack.enter_context(output.progress(f"spec-tune {phase}", total, enabled=self.enabled))
        if advance:
            self.advance(advance)

    def close(self) -> None:
        self.stack.close()


def _batch_sizes(value: str | None) -> str | None:
    """--batch-sizes checked while the command line is parsed (a bad one is a usage error, exit 2)."""
    if value is None:
        return None
    try:
        sizes = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise typer.BadParameter(f"{value!r}: give batch sizes as integers separated by commas, e.g. 1,8,32") from None
    if not sizes or min(sizes) < 1 or max(sizes) > defaults.MAX_NUM_SEQS:
        raise typer.BadParameter(f"{value!r}: batch sizes 1 to {defaults.MAX_NUM_SEQS}")
    return value


def _tables(r):
    rows = [("output", r.output), ("method", r.method), ("model", r.model), ("finished", r.finished)]
    if r.data:
        rows += [("training sequences", r.data.sequences), ("answer tokens", r.data.answer_tokens)]
    if r.train:
        t = r.train
        rows += [("steps", f"{t.steps} of {t.total_steps}" + (f" (resumed at {t.resumed_from_step})"
                                                            if t.resumed_from_step else "")),
                 ("loss first -> last", f"{output.fmt(t.first_loss)} -> {output.fmt(t.last_loss)}"),
                 ("training seconds", t.seconds)]
    if r.acceptance:
        a = r.acceptance
        rows += [(f"acceptance length (K={a.num_speculative_tokens})", a.acceptance_length),
                 ("acceptance per position", " ".join(f"{x:.2f}" for x in a.acceptance_rate_per_pos))]
    if r.spec_config_path:
        rows += [("spec_config.json", r.spec_config_path),
                 ("K by batch size", ", ".join(f"{b}: {k}" for b, k in r.choice.items())),
                 ("speedup by batch size", ", ".join(f"{b}: {s:.2f}x" for b, s in r.speedup.items() if s))]
    else:
        rows.append(("next", "continue with --resume"))
    rows += [("seconds", r.seconds), ("load average", r.load_average)]
    tables = [output.kv_table("spec-tune", rows)]
    if r.tune:
        t = output.Table(title="tokens/s by batch size and K (0: plain decoding)", title_justify="left")
        for c in ("batch", "K", "lookup", "tokens/s", "speedup", "acceptance"):
            t.add_column(c, justify="right")
        for p in r.tune:
            look = f"{p.prompt_lookup_min}-{p.prompt_lookup_max}" if p.prompt_lookup_min is not None else ""
            t.add_row(str(p.batch_size), str(p.num_speculative_tokens), look, f"{p.tokens_per_s:.1f}",
                      f"{p.speedup:.2f}x" if p.speedup else "",
                      f"{p.acceptance_length:.2f}" if p.acceptance_length else "")
        tables.append(t)
    return tables


def spec_tune(
    model: str = common.ModelOpt,
    method: str = typer.Option(defaults.SPEC_TUNE_METHOD, "--method", help="eagle3 | eagle (train a head, then tune) "
                               "| ngram | draft_model (tune only)."),
    out_dir: str = typer.Option(None, "--output", "-o", help="Folder for data, checkpoints, the head and "
                                "spec_config.json (required)."),
    data: str = typer.Option(defaults.SPEC_TUNE_DATA, "--data", help="Text the prompts are made from: a text file, "
                             ".jsonl (with --text-field) or Hugging Face dataset path[:config[:split]] (local cache)."),
    text_field: str = typer.Option(defaults.TEXT_FIELD, "--text-field", help="Field of .jsonl rows / dataset column."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --output from its data parts and last "
                                "checkpoint (optimizer state, step, RNG)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace --output (only a folder llmopt wrote)."),
    num_prompts: int = typer.Option(defaults.SPEC_TUNE_NUM_PROMPTS, "--num-prompts", callback=in_range(1, 1_000_000),
                                    help="Training prompts the target answers, 1 to 1000000."),
    eval_prompts: int = typer.Option(defaults.SPEC_TUNE_EVAL_PROMPTS, "--eval-prompts", callback=in_range(1, 10_000),
                                     help="Held-out prompts the acceptance length is measured on, 1 to 10000."),
    prompt_tokens: int = typer.Option(defaults.SPEC_TUNE_PROMPT_TOKENS, "--prompt-tokens", callback=in_range(8, 8192),
                                      help="Tokens of a data passage per prompt, 8 to 8192."),
    max_new_tokens: int = typer.Option(defaults.SPEC_TUNE_MAX_NEW_TOKENS, "--max-new-tokens",
                                       callback=in_range(2, 32768), help="Tokens of each answer at most, 2 to 32768."),
    text_sequences: int = typer.Option(defaults.SPEC_TUNE_TEXT_SEQUENCES, "--text-sequences",
                                       callback=in_range(0, 1_000_000),
                                       help=f"Sequences of {defaults.SPEC_TUNE_TEXT_TOKENS} tokens of the text itself "
                                       "the target reads for more training features (no answers: ~6x cheaper a "
                                       "token), 0 to 1000000."),
    gen_batch: int = typer.Option(defaults.SPEC_TUNE_GEN_BATCH, "--gen-batch",
                                  callback=in_range(1, defaults.MAX_NUM_SEQS),
                                  help=f"Prompts the target answers at once, 1 to {defaults.MAX_NUM_SEQS}."),
    prompt_source: str = typer.Option(defaults.SPEC_TUNE_PROMPT_SOURCE, "--prompt-source",
                                      help="text: prompts made from --data passages; self: requests the target "
                                      "writes itself from its chat template (Magpie), for the kinds of turns users "
                                      "send."),
    init_head: str = typer.Option(None, "--init-head", help="EAGLE / EAGLE-3: start training from this head folder "
                                  "(its weights and draft vocabulary), e.g. to fine-tune on new prompts."),
    chat: bool = typer.Option(None, "--chat/--no-chat", help="Prompts as chat turns with an instruction (default when "
                              "the tokenizer has a chat template) or plain passages."),
    epochs: int = typer.Option(defaults.SPEC_TUNE_EPOCHS, "--epochs", callback=in_range(1, 1000),
                               help="Passes over the training data, 1 to 1000."),
    lr: float = typer.Option(defaults.SPEC_TUNE_LR, "--lr", callback=in_range(0, 1, lo_open=True),
                             help="AdamW learning rate, (0, 1]."),
    train_batch_size: int = typer.Option(defaults.SPEC_TUNE_BATCH_SIZE, "--train-batch-size",
                                         callback=in_range(1, 4096), help="Sequences per optimizer step, 1 to 4096."),
    soft_labels: bool = typer.Option(defaults.SPEC_TUNE_SOFT_LABELS, "--soft-labels/--hard-labels",
                                     help="EAGLE-3: cross-entropy against the target's distribution on the draft "
                                     "vocabulary (EAGLE-3's loss; the data keeps the target's final hidden states) "
                                     "or against its greedy choice."),
    prompt_loss: bool = typer.Option(defaults.SPEC_TUNE_PROMPT_LOSS, "--prompt-loss/--no-prompt-loss",
                                     help="The head's loss counts the prompts' positions too, or the answers' only."),
    ttt_steps: int = typer.Option(defaults.SPEC_TUNE_TTT_STEPS, "--ttt-steps", callback=in_range(1, 16),
                                  help="EAGLE-3 training-time test: steps the head runs on its own features, 1 to 16."),
    draft_vocab_size: int = typer.Option(defaults.SPEC_TUNE_DRAFT_VOCAB, "--draft-vocab-size",
                                         callback=in_range(16, 1 << 20), help="EAGLE-3 draft vocabulary, 16 to 1048576 "
                                         "(capped at the target's)."),
    checkpoint_every: int = typer.Option(defaults.SPEC_TUNE_CHECKPOINT_EVERY, "--checkpoint-every",
                                         callback=in_range(1),
                                         help="Steps between checkpoints, >= 1 (and each epoch)."),
    max_minutes: float = typer.Option(None, "--max-minutes", callback=in_range(0, lo_open=True),
                                      help="Stop training after this many minutes with a checkpoint (> 0); "
                                      "--resume continues."),
    max_steps: int = typer.Option(None, "--max-steps", callback=in_range(1),
                                  help="Stop training at this global step with a checkpoint (>= 1)."),
    batch_sizes: str = typer.Option(",".join(map(str, defaults.SPEC_TUNE_BATCH_SIZES)), "--batch-sizes",
                                    callback=_batch_sizes,
                                    help=f"Batch sizes to tune K for, comma-separated, 1 to {defaults.MAX_NUM_SEQS}."),
    max_k: int = typer.Option(defaults.SPEC_TUNE_MAX_K, "--max-k", callback=in_range(1, 16),
                              help="num_speculative_tokens swept from 1 to this (and 0: plain), 1 to 16."),
    eval_k: int = typer.Option(defaults.SPEC_TUNE_EVAL_K, "--eval-k", callback=in_range(1, 16),
                               help="num_speculative_tokens of the acceptance measurement, 1 to 16."),
    tune_max_tokens: int = typer.Option(defaults.SPEC_TUNE_TUNE_MAX_TOKENS, "--tune-max-tokens",
                                        callback=in_range(1, 32768),
                                        help="Tokens per request while tuning, 1 to 32768."),
    tune_repeats: int = typer.Option(defaults.SPEC_TUNE_TUNE_REPEATS, "--tune-repeats", callback=in_range(1, 100),
                                     help="Times each K is measured, alternating, 1 to 100."),
    draft_model: str = typer.Option(None, "--draft-model", help="draft_model: the draft (same tokenizer)."),
    self_draft_layers: int = typer.Option(None, "--self-draft-layers", callback=in_range(1),
                                          help="draft_model: a self-draft of the target's first N layers (>= 1)."),
    prompt_lookup_min: int = typer.Option(None, "--prompt-lookup-min", callback=in_range(1),
                                          help="ngram: fix prompt_lookup_min (default: tuned)."),
    prompt_lookup_max: int = typer.Option(None, "--prompt-lookup-max", callback=in_range(1),
                                          help="ngram: fix prompt_lookup_max (default: tuned)."),
    seed: int = typer.Option(defaults.SPEC_TUNE_SEED, "--seed", callback=in_range(SEED_MIN, SEED_MAX),
                             help="Seed of the passages, the head's init and the batch order (64-bit integer)."),
    dtype: str = common.DtypeOpt,
    device: str = common.DeviceOpt,
    json_out: bool = common.JsonOpt,
    quiet: bool = common.QuietOpt,
) -> None:
    """Train an EAGLE/EAGLE-3 head and tune speculative decoding; writes spec_config.json."""
    # deferred: keep CLI start-up fast
    from llmopt.spec_tune.train import TrainSettings
    from llmopt.spec_tune.tune import SpecTuneConfig

    settings = TrainSettings(method, epochs=epochs, lr=lr, batch_size=train_batch_size, ttt_steps=ttt_steps,
                             draft_vocab_size=draft_vocab_size, checkpoint_every=checkpoint_every, seed=seed,
                             prompt_loss=prompt_loss, init_from=init_head, soft_labels=soft_labels,
                             max_seconds=None if max_minutes is None else 60.0 * max_minutes, max_steps=max_steps)
    cfg = SpecTuneConfig(model=model, method=method, output=out_dir, data=data, text_field=text_field, resume=resume,
                         overwrite=overwrite, num_prompts=num_prompts, eval_prompts=eval_prompts,
                         prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens, chat=chat, train=settings,
                         text_sequences=text_sequences, gen_batch=gen_batch, prompt_source=prompt_source,
                         batch_sizes=tuple(int(b) for b in batch_sizes.split(",") if b.strip()), max_k=max_k,
                         eval_k=eval_k, tune_max_tokens=tune_max_tokens, tune_repeats=tune_repeats,
                         draft_model=draft_model, self_draft_layers=self_draft_layers,
                         prompt_lookup_min=prompt_lookup_min, prompt_lookup_max=prompt_lookup_max, dtype=dtype,
                         device=device, seed=seed)
    _run(cfg, quiet, json_out)


def _run(cfg, quiet: bool, json_out: bool) -> None:
    """Run spec-tune with a progress bar per phase, then print its result."""
    from llmopt.spec_tune.tune import spec_tune as run   # deferred: keep CLI start-up fast

    phases = _Phases(not quiet)
    try:
        result = run(cfg, progress=phases)
    finally:
        phases.close()
    output.emit(result, as_json=json_out, table=_tables)
