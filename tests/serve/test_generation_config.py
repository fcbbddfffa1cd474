"""vLLM's --generation-config: `llmopt serve` takes temperature, top_p, top_k, min_p,
repetition_penalty and max_new_tokens from the model's generation_config.json for the fields a
request leaves out (a field the request gives wins), says so in its log, and reads nothing with
`vllm`; a malformed file is one line naming the field and the file."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from serve_util import API_KEY, MAX_MODEL_LEN, MODEL_NAME, TINY_CHAT, free_port, serve_cmd, spawn, stop
from llmopt.errors import ModelLoadError, UserInputError
from llmopt.models.generation_config import generation_defaults, resolve_generation_defaults

DEFAULTS = {"temperature": 0.0, "repetition_penalty": 1.5, "top_k": 5}
MAX_NEW = 7   # the file's max_new_tokens: the length of a request without max_tokens


@pytest.fixture(scope="module")
def model(tiny_factory, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gen-config") / "model"
    shutil.copytree(tiny_factory(**TINY_CHAT), folder)
    cfg = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**cfg, **DEFAULTS, "do_sample": True,
                                                                    "max_new_tokens": MAX_NEW}))
    return folder


def test_the_served_defaults_are_the_files_and_a_request_field_wins(model, tmp_path):
    from llmopt import LLM, SamplingParams
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = spawn(serve_cmd(model, port), tmp_path / "server.log", url)
    try:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
            body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True}
            got = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
            hot = http.post("/v1/completions", json={**body, "temperature": 1.0, "seed": 3}).json()["choices"][0]["text"]
            lengths = _lengths(http, body)
    finally:
        stop(proc)
    llm = LLM(str(model), max_model_len=256, kv_cache_memory=1 << 22)
    want = llm.generate(["Once upon a time"], SamplingParams(max_tokens=12, ignore_eos=True, **DEFAULTS))[0]
    sampled = llm.generate(["Once upon a time"], SamplingParams(max_tokens=12, ignore_eos=True,
                                                                **{**DEFAULTS, "temperature": 1.0, "seed": 3}))[0]
    assert got == want.outputs[0].text and hot == sampled.outputs[0].text and got != hot
    assert lengths == {"completion max_tokens null": MAX_NEW, "completion max_tokens omitted": 16,
                       "chat max_tokens omitted": MAX_NEW, "chat max_tokens 3": 3,
                       "near the context's end": 4}
    assert "Default sampling parameters have been overridden by the model's generation config" in \
        (tmp_path / "server.log").read_text()


def _lengths(http, body: dict) -> dict[str, int]:
    """Completion tokens (ignore_eos) of requests that leave max_tokens to the server or not: vLLM's
    get_max_tokens takes the file's max_new_tokens when the request has none, within the context."""
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
    cmpl = {k: v for k, v in body.items() if k != "max_tokens"}
    asks = {"completion max_tokens null": ("/v1/completions", {**cmpl, "max_tokens": None}),
            "completion max_tokens omitted": ("/v1/completions", cmpl),   # its field's default: 16, as vLLM's
            "chat max_tokens omitted": ("/v1/chat/completions", chat),
            "chat max_tokens 3": ("/v1/chat/completions", {**chat, "max_tokens": 3}),
            "near the context's end": ("/v1/completions", {**cmpl, "prompt": [5] * (MAX_MODEL_LEN - 4),
                                                           "max_tokens": None})}
    out = {}
    for name, (route, req) in asks.items():
        r = http.post(route, json=req)
        assert r.status_code == 200, r.text
        out[name] = r.json()["usage"]["completion_tokens"]
    return out


def test_reading_the_file(model, tmp_path):
    assert generation_defaults(model) == {**DEFAULTS, "max_tokens": MAX_NEW}
    assert resolve_generation_defaults("vllm", model) == {} and resolve_generation_defaults(str(model), tmp_path) \
        == {**DEFAULTS, "max_tokens": MAX_NEW}
    assert generation_defaults(tmp_path) == {}
    with pytest.raises(UserInputError, match="--generation-config .*: no generation_config.json there"):
        resolve_generation_defaults(str(tmp_path), model)
    for bad, msg in [({"temperature": "hot"}, "temperature must be a number"), ({"top_k": 2.5}, "top_k must be an "
                                                                                                  "integer"),
                     ({"max_new_tokens": 0}, "max_new_tokens must be at least 1")]:
        (tmp_path / "generation_config.json").write_text(json.dumps(bad))
        with pytest.raises(ModelLoadError, match=f"generation_config.json: {msg}"):
            generation_defaults(tmp_path)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not a JSON file"):
        generation_defaults(tmp_path)
