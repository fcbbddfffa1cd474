"""`OpenAIServingChat`: /v1/chat/completions (vLLM's serving_chat.py): the chat template, its
request -> SamplingParams mapping (max_completion_tokens, logprobs + top_logprobs), and its streamed
and whole responses. `render_chat` is the chat template, which /tokenize uses too."""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from llmopt.core.outputs import CompletionOutput
from llmopt.core.sampling_params import SamplingParams
from llmopt.serve import tool_calls
from llmopt.serve.protocol import ChatCompletionRequest, ChatMessage, OpenAIError, message_text, usage
from llmopt.serve.serving_engine import OpenAIServing
from llmopt.serve.streaming import ChoiceState, EventStream, Job, collect, stream_events


def render_chat(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                kwargs: dict | None = None, tools: list[dict] | None = None, chat_template: str | None = None) -> str:
    """The prompt text of `messages` (and `tools`) by the chat template: `chat_template` (the
    server's --chat-template) or the tokenizer's own."""
    if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise OpenAIError("this model's tokenizer has no chat template: start the server with --chat-template",
                          400, "messages")
    conv = tool_calls.template_messages(messages, message_text)
    extra = dict(kwargs or {})
    if tools:
        extra["tools"] = tools
    if chat_template:
        extra["chat_template"] = chat_template
    try:
        text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **extra)
    except Exception as e:  # noqa: BLE001 - a template's own error (e.g. roles out of order)
        raise OpenAIError(f"the chat template failed on these messages: {e}", 400, "messages") from None
    if not isinstance(text, str):   # chat_template_kwargs asked for something else (return_dict, ...)
        raise OpenAIError(f"the chat template gave a {type(text).__name__}, not text: drop the "
                          "chat_template_kwargs that change its output", 400, "chat_template_kwargs")
    return text


class OpenAIServingChat(OpenAIServing):
    def sampling_params(self, body: ChatCompletionRequest, tools: tool_calls.ToolPlan | None = None,
                        prompt_len: int = 0) -> SamplingParams:
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return self.sampling_params_of(body, max_tokens, logprobs, tool_schema=tools.schema if tools else None,
                                       prompt_len=prompt_len)

    async def create_chat_completion(self, body: ChatCompletionRequest, request: Request, arrival: float):
        self.check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError("top_logprobs needs logprobs: true", 400, "top_logprobs")
        cfg = self.config
        tools = tool_calls.plan(body, cfg.tool_call_parser if cfg.enable_auto_tool_choice else None)
        text = render_chat(self.tokenizer, body.messages, body.add_generation_prompt, body.chat_template_kwargs,
                           [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
                           self.config.chat_template)
        ids = self.truncate(body, await self.tokenize_off_loop(text, add_special_tokens=False, what="messages",
                                                               bounded=body.truncate_prompt_tokens is None))
        params = self.sampling_params(body, tools, len(ids))
        self.check_prompt(ids, params, "messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.config.model_name}
        job = self.start([ids], params, rid, arrival, body.priority, "messages")
        if body.stream:
            return self.stream(body, job, params, base, tools)
        return await self.full(body, request, job, base, tools)

    def stream(self, body: ChatCompletionRequest, job: Job, params: SamplingParams, base: dict,
               tools: tool_calls.ToolPlan) -> EventStream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        hold = max((len(s) for s in params.stop), default=1) - 1
        state = {(0, j): ChoiceState(j) for j in range(params.n)}
        calls = {j: tool_calls.ToolCallStream(tools) for j in range(params.n)} if tools.mode != "none" else None

        def chunk(choices: list[dict]) -> dict:
            return {**base, "choices": choices}

        first = tuple(chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for j in range(params.n))

        def make_choice(st: ChoiceState, c: CompletionOutput, delta: str, new_lps: list, done: bool) -> dict:
            finish = c.finish_reason if done else None
            if calls is None:
                fields = {"content": delta} if delta else {}
            else:   # the text so far, as the whole response would read it
                fields = calls[c.index].update(c.text[:st.sent + len(delta)], done)
                if done and finish == "stop" and calls[c.index].called:
                    finish = "tool_calls"
            choice = {"index": c.index, "delta": fields,
                      "logprobs": self.logprobs_chat(new_lps) if params.logprobs is not None else None,
                      "finish_reason": finish}
            if done:
                choice["stop_reason"] = c.stop_reason
            return choice

        events = stream_events(job, 1, state, hold, make_choice, chunk, include_usage, base["id"], first)
        return EventStream(events, job)

    async def full(self, body: ChatCompletionRequest, request: Request, job: Job, base: dict,
                   tools: tool_calls.ToolPlan):
        """The whole response, or 499 when the client left first."""
        finals = await collect(request, job, 1)
        if finals is None:
            return Response(status_code=499)
        final = finals[0]
        choices = [{"index": c.index, "message": self.message(c, tools),
                    "logprobs": self.logprobs_chat(c.logprobs or []) if job.params.logprobs is not None else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in final.outputs]
        for choice in choices:
            if choice["message"].get("tool_calls") and choice["finish_reason"] == "stop":
                choice["finish_reason"] = "tool_calls"
        response = {**base, "object": "chat.completion", "choices": choices, "usage": usage([final])}
        if body.prompt_logprobs is not None:
            response["prompt_logprobs"] = self.prompt_logprobs_vllm(final.prompt_logprobs)
        return response

    @staticmethod
    def message(c: CompletionOutput, tools: tool_calls.ToolPlan) -> dict:
        """The assistant message of one completion: its text, or the tool calls found in it."""
        if tools.mode == "none":
            return {"role": "assistant", "content": c.text}
        content, calls = tool_calls.parse(tools, c.text)
        return {"role": "assistant", "content": content, "tool_calls": calls}
