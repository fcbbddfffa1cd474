"""The OpenAI-compatible wire format: request bodies (pydantic), the error body and response, the
usage object of a response, and the response bodies as /openapi.json documents them (the serving
classes build those as dicts; tests/serve/test_openapi.py checks them against these types).

Field names follow OpenAI's API and vLLM's extensions (top_k, min_p, repetition_penalty,
ignore_eos, min_tokens, stop_token_ids). Unknown fields are logged and ignored, as vLLM does; fields
that would change the output and are not implemented (UNSUPPORTED_FIELDS) are refused. Types are checked
by pydantic (a wrong type is a 400 in OpenAI's error shape, see api_server.py); ranges are checked by
`SamplingParams` and against the model by `LLMEngine.validate` and the serving classes (context
length in OpenAI's wording)."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt
from starlette.responses import JSONResponse

from llmopt.core.outputs import RequestOutput


class OpenAIError(Exception):
    """An error the server answers with `{"error": {message, type, param, code}}` and `status`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.type = type or _TYPES.get(status, "BadRequestError")


_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "BadRequestError",
          422: "BadRequestError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error body (vLLM's ErrorResponse): every 4xx and 5xx the server answers."""
    error: ErrorInfo


def error_body(message: str, status: int, type: str | None = None, param: str | None = None) -> dict:
    info = ErrorInfo(message=message, type=type or _TYPES.get(status, "BadRequestError"), param=param, code=status)
    return ErrorResponse(error=info).model_dump()


def error_response(e: OpenAIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.status, e.type, e.param), status_code=e.status)


def usage(finals: list[RequestOutput | None], generated: bool = True) -> dict:
    """The `usage` object of a response over the final output of each prompt (`generated` False:
    echo with max_tokens 0, whose one engine token is not part of the answer)."""
    prompt = sum(len(o.prompt_token_ids) for o in finals if o is not None)
    completion = sum(len(c.token_ids) for o in finals if o is not None for c in o.outputs) if generated else 0
    cached = sum(o.num_cached_tokens for o in finals if o is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool | None = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema: a name and the schema (`strict` is accepted; the
    constraint is always enforced)."""
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: Union[dict[str, Any], StrictBool, None] = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` request field (the names of SamplingParams.structured_outputs)."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_schema: Union[dict[str, Any], str, StrictBool, None] = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    disable_additional_properties: StrictBool = False
    disable_any_whitespace: StrictBool = False


# Fields of OpenAI's or vLLM's API that change what is generated and that this server does not
# implement: a value other than these no-ops is a 400 naming the field, never dropped.
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "use_beam_search": (None, False), "length_penalty": (None, 1.0, 1),
    "logits_processors": (None, []), "guided_whitespace_pattern": (None,),
    "functions": (None, []), "function_call": (None, "none"),   # OpenAI's deprecated forms of tools
    "spaces_between_special_tokens": (None, True), "best_of": (None, 1),
}


class _Sampling(BaseModel):
    """Fields shared by completions and chat. Other fields are kept in `model_extra`: the serving
    class refuses those of UNSUPPORTED_FIELDS with a real value and logs the rest, as vLLM does."""
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    n: StrictInt = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    min_p: float | None = None
    seed: StrictInt | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[StrictInt] | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: StrictInt = 0
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs, vLLM's older guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Union[dict[str, Any], str, StrictBool, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_logprobs: StrictInt | None = None    # vLLM's: logprobs of each prompt token, the top k with them
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as a string) -> bias in [-100, 100]
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: StrictInt | None = None   # vLLM's: keep the prompt's last k tokens (-1: the context)


# a prompt: text, token ids, several texts, or several token-id lists
Prompt = Union[str, list[StrictInt], list[str], list[list[StrictInt]]]


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: str | None = None

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0 (vLLM's): the prompt alone; the engine's one token is left out."""
        return self.echo and self.max_tokens == 0


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str                       # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None     # an assistant turn that called tools
    tool_call_id: str | None = None              # a tool's result: the call it answers


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None     # a JSON schema of the arguments
    strict: StrictBool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: StrictBool | None = True
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: exactly one of `prompt` and `messages` (the schema's oneOf says so;
    OpenAIServingTokenization refuses both or neither)."""
    model_config = ConfigDict(extra="ignore", json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]})
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[StrictInt]


def message_text(m: ChatMessage) -> str:
    """A message's content as one string (text parts joined); other part types are refused."""
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    texts = []
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise OpenAIError(f"content parts of type {part.type!r} are not supported (text only)", 400,
                              "messages")
        texts.append(part.text)
    return "".join(texts)


# -- response bodies (documentation of what the serving classes build; no field beyond these) ----
class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Out):
    cached_tokens: int


class UsageInfo(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class PromptLogprob(_Out):
    logprob: float
    rank: int | None
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token None (the first) or {token id: its logprob, rank, text}
PromptLogprobs = Union[list[Union[dict[str, PromptLogprob], None]], None]


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[Union[float, None]]
    top_logprobs: list[Union[dict[str, float], None]]
    text_offset: list[int]


class CompletionResponseChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    stop_reason: Union[int, str, None]
    prompt_logprobs: PromptLogprobs = None    # with the request's prompt_logprobs


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class ChatLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprobs(ChatLogprob):
    top_logprobs: list[ChatLogprob]


class ChatLogprobs(_Out):
    content: list[ChatTokenLogprobs]


class ToolCallOut(_Out):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatResponseMessage(_Out):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None   # with tools (an empty list: none called)


class ChatCompletionResponseChoice(_Out):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    stop_reason: Union[int, str, None]


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs = None    # with the request's prompt_logprobs


class TokenizeResponse(_Out):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Out):
    prompt: str


class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class VersionResponse(_Out):
    version: str
