"""lm-evaluation-harness on the llmopt engine: an lm-eval model registered as `llmopt`
(`lm_eval.simple_evaluate(model="llmopt", model_args="model=DIR,dtype=float32")` once this module is
imported; `llmopt eval` drives it). lm-eval keeps its tasks, metrics and few-shot handling; this class
answers its three request types through the continuous-batching engine, every request of a call
submitted at once:

- `loglikelihood`: the tokens are split as lm-eval's `hf` model splits them (TemplateLM), the last
  `max_length + 1` tokens of context + continuation are one prompt with `prompt_logprobs` from the
  continuation's first position on (`prompt_logprobs_start`), so only those rows reach the LM head
  and a context shared by several requests (few-shot examples, the choices of one question) is
  computed once and read from the prefix cache; greedy when every continuation token ranks first.
- `loglikelihood_rolling`: lm-eval's own rolling windows (`get_rolling_token_windows`), each scored as
  above and summed per document.
- `generate_until`: lm-eval's generation kwargs (`until`, `max_gen_toks`, `do_sample`, `temperature`,
  `top_p`, `top_k`), the context left-truncated to `max_length - max_gen_toks` as `hf` does, and the
  text cut at the first stop string. A kwarg the engine does not honour is refused.

lm-eval is the optional `eval` extra; importing this module without it raises ImportError.
"""

from __future__ import annotations

import logging

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (_add_special_kwargs, handle_stop_sequences, has_bos_prefix,
                                  normalize_gen_kwargs, postprocess_generated_text)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from llmopt.core.sampling_params import SamplingParams
from llmopt.engine.llm import LLM
from llmopt.errors import UserInputError

log = logging.getLogger(__name__)

# lm-eval generation kwargs and the SamplingParams field each becomes (do_sample/until/max_gen_toks
# are handled before this table)
GEN_KWARGS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
              "seed": "seed", "repetition_penalty": "repetition_penalty"}
DEFAULT_MAX_GEN_TOKS = 256     # lm-eval's hf default


@register_model("llmopt")
class LLMoptLM(TemplateLM):
    """An lm-eval model over `llmopt.LLM`. Arguments: `model` (or lm-eval's `pretrained`), `max_length`
    (default: the engine's max_model_len - 2, so a window plus its one sampled token fits),
    `add_bos_token`, `max_gen_toks`, and any EngineArgs field (dtype, kv_cache_memory, ...)."""

    def __init__(self, model: str | None = None, pretrained: str | None = None, max_length: int | None = None,
                 add_bos_token: bool | None = None, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
                 batch_size: int | str | None = None, device: str | None = None, llm: LLM | None = None,
                 **engine_args) -> None:
        super().__init__()
        if batch_size not in (None, 1, "1", "auto"):
            # The engine batches every request of a call itself; lm-eval's batch size has no meaning here.
            log.info("llmopt: batch_size=%s is not used: all requests go to the engine at once", batch_size)
        if device is not None:
            engine_args.setdefault("device", device)
        self.llm = llm or LLM(model if model is not None else pretrained, **engine_args)
        self.tokenizer = self.llm.tokenizer
        if self.tokenizer is None:
            raise UserInputError("lm-eval needs the model's tokenizer: this model has none")
        limit = self.llm.engine.max_model_len - 2
        self.max_length = limit if max_length is None else int(max_length)
        if not 1 <= self.max_length <= limit:
            raise UserInputError(f"max_length must be in [1, {limit}] (the engine's max_model_len - 2), "
                                 f"got {self.max_length}")
        self.add_bos_token = add_bos_token
        self.max_gen_toks = int(max_gen_toks)

    # -- tokens, as lm-eval's hf model ----------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        special = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # -- scoring ---------------------------------------------------------------------------------------
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log P(continuation | context), greedy) per (context, continuation) token pair, all at once."""
        prompts, n_cont, params = [], [], []
        for ctx, cont in pairs:
            if not cont:
                raise UserInputError("lm-eval sent an empty continuation to score")
            prompt = (ctx + cont)[-(self.max_length + 1):]
            prompts.append(prompt)
            n_cont.append(min(len(cont), len(prompt) - 1))
            # only the continuation is scored; the context may come from the prefix cache
            params.append(SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0,
                                         prompt_logprobs_start=len(prompt) - n_cont[-1]))
        outs = self.llm.generate(prompts, params)
        results = []
        for out, n in zip(outs, n_cont):
            scored = out.prompt_logprobs[-n:]
            results.append((sum(t.logprob for t in scored), all(t.rank == 1 for t in scored)))
        return results

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        return self._score([(ctx, cont) for _, ctx, cont in requests])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((ctx, cont))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (lp, _) in zip(owner, self._score(windows)):
            totals[i] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generation ------------------------------------------------------------------------------------
    def _sampling_params(self, gen_kwargs: dict) -> tuple[SamplingParams, list[str], int]:
        kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok_decode([self.eot_token_id],
                                                                                     skip_special_tokens=False))
        max_gen_toks = kwargs.pop("max_gen_toks")
        do_sample = kwargs.pop("do_sample", False)
        fields = {}
        for key, value in kwargs.items():
            if key not in GEN_KWARGS:
                raise UserInputError(f"lm-eval generation kwarg {key!r} is not supported by llmopt "
                                     f"(supported: until, max_gen_toks, do_sample, {', '.join(GEN_KWARGS)})")
            fields[GEN_KWARGS[key]] = value
        if not do_sample:
            fields["temperature"] = 0.0
        return SamplingParams(max_tokens=max_gen_toks, stop=list(until), **fields), list(until), max_gen_toks

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts, params, stops = [], [], []
        for context, gen_kwargs in (req.args for req in requests):
            sp, until, max_gen_toks = self._sampling_params(gen_kwargs)
            if max_gen_toks >= self.max_length:
                raise UserInputError(f"max_gen_toks {max_gen_toks} must be below max_length {self.max_length}")
            prompts.append(self.tok_encode(context, left_truncate_len=self.max_length - max_gen_toks))
            params.append(sp)
            stops.append(until)
        outs = self.llm.generate(prompts, params)
        texts = []
        for req, out, until in zip(requests, outs, stops):
            text = postprocess_generated_text(self.tok_decode(out.outputs[0].token_ids), until, None)
            self.cache_hook.add_partial("generate_until", req.args, text)
            texts.append(text)
        return texts
