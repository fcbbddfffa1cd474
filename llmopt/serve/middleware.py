"""The server's ASGI middlewares: the API key, X-Request-Id and the request-body limit (which also stamps each
request's arrival time). Plain ASGI, not BaseHTTPMiddleware, which gets in the way of streaming
and disconnects."""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request

from llmopt.serve.protocol import OpenAIError, error_response

ARRIVAL = "llmopt.arrival"   # scope key: time.monotonic() when the request reached the server


def arrival_time(request: Request) -> float:
    """When the request reached the server (stamped by BodyLimitMiddleware), else now."""
    return request.scope.get(ARRIVAL) or time.monotonic()


class ApiKeyMiddleware:
    """/v1/* needs `Authorization: Bearer KEY` for one of the keys, as vLLM's --api-key (CORS
    preflights, which browsers send without credentials, pass)."""

    def __init__(self, app, api_keys: tuple[str, ...]) -> None:
        self.app, self.expected = app, {f"Bearer {k}".encode() for k in api_keys}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            auth = dict(scope.get("headers") or []).get(b"authorization", b"")
            if auth not in self.expected:
                await error_response(OpenAIError("Unauthorized: a valid API key is required", 401))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """X-Request-Id on every response: the client's own, else a new one (vLLM's
    --enable-request-id-headers)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"x-request-id")
        rid = given[:128] if given else uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class BodyLimitMiddleware:
    """Stamps each request's arrival time, and reads a request body whole before the app does,
    answering 413 as soon as it passes `limit` bytes (by its Content-Length, or while it arrives
    when chunked). The app then reads the body from memory; later receive() calls (disconnects) go
    to the client."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[ARRIVAL] = time.monotonic()
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await error_response(OpenAIError(f"Content-Length {length[:40]!r} is not a number", 400))(
                    scope, receive, send)
                return
            if declared > self.limit:
                await self._too_large(declared, scope, receive, send)
                return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.limit:
                await self._too_large(size, scope, receive, send, at_least=True)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, size: int, scope, receive, send, at_least: bool = False) -> None:
        given = f"over {self.limit:,} bytes (sent in chunks)" if at_least else f"{size:,} bytes"
        await error_response(OpenAIError(f"the request body is {given}; at most {self.limit:,} bytes are allowed "
                                         "(--max-request-bytes)", 413))(scope, receive, send)
