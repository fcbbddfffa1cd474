"""`llmopt serve`: the OpenAI-compatible server (llmopt/serve) on one model, with vLLM's flag names."""

from __future__ import annotations

import logging
import sys

import typer

from llmopt import defaults
from llmopt.cli import common
from llmopt.errors import UserInputError
from llmopt.units import SIZE_HELP, parse_bytes

# Shown under Examples in --help (app.py registers the command); one short line each.
EXAMPLES = [
    "llmopt serve --port 8000",
    "llmopt serve --model out/smollm2-awq --served-model-name smol --api-key KEY",
]


def serve(
    model: str = common.ModelOpt,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, "--port"),
    api_key: str = typer.Option(None, "--api-key", envvar="LLMOPT_API_KEY",
                                help="Require `Authorization: Bearer KEY` on /v1/* (or LLMOPT_API_KEY)."),
    served_model_name: str = typer.Option(None, "--served-model-name",
                                          help="The model name clients send (default: --model)."),
    dtype: str = common.DtypeOpt,
    device: str = common.DeviceOpt,
    block_size: int = typer.Option(defaults.BLOCK_SIZE, "--block-size"),
    kv_cache_memory: str = typer.Option(None, "--kv-cache-memory-bytes", "--kv-cache-memory",
                                        help=f"KV-cache bytes: {SIZE_HELP}; default: --gpu-memory-utilization "
                                        "on a GPU, 1GiB on the CPU."),
    gpu_memory_utilization: float = typer.Option(defaults.GPU_MEMORY_UTILIZATION, "--gpu-memory-utilization"),
    kv_cache_dtype: str = typer.Option(defaults.KV_CACHE_DTYPE, "--kv-cache-dtype",
                                       help="auto|fp8|fp8_e4m3|fp8_e5m2|int8."),
    max_model_len: int = typer.Option(None, "--max-model-len", help="Default: the model's context length."),
    max_num_seqs: int = typer.Option(defaults.MAX_NUM_SEQS, "--max-num-seqs"),
    max_num_batched_tokens: int = typer.Option(defaults.MAX_NUM_BATCHED_TOKENS, "--max-num-batched-tokens",
                                               help="Token budget per step (chunked prefill); 0 = unlimited."),
    max_num_queued_reqs: int = typer.Option(None, "--max-num-queued-reqs",
                                            help="Answer 503 above this many queued sequences (default: no cap)."),
    prefix_caching: bool = typer.Option(defaults.ENABLE_PREFIX_CACHING,
                                        "--enable-prefix-caching/--no-enable-prefix-caching"),
    scheduling_policy: str = typer.Option(defaults.SCHEDULING_POLICY, "--scheduling-policy", help="fcfs|priority."),
    attention_backend: str = typer.Option(defaults.ATTENTION_BACKEND, "--attention-backend", help="auto|torch|triton."),
    seed: int = typer.Option(0, "--seed", help="Seed of the engine's sampler."),
    log_level: str = typer.Option("info", "--uvicorn-log-level", help="uvicorn's log level."),
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (completions, chat, models, metrics)."""
    if not 0 < port < 65536:
        raise UserInputError(f"--port must be in 1..65535, got {port}")
    if max_num_queued_reqs is not None and max_num_queued_reqs < 1:
        raise UserInputError("--max-num-queued-reqs must be at least 1")
    kv_bytes = None if kv_cache_memory is None else parse_bytes(kv_cache_memory, "--kv-cache-memory-bytes")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)

    import uvicorn

    from llmopt.engine.args import EngineArgs
    from llmopt.engine.async_engine import AsyncLLMEngine
    from llmopt.serve.app import ServeConfig, build_app

    args = EngineArgs(model=model, dtype=dtype, device=device, block_size=block_size, kv_cache_memory=kv_bytes,
                      gpu_memory_utilization=gpu_memory_utilization, kv_cache_dtype=kv_cache_dtype,
                      max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=prefix_caching,
                      attention_backend=attention_backend, seed=seed, scheduling_policy=scheduling_policy)
    engine = AsyncLLMEngine.from_engine_args(args)
    name = served_model_name or model or defaults.DEFAULT_MODEL
    app = build_app(engine, ServeConfig(model_name=name, api_key=api_key, max_num_queued_reqs=max_num_queued_reqs))
    logging.getLogger("llmopt.serve").info("serving %s on http://%s:%d/v1", name, host, port)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
