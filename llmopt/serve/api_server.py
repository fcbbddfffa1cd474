"""The OpenAI-compatible HTTP server: a FastAPI app over AsyncLLMEngine (vLLM's api_server.py).

    app = build_app(AsyncLLMEngine(LLMEngine(args)), ServeConfig(model_name="smollm2-135m"))
    uvicorn.run(app, host="127.0.0.1", port=8000)

This module holds the app: its lifespan, the exception handlers that answer our errors in
OpenAI's error shape, the middlewares it installs (middleware.py) and one short route per endpoint
that parses, delegates to a serving class (serving_*.py) and returns. A bad request is a 400 in
OpenAI's error shape before anything is queued (serving_engine.py); a body above
`max_request_bytes` is a 413 before it is parsed.

Failures: a request the engine fails alone gets a 500 (in-band, as an error event, once its stream
has started; streaming.py); the others go on. When the engine is dead, /health answers 503, open
requests fail with 500 and new ones get 503. Shutdown: see server.py. Logs: one line per finished
request and, every `log_interval` seconds while there is work, throughput, running/waiting requests
and KV-cache usage, as vLLM logs them."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from llmopt import __version__
from llmopt.engine.async_engine import AsyncLLMEngine, EngineStoppedError
from llmopt.errors import LLMOptError, UserInputError
from llmopt.serve.metrics import CONTENT_TYPE
from llmopt.serve import openapi
from llmopt.serve.middleware import ApiKeyMiddleware, BodyLimitMiddleware, RequestIdMiddleware, arrival_time
from llmopt.serve.openapi import BODY_ERRORS, ENGINE_ERRORS, errors, ok
from llmopt.serve.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                   CompletionResponse, DetokenizeRequest, DetokenizeResponse, ModelList,
                                   OpenAIError, TokenizeRequest, TokenizeResponse, VersionResponse,
                                   error_response)
from llmopt.serve.server import OpenAIServer, ServeConfig
from llmopt.serve.serving_chat import OpenAIServingChat
from llmopt.serve.serving_completion import OpenAIServingCompletion
from llmopt.serve.serving_tokenization import OpenAIServingTokenization

router = APIRouter()


@asynccontextmanager
async def lifespan(app: FastAPI):
    server: OpenAIServer = app.state.server
    await anyio.sleep(0)   # loads anyio's asyncio backend now, not in the first stream (~0.5 s of its TTFT)
    interval = server.config.log_interval
    stats = asyncio.create_task(server.log_stats_forever(interval)) if interval > 0 else None
    try:
        yield
    finally:
        if stats is not None:
            stats.cancel()
            await asyncio.gather(stats, return_exceptions=True)
        await server.engine.stop()


# -- errors in OpenAI's shape ----------------------------------------------------------------------
async def _openai_error(request: Request, e: OpenAIError):
    return error_response(e)


async def _validation_error(request: Request, e: RequestValidationError):
    errors = e.errors()
    if any(err.get("type") == "json_invalid" for err in errors):
        return error_response(OpenAIError("the request body is not valid JSON (or not UTF-8)", 400))
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    message = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ()) if x != 'body') or 'body'}: "
                        f"{err.get('msg', 'invalid')}" for err in errors[:5])
    return error_response(OpenAIError(message or "invalid request", 400, ".".join(loc) or None))


async def _http_error(request: Request, e: StarletteHTTPException):
    response = error_response(OpenAIError(str(e.detail), e.status_code,
                                          type="NotFoundError" if e.status_code == 404 else None))
    response.headers.update(e.headers or {})   # a 405's Allow (RFC 9110)
    return response


async def _user_error(request: Request, e: UserInputError):
    return error_response(OpenAIError(str(e), 400))


async def _stopped(request: Request, e: EngineStoppedError):
    return error_response(OpenAIError(str(e), 503))


async def _engine_error(request: Request, e: LLMOptError):   # RequestFailedError, EngineDeadError
    return error_response(OpenAIError(str(e), 500))


EXCEPTION_HANDLERS = [(OpenAIError, _openai_error), (RequestValidationError, _validation_error),
                      (StarletteHTTPException, _http_error), (UserInputError, _user_error),
                      (EngineStoppedError, _stopped), (LLMOptError, _engine_error)]


# -- routes ----------------------------------------------------------------------------------------
@router.get("/health", response_class=Response, responses={
    **ok(description="The engine is alive (an empty body)."),
    **errors(503, s503="The engine is dead, or the server is shutting down.")})
async def health(request: Request):
    server: OpenAIServer = request.app.state.server
    if server.engine.dead is not None:
        return error_response(OpenAIError(f"the engine is dead: {server.engine.dead}", 503))
    if server.draining:
        return error_response(OpenAIError("the server is shutting down", 503))
    return Response(status_code=200)


@router.get("/version", responses=ok(VersionResponse))
async def version():
    return {"version": __version__}


@router.get("/metrics", response_class=Response, responses=ok(
    description="Prometheus' text format.", content={CONTENT_TYPE: {"schema": {"type": "string"}}}))
async def metrics(request: Request):
    return Response(request.app.state.server.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/models", responses=ok(ModelList))
async def models(request: Request):
    return request.app.state.server.models()


@router.post("/tokenize", responses={**ok(TokenizeResponse), **errors(*BODY_ERRORS)})
async def tokenize(body: TokenizeRequest, request: Request):
    return request.app.state.serving_tokenization.tokenize(body)


@router.post("/detokenize", responses={**ok(DetokenizeResponse), **errors(*BODY_ERRORS)})
async def detokenize(body: DetokenizeRequest, request: Request):
    return request.app.state.serving_tokenization.detokenize(body)


@router.post("/v1/completions", responses={
    **ok(CompletionResponse, stream=True), **errors(*BODY_ERRORS, *ENGINE_ERRORS)})
async def create_completion(body: CompletionRequest, request: Request):
    return await request.app.state.serving_completion.create_completion(body, request, arrival_time(request))


@router.post("/v1/chat/completions", responses={
    **ok(ChatCompletionResponse, stream=True), **errors(*BODY_ERRORS, *ENGINE_ERRORS)})
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    return await request.app.state.serving_chat.create_chat_completion(body, request, arrival_time(request))


def build_app(engine: AsyncLLMEngine, config: ServeConfig) -> FastAPI:
    """The app serving `engine`; `app.state.server` is its OpenAIServer (run.py drains it)."""
    server = OpenAIServer(engine, config)
    app = FastAPI(title="llmopt", version=__version__, lifespan=lifespan)
    app.state.server = server
    app.state.serving_completion = OpenAIServingCompletion(server)
    app.state.serving_chat = OpenAIServingChat(server)
    app.state.serving_tokenization = OpenAIServingTokenization(server)
    for exc, handler in EXCEPTION_HANDLERS:
        app.add_exception_handler(exc, handler)
    app.add_middleware(BodyLimitMiddleware, limit=config.max_request_bytes)
    if config.api_keys:
        app.add_middleware(ApiKeyMiddleware, api_keys=config.api_keys)   # before the body: none read without a key
    if config.request_id_headers:
        app.add_middleware(RequestIdMiddleware)
    if config.allowed_origins:   # outermost: preflights and errors carry the CORS headers too
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=list(config.allowed_methods), allow_headers=list(config.allowed_headers),
                           allow_credentials=config.allow_credentials)
    app.include_router(router)
    openapi.install(app, api_keys=bool(config.api_keys))
    return app
