"""Prompts the target writes itself (Magpie, Xu et al. 2024): a chat model given its chat template
up to the start of a user turn, and nothing after, samples a user's request from the instructions
it was tuned on. `spec-tune --prompt-source self` answers those requests instead of prompts made
from a text, so the head trains on the kinds of turns users send (code, math, advice, letters),
not only on the text's domain, with no data beyond the target itself.

Requests are sampled (temperature 1, one seed per request, `seed`-derived), kept only when the
turn ended by itself (end of turn, at least SPEC_TUNE_SELF_PROMPT_MIN_TOKENS tokens) and unique,
then wrapped in the chat template with the generation prompt."""

from __future__ import annotations

from typing import Callable

from llmopt import defaults
from llmopt.errors import DataError, UserInputError

_SENTINEL = "\x00llmopt-user-turn\x00"


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user's first message starts (the system turn
    the template adds by default included)."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserInputError("--prompt-source self needs a tokenizer with a chat template (an instruct model)")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                         add_generation_prompt=True)
    if _SENTINEL not in text:
        raise UserInputError("--prompt-source self: the chat template does not show the user's message as given")
    return list(tokenizer(text[:text.index(_SENTINEL)], add_special_tokens=False).input_ids)


def self_prompts(llm, tokenizer, n: int, seed: int, batch: int,
                 max_tokens: int = defaults.SPEC_TUNE_SELF_PROMPT_TOKENS,
                 kept: Callable[[int], None] = lambda k: None) -> list[list[int]]:
    """`n` chat prompts (token ids, generation prompt included) around requests the model behind
    `llm` (an llmopt LLM) writes itself, in the order of their seeds; `kept(k)` after each batch."""
    from llmopt.core.sampling_params import SamplingParams   # deferred: start-up time (torch)
    from llmopt.spec_tune.train_data import chat_prompt   # deferred: start-up time (imports torch)
    prefix = user_turn_prefix(tokenizer)
    seen: set[str] = set()
    out: list[list[int]] = []
    tried, budget = 0, max(4 * n, 64)
    while len(out) < n:
        if tried >= budget:
            raise DataError(f"--prompt-source self: the model wrote only {len(out)} usable requests in {tried} "
                            f"tries ({n} asked for)")
        k = min(batch, budget - tried)
        params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed * 1_000_003 + tried + i)
                  for i in range(k)]
        tried += k
        before = len(out)
        for o in llm.generate([prefix] * k, params):
            c = o.outputs[0]
            text = tokenizer.decode(c.token_ids, skip_special_tokens=True).strip()
            if c.finish_reason != "stop" or len(c.token_ids) < defaults.SPEC_TUNE_SELF_PROMPT_MIN_TOKENS \
                    or not text or text in seen or len(out) == n:
                continue
            seen.add(text)
            out.append(chat_prompt(tokenizer, text))
        kept(len(out) - before)
    return out
