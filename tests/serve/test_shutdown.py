"""`llmopt serve` as a process: SIGTERM with --shutdown-timeout (drain, then exit 0; or abort at
once, the default), the start-up and periodic log lines, and --config (keys are flag names, flags on
the command line win, unknown keys and bad values refused in one line)."""

from __future__ import annotations

import json
import signal
import socket
import time

import httpx
import pytest
from typer.testing import CliRunner

from llmopt.cli.app import app
from serve_util import API_KEY, MODEL_NAME, TINY_CHAT, free_port, serve_cmd, spawn, stop

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG = {"prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def model(tiny_factory):
    return tiny_factory(**TINY_CHAT)


def sigterm_mid_stream(url: str, proc, during=None) -> tuple[list, float]:
    """Stream LONG; after 3 events send SIGTERM, call during(), read the rest. Returns the
    events (JSON, or "[DONE]") and the time SIGTERM was sent."""
    evs, sent = [], None
    with httpx.stream("POST", url + "/v1/completions", json=LONG, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            evs.append(data if data == "[DONE]" else json.loads(data))
            if len(evs) == 3:
                proc.send_signal(signal.SIGTERM)
                sent = time.monotonic()
                if during is not None:
                    during()
    return evs, sent


def test_sigterm_drains_with_shutdown_timeout_from_config(model, tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("shutdown-timeout: 30\nlog_interval: 0.3\nserved-model-name: from-config\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    proc = spawn(serve_cmd(model, port, "--config", str(cfg)), log, url)
    try:
        models = httpx.get(url + "/v1/models", headers=AUTH).json()
        assert [m["id"] for m in models["data"]] == [MODEL_NAME]   # the command line's name wins

        def during():   # draining: no new work, and /health says so
            assert httpx.get(url + "/health").status_code == 503
            r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=AUTH)
            assert r.status_code == 503 and r.json()["error"]["code"] == 503

        evs, _ = sigterm_mid_stream(url, proc, during)
        assert evs[-1] == "[DONE]" and evs[-2]["usage"]["completion_tokens"] == 240   # finished in full
        assert [e["choices"][0]["finish_reason"] for e in evs[:-2]][-1] == "length"
        assert proc.wait(timeout=30) == 0
    finally:
        stop(proc)
    text = log.read_text()
    for needle in ["KV cache: 64 blocks of 16 tokens = 1024 tokens", "Maximum concurrency for 256 tokens per "
                   "request: 4.00x", "finished (length): prompt", "output 240 tokens", "Avg prompt throughput:",
                   "Avg generation throughput:", "Running: 1 reqs, Waiting: 0 reqs, KV cache usage:",
                   "SIGTERM: shutting down (--shutdown-timeout 30 s)", "shut down"]:
        assert needle in text, needle
    assert "Traceback" not in text


def test_sigterm_aborts_at_once_by_default(model, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = spawn(serve_cmd(model, port), tmp_path / "server.log", url)
    try:
        evs, sent = sigterm_mid_stream(url, proc)
        assert proc.wait(timeout=20) == 0
        assert time.monotonic() - sent < 10
    finally:
        stop(proc)
    assert evs[-1] == "[DONE]" and evs[-2]["error"]["code"] == 503    # the stream ends, saying why
    assert "shutting down" in evs[-2]["error"]["message"]
    text = "".join(e["choices"][0]["text"] for e in evs[:-2] if isinstance(e, dict) and e.get("choices"))
    assert 0 < len(text) and not any(e.get("choices", [{}])[0].get("finish_reason") for e in evs[:-2]
                                     if isinstance(e, dict) and e.get("choices"))


# -- --config and start-up errors (in this process: they stop before the model loads) ----------------
def run_cli(*args: str):
    res = CliRunner().invoke(app, ["serve", *args], env={"COLUMNS": "200"})
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    return res.exit_code, lines


@pytest.mark.parametrize("content,message", [
    ("max-modle-len: 128\n", "unknown key 'max-modle-len' (did you mean max-model-len?): use flag names of "
                             "llmopt serve (see llmopt serve --help)"),
    ("max-num-seqs: 0\n", "max-num-seqs: 0 is out of range: use >= 1"),
    ("port: 70000\n", "port: 70000 is out of range: use 1 to 65535"),
    ("enable-prefix-caching: maybe\n", "enable-prefix-caching must be true or false, got 'maybe'"),
    ("max-num-seqs: [1, 2]\n", "max-num-seqs must be a single value, got a list"),
    ("api-key: [{a: 1}]\n", "api-key must be a value or a list of values"),
    ("max-model-len: [\n", "is not valid YAML"),
    ("- port\n", "must be a mapping of flag names to values, got a list"),
])
def test_config_errors_are_one_line(tmp_path, content, message):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(content)
    code, lines = run_cli("--config", str(cfg))
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: --config "), lines
    assert message in lines[0], lines


def test_config_missing_file_and_busy_port(tmp_path, model):
    code, lines = run_cli("--config", str(tmp_path / "none.yaml"))
    assert code == 2 and lines == [f"error: --config {tmp_path / 'none.yaml'}: no such file"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        code, lines = run_cli("--model", str(model), "--port", str(port))
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: cannot listen on 127.0.0.1:{port}: ")
    assert time.monotonic() - t0 < 5    # refused before the model loads


def test_config_values_reach_the_command(tmp_path, monkeypatch):
    """Config values fill the flags not given (converted and checked as flags, the --no- form
    too); flags on the command line win."""
    import llmopt.cli.serve as serve_cli
    seen = {}
    monkeypatch.setattr(serve_cli, "run", lambda **kw: seen.update(kw))
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max_num_seqs: 7\nport: 9000\nno-enable-prefix-caching: true\nkv-cache-memory-bytes: 8MiB\n"
                   "shutdown-timeout: 2.5\nscheduling-policy: priority\nmax-model-len: null\n")
    res = CliRunner().invoke(app, ["serve", "--config", str(cfg), "--port", "9001"])
    assert res.exit_code == 0, res.stderr
    assert seen["max_num_seqs"] == 7 and seen["port"] == 9001 and seen["prefix_caching"] is False
    assert seen["kv_cache_memory"] == "8MiB" and seen["shutdown_timeout"] == 2.5
    assert seen["scheduling_policy"] == "priority" and seen["max_model_len"] is None


def test_positional_model_repeatable_flags_and_their_config_lists(tmp_path, monkeypatch):
    """`llmopt serve MODEL` as `vllm serve MODEL`; the same model also given by --model is fine, a
    different one is refused; --api-key repeats, and a config key of a repeatable flag takes one
    value or a list."""
    import llmopt.cli.serve as serve_cli
    seen = {}
    monkeypatch.setattr(serve_cli, "run", lambda **kw: seen.update(kw))
    res = CliRunner().invoke(app, ["serve", "some/model", "--api-key", "a", "--api-key", "b"])
    assert res.exit_code == 0, res.stderr
    assert seen["model"] == "some/model" and list(seen["api_key"]) == ["a", "b"]
    assert list(seen["allowed_origins"]) == ["*"]
    code, lines = run_cli("m1", "--model", "m2")
    assert code == 2 and lines == ["error: the model is given twice ('m1' and --model 'm2'): give it once"]
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("api-key: [k1, k2]\nallowed-origins: https://app.example\n")
    res = CliRunner().invoke(app, ["serve", "--config", str(cfg)])
    assert res.exit_code == 0, res.stderr
    assert list(seen["api_key"]) == ["k1", "k2"] and list(seen["allowed_origins"]) == ["https://app.example"]
