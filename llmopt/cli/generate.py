"""`llmopt generate`: complete prompts with the engine; completions on stdout, one JSON object per
completion and line with --json, so it pipes."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import typer

from llmopt import defaults
from llmopt.cli import common, output
from llmopt.errors import UserInputError
from llmopt.units import SIZE_HELP, parse_bytes


def read_prompts(prompts: list[str], file: str | None) -> list[str]:
    if prompts and file:
        raise UserInputError("give prompts as arguments or with --file, not both")
    if file:
        lines = Path(file).read_text(encoding="utf-8").splitlines()
    elif prompts:
        return prompts
    elif not sys.stdin.isatty():
        lines = sys.stdin.read().splitlines()
    else:
        raise UserInputError("no prompt: pass prompts as arguments, --file FILE, or lines on stdin")
    out = [line for line in lines if line.strip()]
    if not out:
        raise UserInputError("no prompt: the input has only empty lines")
    return out


# Shown under Examples in --help (app.py registers the command); one short line each.
EXAMPLES = [
    'llmopt generate --chat "What is the capital of France?"',
    'echo "Once upon a time" | llmopt generate --max-tokens 64 --json',
]


def generate(
    prompts: list[str] = typer.Argument(None, help="Prompts (default: one per line from --file or stdin)."),
    file: str = typer.Option(None, "--file", "-f", help="Read prompts from this file, one per line."),
    chat: bool = typer.Option(False, "--chat", help="Wrap each prompt as a user message in the chat template."),
    system: str = typer.Option(None, "--system", help="System message for --chat."),
    model: str = common.ModelOpt,
    dtype: str = common.DtypeOpt,
    device: str = common.DeviceOpt,
    max_tokens: int = typer.Option(defaults.GENERATE_MAX_TOKENS, "--max-tokens", "-n"),
    min_tokens: int = typer.Option(0, "--min-tokens"),
    temperature: float = typer.Option(defaults.GENERATE_TEMPERATURE, "--temperature", "-t", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 = off."),
    min_p: float = typer.Option(0.0, "--min-p"),
    seed: int = typer.Option(None, "--seed", help="Per-request sampling seed."),
    presence_penalty: float = typer.Option(0.0, "--presence-penalty"),
    frequency_penalty: float = typer.Option(0.0, "--frequency-penalty"),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty"),
    stop: list[str] = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    stop_token_ids: list[int] = typer.Option(None, "--stop-token-id", help="Stop token id (repeatable)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos"),
    num: int = typer.Option(1, "--num-completions", help="Completions per prompt (n)."),
    logprobs: int = typer.Option(None, "--logprobs", help="Also return the top-N logprobs per token (--json)."),
    block_size: int = typer.Option(defaults.BLOCK_SIZE, "--block-size"),
    kv_cache_memory: str = typer.Option(None, "--kv-cache-memory", help=f"KV-cache bytes: {SIZE_HELP}; "
                                        "default: --gpu-memory-utilization on a GPU, 1GiB on the CPU."),
    gpu_memory_utilization: float = typer.Option(defaults.GPU_MEMORY_UTILIZATION, "--gpu-memory-utilization"),
    kv_cache_dtype: str = typer.Option(defaults.KV_CACHE_DTYPE, "--kv-cache-dtype",
                                       help="auto|fp8|fp8_e4m3|fp8_e5m2|int8."),
    max_model_len: int = typer.Option(None, "--max-model-len", help="Default: the model's context length."),
    max_num_seqs: int = typer.Option(defaults.MAX_NUM_SEQS, "--max-num-seqs"),
    max_num_batched_tokens: int = typer.Option(defaults.MAX_NUM_BATCHED_TOKENS, "--max-num-batched-tokens",
                                               help="Token budget per step (chunked prefill); 0 = unlimited."),
    prefix_caching: bool = typer.Option(defaults.ENABLE_PREFIX_CACHING,
                                        "--enable-prefix-caching/--no-enable-prefix-caching"),
    attention_backend: str = typer.Option(defaults.ATTENTION_BACKEND, "--attention-backend", help="auto|torch|triton."),
    json_out: bool = common.JsonOpt,
    quiet: bool = common.QuietOpt,
) -> None:
    """Complete prompts with the paged-KV, continuous-batching engine."""
    from llmopt.engine.llm import LLM
    from llmopt.engine.sampling_params import SamplingParams

    texts = read_prompts(prompts or [], file)
    kv_bytes = None if kv_cache_memory is None else parse_bytes(kv_cache_memory, "--kv-cache-memory")
    params = SamplingParams(
        n=num, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty, stop=list(stop or []), stop_token_ids=list(stop_token_ids or []),
        max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos, logprobs=logprobs)
    if not quiet:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    llm = LLM(model, dtype=dtype, device=device, block_size=block_size,
              kv_cache_memory=kv_bytes, gpu_memory_utilization=gpu_memory_utilization,
              kv_cache_dtype=kv_cache_dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=prefix_caching,
              attention_backend=attention_backend, seed=seed or 0)
    with output.progress("generate", len(texts), enabled=not quiet and len(texts) > 1) as advance:
        if chat:
            convs = [([{"role": "system", "content": system}] if system else []) +
                     [{"role": "user", "content": t}] for t in texts]
            results = llm.chat(convs, params, progress=advance)
        else:
            results = llm.generate(texts, params, progress=advance)
    for prompt, res in zip(texts, results):
        for c in res.outputs:
            if json_out:
                row = {"prompt": prompt, "index": c.index, "text": c.text, "token_ids": c.token_ids,
                       "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                       "num_prompt_tokens": len(res.prompt_token_ids), "num_output_tokens": len(c.token_ids),
                       "num_cached_tokens": res.num_cached_tokens}
                if c.logprobs is not None:
                    row["logprobs"] = c.logprobs
                    row["cumulative_logprob"] = c.cumulative_logprob
                sys.stdout.write(output.dumps(row) + "\n")
            else:
                sys.stdout.write(c.text + "\n")
    sys.stdout.flush()

