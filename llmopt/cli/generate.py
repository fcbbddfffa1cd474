"""`llmopt generate`: complete prompts with the engine; completions on stdout, one JSON object per
completion and line with --json, so it pipes."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import typer

from llmopt import defaults
from llmopt.cli import common, output
from llmopt.errors import UserInputError
from llmopt.cli.ranges import in_range
from llmopt.validate import SEED_MAX, SEED_MIN, decode_utf8


def read_prompts(prompts: list[str], file: str | None) -> list[str]:
    if prompts and file:
        raise UserInputError("give prompts as arguments or with --file, not both")
    if file:
        lines = decode_utf8(Path(file).read_bytes(), f"--file {file}").splitlines()
    elif prompts:
        return prompts
    elif sys.stdin is not None and not sys.stdin.closed and not sys.stdin.isatty():
        raw = getattr(sys.stdin, "buffer", None)
        lines = (decode_utf8(raw.read(), "stdin") if raw is not None else sys.stdin.read()).splitlines()
    else:   # a terminal, or no stdin at all (closed: `<&-`)
        raise UserInputError("no prompt: pass prompts as arguments, --file FILE, or lines on stdin")
    out = [line for line in lines if line.strip()]
    if not out:
        raise UserInputError("no prompt: the input is empty" if not lines else
                             "no prompt: the input has only empty lines")
    return out


SEPARATOR = "-" * 40   # between completions in plain output (--json: one object per line instead)


class _StderrHandler(logging.StreamHandler):
    """Writes to the sys.stderr of the moment (an in-process runner swaps it between commands)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def log_to_stderr(level: int) -> None:
    """llmopt's log lines from `level` on stderr (INFO: the engine's KV cache size, concurrency)."""
    logger = logging.getLogger("llmopt")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level)


# Shown under Examples in --help (app.py registers the command); one short line each.
EXAMPLES = [
    'llmopt generate --chat "What is the capital of France?"',
    'echo "Once upon a time" | llmopt generate --max-tokens 64 --json',
]


def speed_line(results) -> str | None:
    """One line on how fast the completions came: output tokens over the wall time, and the decode
    rate after each request's first token (what docs/benchmarks.md measures), or None."""
    ms = [r.metrics for r in results if r.metrics is not None and r.metrics.first_token_time is not None
          and r.metrics.finished_time is not None]
    if not ms:
        return None
    n = sum(len(c.token_ids) for r in results for c in r.outputs)
    start, first, end = min(m.arrival_time for m in ms), min(m.first_token_time for m in ms), max(m.finished_time for m in ms)
    line = f"{n} output tokens in {end - start:.2f} s ({n / max(end - start, 1e-9):.1f} tok/s)"
    after = sum(max(len(m.token_times) - 1, 0) for m in ms)
    if after and end > first:
        line += f"; decode {after / (end - first):.1f} tok/s after the first token at {first - start:.2f} s"
    return line


@common.engine_options(before="json_out")
def generate(
    prompts: list[str] = typer.Argument(None, help="Prompts (default: one per line from --file or stdin)."),
    file: str = typer.Option(None, "--file", "-f", help="Read prompts from this UTF-8 file, one per line."),
    chat: bool = typer.Option(False, "--chat", help="Wrap each prompt as a user message in the chat template."),
    system: str = typer.Option(None, "--system", help="System message for --chat."),
    model: str = common.ModelOpt,
    max_tokens: int = typer.Option(defaults.GENERATE_MAX_TOKENS, "--max-tokens", "-n", callback=in_range(1),
                                   help="Tokens to generate per completion, >= 1 (stops earlier at "
                                   "--max-model-len)."),
    min_tokens: int = typer.Option(0, "--min-tokens", callback=in_range(0),
                                   help="Tokens before EOS or a stop may end a completion, 0 to --max-tokens."),
    temperature: float = typer.Option(defaults.GENERATE_TEMPERATURE, "--temperature", "-t", callback=in_range(0),
                                      help="Sampling temperature, >= 0 (0 = greedy)."),
    top_p: float = typer.Option(1.0, "--top-p", callback=in_range(0, 1, lo_open=True),
                                help="Nucleus sampling: smallest set of tokens with this probability, (0, 1]."),
    top_k: int = typer.Option(0, "--top-k", callback=in_range(-1),
                              help="Sample among the k most likely tokens, >= 1; 0 or -1 = off."),
    min_p: float = typer.Option(0.0, "--min-p", callback=in_range(0, 1),
                                help="Drop tokens below this share of the top token's probability, 0 to 1."),
    seed: int = typer.Option(None, "--seed", callback=in_range(SEED_MIN, SEED_MAX),
                             help="Per-request sampling seed, a 64-bit integer (-2^63 to 2^63-1)."),
    presence_penalty: float = typer.Option(0.0, "--presence-penalty", callback=in_range(-2, 2),
                                           help="Subtracted once per token already in the output, -2 to 2."),
    frequency_penalty: float = typer.Option(0.0, "--frequency-penalty", callback=in_range(-2, 2),
                                            help="Subtracted per occurrence in the output, -2 to 2."),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty", callback=in_range(0, lo_open=True),
                                             help="Divides the logits of prompt and output tokens, > 0 (1 = off)."),
    stop: list[str] = typer.Option(None, "--stop", help="Stop string, not empty (repeatable)."),
    stop_token_ids: list[int] = typer.Option(None, "--stop-token-id", callback=in_range(0),
                                             help="Stop token id, >= 0 (repeatable)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep generating after the EOS token."),
    num: int = typer.Option(1, "--num-completions", callback=in_range(1, defaults.GENERATE_MAX_COMPLETIONS),
                            help=f"Completions per prompt (n), 1 to {defaults.GENERATE_MAX_COMPLETIONS}."),
    logprobs: int = typer.Option(None, "--logprobs", callback=in_range(0, defaults.MAX_LOGPROBS),
                                 help=f"Also return the top-N logprobs per token (--json), 0 to "
                                 f"{defaults.MAX_LOGPROBS} (vLLM's max_logprobs)."),
    json_out: bool = common.JsonLinesOpt,
    quiet: bool = common.QuietOpt,
    **engine: Any,
) -> None:
    """Complete prompts with the paged-KV, continuous-batching engine."""
    # deferred: keep CLI start-up fast
    from llmopt.engine.llm import LLM
    from llmopt.core.sampling_params import SamplingParams

    texts = read_prompts(prompts or [], file)
    engine_args = common.engine_args_from_flags(engine, seed=seed or 0)
    params = SamplingParams(
        n=num, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty, stop=list(stop or []), stop_token_ids=list(stop_token_ids or []),
        max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos, logprobs=logprobs)
    log_to_stderr(logging.WARNING if quiet else logging.INFO)
    llm = LLM(model, **engine_args)
    with output.progress("generate", len(texts), enabled=not quiet and len(texts) > 1) as advance:
        if chat:
            convs = [([{"role": "system", "content": system}] if system else []) +
                     [{"role": "user", "content": t}] for t in texts]
            results = llm.chat(convs, params, progress=advance)
        else:
            results = llm.generate(texts, params, progress=advance)
    print_completions(texts, results, json_out)
    line = speed_line(results)
    if line:
        logging.getLogger("llmopt.cli").info(line)


def print_completions(texts: list[str], results, json_out: bool) -> None:
    """Each completion on stdout: a JSON line (with its token ids, finish reason, token counts and, when
    asked for, logprobs), or its text, with a separator line between texts."""
    printed = 0
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
                if printed:    # completions may span lines: a separator line between them
                    sys.stdout.write(SEPARATOR + "\n")
                sys.stdout.write(c.text + "\n")
            printed += 1
    sys.stdout.flush()
