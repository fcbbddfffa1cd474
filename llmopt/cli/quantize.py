"""`llmopt quantize`: AWQ, GPTQ, RTN, FP8, INT8, NVFP4, MXFP4 and NF4 into AutoAWQ, GPTQ,
compressed-tensors, GGUF or bitsandbytes checkpoints, one decoder layer at a time."""

from __future__ import annotations

import typer

from llmopt import defaults
from llmopt.cli import common, output
from llmopt.cli.evaluate import task_table
from llmopt.cli.ranges import in_range
from llmopt.errors import UserInputError
from llmopt.validate import SEED_MAX, SEED_MIN


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _tables(r):
    group = [] if r.group_size is None else [  # fp8/int8: per-channel scales, no group size
        ("group size", f"{r.group_size}" + (f" ({r.group_size_reason})" if r.group_size_reason else ""))]
    rows = [("output", r.output), ("source", r.source), ("method", r.method), ("format", r.format),
            ("bits", r.bits), *group, ("symmetric", r.sym),
            ("calibration", f"{r.calib_samples} x {r.calib_seq_len} tokens"),
            ("size before", _mb(r.size_before)), ("size after", _mb(r.size_after)),
            ("compression", f"{r.size_before / max(r.size_after, 1):.2f}x"),
            ("layer error mean", r.mean_rel_error), ("layer error max", r.max_rel_error), ("seconds", r.seconds)]
    tables = [output.kv_table("quantize", rows)]
    t = output.Table(title="per-layer reconstruction error ||y_q - y||^2 / ||y - x||^2", title_justify="left")
    for c in ("layer", "error", "seconds"):
        t.add_column(c, justify="right")
    for lr in r.layers:
        t.add_row(str(lr.layer), output.fmt(lr.rel_error), f"{lr.seconds:.1f}")
    tables.append(t)
    if r.eval:
        e = r.eval
        tables.append(output.kv_table(f"eval-ppl {e.method} {e.window} (before -> after)", [
            ("perplexity before", e.perplexity_before), ("perplexity after", e.perplexity_after),
            ("KLD mean", e.kld_mean), ("top-1 agreement", e.top1_agreement), ("scored tokens", e.scored_tokens)]))
    if r.task_eval:
        tables.append(task_table(r.task_eval))
    return tables


# Shown under Examples in --help (app.py registers the command); one short line each.
EXAMPLES = [
    "llmopt quantize --method awq --group-size 64 -o out/smollm2-awq",
    "llmopt quantize --recipe recipes/gptq-w4-g64.yaml -o out/gptq --eval",
    "llmopt quantize -o out/awq --eval-tasks arc_easy --eval-task-limit 200",
    "llmopt quantize --method nvfp4 --fp4-algorithm gptq -o out/nvfp4",
    "llmopt quantize --method mxfp4 --format gguf -o out/model-mxfp4.gguf",
]


def quantize(
    model: str = common.ModelOpt,
    method: str = typer.Option(None, "--method", help="awq | gptq | rtn | fp8 | int8 | nvfp4 | mxfp4 | nf4 (default "
                               "awq; nvfp4/mxfp4: 4-bit float weights, blocks of 16 / 32; nf4: bitsandbytes, "
                               "double quantized)."),
    bits: int = typer.Option(None, "--bits", help="4 or 8 (default 4; fp8/int8 are 8; 2 and 3 for experiments)."),
    group_size: int = typer.Option(None, "--group-size", callback=in_range(1, allow=(-1,)),
                                   help="Weights per scale: a positive divisor of every layer's width (128, 64, 32...) "
                                   "or -1 (one group per row); default: the largest of "
                                   f"{', '.join(map(str, defaults.QUANT_GROUP_SIZES))} that divides them all "
                                   "(SmolLM2's 576: 64)."),
    sym: bool = typer.Option(None, "--sym/--asym", help="Symmetric, or with zero points (default: sym, asym for awq)."),
    out_dir: str = typer.Option(None, "--output", "-o", help="Folder to write, or FILE.gguf with "
                                 "--format gguf (required, or `output` in --recipe)."),
    calib_data: str = typer.Option(None, "--calib-data", help="Text file, .jsonl (with --text-field) or Hugging Face "
                                   f"dataset path[:config[:split]] (local cache; split default {defaults.CALIB_SPLIT}) "
                                   f"(default {defaults.CALIB_DATA})."),
    text_field: str = typer.Option(None, "--text-field", help="Field of .jsonl rows / dataset column of --calib-data "
                                   f"(default {defaults.TEXT_FIELD})."),
    num_samples: int = typer.Option(None, "--num-samples", callback=in_range(1, defaults.QUANT_MAX_NUM_SAMPLES),
                                    help=f"Calibration windows, 1 to {defaults.QUANT_MAX_NUM_SAMPLES} "
                                    f"(default {defaults.QUANT_NUM_SAMPLES})."),
    seq_len: int = typer.Option(None, "--seq-len", callback=in_range(2), help="Tokens per window, 2 to the model's "
                                f"context (default {defaults.QUANT_SEQ_LEN})."),
    seed: int = typer.Option(None, "--seed", callback=in_range(SEED_MIN, SEED_MAX),
                             help=f"Seed of the window sampling, a 64-bit integer (default {defaults.QUANT_SEED})."),
    fmt: str = typer.Option(None, "--format", help="awq | gptq | compressed-tensors | gguf | bitsandbytes | "
                            "dequantized (default: awq for awq, gptq for gptq, bitsandbytes for nf4, "
                            "compressed-tensors otherwise; gguf: one llama.cpp file, Q4_1 / Q4_0 (--sym) / Q8_0 "
                            "or MXFP4 blocks)."),
    damp: float = typer.Option(None, "--damp", callback=in_range(0, 1, lo_open=True, hi_open=True),
                               help="GPTQ dampening, fraction of the mean Hessian diagonal, (0, 1) "
                               f"(default {defaults.GPTQ_DAMP})."),
    act_order: str = typer.Option(None, "--act-order", help="GPTQ column order: static (default: by decreasing Hessian "
                                  "diagonal, natural groups), group (GPTQModel's desc_act: g_idx, --format gptq only) "
                                  "or none."),
    smoothquant_alpha: float = typer.Option(None, "--smoothquant-alpha", callback=in_range(0, 1),
                                            help="INT8 W8A8 SmoothQuant migration strength, 0 to 1 "
                                            f"(default {defaults.SMOOTHQUANT_ALPHA})."),
    awq_duo_scaling: bool = typer.Option(None, "--awq-duo-scaling/--no-awq-duo-scaling",
                                         help="AWQ scales x^a / w^(1-a) (AutoAWQ's default) instead of x^a."),
    fp8_scale: str = typer.Option(None, "--fp8-scale", help="FP8 weight scales: channel (default) or tensor."),
    activations: str = typer.Option(None, "--activations", help="fp8/int8: dynamic (W8A8, default) or none (weight-only); "
                                    "nvfp4/mxfp4: none (W4A16, default) or dynamic (W4A4: FP4 activations per "
                                    "block, NVFP4's global scale calibrated; compressed-tensors' NVFP4 / MXFP4)."),
    fp4_algorithm: str = typer.Option(None, "--fp4-algorithm", help="nvfp4/mxfp4: rtn (round to nearest, default) or "
                                      "gptq (GPTQ's error feedback over the calibration data, as llm-compressor)."),
    recipe: str = typer.Option(None, "--recipe", help="YAML file whose keys mirror these flags; flags override it."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace --output if it exists."),
    run_eval: bool = typer.Option(False, "--eval", help="Perplexity before and after (eval-ppl chunks, KLD vs the source)."),
    eval_limit: int = typer.Option(defaults.QUANT_EVAL_LIMIT, "--eval-limit", callback=in_range(defaults.PPL_CTX),
                                   help=f"Tokens of WikiText-2 test for --eval, >= {defaults.PPL_CTX} (one window)."),
    eval_tasks: str = typer.Option(None, "--eval-tasks", help="Also run these lm-eval tasks (comma-separated) on "
                                   "the output and its source, as `llmopt eval --base-model` (the `eval` extra)."),
    eval_task_limit: float = typer.Option(None, "--eval-task-limit", help="Documents per --eval-tasks task: a count "
                                          "(>= 1) or a fraction (< 1), as lm-eval's --limit (default: all)."),
    eval_include_path: str = typer.Option(None, "--eval-include-path", help="A folder of lm-eval task YAML files "
                                          "for --eval-tasks, as lm-eval's --include_path."),
    json_out: bool = common.JsonOpt,
    quiet: bool = common.QuietOpt,
) -> None:
    """Quantize a checkpoint layer by layer (peak memory: one layer plus the calibration activations)."""
    # deferred: keep CLI start-up fast
    from llmopt.quant.evaluate import plan_quant_eval, run_quant_eval
    from llmopt.quant.pipeline import quantize_model
    from llmopt.quant.config import merge_sources
    from llmopt.eval.tasks import check_tasks, parse_limit, parse_task_names, run_tasks, task_manager

    job = merge_sources(recipe, dict(
        model=model, output=out_dir, method=method, bits=bits, group_size=group_size, sym=sym,
        calib_data=calib_data, text_field=text_field, num_samples=num_samples, seq_len=seq_len, seed=seed,
        format=fmt, damp=damp,
        act_order=act_order, smoothquant_alpha=smoothquant_alpha, awq_duo_scaling=awq_duo_scaling,
        fp8_scale=fp8_scale, activations=activations, fp4_algorithm=fp4_algorithm))
    if eval_tasks is None and (eval_task_limit is not None or eval_include_path is not None):
        raise UserInputError("--eval-task-limit and --eval-include-path go with --eval-tasks")
    if eval_tasks is not None:   # bad tasks, limits and missing data are refused before quantizing
        names, task_limit = parse_task_names(eval_tasks), parse_limit(eval_task_limit, "--eval-task-limit")
        manager = task_manager(eval_include_path)
        check_tasks(names, manager, "--eval-tasks")
    with output.progress(f"quantize {job.qconfig.method}", None, enabled=not quiet) as advance:
        result = quantize_model(job.model, job.output, job.qconfig, overwrite=overwrite, progress=advance,
                                on_start=advance.set_total)
    if run_eval:
        plan = plan_quant_eval(result.source, result.output, limit=eval_limit)
        with output.progress("eval-ppl", plan.windows, enabled=not quiet) as advance:
            result.eval = run_quant_eval(plan, progress=advance)
    if eval_tasks is not None:
        with output.progress("lm-eval", 2, enabled=not quiet) as advance:
            result.task_eval = run_tasks(str(result.output), names, base_model=str(result.source), limit=task_limit,
                                         progress=advance, manager=manager)
    output.emit(result, as_json=json_out, table=_tables)
