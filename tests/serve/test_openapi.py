"""/openapi.json tells the truth about the server: each route lists the error statuses it really
answers (each with OpenAI's error body) and no 422, which it never answers; /health, /metrics and
streams declare their real content types; and schemathesis, generating requests from the served
document, finds no 5xx, no undocumented status or content type and no body that breaks its schema.

The server is a real one (uvicorn in this process, on a port) over a tiny random model with
SmolLM2's tokenizer and an API key; the fuzzer is schemathesis' CLI against it, with the hooks of
openapi_hooks.py (few tokens and samples per request). It is bounded (MAX_EXAMPLES per operation
and mode) so the file runs in well under a minute on two cores. (Not schemathesis' pytest plugin:
its `from_fixture` loader reads a private attribute that pytest 9 no longer has.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import pytest

from llmopt.engine.args import EngineArgs
from llmopt.engine.async_engine import AsyncLLMEngine
from llmopt.engine.engine import LLMEngine
from llmopt.serve.api_server import build_app
from llmopt.serve.server import ServeConfig
from serve_util import API_KEY, ENGINE_ARGS, MAX_MODEL_LEN, MAX_REQUEST_BYTES, MODEL_NAME, TINY_CHAT, inprocess_server

HERE = Path(__file__).resolve().parent
MAX_EXAMPLES = 30   # per operation and generation mode, in the fuzzing phase
SEED = int(os.environ.get("FUZZ_SEED", "1"))   # the same cases every run; FUZZ_SEED=n explores others
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHECKS = ["not_a_server_error", "status_code_conformance", "content_type_conformance", "response_schema_conformance",
          "negative_data_rejection", "unsupported_method"]
C, CHAT = "/v1/completions", "/v1/chat/completions"
# every route and the error statuses it answers (401: the /v1 routes, as this server has an API key)
BODY, ENGINE = (400, 404, 413), (500, 503)
ROUTES = {("GET", "/health"): (503,), ("GET", "/version"): (), ("GET", "/metrics"): (), ("GET", "/v1/models"): (401,),
          ("POST", "/tokenize"): BODY, ("POST", "/detokenize"): BODY,
          ("POST", C): (*BODY, 401, *ENGINE), ("POST", CHAT): (*BODY, 401, *ENGINE)}
ERROR_SCHEMA = {"type": "object", "required": ["error"], "additionalProperties": False, "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}}}


def make_app(model, **config):
    engine = AsyncLLMEngine(LLMEngine(EngineArgs(model=str(model), **ENGINE_ARGS)))
    return build_app(engine, ServeConfig(model_name=MODEL_NAME, log_interval=0, log_requests=False,
                                         max_request_bytes=MAX_REQUEST_BYTES, **config))


@pytest.fixture(scope="module")
def model(tiny_factory):
    return tiny_factory(**TINY_CHAT)


@pytest.fixture(scope="module")
def app(model):
    return make_app(model, api_keys=(API_KEY,))


@pytest.fixture(scope="module")
def url(app):
    with inprocess_server(app) as u:
        yield u


@pytest.fixture(scope="module")
def doc(url) -> dict:
    r = httpx.get(url + "/openapi.json")
    assert r.status_code == 200, r.text
    return r.json()


# -- the document, read directly ---------------------------------------------------------------------
def test_routes_and_their_error_statuses(doc):
    """Every route is documented with exactly the error statuses it answers, each as OpenAI's error
    body; 422, which the server never answers, is nowhere."""
    got = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert got == set(ROUTES)
    for (method, path), statuses in ROUTES.items():
        responses = doc["paths"][path][method.lower()]["responses"]
        assert sorted(int(s) for s in responses) == sorted({200, *statuses}), (method, path)
        for s in statuses:
            assert responses[str(s)]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorResponse"}, (method, path, s)
    assert "422" not in str(doc["paths"]) and "HTTPValidationError" not in doc["components"]["schemas"]
    body = doc["components"]["schemas"]["ErrorResponse"]
    info = doc["components"]["schemas"][body["properties"]["error"]["$ref"].rsplit("/", 1)[1]]
    assert body["required"] == ["error"] and sorted(info["required"]) == ["code", "message", "param", "type"]


def test_content_types(doc):
    """/health answers an empty 200, /metrics Prometheus' text format, completions JSON or (with
    stream: true) an event stream."""
    assert "content" not in doc["paths"]["/health"]["get"]["responses"]["200"]
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == [
        "text/plain; version=0.0.4; charset=utf-8"]
    for path in (C, CHAT):
        assert sorted(doc["paths"][path]["post"]["responses"]["200"]["content"]) == [
            "application/json", "text/event-stream"]


def test_no_api_key_no_401(model):
    """Without --api-key nothing answers 401, so nothing lists it."""
    doc = make_app(model).openapi()
    assert "401" not in str(doc["paths"]) and "securitySchemes" not in doc["components"]


# -- the document against real answers -----------------------------------------------------------
def check(doc: dict, method: str, path: str, r: httpx.Response, status: int) -> None:
    """`r` has `status`, and the content type and body the document gives for it (an error: OpenAI's)."""
    assert r.status_code == status, (method, path, r.status_code, r.text)
    entry = doc["paths"][path][method.lower()]["responses"][str(status)]
    if "content-type" not in r.headers:
        assert r.content == b"" and "content" not in entry
        return
    body = r.json()
    schema = entry["content"][r.headers["content-type"].split(";")[0]]["schema"]
    jsonschema.validate(body, {**schema, "components": doc["components"]})   # its $refs resolve in the document
    if status >= 400:
        jsonschema.validate(body, ERROR_SCHEMA)
        assert body["error"]["code"] == status


def test_each_documented_error_is_real(doc, app, url):
    """Each route answers each error status it lists (but 500: tests/serve/test_faults.py), in the
    body the document gives."""
    c = httpx.Client(base_url=url, headers=AUTH, timeout=60)
    bodies = {"/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [1]}, C: {"prompt": "hi", "max_tokens": 1},
              CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}}
    for path, body in bodies.items():
        check(doc, "POST", path, c.post(path, json=body), 200)
        check(doc, "POST", path, c.post(path, json={**body, "model": "nope"}), 404)
        check(doc, "POST", path, c.post(path, json=[body]), 400)
        check(doc, "POST", path, c.post(path, content=b"{", headers={"content-type": "application/json"}), 400)
        check(doc, "POST", path, c.post(path, json={**body, "pad": "x" * MAX_REQUEST_BYTES}), 413)
    for method, path in (("GET", "/v1/models"), ("POST", C), ("POST", CHAT)):
        check(doc, method, path, httpx.request(method, url + path, json=bodies.get(path)), 401)
    server = app.state.server
    server.draining = True
    try:
        for method, path in (("GET", "/health"), ("POST", C), ("POST", CHAT)):
            check(doc, method, path, c.request(method, path, json=bodies.get(path)), 503)
    finally:
        server.draining = False
    check(doc, "GET", "/health", c.get("/health"), 200)


def test_stream_content_type(url):
    for path, body in ((C, {"prompt": "hi"}), (CHAT, {"messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(url + path, json={**body, "max_tokens": 2, "stream": True}, headers=AUTH, timeout=60)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.text.endswith("data: [DONE]\n\n")


# -- the fuzzer ------------------------------------------------------------------------------------
def test_405_names_the_allowed_methods(url):
    """A wrong method is a 405 in OpenAI's shape with the Allow header RFC 9110 requires (our error
    handler dropped it; schemathesis' unsupported_method check found that)."""
    for method, path, allowed in (("TRACE", "/health", "GET"), ("DELETE", C, "POST"), ("GET", "/tokenize", "POST")):
        r = httpx.request(method, url + path, headers=AUTH)
        assert r.status_code == 405 and r.headers.get("allow") == allowed, (method, path, r.headers)
        jsonschema.validate(r.json(), ERROR_SCHEMA)


def test_fuzz(url, tmp_path):
    """schemathesis' CLI over the served document, its coverage phase (boundary values, each
    operation under other methods) then its fuzzing phase (valid and invalid bodies): no 5xx, only
    documented statuses and content types, bodies that fit their schema, bodies that break the
    schema refused; and valid requests served (a 200 on every operation)."""
    seen = tmp_path / "seen.json"
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "openapi_hooks", "FUZZ_SEEN": str(seen),
           "FUZZ_MAX_MODEL_LEN": str(MAX_MODEL_LEN), "PYTHONPATH": str(HERE)}
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", url + "/openapi.json", "-H", f"Authorization: Bearer {API_KEY}",
           "--checks", ",".join(CHECKS), "--phases", "coverage,fuzzing", "--max-examples", str(MAX_EXAMPLES),
           "--workers", "1", "--request-timeout", "60", "--seed", str(SEED)]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-20000:] + r.stderr[-5000:]
    counts = json.loads(seen.read_text())
    for method, path in ROUTES:
        assert counts.get(f"{method} {path}", {}).get("200"), (method, path, counts)
