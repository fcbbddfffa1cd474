"""`llmopt eval-ppl`: perplexity by a peer's protocol, optionally with KL divergence against a base."""

from __future__ import annotations

import typer

from llmopt import defaults
from llmopt.cli import common, output
from llmopt.cli.ranges import in_range

MAX_BATCH = 1024   # --batch-size at most

METHOD_HELP = ("sliding: Hugging Face fixed-length loop (--max-length, --stride); chunks: GPTQ/AWQ "
               "non-overlapping --ctx windows; rolling: lm-evaluation-harness wikitext (per-document "
               "rolling windows of --max-length, default the model's max_position_embeddings; word and "
               "byte perplexity); llamacpp: llama.cpp perplexity (--ctx 512 chunks, last half scored; a text file "
               "read as stored, line ends included, as llama-perplexity reads it).")


def _table(r):
    rows = [("model", r.model), ("dataset", r.dataset), ("method", r.method), ("perplexity", r.ppl),
            ("mean NLL", r.mean_nll), ("scored tokens", r.scored_tokens), ("bits per byte", r.bits_per_byte)]
    if r.method == "rolling":
        rows += [("word perplexity", r.word_perplexity), ("byte perplexity", r.byte_perplexity),
                 ("documents", r.documents)]
    rows += [("window", r.window)] + ([("stride", r.stride)] if r.stride else [])
    rows += [("windows", r.windows), ("tokens/s", r.tokens_per_s), ("seconds", r.seconds),
             ("dtype", r.dtype), ("device", r.device)]
    if r.kv_cache_dtype:
        rows.append(("KV cache dtype", r.kv_cache_dtype))
    tables = [output.kv_table("eval-ppl", rows)]
    if r.kl:
        k = r.kl
        tables.append(output.kv_table(f"KL divergence vs {k.base_model}", [
            ("KLD mean", k.kld_mean), ("KLD median", k.kld_median), ("KLD p99", k.kld_p99),
            ("KLD max", k.kld_max), ("top-1 agreement", k.top1_agreement), ("base perplexity", k.base_ppl)]))
    return tables


# Shown under Examples in --help (app.py registers the command); one short line each.
EXAMPLES = [
    "llmopt eval-ppl --method chunks --ctx 2048 --limit 40000",
    "llmopt eval-ppl --model out/smollm2-awq --base-model smollm2-135m",
]


def eval_ppl(
    model: str = common.ModelOpt,
    dtype: str = common.DtypeOpt,
    device: str = common.DeviceOpt,
    dataset: str = typer.Option(defaults.PPL_DATASET, "--dataset", "-d", help="Text file, .jsonl (with "
                                "--text-field) or Hugging Face dataset path[:config[:split]] (local cache; split "
                                f"default {defaults.PPL_SPLIT})."),
    text_field: str = typer.Option(defaults.TEXT_FIELD, "--text-field", help="Field of .jsonl rows / dataset column "
                                   "to read."),
    method: str = typer.Option(defaults.PPL_METHOD, "--method", help=METHOD_HELP),
    ctx: int = typer.Option(None, "--ctx", callback=in_range(2), help=f"Window of chunks (default {defaults.PPL_CTX}) "
                            f"and llamacpp (default {defaults.PPL_LLAMACPP_CTX}, >= 4): 2 to the model's context."),
    max_length: int = typer.Option(None, "--max-length", callback=in_range(2), help="Window of sliding (default "
                                   f"{defaults.PPL_CTX}) and rolling (default: the model's max_position_embeddings): "
                                   "2 to the model's context."),
    stride: int = typer.Option(defaults.PPL_STRIDE, "--stride", callback=in_range(1),
                               help="Step between sliding windows, 1 to --max-length."),
    limit: int = typer.Option(None, "--limit", callback=in_range(2), help="Use only the first N tokens, >= 2 "
                              "(rolling: whole documents up to N tokens)."),
    batch_size: int = typer.Option(defaults.PPL_BATCH_SIZE, "--batch-size", "-b", callback=in_range(1, MAX_BATCH),
                                   help=f"Windows per forward, 1 to {MAX_BATCH}."),
    base_model: str = typer.Option(None, "--base-model", help="Also report KL divergence and top-1 agreement "
                                   "against this model (same tokenizer), in the same pass."),
    quantization: str = common.QuantizationOpt,
    lm_head_dtype: str = common.LmHeadDtypeOpt,
    kv_cache_dtype: str = typer.Option(None, "--kv-cache-dtype", help="Score through the engine's paged KV cache "
                                       "in this dtype (auto, float32, bfloat16, float16, fp8, fp8_e4m3, "
                                       "fp8_e5m2, int8, int4, kivi2: KIVI's paper sizes, read as it decodes); "
                                       "default: dense attention, no cache. --base-model then "
                                       "scores through a float32 cache the same way: with the same model, the "
                                       "KL divergence is the cache's."),
    json_out: bool = common.JsonOpt,
    out_file: str = typer.Option(None, "--output", "-o", help="Also write the JSON result to this file."),
    quiet: bool = common.QuietOpt,
) -> None:
    """Perplexity (and KL divergence against a base model) on a text, by a peer's exact protocol."""
    # deferred: keep CLI start-up fast
    from llmopt.eval import load_text_dataset, plan_ppl, run_ppl
    from llmopt.fsutil import check_output_file
    from llmopt.models.loader import load_model

    if out_file:   # refused before any scoring: a folder, a missing folder, the dataset or a model file itself
        check_output_file(out_file, [dataset, model, base_model])
    if kv_cache_dtype is not None:   # refused before loading anything
        from llmopt.kernels import kv_cache_torch_dtype
        kv_cache_torch_dtype(kv_cache_dtype, None)
    data = load_text_dataset(dataset, text_field)
    lm = load_model(model, dtype, device, quantization=quantization, lm_head_dtype=lm_head_dtype)
    base = load_model(base_model, dtype, device) if base_model else None
    plan = plan_ppl(lm.tokenizer, lm.config.max_position_embeddings, data, method, ctx=ctx,
                    max_length=max_length, stride=stride, limit=limit)
    with output.progress(f"eval-ppl {method}", len(plan.windows), enabled=not quiet) as advance:
        result = run_ppl(lm, plan, batch_size, base=base, progress=advance, kv_cache_dtype=kv_cache_dtype)
    output.emit(result, as_json=json_out, table=_table, output=out_file)

