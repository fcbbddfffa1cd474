"""`OpenAIServing`: what the completion and chat endpoints share (vLLM's serving_engine.py): the
model check, tokenization, the request -> SamplingParams fields both have, the prompt checks,
admission, starting the engine requests of an HTTP request, the request log line, and logprobs in
both of OpenAI's shapes.

Every request is validated completely before anything is queued or streamed: types by pydantic,
ranges by `SamplingParams`, then against the model by `LLMEngine.validate` (vocabulary, top_k,
logprobs and stop ids, a prompt that leaves no room) and here (context length in OpenAI's wording,
`n`, priority); the engine's own `add_request` checks again, synchronously. The engine's
`UserInputError` is answered as OpenAI's 400, so a bad request never reaches the engine's step."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from llmopt.engine.async_engine import RequestStream
from llmopt.core.outputs import RequestOutput, TokenLogprobs
from llmopt.core.sampling_params import SamplingParams
from llmopt.errors import UserInputError
from llmopt.serve.protocol import UNSUPPORTED_FIELDS, OpenAIError
from llmopt.serve.server import OpenAIServer
from llmopt.serve.streaming import Job
from llmopt.structured.params import StructuredOutputsParams

log = logging.getLogger("llmopt.serve")

OFF_LOOP_CHARS = 20_000   # longer texts are tokenized in a worker thread (~40 ms of tokenizer time and up)
LOGPROB_FLOOR = -9999.0   # vLLM's stand-in for -inf (JSON has no infinities)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids written as strings."""
    if not bias:
        return None
    try:
        return {int(k): v for k, v in bias.items()}
    except ValueError:
        raise OpenAIError("logit_bias keys must be token ids (integers as strings)", 400, "logit_bias") from None


def _lp(x: float) -> float:
    return x if x == x and x > LOGPROB_FLOOR else LOGPROB_FLOOR


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs_of(r) -> StructuredOutputsParams | None:
    """The request's output constraint from whichever one field gives it: response_format
    (json_object, json_schema), structured_outputs, or one guided_* field; 400 for two, or for a
    constraint StructuredOutputsParams refuses (whether it compiles is the engine's check)."""
    given: dict[str, dict] = {}
    fmt = r.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            given["response_format"] = {"json_object": True}
        elif fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise OpenAIError("response_format json_schema needs json_schema.schema", 400, "response_format")
        else:
            given["response_format"] = {"json": fmt.json_schema.json_schema}
    if r.structured_outputs is not None:
        given["structured_outputs"] = r.structured_outputs.model_dump(by_alias=True, exclude_none=True)
    for field, kind in GUIDED.items():
        if getattr(r, field) is not None:
            given[field] = {kind: getattr(r, field)}
    if not given:
        return None
    if len(given) > 1:
        raise OpenAIError(f"give one output constraint, not {' and '.join(given)}", 400, next(iter(given)))
    (field, kw), = given.items()
    try:
        return StructuredOutputsParams(**kw)
    except UserInputError as e:
        raise OpenAIError(str(e), 400, field) from None


class OpenAIServing:
    def __init__(self, server: OpenAIServer) -> None:
        self.server = server
        self.engine, self.llm, self.config = server.engine, server.llm, server.config
        self.tokenizer, self.max_model_len, self.metrics = server.tokenizer, server.max_model_len, server.metrics

    # -- validation ------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, "model", "NotFoundError")

    def check_fields(self, r) -> None:
        """Refuse a field we do not implement that would change the output (400); log the others
        we do not know (vLLM's warning), so nothing is dropped without a word."""
        extra = r.model_extra or {}
        for name, value in extra.items():
            noop = UNSUPPORTED_FIELDS.get(name)
            if noop is not None and not any(value == v and type(value) is type(v) for v in noop):
                raise OpenAIError(f"{name} is not supported by this server: drop it", 400, name)
        unknown = sorted(k for k in extra if k not in UNSUPPORTED_FIELDS)
        if unknown:
            log.warning("The following fields were present in the request but ignored: %s", set(unknown))

    def sampling_params_of(self, r, max_tokens: int | None, logprobs: int | None,
                           prompt_logprobs: int | None = None, tool_schema: dict | None = None,
                           prompt_len: int = 0) -> SamplingParams:
        """The SamplingParams of the fields completions and chat share (`r`), with their own
        max_tokens, logprobs and prompt logprobs (default: vLLM's `prompt_logprobs` field);
        SamplingParams checks the ranges. `tool_schema`: the JSON schema tool_choice required or a
        named function constrains the output to (with another output constraint: a 400)."""
        self.check_fields(r)
        if r.stream and r.prompt_logprobs is not None:
            raise OpenAIError("prompt_logprobs is not supported when streaming: send stream: false", 400,
                              "prompt_logprobs")
        max_n = self.server.max_n
        if r.n > max_n:
            raise OpenAIError(f"n must be at most {max_n}, got {r.n}", 400, "n")
        policy = self.llm.args.scheduling_policy
        if r.priority and policy != "priority":
            raise OpenAIError(f"priority {r.priority} is only allowed with --scheduling-policy priority (this "
                              f"server runs {policy}): send 0 or omit it", 400, "priority")
        structured = structured_outputs_of(r)
        if tool_schema is not None:
            if structured is not None:
                raise OpenAIError("tool_choice required or a named function constrains the output already: drop "
                                  "the other output constraint", 400, "tool_choice")
            # the JSON's own separators, no free whitespace: a model cannot spend max_tokens on blanks
            # before the call closes (the arguments are the model's text: tool_parsers.py)
            structured = StructuredOutputsParams(json=tool_schema, disable_any_whitespace=True)
        gen = self.config.generation_defaults
        if max_tokens is None and "max_tokens" in gen:   # vLLM's get_max_tokens: the file's, within the context
            max_tokens = min(gen["max_tokens"], max(self.max_model_len - prompt_len, 1))

        def given(name: str, default):
            value = getattr(r, name)
            return value if value is not None else gen.get(name, default)
        kw: dict[str, Any] = dict(
            n=r.n, temperature=given("temperature", 1.0), top_p=given("top_p", 1.0), top_k=given("top_k", 0),
            min_p=given("min_p", 0.0), seed=r.seed, presence_penalty=r.presence_penalty or 0.0,
            frequency_penalty=r.frequency_penalty or 0.0, repetition_penalty=given("repetition_penalty", 1.0),
            stop=[r.stop] if isinstance(r.stop, str) else list(r.stop or []),
            stop_token_ids=list(r.stop_token_ids or []), include_stop_str_in_output=r.include_stop_str_in_output,
            max_tokens=max_tokens, min_tokens=r.min_tokens, ignore_eos=r.ignore_eos, logprobs=logprobs,
            prompt_logprobs=r.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            skip_special_tokens=r.skip_special_tokens, structured_outputs=structured, logit_bias=_logit_bias(r.logit_bias),
            allowed_token_ids=r.allowed_token_ids, bad_words=list(r.bad_words or []))
        try:
            return SamplingParams(**kw)
        except (UserInputError, ValueError, TypeError) as e:
            raise OpenAIError(str(e), 400) from None

    def tokenize_text(self, text: str, add_special_tokens: bool = True, what: str = "prompt",
                      bounded: bool = True) -> list[int]:
        """The token ids of a text; a text too long for the context by its length alone is a 400
        before the tokenizer sees it (a 5 MB prompt took 11.7 s to reach its 400), unless it is to be
        truncated (`bounded` False)."""
        per_token = self.server.max_token_chars
        if bounded and per_token is not None and len(text) > self.max_model_len * per_token:
            raise OpenAIError(f"the {what} has {len(text):,} characters, more than this model's maximum context "
                              f"length of {self.max_model_len} tokens can hold (a token here is at most {per_token} "
                              f"characters): shorten it", 400, what)
        try:
            return self.llm.tokenize(text, add_special_tokens=add_special_tokens)
        except UserInputError as e:   # no tokenizer
            raise OpenAIError(f"{e}", 400, what) from None
        except (TypeError, ValueError) as e:   # e.g. a lone surrogate ("\ud800"), which UTF-8 cannot encode
            raise OpenAIError(f"the {what} cannot be tokenized ({type(e).__name__}): send valid Unicode text "
                              "(no lone surrogates)", 400, what) from None

    async def tokenize_off_loop(self, text: str, add_special_tokens: bool = True, what: str = "prompt",
                                bounded: bool = True) -> list[int]:
        """tokenize_text, in a worker thread for a long text (so open streams go on meanwhile)."""
        if len(text) > OFF_LOOP_CHARS:
            return await asyncio.to_thread(self.tokenize_text, text, add_special_tokens, what, bounded)
        return self.tokenize_text(text, add_special_tokens, what, bounded)

    def truncate(self, r, ids: list[int]) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: as many as the context holds)."""
        k = r.truncate_prompt_tokens
        if k is None:
            return ids
        if k == -1:
            k = self.max_model_len
        if not 1 <= k <= self.max_model_len:
            raise OpenAIError(f"truncate_prompt_tokens must be -1 or in [1, {self.max_model_len}] (the maximum "
                              f"context length), got {r.truncate_prompt_tokens}", 400, "truncate_prompt_tokens")
        return ids[-k:]

    def check_prompt(self, ids: list[int], params: SamplingParams, what: str = "prompt") -> None:
        """The context length in OpenAI's wording (prompt + max_tokens), then the engine's checks."""
        want = len(ids) + (params.max_tokens or 1)
        if ids and want > self.max_model_len:
            where = "messages" if what == "messages" else "prompt"
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{want} tokens ({len(ids)} in the {where}, {params.max_tokens or 1} for the completion). "
                f"Please reduce the length of the {where} or completion.", 400, what)
        try:
            self.llm.validate(ids, params)
        except UserInputError as e:
            raise OpenAIError(str(e), 400, what) from None

    def admit(self, n: int) -> None:
        cap = self.config.max_num_queued_reqs
        if cap is not None and self.server.in_flight + n > cap:
            raise OpenAIError(f"the server is at capacity ({cap} queued sequences): retry later", 503)

    def release(self, n: int) -> None:
        """Give back the admission of n sequences that finished or were aborted."""
        self.server.in_flight -= n

    # -- running requests ------------------------------------------------------------------------
    def start(self, prompts: list[list[int]], params: SamplingParams, prefix: str, arrival: float,
              priority: int = 0, what: str = "prompt") -> Job:
        """Queue one engine request per prompt now (synchronously: a request the engine refuses
        is a 400 here, before any response starts); the caller must `aclose` the job."""
        if self.server.draining:
            raise OpenAIError("the server is shutting down: retry on another replica", 503)
        if self.engine.dead is not None:
            raise OpenAIError(f"the engine is dead ({self.engine.dead}): restart the server", 503)
        self.admit(params.n * len(prompts))
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                streams.append(self.engine.add_request(f"{prefix}-{i}", ids, params, priority, arrival))
        except UserInputError as e:
            for st in streams:
                self.engine.abort(st.request_id)
            raise OpenAIError(str(e), 400, what) from None
        except BaseException:
            for st in streams:
                self.engine.abort(st.request_id)
            raise
        self.server.in_flight += params.n * len(prompts)
        return Job(self, streams, params, arrival)

    def log_request(self, request_id: str, out: RequestOutput | None, arrival: float, how: str | None = None) -> None:
        """One line per request that ended: how, its tokens, and its latencies (vLLM logs one too)."""
        if not self.config.log_requests:
            return
        if out is None:
            log.info("request %s %s before its prompt was computed", request_id, how)
            return
        m = out.metrics
        gen = sum(len(c.token_ids) for c in out.outputs)
        reasons = ",".join(sorted({c.finish_reason for c in out.outputs if c.finish_reason})) or "-"

        def since(t: float | None) -> str:
            return "-" if t is None else f"{max(t - arrival, 0.0):.3f} s"
        log.info("request %s %s: prompt %d tokens (%d cached), output %d tokens, queue %s, TTFT %s, e2e %s",
                 request_id, how or f"finished ({reasons})", len(out.prompt_token_ids), out.num_cached_tokens, gen,
                 since(m.first_scheduled_time if m else None), since(m.first_token_time if m else None),
                 since(m.finished_time if m and m.finished_time else time.monotonic()))

    # -- logprobs --------------------------------------------------------------------------------
    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def logprobs_completion(self, lps: list[TokenLogprobs], offset: int,
                            prompt: tuple[list[int], list[TokenLogprobs | None]] | None = None) -> dict:
        """Completions' logprobs: tokens, token_logprobs, top_logprobs, text_offset (from `offset`).
        With `prompt` (echo: its ids and prompt logprobs) the prompt's tokens come first, as vLLM
        gives them: the first with no logprob, each with the top k and itself in top_logprobs."""
        tokens, token_lps, tops, offsets = [], [], [], []

        def add(token_id: int, logprob: float | None, top: dict | None) -> None:
            nonlocal offset
            s = self._decode_one(token_id)
            tokens.append(s)
            token_lps.append(None if logprob is None else _lp(logprob))
            tops.append({self._decode_one(k): _lp(v) for k, v in top.items()} if top else None)
            offsets.append(offset)
            offset += len(s)

        for tid, t in zip(*prompt) if prompt is not None else ():
            add(tid, None, None) if t is None else add(tid, t.logprob, {**t.top, t.token_id: t.logprob})
        for t in lps:
            add(t.token_id, t.logprob, t.top)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def prompt_logprobs_vllm(self, lps: list[TokenLogprobs | None] | None) -> list | None:
        """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank,
        decoded_token}} over the token itself and the top k (their ranks 1..k)."""
        if lps is None:
            return None
        out: list = []
        for t in lps:
            if t is None:
                out.append(None)
                continue
            entry = {str(k): {"logprob": _lp(v), "rank": r, "decoded_token": self._decode_one(k)}
                     for r, (k, v) in enumerate(t.top.items(), start=1)}
            entry[str(t.token_id)] = {"logprob": _lp(t.logprob), "rank": t.rank,
                                      "decoded_token": self._decode_one(t.token_id)}
            out.append(entry)
        return out

    def logprobs_chat(self, lps: list[TokenLogprobs]) -> dict:
        """Chat's logprobs: per token its text, logprob, UTF-8 bytes and top alternatives."""
        def entry(tid, lp):
            s = self._decode_one(tid)
            return {"token": s, "logprob": _lp(lp), "bytes": list(s.encode("utf-8"))}
        return {"content": [{**entry(t.token_id, t.logprob),
                             "top_logprobs": [entry(k, v) for k, v in t.top.items()]} for t in lps]}
