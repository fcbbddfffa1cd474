"""LLM: the offline front end. `LLM(model=..., **engine_args).generate(prompts, params)` runs every
prompt through the continuous-batching engine and returns one RequestOutput per prompt, in order;
`.chat(messages, params)` applies the tokenizer's chat template first."""

from __future__ import annotations

from typing import Callable, Sequence

from llmopt.engine.args import EngineArgs
from llmopt.engine.engine import EngineStats, LLMEngine
from llmopt.core.outputs import RequestOutput
from llmopt.core.sampling_params import SamplingParams
from llmopt.errors import UserInputError

Prompt = "str | list[int]"


class LLM:
    def __init__(self, model: str | None = None, *, loaded=None, progress=None, **engine_args) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args), loaded=loaded, progress=progress)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: "str | list[int] | Sequence[str | list[int]]",
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress: Callable[[int], None] | None = None, priority: Sequence[int] | None = None,
                 _texts: Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Complete every prompt (text or token ids); `progress(1)` after each one finishes."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise UserInputError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            text = _texts[i] if _texts is not None else None
            if text is not None:
                ids.append(self.engine.add_request(None, text, sp, priority[i] if priority else 0, prompt_token_ids=p))
            else:
                ids.append(self.engine.add_request(None, p, sp, priority[i] if priority else 0))
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    if progress:
                        progress(1)
        return [done[i] for i in ids]

    def stats(self) -> EngineStats:
        """The engine's counters: KV usage, prefix-cache and offload-tier hits, preemptions."""
        return self.engine.stats()

    def chat(self, messages: list[dict] | Sequence[list[dict]], sampling_params=None, progress=None,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or several; returns their completions."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise UserInputError("this model's tokenizer has no chat template: use generate() with plain prompts")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        texts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                    **(chat_template_kwargs or {})) for c in convs]
        ids = [list(self.tokenizer(t, add_special_tokens=False).input_ids) for t in texts]
        return self.generate(ids, sampling_params, progress, _texts=texts)
