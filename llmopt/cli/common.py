"""Options shared by every command that loads a model, so flags read the same everywhere."""

from __future__ import annotations

import typer

from llmopt import defaults

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
