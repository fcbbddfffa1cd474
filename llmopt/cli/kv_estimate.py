"""`llmopt kv-estimate`: does the model fit, how many requests, how long a context, at which dtype."""

from __future__ import annotations

from typing import Optional

import typer

from llmopt import defaults
from llmopt.cli import output
from llmopt.cache.kivi import kivi_config
from llmopt.cli.common import JsonOpt, KiviGroupSizeOpt, KiviResidualLengthOpt, ModelOpt
from llmopt.cli.kv_estimate_view import list_presets as show_presets
from llmopt.cli.kv_estimate_view import render
from llmopt.cli.ranges import in_range
from llmopt.errors import DoesNotFitError, UserInputError
from llmopt.units import SIZE_HELP

GIB = 1 << 30
MAX_GIB = 1 << 20        # --gpu-memory / --reserve-gib at most (1 PiB)
MAX_LAYERS = 4096        # --num-layers at most (the plan lists every layer)


# Shown under Examples in --help (app.py registers the command); one short line each.
EXAMPLES = [
    "llmopt kv-estimate --model Qwen/Qwen2.5-7B --gpu H100-80GB",
    "llmopt kv-estimate --gpu-memory 8 --max-model-len 8k --require-fit",
]


def kv_estimate(
    model: Optional[str] = ModelOpt,
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU preset: H100-80GB, H200, A100-40GB, A100-80GB, L40S, "
                                      "L4, RTX-4090 (see --list-presets)."),
    gpu_memory: Optional[float] = typer.Option(None, "--gpu-memory", callback=in_range(0.001, MAX_GIB),
                                               help=f"GPU memory in GiB, 0.001 to {MAX_GIB} (instead of --gpu)."),
    gpu_memory_utilization: float = typer.Option(defaults.GPU_MEMORY_UTILIZATION, "--gpu-memory-utilization",
                                                 callback=in_range(0, 1, lo_open=True),
                                                 help="Share of GPU memory the server may use, (0, 1] (vLLM's "
                                                 "meaning)."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", "-tp", callback=in_range(1),
                                             help="GPUs per replica, >= 1: as the engine takes it, dividing the "
                                             "attention heads and the MLP width, and dividing the KV heads or a "
                                             "multiple of them."),
    device: str = typer.Option(defaults.DEVICE, "--device", help="auto|cpu|cuda: where the plan runs (auto: a GPU "
                               "with --gpu/--gpu-memory, else what the engine picks on this machine)."),
    dtype: str = typer.Option(defaults.DTYPE, "--dtype", help="auto|float32|bfloat16|float16: the model's dtype, as "
                              "the engine resolves it (auto: float32 on the CPU, the checkpoint's dtype on a GPU)."),
    kv_cache_dtype: str = typer.Option(defaults.KV_CACHE_DTYPE, "--kv-cache-dtype",
                                       help="auto (the model's dtype)|float32|bfloat16|float16|fp8|fp8_e4m3|fp8_e5m2|"
                                       "int8|int4|kivi2|fp8_ds_mla."),
    block_size: int = typer.Option(defaults.BLOCK_SIZE, "--block-size", callback=in_range(1),
                                   help="Tokens per KV block, >= 1 (kivi2: its group size)."),
    kivi_group_size: int = KiviGroupSizeOpt,
    kivi_residual_length: int = KiviResidualLengthOpt,
    max_model_len: Optional[str] = typer.Option(None, "--max-model-len", help="Context per request, e.g. 32768 or 32k "
                                                "(default: the model's max_position_embeddings)."),
    max_num_batched_tokens: Optional[str] = typer.Option(None, "--max-num-batched-tokens",
                                                         help="Tokens per scheduler step (caps sliding-window blocks; "
                                                         "sizes kivi2's residual); default: the engine's, "
                                                         f"{defaults.MAX_NUM_BATCHED_TOKENS} on a GPU, "
                                                         f"{defaults.MAX_NUM_BATCHED_TOKENS_CPU} on the CPU."),
    max_num_seqs: int = typer.Option(defaults.MAX_NUM_SEQS, "--max-num-seqs", callback=in_range(1),
                                     help="Requests per step, >= 1 (sizes logits)."),
    kv_cache_memory: Optional[str] = typer.Option(None, "--kv-cache-memory", help=f"KV cache bytes per GPU: {SIZE_HELP} "
                                                  "(instead of deriving it from the GPU budget)."),
    reserve_gib: Optional[float] = typer.Option(None, "--reserve-gib", callback=in_range(0, MAX_GIB),
                                                help=f"Non-KV, non-weight memory per GPU in GiB, 0 to {MAX_GIB} "
                                                "(default: estimated activations + logits + runtime)."),
    weight_format: str = typer.Option("auto", "--weight-format", help="auto|bfloat16|float16|float32|fp8|fp8-block|"
                                      "int8|int4|nvfp4|mxfp4|nf4|<GGML type such as q4_k>."),
    group_size: Optional[int] = typer.Option(None, "--group-size", callback=in_range(1, allow=(-1,)),
                                             help="Group size for --weight-format int4, dividing the layer widths "
                                             f"(default {defaults.QUANT_GROUP_SIZE}; -1 per channel)."),
    batch_sizes: Optional[str] = typer.Option(None, "--batch-sizes", help="Grid mode: batch sizes, e.g. 1,8,32."),
    seq_lens: Optional[str] = typer.Option(None, "--seq-lens", help="Grid mode: context lengths, e.g. 2k,8k,32k."),
    naive: bool = typer.Option(False, "--naive", help="Show the 2 x layers x hidden x seq x batch x bytes formula beside."),
    require_fit: bool = typer.Option(False, "--require-fit", help="Exit with code 3 when it does not fit (CI gate)."),
    no_hybrid: bool = typer.Option(False, "--no-hybrid", help="Like vLLM --disable-hybrid-kv-cache-manager: "
                                   "sliding-window layers hold full-length blocks."),
    what_if: bool = typer.Option(True, "--what-if/--no-what-if", help="Also show fp8 KV, quantized weights, "
                                 "2x GPUs and the longest fitting context under the same budget."),
    list_presets: bool = typer.Option(False, "--list-presets", help="List model and GPU presets and exit."),
    num_layers: Optional[int] = typer.Option(None, "--num-layers", callback=in_range(1, MAX_LAYERS),
                                             help=f"Override: decoder layers, 1 to {MAX_LAYERS}."),
    num_kv_heads: Optional[int] = typer.Option(None, "--num-kv-heads", callback=in_range(1),
                                               help="Override: KV heads, >= 1."),
    head_dim: Optional[int] = typer.Option(None, "--head-dim", callback=in_range(1),
                                           help="Override: head dimension, >= 1."),
    hidden_size: Optional[int] = typer.Option(None, "--hidden-size", callback=in_range(1),
                                              help="Override: hidden size, >= 1."),
    num_attention_heads: Optional[int] = typer.Option(None, "--num-attention-heads", callback=in_range(1),
                                                      help="Override: query heads, >= 1."),
    intermediate_size: Optional[int] = typer.Option(None, "--intermediate-size", callback=in_range(1),
                                                    help="Override: MLP width, >= 1."),
    vocab_size: Optional[int] = typer.Option(None, "--vocab-size", callback=in_range(1),
                                             help="Override: vocabulary size, >= 1."),
    sliding_window: Optional[int] = typer.Option(None, "--sliding-window", callback=in_range(0),
                                                 help="Override: window, >= 1 (0: none)."),
    kv_lora_rank: Optional[int] = typer.Option(None, "--kv-lora-rank", callback=in_range(1),
                                               help="Override: MLA latent rank, >= 1."),
    as_json: bool = JsonOpt,
) -> None:
    """Plan KV-cache and weight memory: bytes per token, blocks, concurrency, longest context, fit."""
    if list_presets:
        show_presets(as_json)
        return
    from llmopt.estimate import estimate, resolve_model_arch
    from llmopt.estimate.kv import canonical_kv_dtype
    from llmopt.units import parse_bytes, parse_list, parse_tokens
    overrides = {"num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                 "hidden_size": hidden_size, "num_attention_heads": num_attention_heads,
                 "intermediate_size": intermediate_size, "vocab_size": vocab_size,
                 "sliding_window": sliding_window, "kv_lora_rank": kv_lora_rank}
    arch = resolve_model_arch(model, overrides)
    if reserve_gib is not None and reserve_gib < 0:
        raise UserInputError(f"--reserve-gib must be non-negative, got {reserve_gib}")
    est = estimate(
        arch, device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
        max_model_len=parse_tokens(max_model_len, "--max-model-len") if max_model_len else None,
        max_num_batched_tokens=parse_tokens(max_num_batched_tokens, "--max-num-batched-tokens")
        if max_num_batched_tokens is not None else None,
        max_num_seqs=max_num_seqs, tensor_parallel_size=tensor_parallel_size, gpu=gpu, gpu_memory_gib=gpu_memory,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_memory=parse_bytes(kv_cache_memory, "--kv-cache-memory") if kv_cache_memory is not None else None,
        reserve_bytes=None if reserve_gib is None else int(reserve_gib * GIB), weight_format=weight_format,
        group_size=group_size, batch_sizes=parse_list(batch_sizes, "--batch-sizes") if batch_sizes else None,
        seq_lens=parse_list(seq_lens, "--seq-lens") if seq_lens else None, naive=naive, hybrid=not no_hybrid,
        what_if=what_if, kivi=kivi_config(canonical_kv_dtype(kv_cache_dtype, arch), kivi_group_size,
                                          kivi_residual_length))
    if est.max_model_len > est.max_position_embeddings:   # as the engine and vLLM refuse it
        raise UserInputError(f"--max-model-len {est.max_model_len:,} is longer than the model's context of "
                             f"{est.max_position_embeddings:,} tokens (max_position_embeddings): give at most that")
    output.emit(est, as_json=as_json, table=render)
    if require_fit:
        if est.fits is None:
            raise UserInputError("--require-fit needs a memory budget: --gpu, --gpu-memory or --kv-cache-memory")
        if not est.fits:
            raise DoesNotFitError("does not fit: " + "; ".join(est.problems))
