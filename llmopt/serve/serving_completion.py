"""`OpenAIServingCompletion`: /v1/completions (vLLM's serving_completion.py): its prompts (text,
token ids, or lists of either), its request -> SamplingParams mapping, echo, and its streamed and
whole responses. Choice i * n + j is sample j of prompt i."""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from llmopt.core.outputs import CompletionOutput, RequestOutput
from llmopt.core.sampling_params import SamplingParams
from llmopt.serve.protocol import CompletionRequest, OpenAIError, usage
from llmopt.serve.serving_engine import OpenAIServing
from llmopt.serve.streaming import ChoiceState, EventStream, Job, collect, stream_events


class OpenAIServingCompletion(OpenAIServing):
    def sampling_params(self, body: CompletionRequest, prompt_len: int = 0) -> SamplingParams:
        """echo with logprobs scores the prompt too (its logprobs come first); echo with max_tokens 0
        is the prompt alone (vLLM's): the engine computes one token, which the answer leaves out."""
        scored = body.logprobs if body.echo and body.logprobs is not None else None
        if body.prompt_logprobs is not None:
            scored = max(scored or 0, body.prompt_logprobs)
        max_tokens = 1 if body.echo_only else body.max_tokens
        return self.sampling_params_of(body, max_tokens, body.logprobs, scored, prompt_len=prompt_len)

    async def prompts(self, body: CompletionRequest) -> tuple[list[str | None], list[list[int]]]:
        """Each prompt's text (None when given as token ids) and token ids."""
        p, bounded = body.prompt, body.truncate_prompt_tokens is None
        if isinstance(p, str):
            return [p], [await self.tokenize_off_loop(p, bounded=bounded)]
        if not p:
            raise OpenAIError("the prompt is empty", 400, "prompt")
        if isinstance(p[0], int):
            return [None], [list(p)]
        if isinstance(p[0], str):
            return list(p), [await self.tokenize_off_loop(t, bounded=bounded) for t in p]
        return [None] * len(p), [list(x) for x in p]

    async def create_completion(self, body: CompletionRequest, request: Request, arrival: float):
        self.check_model(body.model)
        if body.suffix:
            raise OpenAIError("suffix is not supported", 400, "suffix")
        if body.echo and body.stream and (body.logprobs is not None or body.echo_only):
            raise OpenAIError("echo with logprobs or max_tokens 0 is not supported when streaming: send stream: "
                              "false", 400, "echo")
        texts, prompts = await self.prompts(body)
        if body.truncate_prompt_tokens is not None:   # echo gives back the prompt as the model saw it
            texts, prompts = [None] * len(prompts), [self.truncate(body, ids) for ids in prompts]
        params = self.sampling_params(body, max(map(len, prompts)))
        for ids in prompts:
            self.check_prompt(ids, params)
        echo = [(t if t is not None else self.tokenizer.decode(ids)) if body.echo else ""
                for t, ids in zip(texts, prompts)]
        rid = f"cmpl-{uuid.uuid4().hex}"
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.config.model_name}
        job = self.start(prompts, params, rid, arrival, body.priority)
        if body.stream:
            return self.stream(body, job, params, echo, base)
        return await self.full(body, request, job, echo, base)

    def stream(self, body: CompletionRequest, job: Job, params: SamplingParams, echo: list[str],
               base: dict) -> EventStream:
        n, num_prompts = params.n, len(echo)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        hold = max((len(s) for s in params.stop), default=1) - 1
        state = {(i, j): ChoiceState(i * n + j, echo[i]) for i in range(num_prompts) for j in range(n)}

        def make_choice(st: ChoiceState, c: CompletionOutput, delta: str, new_lps: list, done: bool) -> dict:
            choice = {"index": st.index, "text": st.prefix + delta, "logprobs": None,
                      "finish_reason": c.finish_reason if done else None,
                      "stop_reason": c.stop_reason if done else None}
            if body.logprobs is not None:
                choice["logprobs"] = self.logprobs_completion(new_lps, st.sent)
            return choice

        def chunk(choices: list[dict]) -> dict:
            return {**base, "choices": choices}

        events = stream_events(job, num_prompts, state, hold, make_choice, chunk, include_usage, base["id"])
        return EventStream(events, job)

    async def full(self, body: CompletionRequest, request: Request, job: Job, echo: list[str], base: dict):
        """The whole response, or 499 when the client left first."""
        finals = await collect(request, job, len(echo))
        if finals is None:
            return Response(status_code=499)
        choices = [self.choice(body, i * job.params.n + c.index, echo[i], out, c)
                   for i, out in enumerate(finals) for c in out.outputs]
        return {**base, "choices": choices, "usage": usage(finals, generated=not body.echo_only)}

    def choice(self, body: CompletionRequest, index: int, echo: str, out: RequestOutput, c: CompletionOutput) -> dict:
        generated = not body.echo_only
        choice = {"index": index, "text": echo + (c.text if generated else ""), "logprobs": None,
                  "finish_reason": c.finish_reason if generated else "length",
                  "stop_reason": c.stop_reason if generated else None}
        if body.logprobs is not None:
            prompt = (out.prompt_token_ids, out.prompt_logprobs) if body.echo else None
            choice["logprobs"] = self.logprobs_completion((c.logprobs or []) if generated else [], 0, prompt)
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs_vllm(out.prompt_logprobs)
        return choice

