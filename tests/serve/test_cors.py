"""CORS as vLLM configures it (--allowed-origins, --allowed-methods, --allowed-headers,
--allow-credentials; defaults *, *, *, no), checked against Starlette's documented CORSMiddleware
behaviour (docs/middleware.md): a preflight (OPTIONS with Origin and Access-Control-Request-Method)
is answered by the middleware, 200 when the origin, method and headers are allowed and 400 when
not; Accept, Accept-Language, Content-Language and Content-Type are always allowed; `*` allows
every origin, every standard method and any header; with credentials the response names the origin
and says Access-Control-Allow-Credentials: true."""

from __future__ import annotations

import httpx
import pytest
from typer.testing import CliRunner

from llmopt.cli.app import app
from serve_util import API_KEY, TINY_CHAT, free_port, serve_cmd, shared_server, spawn, stop

UI = "https://ui.example"
SAFELISTED = {"accept", "accept-language", "content-language", "content-type"}
STANDARD_METHODS = {"DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT"}


@pytest.fixture(scope="module")
def model(tiny_factory):
    return tiny_factory(**TINY_CHAT)


@pytest.fixture(scope="module")
def configured(model, tmp_path_factory):
    """A server that allows one origin, GET and POST, two headers, and credentials."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("cors") / "server.log"
    proc = spawn(serve_cmd(model, port, "--allowed-origins", UI, "--allowed-methods", "GET", "--allowed-methods",
                           "POST", "--allowed-headers", "Authorization", "--allowed-headers", "X-Trace",
                           "--allow-credentials"), log, url)
    yield url
    stop(proc)


def preflight(url: str, path: str, origin: str, method: str, headers: str | None = None) -> httpx.Response:
    h = {"origin": origin, "access-control-request-method": method}
    if headers is not None:
        h["access-control-request-headers"] = headers
    return httpx.options(url + path, headers=h, timeout=30)


def listed(r: httpx.Response, name: str) -> set[str]:
    return {v.strip() for v in r.headers.get(name, "").split(",") if v.strip()}


def test_cli_defaults_are_vllms_and_flags_reach_run(monkeypatch, tmp_path):
    import llmopt.cli.serve as serve_cli
    seen: dict = {}
    monkeypatch.setattr(serve_cli, "run", lambda **kw: seen.update(kw))
    assert CliRunner().invoke(app, ["serve"]).exit_code == 0
    assert [list(seen[k]) for k in ("allowed_origins", "allowed_methods", "allowed_headers")] == [["*"]] * 3
    assert seen["allow_credentials"] is False
    res = CliRunner().invoke(app, ["serve", "--allowed-methods", "GET", "--allowed-methods", "POST",
                                   "--allowed-headers", "X-Trace", "--allow-credentials"])
    assert res.exit_code == 0, res.stderr
    assert list(seen["allowed_methods"]) == ["GET", "POST"] and list(seen["allowed_headers"]) == ["X-Trace"]
    assert seen["allow_credentials"] is True
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("allowed-methods: [GET]\nallowed-headers: X-Trace\nallow-credentials: true\n")
    assert CliRunner().invoke(app, ["serve", "--config", str(cfg)]).exit_code == 0
    assert list(seen["allowed_methods"]) == ["GET"] and list(seen["allowed_headers"]) == ["X-Trace"]
    assert seen["allow_credentials"] is True


def test_default_cors_allows_any_origin_method_and_header_without_credentials(model, tmp_path_factory):
    url = shared_server(model, tmp_path_factory.mktemp("serve-log")).url
    r = preflight(url, "/v1/completions", "https://anywhere.example", "DELETE", "x-anything, authorization")
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "*"
    assert listed(r, "access-control-allow-methods") >= STANDARD_METHODS
    assert listed(r, "access-control-allow-headers") >= {"x-anything", "authorization"}
    assert "access-control-allow-credentials" not in r.headers
    simple = httpx.get(url + "/health", headers={"origin": "https://anywhere.example"}, timeout=30)
    assert simple.status_code == 200 and simple.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-credentials" not in simple.headers


def test_configured_cors_allows_what_it_lists_and_refuses_the_rest(configured):
    url = configured
    ok = preflight(url, "/v1/chat/completions", UI, "POST", "authorization, x-trace, content-type")
    assert ok.status_code == 200, ok.text
    assert ok.headers["access-control-allow-origin"] == UI
    assert ok.headers["access-control-allow-credentials"] == "true"
    assert listed(ok, "access-control-allow-methods") == {"GET", "POST"}
    assert {h.lower() for h in listed(ok, "access-control-allow-headers")} == {"authorization", "x-trace"} | SAFELISTED
    # refused by the middleware (400) before any route: a method, a header, an origin not listed
    for bad in (preflight(url, "/v1/chat/completions", UI, "DELETE"),
                preflight(url, "/v1/chat/completions", UI, "POST", "authorization, x-other"),
                preflight(url, "/v1/chat/completions", "https://evil.example", "POST")):
        assert bad.status_code == 400, bad.text
        assert bad.headers.get("access-control-allow-origin") != "https://evil.example"
    # an actual request from the origin: the origin named, credentials allowed
    r = httpx.get(url + "/v1/models", headers={"origin": UI, "authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == UI and r.headers["access-control-allow-credentials"] == "true"
    other = httpx.get(url + "/v1/models", headers={"origin": "https://evil.example",
                                                   "authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert "access-control-allow-origin" not in other.headers
