"""Options shared by every command that loads a model, so flags read the same everywhere."""

from __future__ import annotations

import inspect
from typing import Any, Callable, TypeVar

import typer

from llmopt import defaults
from llmopt.cli.ranges import in_range
from llmopt.units import SIZE_HELP, parse_bytes

F = TypeVar("F", bound=Callable[..., Any])

ModelOpt = typer.Option(None, "--model", "-m", help="Checkpoint folder, .gguf file, Hugging Face id in the local "
                        f"cache, or a built-in name (default: {defaults.DEFAULT_MODEL}).")
DtypeOpt = typer.Option(defaults.DTYPE, "--dtype", help="auto|float32|bfloat16|float16. On a GPU the model runs "
                        "in it (auto: the checkpoint's dtype). On the CPU it computes in float32 and this is "
                        "how the weights are held (auto: a bfloat16/float16 checkpoint stays 16-bit).")
DeviceOpt = typer.Option(defaults.DEVICE, "--device", help="auto|cpu|cuda.")
JsonOpt = typer.Option(False, "--json", help="Print one JSON object on stdout (an error too: "
                       '{"error": {"message", "type", "exit_code"}}).')
JsonLinesOpt = typer.Option(False, "--json", help="Print JSON Lines on stdout: one object per completion (an "
                            'error: one {"error": {"message", "type", "exit_code"}} object).')
QuietOpt = typer.Option(False, "--quiet", "-q", help="No progress bar.")
QuantizationOpt = typer.Option(None, "--quantization", help="int8 or fp8: quantize a float checkpoint's "
                               "linear layers per channel as they load (no calibration).")
LmHeadDtypeOpt = typer.Option(defaults.LM_HEAD_DTYPE, "--lm-head-dtype", help="auto, float or int8 (auto: "
                              "int8 per row for a quantized model on the CPU, else float).")
EnforceEagerOpt = typer.Option(defaults.ENFORCE_EAGER, "--enforce-eager/--no-enforce-eager",
                               help="Never compile the decode step (vLLM's flag); else decode steps of up to "
                               f"{max(defaults.COMPILE_BATCH_BUCKETS)} sequences on the CPU run a torch.compile "
                               "graph, compiled on first use and cached.")

# -- the engine's flags (generate, serve, bench offline): vLLM's names ---------------------------------
BlockSizeOpt = typer.Option(defaults.BLOCK_SIZE, "--block-size", callback=in_range(1),
                            help="Tokens per KV-cache block, >= 1.")
KvCacheMemoryOpt = typer.Option(None, "--kv-cache-memory-bytes", "--kv-cache-memory",
                                help=f"KV-cache bytes: {SIZE_HELP}; at most the device's free memory; default: "
                                "--gpu-memory-utilization on a GPU, 1GiB on the CPU.")
GpuMemoryUtilizationOpt = typer.Option(defaults.GPU_MEMORY_UTILIZATION, "--gpu-memory-utilization",
                                       callback=in_range(0, 1, lo_open=True),
                                       help="Share of the GPU's memory for weights, activations and the KV cache, "
                                       "(0, 1] (vLLM's meaning).")
KvCacheDtypeOpt = typer.Option(defaults.KV_CACHE_DTYPE, "--kv-cache-dtype",
                               help="auto (a 16-bit model's dtype, else the compute dtype: float32 on the CPU), "
                               "float32, bfloat16, float16, fp8, fp8_e4m3, fp8_e5m2, int8, int4 (llama.cpp's q4_0 "
                               "blocks along each head: 4.5 bits a value; head_dim a multiple of 32) or kivi2 (KIVI: "
                               "2-bit keys per channel and values per token, the last --kivi-residual-length tokens "
                               "in full precision; the block size becomes --kivi-group-size).")
MaxModelLenOpt = typer.Option(None, "--max-model-len", callback=in_range(2),
                              help="Context per request, 2 to the model's context length (the default).")
MaxNumSeqsOpt = typer.Option(defaults.MAX_NUM_SEQS, "--max-num-seqs", callback=in_range(1),
                             help="Requests per engine step, >= 1.")
MaxNumBatchedTokensOpt = typer.Option(None, "--max-num-batched-tokens", callback=in_range(0),
                                      help="Token budget per step (chunked prefill), >= 1; 0 = unlimited. "
                                      f"Default: {defaults.MAX_NUM_BATCHED_TOKENS} on a GPU, "
                                      f"{defaults.MAX_NUM_BATCHED_TOKENS_CPU} on the CPU.")
PrefixCachingOpt = typer.Option(defaults.ENABLE_PREFIX_CACHING, "--enable-prefix-caching/--no-enable-prefix-caching",
                                help="Reuse the KV blocks of prompt prefixes seen before.")
AttentionBackendOpt = typer.Option(defaults.ATTENTION_BACKEND, "--attention-backend",
                                   help="auto, torch or triton (auto: triton on CUDA, torch on the CPU).")
SpeculativeConfigOpt = typer.Option(None, "--speculative-config",
                                    help="vLLM's speculative decoding config: a JSON object (method ngram|draft_model|"
                                    "eagle|eagle3, model, num_speculative_tokens, prompt_lookup_min/max, "
                                    "disable_by_batch_size) or a spec_config.json from llmopt spec-tune.")
TensorParallelSizeOpt = typer.Option(defaults.TENSOR_PARALLEL_SIZE, "--tensor-parallel-size", "-tp",
                                     callback=in_range(1),
                                     help="Ranks to split the model over, >= 1 (vLLM's flag): dividing the attention "
                                     "heads and the MLP width, and dividing the KV heads or a multiple of them. The "
                                     "engine starts one process per extra rank (gloo on the CPU, NCCL on GPUs), or "
                                     "runs under torchrun (docs/parallel.md).")

KvOffloadBytesOpt = typer.Option(None, "--kv-offload-bytes",
                                 help=f"A second KV tier ({SIZE_HELP}): full prefix-cache blocks evicted from the "
                                 "cache are kept there and copied back on a hit, a preempted request's too. Host "
                                 "memory, or a file in --kv-offload-dir.")
KvOffloadDirOpt = typer.Option(None, "--kv-offload-dir",
                               help="Keep the --kv-offload-bytes tier in a memory-mapped file in this folder: a "
                               "restart with the same model, dtypes and block size finds its blocks.")
KiviGroupSizeOpt = typer.Option(defaults.KIVI_GROUP_SIZE, "--kivi-group-size", callback=in_range(4),
                                help="kivi2: tokens a key group spans and channels a value group spans (the paper's "
                                f"{defaults.KIVI_GROUP_SIZE}); a multiple of 4.")
KiviResidualLengthOpt = typer.Option(defaults.KIVI_RESIDUAL_LENGTH, "--kivi-residual-length", callback=in_range(0),
                                     help="kivi2: the most recent tokens kept in full precision (the paper's "
                                     f"{defaults.KIVI_RESIDUAL_LENGTH}); a multiple of the group size.")
HybridOpt = typer.Option(False, "--disable-hybrid-kv-cache-manager",
                         help="vLLM's flag: layers of different windows share one block table and keep every "
                         "block (default: a table per window, each freeing what its window has left).")

# name -> (type, option): the one declaration of the engine's flags. A command takes them with
# @engine_options(...) as **engine and turns them into EngineArgs with engine_args_from_flags.
ENGINE_FLAGS: dict[str, tuple[type, Any]] = {
    "dtype": (str, DtypeOpt),
    "device": (str, DeviceOpt),
    "block_size": (int, BlockSizeOpt),
    "kv_cache_memory": (str, KvCacheMemoryOpt),
    "gpu_memory_utilization": (float, GpuMemoryUtilizationOpt),
    "kv_cache_dtype": (str, KvCacheDtypeOpt),
    "max_model_len": (int, MaxModelLenOpt),
    "max_num_seqs": (int, MaxNumSeqsOpt),
    "max_num_batched_tokens": (int, MaxNumBatchedTokensOpt),
    "prefix_caching": (bool, PrefixCachingOpt),
    "attention_backend": (str, AttentionBackendOpt),
    "quantization": (str, QuantizationOpt),
    "lm_head_dtype": (str, LmHeadDtypeOpt),
    "enforce_eager": (bool, EnforceEagerOpt),
    "speculative_config": (str, SpeculativeConfigOpt),
    "tensor_parallel_size": (int, TensorParallelSizeOpt),
    "kv_offload_bytes": (str, KvOffloadBytesOpt),
    "kv_offload_dir": (str, KvOffloadDirOpt),
    "disable_hybrid_kv_cache_manager": (bool, HybridOpt),
    "kivi_group_size": (int, KiviGroupSizeOpt),
    "kivi_residual_length": (int, KiviResidualLengthOpt),
}
# flag name -> EngineArgs field, where they differ
_ENGINE_FIELDS = {"prefix_caching": "enable_prefix_caching"}


def engine_options(*, exclude: tuple[str, ...] = (), before: str | None = None) -> Callable[[F], F]:
    """Add the engine's flags (ENGINE_FLAGS less `exclude`) to a command function that takes them
    as **engine: keyword-only parameters in its __signature__ (which Typer reads), placed before the
    parameter `before` (default: last), so --help lists them there."""
    names = [n for n in ENGINE_FLAGS if n not in exclude]

    def decorate(fn: F) -> F:
        sig = inspect.signature(fn, eval_str=True)
        params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
        added = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=ENGINE_FLAGS[n][0],
                                   default=ENGINE_FLAGS[n][1]) for n in names]
        at = next(i for i, p in enumerate(params) if p.name == before) if before else len(params)
        # keyword-only from there on: the order of a signature's kinds must not go down
        tail = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params[at:]]
        fn.__signature__ = sig.replace(parameters=params[:at] + added + tail)   # type: ignore[attr-defined]
        return fn
    return decorate


def engine_flags_given(engine: dict[str, Any]) -> list[str]:
    """The flags of `engine` (the **engine of a command) set to other than their defaults."""
    return [ENGINE_FLAGS[k][1].param_decls[0].split("/")[0] for k, v in engine.items()
            if v != ENGINE_FLAGS[k][1].default]


def engine_args_from_flags(engine: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """EngineArgs' keyword arguments from the engine's flags (sizes parsed, vLLM's field names) and
    `extra` (model, seed, ...)."""
    out = {_ENGINE_FIELDS.get(k, k): v for k, v in engine.items()}
    if out.get("kv_cache_memory") is not None:
        out["kv_cache_memory"] = parse_bytes(out["kv_cache_memory"], "--kv-cache-memory")
    if out.get("kv_offload_bytes") is not None:
        out["kv_offload_bytes"] = parse_bytes(out["kv_offload_bytes"], "--kv-offload-bytes")
    return out | extra
