"""Options shared by every command that loads a model, so flags read the same everywhere."""

from __future__ import annotations

import typer

from llmopt import defaults
from llmopt.cli.ranges import in_range
from llmopt.units import SIZE_HELP

ModelOpt = typer.Option(None, "--model", "-m", help="Checkpoint folder, .gguf file, Hugging Face id in the local "
                        f"cache, or a built-in name (default: {defaults.DEFAULT_MODEL}).")
DtypeOpt = typer.Option(defaults.DTYPE, "--dtype", help="auto|float32|bfloat16|float16 (auto: float32 on the CPU, "
                        "the checkpoint's dtype on a GPU).")
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
KvCacheDtypeOpt = typer.Option(defaults.KV_CACHE_DTYPE, "--kv-cache-dtype", help="auto, fp8, fp8_e4m3, fp8_e5m2 or int8.")
MaxModelLenOpt = typer.Option(None, "--max-model-len", callback=in_range(2),
                              help="Context per request, 2 to the model's context length (the default).")
MaxNumSeqsOpt = typer.Option(defaults.MAX_NUM_SEQS, "--max-num-seqs", callback=in_range(1),
                             help="Requests per engine step, >= 1.")
MaxNumBatchedTokensOpt = typer.Option(defaults.MAX_NUM_BATCHED_TOKENS, "--max-num-batched-tokens", callback=in_range(0),
                                      help="Token budget per step (chunked prefill), >= 1; 0 = unlimited.")
PrefixCachingOpt = typer.Option(defaults.ENABLE_PREFIX_CACHING, "--enable-prefix-caching/--no-enable-prefix-caching",
                                help="Reuse the KV blocks of prompt prefixes seen before.")
AttentionBackendOpt = typer.Option(defaults.ATTENTION_BACKEND, "--attention-backend",
                                   help="auto, torch or triton (auto: triton on CUDA, torch on the CPU).")
SpeculativeConfigOpt = typer.Option(None, "--speculative-config",
                                    help="vLLM's speculative decoding config: a JSON object (method ngram|draft_model|"
                                    "eagle|eagle3, model, num_speculative_tokens, prompt_lookup_min/max, "
                                    "disable_by_batch_size) or a spec_config.json from llmopt spec-tune.")
