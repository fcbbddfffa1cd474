"""`llmopt spec-tune`: train an EAGLE / EAGLE-3 head on the target's own answers (train.py), measure
its acceptance on held-out prompts, then tune num_speculative_tokens per batch size by real tokens/s
against plain decoding and write the spec_config.json that `serve`, `generate` and `bench` load
(`--speculative-config DIR`). `--method ngram|draft_model` tunes the parameters only.

The output folder (checked before any work; `--overwrite` replaces only a folder llmopt wrote):
    llmopt.json        marker
    data/              meta.json + part-NNNNN.pt: prompts' answers and the target's features; text-NNNNN.pt:
                       the target's features on sequences of the text itself (--text-sequences);
                       self_prompts.json: the requests the target wrote (--prompt-source self)
    checkpoint.pt      head, optimizer, step, RNG and loss curve (`--resume` continues from it)
    head/              the trained head (config.json + model.safetensors, the EAGLE repository's format, fp16)
    draft/             a self-draft (`--self-draft-layers N`, draft_model only)
    spec_config.json   vLLM's keys + num_speculative_tokens_by_batch_size ({batch size: K}, 0 = off)
    spec_tune.json     the result (what --json prints)
Every file is written atomically (`.NAME.tmp<PID>` and a rename), so a killed run leaves the last
checkpoint and the parts it finished.

Tuning runs batches of exactly b requests at once (ignore_eos, SPEC_TUNE_TUNE_MAX_TOKENS each; at
least SPEC_TUNE_TUNE_MIN_PROMPTS prompts per point, b at a time) on held-out prompts, one engine
per K over the same loaded weights, each warmed up at b first; K = 0 is plain decoding; the Ks
alternate SPEC_TUNE_TUNE_REPEATS times and their tokens and seconds are summed. The best K per
batch size is the one with the most output tokens/s, kept only when it beats plain decoding by
more than SPEC_TUNE_MIN_GAIN (else 0: off)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from llmopt import defaults, fsutil
from llmopt.data import read_dataset, resolve_data_path
from llmopt.engine.args import EngineArgs
from llmopt.engine.engine import LLMEngine
from llmopt.engine.llm import LLM
from llmopt.core.sampling_params import SamplingParams
from llmopt.errors import UserInputError
from llmopt.models.loader import load_model
from llmopt.speculative.config import METHODS, SpeculativeConfig
from llmopt.speculative.draft_model import write_self_draft
from llmopt.speculative.eagle import save_head
from llmopt.spec_tune import self_instruct
from llmopt.spec_tune.train import TrainSettings, TrainSummary, train_head
from llmopt.spec_tune.train_data import (DATA_DIR, DataSummary, Progress, _noop, build_data, kv_bytes, make_prompts,
                                           pick_passages, text_sequences)

HEAD_DIR = "head"
DRAFT_DIR = "draft"
RESULT_FILE = "spec_tune.json"
SELF_PROMPTS_FILE = "self_prompts.json"


@dataclass
class SpecTuneConfig:
    model: str | None = None
    method: str = defaults.SPEC_TUNE_METHOD
    output: str | None = None
    data: str = defaults.SPEC_TUNE_DATA
    text_field: str = defaults.TEXT_FIELD
    resume: bool = False
    overwrite: bool = False
    num_prompts: int = defaults.SPEC_TUNE_NUM_PROMPTS
    eval_prompts: int = defaults.SPEC_TUNE_EVAL_PROMPTS
    prompt_tokens: int = defaults.SPEC_TUNE_PROMPT_TOKENS
    max_new_tokens: int = defaults.SPEC_TUNE_MAX_NEW_TOKENS
    gen_batch: int = defaults.SPEC_TUNE_GEN_BATCH
    text_sequences: int = defaults.SPEC_TUNE_TEXT_SEQUENCES   # EAGLE: sequences of the text itself read for features
    chat: bool | None = None                 # None: chat prompts when the tokenizer has a chat template
    prompt_source: str = defaults.SPEC_TUNE_PROMPT_SOURCE   # text | self (llmopt/spec_tune/self_instruct.py)
    train: TrainSettings | None = None       # None: defaults for `method`
    batch_sizes: tuple[int, ...] = defaults.SPEC_TUNE_BATCH_SIZES
    max_k: int = defaults.SPEC_TUNE_MAX_K
    eval_k: int = defaults.SPEC_TUNE_EVAL_K
    tune_max_tokens: int = defaults.SPEC_TUNE_TUNE_MAX_TOKENS
    tune_min_prompts: int = defaults.SPEC_TUNE_TUNE_MIN_PROMPTS
    tune_repeats: int = defaults.SPEC_TUNE_TUNE_REPEATS
    draft_model: str | None = None
    self_draft_layers: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    dtype: str = defaults.DTYPE
    device: str = defaults.DEVICE
    seed: int = defaults.SPEC_TUNE_SEED

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise UserInputError(f"--method {self.method!r}: choose one of {', '.join(METHODS)}")
        if not self.output:
            raise UserInputError("spec-tune needs --output DIR (the folder for the head, checkpoints and "
                                 "spec_config.json)")
        if self.train is None:
            self.train = TrainSettings(self.method, seed=self.seed)
        self.train.method = self.method
        self.batch_sizes = tuple(sorted(set(int(b) for b in self.batch_sizes)))
        if not self.batch_sizes or self.batch_sizes[0] < 1:
            raise UserInputError("--batch-sizes: give batch sizes >= 1, e.g. 1,8,32")
        if self.prompt_source not in ("text", "self"):
            raise UserInputError(f"--prompt-source {self.prompt_source!r}: choose text or self")
        if self.prompt_source == "self" and self.chat is False:
            raise UserInputError("--prompt-source self writes chat turns: drop --no-chat")
        if self.train.init_from is not None:
            if self.method not in ("eagle", "eagle3"):
                raise UserInputError("--init-head is for --method eagle or eagle3")
            if not (Path(self.train.init_from).expanduser() / "config.json").is_file():
                raise UserInputError(f"--init-head {self.train.init_from}: no config.json there, so not a head folder")
        if self.train.soft_labels and self.method != "eagle3":
            raise UserInputError("--soft-labels is for --method eagle3 (EAGLE-1's loss always reads the target's "
                                 "distribution)")
        if self.text_sequences < 0:
            raise UserInputError("--text-sequences must be at least 0")
        for name in ("num_prompts", "eval_prompts", "prompt_tokens", "max_new_tokens", "gen_batch", "max_k", "eval_k",
                     "tune_max_tokens", "tune_min_prompts", "tune_repeats"):
            if getattr(self, name) < 1:
                raise UserInputError(f"--{name.replace('_', '-')} must be at least 1")
        if self.method == "draft_model":
            if (self.draft_model is None) == (self.self_draft_layers is None):
                raise UserInputError("--method draft_model needs --draft-model PATH or --self-draft-layers N (one)")
        elif self.draft_model is not None or self.self_draft_layers is not None:
            raise UserInputError("--draft-model and --self-draft-layers are for --method draft_model")
        if self.method != "ngram" and (self.prompt_lookup_min is not None or self.prompt_lookup_max is not None):
            raise UserInputError("--prompt-lookup-min/--prompt-lookup-max are for --method ngram")


@dataclass
class AcceptanceResult:
    prompts: int
    num_speculative_tokens: int
    acceptance_length: float            # 1 + accepted / drafts: tokens per verifying step
    acceptance_rate_per_pos: list[float]
    output_tokens: int
    seconds: float


@dataclass
class TunePoint:
    batch_size: int
    num_speculative_tokens: int          # 0: plain decoding
    tokens_per_s: float
    speedup: float | None                # over plain decoding at this batch size
    acceptance_length: float | None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None


@dataclass
class SpecTuneResult:
    output: str
    method: str
    model: str
    finished: bool                       # False: stopped by --max-minutes / --max-steps; --resume continues
    spec_config_path: str | None
    spec_config: dict | None
    choice: dict[int, int]               # batch size -> K (0 = off)
    speedup: dict[int, float]            # batch size -> tokens/s of the choice over plain decoding
    data: DataSummary | None
    train: TrainSummary | None
    acceptance: AcceptanceResult | None
    tune: list[TunePoint] = field(default_factory=list)
    seconds: float = 0.0
    load_average: float | None = None    # 1-minute load average at the end (a busy machine measures slower)


# -- the output folder --------------------------------------------------------------------------------

def prepare_output(cfg: SpecTuneConfig) -> Path:
    """Check --output before any work: a fresh run gets a new folder (marker only); --resume needs
    one that spec-tune wrote."""
    out = Path(cfg.output).expanduser()
    inputs = [p for p in (cfg.model, str(resolve_data_path(cfg.data)), cfg.draft_model)
              if p is not None and Path(p).expanduser().exists()]
    if cfg.resume:
        if not out.is_dir() or not fsutil.is_ours(out):
            raise UserInputError(f"--resume: {cfg.output} is not a folder spec-tune wrote (no {fsutil.MARKER}); "
                                 "start without --resume")
        fsutil.check_output_folder(out, overwrite=True, inputs=inputs)
        return out.resolve()
    if not cfg.overwrite and out.is_dir() and fsutil.is_ours(out) and (out / DATA_DIR).is_dir():
        raise UserInputError(f"--output {cfg.output} holds an earlier spec-tune run: pass --resume to continue it "
                             "or --overwrite to start over")
    out = fsutil.check_output_folder(out, cfg.overwrite, inputs=inputs)
    with fsutil.atomic_folder(out, {"command": "spec-tune", "method": cfg.method}):
        pass
    return out


# -- measuring --------------------------------------------------------------------------------------------

# What is measured comes through the engine's interfaces: output tokens from the step outputs, drafts
# and accepted tokens from `LLMEngine.stats().spec_decoding` (engine/spec_stats.py). The engines share
# one loaded target: hidden states are asked for per forward (SchedulerOutput.hidden_layers).

def _engine(loaded, cfg: SpecTuneConfig, spec: dict | None, seqs: int, length: int) -> LLMEngine:
    length = min(length + 2 * cfg.max_k + 8, loaded.config.max_position_embeddings)
    return LLMEngine(EngineArgs(model=str(loaded.path), dtype=cfg.dtype, device=cfg.device, detokenize=False,
                                max_num_seqs=seqs, kv_cache_memory=kv_bytes(loaded, seqs, length), max_model_len=length,
                                enable_prefix_caching=False, speculative_config=spec), loaded=loaded)


def _run(engine: LLMEngine, groups: list[list[list[int]]], params: SamplingParams) -> tuple[int, float]:
    """Run each group of prompts at once, one group after the other: (output tokens, seconds)."""
    tokens, t0 = 0, time.perf_counter()
    for g in groups:
        for p in g:
            engine.add_request(None, p, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens += len(out.outputs[0].token_ids)
    return tokens, time.perf_counter() - t0


def _spec_counts(engine: LLMEngine) -> tuple[int, int, list[int]]:
    st = engine.stats().spec_decoding
    return (0, 0, []) if st is None else (st.num_drafts, st.num_accepted_tokens, list(st.num_accepted_tokens_per_pos))


def measure_acceptance(loaded, cfg: SpecTuneConfig, spec: dict, prompts: list[list[int]],
                       progress: Progress = _noop) -> AcceptanceResult:
    """Mean acceptance length of `spec` on `prompts` (greedy answers of up to max_new_tokens, batched)."""
    progress("acceptance", len(prompts), 0)
    eng = _engine(loaded, cfg, spec, cfg.gen_batch, max(map(len, prompts)) + cfg.max_new_tokens)
    groups = [prompts[i:i + cfg.gen_batch] for i in range(0, len(prompts), cfg.gen_batch)]
    tokens, secs = 0, 0.0
    for g in groups:
        t, s = _run(eng, [g], SamplingParams(temperature=0.0, max_tokens=cfg.max_new_tokens))
        tokens, secs = tokens + t, secs + s
        progress("acceptance", None, len(g))
    st = eng.stats().spec_decoding
    return AcceptanceResult(len(prompts), spec["num_speculative_tokens"], st.mean_acceptance_length,
                            st.acceptance_rate_per_pos(), tokens, secs)


def _groups(prompts: list[list[int]], b: int, min_prompts: int) -> list[list[list[int]]]:
    n = max(b, min_prompts)
    n = -(-n // b) * b
    chosen = [prompts[i % len(prompts)] for i in range(n)]
    return [chosen[i:i + b] for i in range(0, n, b)]


def sweep(loaded, cfg: SpecTuneConfig, base: dict, prompts: list[list[int]], progress: Progress = _noop,
          ks: list[int] | None = None, batch_sizes: tuple[int, ...] | None = None) -> list[TunePoint]:
    """Tokens/s of `base` with each K in `ks` (0: plain) at each batch size: one engine per K, warmed up,
    then per batch size its groups of prompts; speedups against K = 0 (measured when in `ks`)."""
    ks = list(range(0, cfg.max_k + 1)) if ks is None else ks
    bss = batch_sizes or cfg.batch_sizes
    params = SamplingParams(temperature=0.0, max_tokens=cfg.tune_max_tokens, ignore_eos=True)
    length = max(map(len, prompts)) + cfg.tune_max_tokens
    points: list[TunePoint] = []
    engines = {}
    for k in ks:
        spec = None if k == 0 else dict(base, num_speculative_tokens=k)
        engines[k] = _engine(loaded, cfg, spec, max(bss), length)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for b in bss:                      # batch size outside, K inside: the K compared at one b run close in time
        for k in ks:
            _run(engines[k], _groups(prompts, b, 1)[:1], warm)   # warm-up at this batch size (a compiled step compiles)
        got = {k: [0, 0.0, 0, 0] for k in ks}                    # tokens, seconds, drafts, accepted
        for _ in range(cfg.tune_repeats):                        # K alternated: a machine's drift hits every K alike
            for k in ks:
                d0, a0, _ = _spec_counts(engines[k])
                tokens, secs = _run(engines[k], _groups(prompts, b, cfg.tune_min_prompts), params)
                d1, a1, _ = _spec_counts(engines[k])
                g = got[k]
                g[0], g[1], g[2], g[3] = g[0] + tokens, g[1] + secs, g[2] + d1 - d0, g[3] + a1 - a0
        plain = got[0][0] / got[0][1] if 0 in got and got[0][1] > 0 else None
        for k in ks:
            tokens, secs, drafts, acc = got[k]
            tps = tokens / secs if secs > 0 else 0.0
            points.append(TunePoint(b, k, tps, tps / plain if plain else None, 1 + acc / drafts if drafts else None,
                                    base.get("prompt_lookup_min"), base.get("prompt_lookup_max")))
            progress("tune", None, 1)
    return points


def choose(points: list[TunePoint], batch_sizes: tuple[int, ...],
           min_gain: float = defaults.SPEC_TUNE_MIN_GAIN) -> dict[int, int]:
    """Per batch size, the K with the most tokens/s; 0 (plain decoding) unless it beats plain
    decoding by more than `min_gain` (a share: measurement noise is not a gain)."""
    out = {}
    for b in batch_sizes:
        at = [p for p in points if p.batch_size == b]
        best = max(at, key=lambda p: (p.tokens_per_s, -p.num_speculative_tokens))
        out[b] = best.num_speculative_tokens if best.speedup is None or best.speedup > 1 + min_gain else 0
    return out


# -- the command ------------------------------------------------------------------------------------------

def spec_tune(cfg: SpecTuneConfig, progress: Progress = _noop) -> SpecTuneResult:
    """Train (EAGLE, EAGLE-3) and tune (every method); see the module docstring."""
    t0 = time.perf_counter()
    out = prepare_output(cfg)
    loaded = load_model(cfg.model, cfg.dtype, cfg.device)
    if loaded.tokenizer is None:
        raise UserInputError(f"{cfg.model}: spec-tune makes prompts from text and needs the model's tokenizer")
    prompts = _prompts(loaded, cfg, out, progress)
    trains = cfg.method in ("eagle", "eagle3")
    data = tsum = acc = None
    base: dict = {"method": cfg.method}
    if trains:
        data, tsum = _train(loaded, cfg, out, prompts, progress)
        if not tsum.finished:
            return _finish(cfg, out, loaded, t0, None, {}, {}, data, tsum, None, [], False)
        base["model"] = HEAD_DIR
    elif cfg.method == "draft_model":
        base["model"] = _draft_model(loaded, cfg, out)
    absolute = dict(base, model=str(out / base["model"])) if base.get("model") in (HEAD_DIR, DRAFT_DIR) else base
    held = prompts.held
    if trains:
        acc = measure_acceptance(loaded, cfg, dict(absolute, num_speculative_tokens=cfg.eval_k),
                                 held[:cfg.eval_prompts], progress)
    points: list[TunePoint] = []
    if cfg.method == "ngram":
        lookup, points = _ngram_lookup(loaded, cfg, absolute, held, progress)
        absolute, base = dict(absolute, **lookup), dict(base, **lookup)
    else:
        progress("tune", (cfg.max_k + 1) * len(cfg.batch_sizes), 0)
    final = sweep(loaded, cfg, absolute, held, progress)
    points += final
    choice = choose(final, cfg.batch_sizes)
    speedup = {b: next(p.speedup for p in final if p.batch_size == b and p.num_speculative_tokens == choice[b])
               for b in cfg.batch_sizes}
    spec = dict(base, num_speculative_tokens=max(max(choice.values()), 1),
                num_speculative_tokens_by_batch_size={str(b): k for b, k in choice.items()})
    SpeculativeConfig(**dict(absolute, num_speculative_tokens=spec["num_speculative_tokens"],
                             num_speculative_tokens_by_batch_size=choice))      # what serve and bench will parse
    fsutil.write_atomic(out / defaults.SPEC_CONFIG_FILE, json.dumps(spec, indent=2) + "\n")
    return _finish(cfg, out, loaded, t0, spec, choice, speedup, data, tsum, acc, points, True)


@dataclass
class _Prompts:
    chat: bool
    text: str                            # the dataset's text ("" when nothing reads it)
    picked: list                         # (passage index, passage) of text prompts, train ones first
    train: list[list[int]]
    held: list[list[int]]                # held out: acceptance and tuning


def _prompts(loaded, cfg: SpecTuneConfig, out: Path, progress: Progress) -> _Prompts:
    """The training prompts (EAGLE only) and the held-out ones, from the text or written by the target."""
    tok = loaded.tokenizer
    chat = cfg.chat if cfg.chat is not None else bool(getattr(tok, "chat_template", None))
    trains = cfg.method in ("eagle", "eagle3")
    n_train = cfg.num_prompts if trains else 0
    n_held = max(cfg.eval_prompts, max(cfg.batch_sizes), cfg.tune_min_prompts)
    text = read_dataset(cfg.data, cfg.text_field, defaults.CALIB_SPLIT).text \
        if cfg.prompt_source == "text" or (trains and cfg.text_sequences) else ""
    if cfg.prompt_source == "self":
        prompts = _self_prompts(loaded, cfg, n_train + n_held, out, progress)
        return _Prompts(chat, text, [], prompts[:n_train], prompts[n_train:])
    picked = pick_passages(text, tok, n_train + n_held, cfg.prompt_tokens, cfg.seed)
    texts = [p for _, p in picked]
    return _Prompts(chat, text, picked, make_prompts(tok, texts[:n_train], chat),
                    make_prompts(tok, texts[n_train:], chat, offset=n_train))


def _train(loaded, cfg: SpecTuneConfig, out: Path, prompts: _Prompts, progress: Progress):
    """EAGLE: the target's answers and features (data/), then the head (head/ once training finished)."""
    n_train = len(prompts.train)
    meta = {"model": str(loaded.path), "method": cfg.method, "data": cfg.data, "text_field": cfg.text_field,
            "num_prompts": cfg.num_prompts, "prompt_tokens": cfg.prompt_tokens, "chat": prompts.chat,
            "max_new_tokens": cfg.max_new_tokens, "gen_batch": cfg.gen_batch, "seed": cfg.seed}
    if cfg.prompt_source != "text":   # (absent for text prompts: a run from before the key still resumes)
        meta["prompt_source"] = cfg.prompt_source
    if cfg.train.soft_labels:         # the data keeps the target's final hidden states (same rule)
        meta["final_hidden"] = True
    seqs = []
    if cfg.text_sequences:       # (keys absent without them: a run from before them still resumes)
        length = min(defaults.SPEC_TUNE_TEXT_TOKENS, loaded.config.max_position_embeddings)
        meta.update(text_sequences=cfg.text_sequences, text_tokens=length)
        seqs = text_sequences(prompts.text, loaded.tokenizer, cfg.text_sequences, length, cfg.prompt_tokens,
                              {i for i, _ in prompts.picked[n_train:]}, cfg.seed)
    rows, data = build_data(loaded, prompts.train, out / DATA_DIR, cfg.method, cfg.max_new_tokens, cfg.gen_batch,
                            meta, progress, seqs, keep_final=cfg.train.soft_labels)
    head, tsum = train_head(loaded, rows, out, cfg.train, cfg.resume, progress)
    del rows
    if tsum.finished:
        with fsutil.atomic_folder(out / HEAD_DIR, {"command": "spec-tune", "method": cfg.method}) as tmp:
            save_head(head, tmp)
    return data, tsum


def _draft_model(loaded, cfg: SpecTuneConfig, out: Path) -> str:
    """The draft model's path for spec_config.json: a self-draft written to draft/, or --draft-model."""
    if cfg.self_draft_layers is not None:
        with fsutil.atomic_folder(out / DRAFT_DIR, {"command": "spec-tune", "self_draft_layers":
                                                    cfg.self_draft_layers}) as tmp:
            write_self_draft(loaded.path, cfg.self_draft_layers, tmp)
        return DRAFT_DIR
    path = Path(cfg.draft_model).expanduser()
    return str(path.resolve()) if path.exists() else cfg.draft_model


def _ngram_lookup(loaded, cfg: SpecTuneConfig, absolute: dict, held: list[list[int]],
                  progress: Progress) -> tuple[dict, list[TunePoint]]:
    """prompt_lookup_min/max: the given ones (vLLM's rules for one of the two), else the grid's
    fastest at the first batch size and eval_k; with the grid's points."""
    points: list[TunePoint] = []
    if cfg.prompt_lookup_min is None and cfg.prompt_lookup_max is None:
        grid = defaults.SPEC_TUNE_LOOKUP_GRID
        progress("tune", len(grid) + (cfg.max_k + 1) * len(cfg.batch_sizes), 0)
        for lo, hi in grid:
            points += sweep(loaded, cfg, dict(absolute, prompt_lookup_min=lo, prompt_lookup_max=hi), held,
                            progress, ks=[cfg.eval_k], batch_sizes=cfg.batch_sizes[:1])
        best = max(points, key=lambda p: p.tokens_per_s)
        lo, hi = best.prompt_lookup_min, best.prompt_lookup_max
    else:
        sc = SpeculativeConfig(method="ngram", num_speculative_tokens=1, prompt_lookup_min=cfg.prompt_lookup_min,
                               prompt_lookup_max=cfg.prompt_lookup_max)
        lo, hi = sc.prompt_lookup_min, sc.prompt_lookup_max
        progress("tune", (cfg.max_k + 1) * len(cfg.batch_sizes), 0)
    return {"prompt_lookup_min": lo, "prompt_lookup_max": hi}, points


def _self_prompts(loaded, cfg: SpecTuneConfig, n: int, out: Path, progress: Progress) -> list[list[int]]:
    """`n` prompts the target writes itself; kept in DIR/data/self_prompts.json, which --resume reads
    (sampling need not repeat exactly across runs)."""
    f = out / DATA_DIR / SELF_PROMPTS_FILE
    if f.is_file():        # an earlier run in this folder: the same requests, or a refusal (nothing replaced)
        saved = json.loads(f.read_text())
        if saved.get("seed") != cfg.seed or len(saved.get("prompts", [])) != n:
            raise UserInputError(f"--resume: {out} holds {len(saved.get('prompts', []))} self-written prompts of seed "
                                 f"{saved.get('seed')}, not {n} of seed {cfg.seed}: give the same settings or a new "
                                 "--output")
        return saved["prompts"]
    progress("self-written prompts", n, 0)
    length = min(len(self_instruct.user_turn_prefix(loaded.tokenizer)) + defaults.SPEC_TUNE_SELF_PROMPT_TOKENS,
                 loaded.config.max_position_embeddings)
    llm = LLM(loaded=loaded, model=str(loaded.path), detokenize=False, max_num_seqs=cfg.gen_batch,
              kv_cache_memory=kv_bytes(loaded, cfg.gen_batch, length), max_model_len=length)
    prompts = self_instruct.self_prompts(llm, loaded.tokenizer, n, cfg.seed, cfg.gen_batch,
                           kept=lambda k: progress("self-written prompts", None, k))
    f.parent.mkdir(parents=True, exist_ok=True)
    fsutil.write_atomic(f, json.dumps({"seed": cfg.seed, "prompts": prompts}) + "\n")
    return prompts


def _finish(cfg, out: Path, loaded, t0, spec, choice, speedup, data, tsum, acc, points, finished) -> SpecTuneResult:
    res = SpecTuneResult(str(out), cfg.method, str(loaded.path), finished,
                         str(out / defaults.SPEC_CONFIG_FILE) if spec else None, spec, choice, speedup, data, tsum,
                         acc, points, time.perf_counter() - t0,
                         os.getloadavg()[0] if hasattr(os, "getloadavg") else None)
    fsutil.write_atomic(out / RESULT_FILE, json.dumps(dataclasses.asdict(res), indent=2, default=str) + "\n")
    return res
