"""What /openapi.json says each route answers, so that it tells the truth: the success body (JSON,
an event stream with `stream: true`, Prometheus text, or nothing) and every error status the
route really answers, each with OpenAI's error body (protocol.ErrorResponse).

FastAPI adds a 422 to every route with a body; we never answer one (a body that does not validate
is a 400, api_server.py), so `install` takes it out. The 401 of `--api-key` is listed on /v1/*
(the paths ApiKeyMiddleware guards) only when the server has a key. Unknown paths (404) and
wrong methods (405) belong to no route, so no route lists them."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from llmopt.serve.protocol import ErrorResponse

ERRORS = {
    400: "Bad request: a body that is not valid JSON or does not validate, a value out of range, or a "
         "request this model cannot serve (context length, vocabulary).",
    401: "No valid API key: send `Authorization: Bearer KEY` (only with --api-key).",
    404: "The model named in the request is not served here.",
    413: "The request body is larger than --max-request-bytes.",
    500: "The engine failed this request (or died while it ran).",
    503: "Not now: the server is shutting down, its engine is dead, or --max-num-queued-reqs is reached.",
}
BODY_ERRORS = (400, 404, 413)   # every route that reads a JSON body
ENGINE_ERRORS = (500, 503)      # every route that runs the engine
API_KEY_PREFIX = "/v1"          # the paths that need the API key (middleware.ApiKeyMiddleware)
SSE = "text/event-stream"


def errors(*statuses: int, **descriptions: str) -> dict:
    """The `responses` entries of these error statuses (`descriptions`: s503="..." overrides one)."""
    return {s: {"model": ErrorResponse, "description": descriptions.get(f"s{s}", ERRORS[s])} for s in statuses}


def ok(model=None, description: str = "Successful Response", content: dict | None = None,
       stream: bool = False) -> dict:
    """The 200 entry: a JSON `model`, other `content` (media type -> schema), and with `stream` the
    event stream of `stream: true` (`data: {chunk}` events, then `data: [DONE]`)."""
    entry: dict = {"description": description}
    if model is not None:
        entry["model"] = model
    more = dict(content or {})
    if stream:
        more[SSE] = {"schema": {"type": "string", "description": "Server-sent events: one `data: {chunk}` per "
                                "update, then `data: [DONE]`; an error after the start is an event with "
                                "OpenAI's error body"}}
    if more:
        entry["content"] = more
    return {200: entry}


def _document(schema: dict, api_keys: bool) -> dict:
    """Drop the 422s we never answer; add the 401 on /v1/* when the server has an API key."""
    for path, ops in schema.get("paths", {}).items():
        for op in ops.values():
            op["responses"].pop("422", None)
            if api_keys and path.startswith(API_KEY_PREFIX):
                op["responses"]["401"] = {"description": ERRORS[401], "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
                op["security"] = [{"bearer": []}]
    components = schema.setdefault("components", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.get("schemas", {}).pop(name, None)
    if api_keys:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return schema


def install(app: FastAPI, api_keys: bool) -> None:
    """Serve the document above as the app's /openapi.json (built once, on first request)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = _document(schema, api_keys)
        return app.openapi_schema
    app.openapi = openapi
