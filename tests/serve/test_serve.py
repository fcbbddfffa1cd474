"""`llmopt serve` end to end: the official openai client against a real server subprocess on a tiny
random model; malformed requests; a client leaving mid-stream; /metrics."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_util import (API_KEY, ENGINE_ARGS, MAX_MODEL_LEN, MAX_REQUEST_BYTES, MODEL_NAME, TINY_CHAT, metrics,
                        shared_server, wait_idle)

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def tiny_chat_model(tiny_factory):
    return tiny_factory(**TINY_CHAT)


@pytest.fixture(scope="module")
def server(tiny_chat_model, tmp_path_factory):
    return shared_server(tiny_chat_model, tmp_path_factory.mktemp("serve-log"))


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def http(server):
    with server.http() as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_chat_model):
    """The offline LLM API on the same model and engine arguments."""
    from llmopt import LLM
    return LLM(str(tiny_chat_model), **ENGINE_ARGS)


# -- happy paths --------------------------------------------------------------------------------------
def test_models_health_version(client, http):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]


def test_completion_greedy_matches_offline_and_stream(client, offline):
    from llmopt import SamplingParams
    want = offline.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for prompt, ref in zip(PROMPTS, want):
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.object == "text_completion" and len(r.choices) == 1
        assert r.choices[0].text == ref.outputs[0].text
        assert r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8
        assert r.usage.prompt_tokens_details.cached_tokens >= 0
        chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == r.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices


def test_completion_token_ids_batch_and_n(client, offline):
    ids = offline.tokenizer("Hello world").input_ids
    ids2 = offline.tokenizer(PROMPTS[0]).input_ids
    r = client.completions.create(model=MODEL_NAME, prompt=[ids, ids2], max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 8
    same = client.completions.create(model=MODEL_NAME, prompt="Hello world", max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert same.choices[0].text == r.choices[0].text       # token ids and text prompts agree
    assert r.usage.prompt_tokens == len(ids) + len(ids2)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[:2], max_tokens=5, n=3, temperature=1.0, seed=7,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == list(range(6))
    assert r.usage.completion_tokens == 30
    # n samples streamed: every index appears and finishes
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=5, n=3, seed=3,
                                            stream=True, extra_body={"ignore_eos": True}))
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1, 2}


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=6, temperature=0.9, top_p=0.9, seed=123)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


def test_chat_greedy_matches_offline_and_stream(client, offline):
    from llmopt import SamplingParams
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    ref = offline.chat(messages, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == 6
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6
    # the same conversation again: its prompt blocks come from the prefix cache
    again = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_stop_string_across_tokens_streams_the_same_text(client):
    base = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=12, temperature=0,
                                     logprobs=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    tokens = base.choices[0].logprobs.tokens
    # a stop string spanning the boundary between output tokens 3 and 4 (2 chars on each side)
    cut = len("".join(tokens[:4]))
    stop = text[cut - 2:cut + 2]
    assert len(stop) == 4 and stop in text
    kw = dict(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=12, temperature=0, stop=[stop])
    plain = client.completions.create(**kw).choices[0]
    assert plain.finish_reason == "stop" and plain.text == text[:text.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
    assert streamed == plain.text


def test_logprobs(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 3 and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(t) <= 2 and t for t in lp.top_logprobs)
    c = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 3 for t in content)


@pytest.fixture(scope="module")
def hf_logprobs(tiny_chat_model):
    """transformers' float32 log-softmax over each position of a token-id prompt."""
    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    return run


def test_echo_logprobs_as_lm_eval_scores_them(http, hf_logprobs):
    """lm-evaluation-harness's local-completions loglikelihood request (token-id prompts in a batch,
    echo, logprobs 1, max_tokens 1, temperature 0): the prompt's logprobs first (the first token has
    none), each position's top_logprobs holding the top token and the prompt's own, then the one
    generated token. With max_tokens 0, the prompt alone and no completion tokens."""
    prompts = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13, 14, 15]]
    body = {"model": MODEL_NAME, "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    for ids, choice in zip(prompts, sorted(r.json()["choices"], key=lambda c: c["index"])):
        lp, ref = choice["logprobs"], hf_logprobs(ids)
        assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None
        want = [float(ref[i - 1, t]) for i, t in enumerate(ids) if i]
        assert lp["token_logprobs"][1:len(ids)] == pytest.approx(want, abs=2e-4)
        for i, top in enumerate(lp["top_logprobs"][1:len(ids)], start=1):
            assert max(top.values()) == pytest.approx(float(ref[i - 1].max()), abs=2e-4)
            assert lp["token_logprobs"][i] in top.values()                     # the prompt's own token
        assert lp["token_logprobs"][-1] == pytest.approx(float(ref[-1].max()), abs=2e-4)   # greedy: the top
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    only = http.post("/v1/completions", json={**body, "max_tokens": 0}).json()
    for ids, choice in zip(prompts, sorted(only["choices"], key=lambda c: c["index"])):
        assert len(choice["logprobs"]["token_logprobs"]) == len(ids) and choice["finish_reason"] == "length"
        assert choice["text"] == "".join(choice["logprobs"]["tokens"])
    assert only["usage"]["completion_tokens"] == 0 and only["usage"]["prompt_tokens"] == 12


def test_vllm_prompt_logprobs_on_completions_and_chat(http, hf_logprobs):
    ids = [5, 17, 42, 99, 3]
    r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": ids, "max_tokens": 2, "temperature": 0,
                                           "prompt_logprobs": 2}).json()
    got, ref = r["choices"][0]["prompt_logprobs"], hf_logprobs(ids)
    assert len(got) == len(ids) and got[0] is None
    for i, entry in enumerate(got[1:], start=1):
        row, t = ref[i - 1], ids[i]
        assert entry[str(t)]["logprob"] == pytest.approx(float(row[t]), abs=2e-4)
        assert entry[str(t)]["rank"] == int((row > row[t]).sum()) + 1
        top = torch_topk(row, 2)
        assert all(entry[str(k)]["rank"] == rank for rank, k in enumerate(top, start=1))
    assert r["choices"][0]["logprobs"] is None                   # no echo: the completion as before
    c = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": MSG, "max_tokens": 2,
                                                "prompt_logprobs": 0}).json()
    assert c["prompt_logprobs"][0] is None and len(c["prompt_logprobs"]) == c["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in c["prompt_logprobs"][1:])   # k = 0: the prompt's own token alone
    for body in ({"prompt": ids, "echo": True, "logprobs": 1, "stream": True},
                 {"prompt": ids, "prompt_logprobs": 1, "stream": True}, {"prompt": ids, "max_tokens": 0}):
        r = http.post("/v1/completions", json={"model": MODEL_NAME, "max_tokens": 1, **body})
        assert r.status_code == 400, r.text


def torch_topk(row, k: int) -> list[int]:
    import torch
    return torch.topk(row, k).indices.tolist()


def test_tokenize_detokenize(http, offline):
    r = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": "Hello world"}).json()
    assert r["tokens"] == offline.tokenizer("Hello world").input_ids and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_MODEL_LEN
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "Hello world"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 3


# -- bad input ----------------------------------------------------------------------------------------
C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
BAD = [
    ("negative max_tokens", C, {"prompt": "hi", "max_tokens": -1}, 400),
    ("zero max_tokens", C, {"prompt": "hi", "max_tokens": 0}, 400),
    ("max_tokens of the wrong type", C, {"prompt": "hi", "max_tokens": "ten"}, 400),
    ("negative temperature", C, {"prompt": "hi", "temperature": -0.5}, 400),
    ("NaN temperature", C, '{"prompt": "hi", "temperature": NaN}', 400),
    ("top_p 0", C, {"prompt": "hi", "top_p": 0}, 400),
    ("top_k above the vocabulary", C, {"prompt": "hi", "top_k": 10 ** 6}, 400),
    ("logprobs above 20", C, {"prompt": "hi", "logprobs": 21}, 400),
    ("negative logprobs", C, {"prompt": "hi", "logprobs": -1}, 400),
    ("top_logprobs above 20", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400),
    ("top_logprobs without logprobs", CHAT, {"messages": MSG, "top_logprobs": 2}, 400),
    ("seed above 64 bits", C, {"prompt": "hi", "seed": 2 ** 64}, 400),
    ("seed of the wrong type", C, {"prompt": "hi", "seed": "abc"}, 400),
    ("n = 0", C, {"prompt": "hi", "n": 0}, 400),
    ("huge n", C, {"prompt": "hi", "n": 10 ** 6}, 400),
    ("presence_penalty out of range", C, {"prompt": "hi", "presence_penalty": 5}, 400),
    ("repetition_penalty 0", C, {"prompt": "hi", "repetition_penalty": 0}, 400),
    ("min_tokens above max_tokens", C, {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, 400),
    ("prompt + max_tokens over the context", C, {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400),
    ("prompt over the context", C, {"prompt": "hi " * (2 * MAX_MODEL_LEN)}, 400),
    ("huge max_tokens", C, {"prompt": "hi", "max_tokens": 10 ** 30}, 400),
    ("token id outside the vocabulary", C, {"prompt": [1, 10 ** 9]}, 400),
    ("negative token id", C, {"prompt": [-1]}, 400),
    ("empty prompt", C, {"prompt": ""}, 400),
    ("empty prompt list", C, {"prompt": []}, 400),
    ("missing prompt", C, {"max_tokens": 3}, 400),
    ("prompt of the wrong type", C, {"prompt": {"a": 1}}, 400),
    ("stop_token_ids outside the vocabulary", C, {"prompt": "hi", "stop_token_ids": [-5]}, 400),
    ("empty stop string", C, {"prompt": "hi", "stop": [""]}, 400),
    ("missing messages", CHAT, {"max_tokens": 3}, 400),
    ("empty messages", CHAT, {"messages": []}, 400),
    ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("image content part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    ("chat max_completion_tokens over the context", CHAT, {"messages": MSG, "max_completion_tokens": 10 ** 6}, 400),
    ("priority under fcfs", C, {"prompt": "hi", "priority": 1}, 400),
    ("non-JSON body", C, "this is not json", 400),
    ("invalid UTF-8", C, b'{"prompt": "\xff\xfe"}', 400),
    ("a JSON list as the body", C, "[1, 2]", 400),
    ("streamed: negative max_tokens", C, {"prompt": "hi", "max_tokens": -1, "stream": True}, 400),
    ("streamed chat: logprobs above 20", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 99,
                                                "stream": True}, 400),
    ("stream_options of the wrong type", C, {"prompt": "hi", "stream": True, "stream_options": 3}, 400),
    ("empty body", C, b"", 400),
    ("JSON null as the body", C, "null", 400),
    ("deeply nested JSON", C, "[" * 20000 + "]" * 20000, 400),
    ("invalid UTF-8 in a chat message", CHAT, b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', 400),
    ("truncated UTF-8 sequence", C, b'{"prompt": "abc\xe2\x82"}', 400),
    ("overlong UTF-8 encoding", C, b'{"prompt": "\xc0\xaf"}', 400),
    ("Latin-1 body", C, '{"prompt": "caf\u00e9"}'.encode("latin-1"), 400),
    ("lone surrogate in the prompt", C, '{"prompt": "\\ud800 hi"}', 400),
    ("lone surrogate in a prompt list", C, '{"prompt": ["ok", "\\udfff"]}', 400),
    ("lone surrogate in a chat message", CHAT, '{"messages": [{"role": "user", "content": "a\\udc00"}]}', 400),
    ("lone surrogate in /tokenize", "/tokenize", '{"prompt": "\\ud83d"}', 400),
    ("oversized body", C, b'{"prompt": "' + b"a" * MAX_REQUEST_BYTES + b'"}', 413),
    ("oversized body, chunked", C, ("chunked", b'{"prompt": "' + b"a" * MAX_REQUEST_BYTES + b'"}'), 413),
    ("top_k below -1", C, {"prompt": "hi", "top_k": -2}, 400),
    ("logprobs as a boolean in completions", C, {"prompt": "hi", "logprobs": True}, 400),
    ("n as a float", C, {"prompt": "hi", "n": 1.5}, 400),
    ("max_tokens as a boolean", C, {"prompt": "hi", "max_tokens": True}, 400),
    ("stop as a list of numbers", C, {"prompt": "hi", "stop": [1, 2]}, 400),
    ("seed below -2**63", C, {"prompt": "hi", "seed": -(2 ** 63) - 1}, 400),
    ("token id beyond 64 bits", C, {"prompt": [2 ** 70]}, 400),
    ("priority of the wrong type", C, {"prompt": "hi", "priority": "high"}, 400),
    ("messages as a string", CHAT, {"messages": "hi"}, 400),
    ("message without a role", CHAT, {"messages": [{"content": "hi"}]}, 400),
    ("chat_template_kwargs that break the template call", CHAT,
     {"messages": MSG, "chat_template_kwargs": {"tokenize": True}}, 400),
    ("detokenize outside the vocabulary", "/detokenize", {"tokens": [10 ** 9]}, 400),
    ("tokenize with prompt and messages", "/tokenize", {"prompt": "hi", "messages": MSG}, 400),
    ("unknown model", C, {"model": "gpt-4", "prompt": "hi"}, 404),
    ("unknown model in chat", CHAT, {"model": "gpt-4", "messages": MSG}, 404),
    ("unknown route", "/v1/engines", {}, 404),
]


def post(http, path, body):
    """POST a malformed request: a dict as JSON, text or bytes as they are, ("chunked", bytes)
    without a Content-Length."""
    if isinstance(body, dict):
        return http.post(path, json=body)
    if isinstance(body, tuple):
        data = body[1]
        content = (data[i:i + 4096] for i in range(0, len(data), 4096))
    else:
        content = body if isinstance(body, bytes) else body.encode()
    return http.post(path, content=content, headers={"content-type": "application/json"})


def test_at_least_30_malformed_requests():
    assert len(BAD) >= 30


@pytest.mark.parametrize("name,path,body,status", BAD, ids=[b[0] for b in BAD])
def test_bad_request(http, name, path, body, status):
    r = post(http, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["code"] == status


@pytest.mark.parametrize("path,body,param,message", [
    (C, {"prompt": [1, 10 ** 9]}, "prompt", "prompt token id 1000000000 is outside the vocabulary"),
    (C, {"prompt": "hi", "top_k": 10 ** 6}, "prompt", "top_k 1000000 is larger than the vocabulary"),
    (C, {"prompt": "hi", "stop_token_ids": [-5]}, "prompt", "stop token id -5 is outside the vocabulary"),
    (CHAT, {"messages": MSG, "stop_token_ids": [-5]}, "messages", "stop token id -5 is outside the vocabulary"),
    (C, {"prompt": [[1, 2], []]}, "prompt", "the prompt is empty"),
    (C, {"prompt": "hi", "temperature": -1}, None, "temperature must be >= 0"),
])
def test_engine_checks_answer_as_openai_400(http, path, body, param, message):
    """What SamplingParams and LLMEngine.validate refuse is a 400 in their own words (the server
    keeps no copy of those checks), with the field it is about."""
    r = http.post(path, json=body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == 400 and err["param"] == param, r.text
    assert err["message"].startswith(message), err


def test_bad_requests_leave_concurrent_good_ones_alone(client, http):
    from concurrent.futures import ThreadPoolExecutor

    def good(prompt):
        return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    alone = [good(p) for p in PROMPTS]
    with ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(good, p) for p in PROMPTS * 2]
        bads = [pool.submit(post, http, path, body) for _, path, body, _ in BAD]
        assert [f.result() for f in goods] == alone * 2
        assert all(400 <= f.result().status_code < 500 for f in bads)
    assert http.get("/health").status_code == 200


def test_api_key_required(server, http):
    r = httpx.post(server.url + C, json={"prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server.url + "/health").status_code == 200   # only /v1 needs the key


def test_client_errors_map_to_openai_exceptions(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSG)


# -- disconnects, metrics -----------------------------------------------------------------------------
ABORTS = "llmopt:request_success_total{finished_reason=abort}"


@pytest.mark.parametrize("path,body", [(C, {"prompt": PROMPTS[0], "n": 2}), (CHAT, {"messages": MSG})])
def test_disconnect_mid_stream_aborts_and_frees_blocks(server, http, path, body):
    before = wait_idle(http)
    body = {**body, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with server.http() as c, c.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: "):
                got += 1
                if got == 3:
                    break
        m = metrics(http)
        assert m["llmopt:num_requests_running"] >= 1 and m["llmopt:kv_cache_usage_perc"] > 0
    # the client left after 3 events of 200 tokens: the request is aborted and its blocks freed
    after = wait_idle(http)
    n = body.get("n", 1)
    assert after[ABORTS] - before[ABORTS] == n
    assert after["llmopt:generation_tokens_total"] == before["llmopt:generation_tokens_total"]  # none finished
    assert http.get("/health").status_code == 200
    r = http.post(C, json={"prompt": "still alive", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_disconnect_non_streaming_aborts(server, http):
    """A non-streaming client that leaves while its request runs (seen running in /metrics: no
    timing guess) aborts it."""
    before = wait_idle(http)
    body = json.dumps({"prompt": PROMPTS[1], "max_tokens": 240, "ignore_eos": True}).encode()
    url = httpx.URL(server.url)
    with socket.create_connection((url.host, url.port)) as s:
        s.sendall(f"POST {C} HTTP/1.1\r\nHost: {url.host}\r\nAuthorization: Bearer {API_KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 30
        while metrics(http)["llmopt:num_requests_running"] < 1:
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.002)
    after = wait_idle(http)
    assert after[ABORTS] - before[ABORTS] == 1
    assert after["llmopt:generation_tokens_total"] == before["llmopt:generation_tokens_total"]


def test_metrics(client, http):
    before = metrics(http)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = metrics(http)
    text = http.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ["llmopt:num_requests_running", "llmopt:num_requests_waiting", "llmopt:kv_cache_usage_perc",
                 "llmopt:prompt_tokens", "llmopt:generation_tokens", "llmopt:request_success",
                 "llmopt:time_to_first_token_seconds", "llmopt:e2e_request_latency_seconds",
                 "llmopt:inter_token_latency_seconds", "llmopt:request_queue_time_seconds",
                 "llmopt:prefix_cache_queries", "llmopt:prefix_cache_hits", "llmopt:num_preemptions"]:
        assert name in families, name
        assert all(s.labels.get("model_name") == MODEL_NAME for s in families[name].samples)
    assert families["llmopt:prompt_tokens"].type == "counter"
    assert families["llmopt:time_to_first_token_seconds"].type == "histogram"
    assert "llmopt:prompt_tokens_total" in after and "llmopt:request_success_total{finished_reason=length}" in after
    assert after["llmopt:prompt_tokens_total"] - before["llmopt:prompt_tokens_total"] == r.usage.prompt_tokens
    assert after["llmopt:generation_tokens_total"] - before["llmopt:generation_tokens_total"] == 4
    assert (after["llmopt:request_success_total{finished_reason=length}"]
            - before["llmopt:request_success_total{finished_reason=length}"]) == 1
    for h in ["llmopt:time_to_first_token_seconds_count", "llmopt:e2e_request_latency_seconds_count"]:
        assert after[h] - before[h] == 1


def test_raw_sse_format(http):
    with http.stream("POST", C, json={"prompt": "hi", "max_tokens": 2, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        assert json.loads(e[len("data: "):])["object"] == "text_completion"


def test_server_tpot_agrees_with_the_client(server, http):
    """The server's request_time_per_output_token (/metrics) against what `llmopt bench` measures as
    a client, over the same streamed requests (one at a time, so the stream's delivery is all that
    separates the two)."""
    from llmopt.bench.config import BenchConfig, SamplingSpec
    from llmopt.bench.datasets import Workload
    from llmopt.bench.runner import run_benchmark
    from llmopt.bench.schedule import Load
    before = metrics(http)
    cfg = BenchConfig(workload=Workload("random", num_prompts=4, random_input_len=16, random_output_len=48,
                                            seed=3),
                      load=Load(max_concurrency=1), base_url=server.url, api_key=API_KEY, model=MODEL_NAME,
                      tokenizer=str(server.model_path), sampling=SamplingSpec(ignore_eos=True))
    d = run_benchmark(cfg).to_dict()
    after = metrics(http)
    key = "llmopt:request_time_per_output_token_seconds"
    n = after[key + "_count"] - before[key + "_count"]
    server_ms = 1000 * (after[key + "_sum"] - before[key + "_sum"]) / n
    assert d["completed"] == 4 and n == 4
    assert d["server_mean_tpot_ms"] == pytest.approx(server_ms, rel=1e-6)   # bench read the same figure
    assert server_ms == pytest.approx(d["mean_tpot_ms"], rel=0.15, abs=0.5)


# -- structured outputs -------------------------------------------------------------------------------
RECORD = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "n": {"type": "integer"}},
          "required": ["kind", "n"], "additionalProperties": False}


@pytest.mark.parametrize("path,fields,engine_kw", [
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": RECORD}}},
     {"json": RECORD}),
    (CHAT, {"response_format": {"type": "json_object"}}, {"json_object": True}),
    (C, {"structured_outputs": {"json": RECORD, "disable_any_whitespace": True}},
     {"json": RECORD, "disable_any_whitespace": True}),
    (C, {"structured_outputs": {"regex": r"[a-z]{3}-\d{2}"}}, {"regex": r"[a-z]{3}-\d{2}"}),
    (C, {"guided_choice": ["alpha", "beta"]}, {"choice": ["alpha", "beta"]}),
    (CHAT, {"guided_regex": r"\d{4}"}, {"regex": r"\d{4}"}),
    (C, {"guided_json": RECORD}, {"json": RECORD}),
], ids=["response_format-json_schema", "response_format-json_object", "structured_outputs-json",
        "structured_outputs-regex", "guided_choice", "guided_regex-chat", "guided_json"])
def test_structured_output_fields_constrain_as_the_engine_does(http, offline, path, fields, engine_kw):
    """Each request field is the engine's own constraint: the greedy text equals the offline engine's
    with SamplingParams(structured_outputs=...) on the rendered prompt, and a finished output passes
    the constraint's checker (jsonschema, re.fullmatch, membership) though the random model's own
    text is noise."""
    import re

    import jsonschema
    from llmopt import SamplingParams
    from llmopt.structured.params import StructuredOutputsParams
    body = {"max_tokens": 48, "temperature": 0, **fields}
    if path == CHAT:
        body["messages"] = MSG
        prompt = http.post("/tokenize", json={"messages": MSG}).json()["tokens"]
    else:
        body["prompt"] = prompt = "Give me a record:"
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if path == CHAT else choice["text"]
    params = SamplingParams(max_tokens=48, temperature=0, structured_outputs=StructuredOutputsParams(**engine_kw))
    ref = offline.generate([prompt], params)[0].outputs[0]
    assert text == ref.text and choice["finish_reason"] == ref.finish_reason
    if ref.finish_reason == "stop":
        if "json" in engine_kw:
            jsonschema.validate(json.loads(text), RECORD)
        elif "json_object" in engine_kw:
            assert isinstance(json.loads(text), dict)
        elif "regex" in engine_kw:
            assert re.fullmatch(engine_kw["regex"], text), text
        else:
            assert text in engine_kw["choice"]
    if "regex" in engine_kw or "choice" in engine_kw:
        assert ref.finish_reason == "stop", text   # short constraints always finish in 48 tokens


@pytest.mark.parametrize("fields,param,message", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format",
     "give one output constraint, not response_format and guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r"}}}, "response_format",
     "response_format json_schema needs json_schema.schema"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs",
     "structured outputs: give exactly one of"),
    ({"guided_json": "{not json"}, "guided_json", "structured outputs: the JSON schema is not JSON"),
    ({"guided_regex": "(unclosed"}, None, "regex"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "response_format.type"),
])
def test_bad_output_constraints_are_openai_400s(http, fields, param, message):
    r = http.post(C, json={"prompt": "hi", "max_tokens": 4, **fields})
    err = r.json()["error"]
    assert r.status_code == 400 and message in err["message"], r.text
    if param is not None:
        assert err["param"] == param, err


# -- fields we do not implement ----------------------------------------------------------------------
@pytest.mark.parametrize("path,fields", [
    (C, {"use_beam_search": True}), (C, {"best_of": 3}), (C, {"logits_processors": ["x"]}),
    (CHAT, {"functions": [{"name": "f", "parameters": {}}]}), (CHAT, {"function_call": "auto"}),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else v)
def test_unimplemented_fields_that_change_output_are_400s(http, path, fields):
    body = {"max_tokens": 2, **({"messages": MSG} if path == CHAT else {"prompt": "hi"}), **fields}
    r = http.post(path, json=body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] in fields and "is not supported by this server" in err["message"], \
        r.text


def test_logit_bias_allowed_token_ids_and_bad_words_over_http(http, offline):
    """OpenAI's logit_bias (string keys) and vLLM's allowed_token_ids and bad_words give what the
    offline engine gives with the same SamplingParams; a key that is no token id is a 400."""
    from llmopt import SamplingParams
    fields = [{"logit_bias": {"17": 100}}, {"allowed_token_ids": [17, 300, 301]}, {"bad_words": ["the", "of"]}]
    for extra in fields:
        r = http.post(C, json={"model": MODEL_NAME, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0,
                               "ignore_eos": True, **extra})
        assert r.status_code == 200, r.text
        kw = {k: ({int(t): b for t, b in v.items()} if k == "logit_bias" else v) for k, v in extra.items()}
        want = offline.generate([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, **kw))
        assert r.json()["choices"][0]["text"] == want[0].outputs[0].text, extra
    r = http.post(C, json={"model": MODEL_NAME, "prompt": "hi", "logit_bias": {"x": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    r = http.post(C, json={"model": MODEL_NAME, "prompt": "hi", "logit_bias": {"999999": 1}})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"], r.text


def test_truncate_prompt_tokens_keeps_the_last_tokens(http, offline):
    from llmopt import SamplingParams
    ids = list(range(300, 400))
    r = http.post(C, json={"model": MODEL_NAME, "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                           "truncate_prompt_tokens": 10, "echo": True}).json()
    want = offline.generate([ids[-10:]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert r["usage"]["prompt_tokens"] == 10
    assert r["choices"][0]["text"] == offline.tokenizer.decode(ids[-10:]) + want.outputs[0].text
    long_text = "word " * (MAX_MODEL_LEN * 40)       # beyond the character bound: tokenized, then truncated
    r = http.post(CHAT, json={"model": MODEL_NAME, "messages": [{"role": "user", "content": long_text}],
                              "max_tokens": 2, "truncate_prompt_tokens": -1})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"], r.text  # no room left
    r = http.post(CHAT, json={"model": MODEL_NAME, "messages": [{"role": "user", "content": long_text}],
                              "max_tokens": 2, "truncate_prompt_tokens": 50})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 50, r.text
    r = http.post(C, json={"model": MODEL_NAME, "prompt": "hi", "truncate_prompt_tokens": MAX_MODEL_LEN + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_auto_tool_choice_needs_the_servers_flags(http):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for choice in (None, "auto"):
        body = {"model": MODEL_NAME, "messages": MSG, "tools": tools, **({"tool_choice": choice} if choice else {})}
        r = http.post(CHAT, json=body)
        assert r.status_code == 400 and "requires --enable-auto-tool-choice and --tool-call-parser" in \
            r.json()["error"]["message"], r.text


def test_no_op_values_pass_and_unknown_fields_are_logged(server, http):
    """logit_bias {}, use_beam_search false, tool_choice "none" change nothing: accepted. A field
    nobody defines is ignored with vLLM's warning in the server's log, not dropped silently."""
    for fields in ({"logit_bias": {}}, {"use_beam_search": False}, {"tool_choice": "none"}, {"best_of": 1}):
        r = http.post(C, json={"prompt": "hi", "max_tokens": 2, **fields})
        assert r.status_code == 200, (fields, r.text)
    r = http.post(C, json={"prompt": "hi", "max_tokens": 2, "frobnicate_level": 3})
    assert r.status_code == 200, r.text
    wait = "The following fields were present in the request but ignored: {'frobnicate_level'}"
    import time
    deadline = time.monotonic() + 10
    while wait not in server.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert wait in server.log.read_text()


def test_a_prompt_too_long_by_its_characters_is_refused_before_tokenizing(http, tiny_chat_model):
    """More characters than max_model_len tokens of the longest vocabulary entry can hold: a 400 that
    says so (no tokenizer call). Just under that bound, the text is tokenized (in a worker thread)
    and gets the usual context-length 400 with its real token count."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tiny_chat_model))
    bound = MAX_MODEL_LEN * max(len(k) for k in tok.get_vocab())
    over = "ab " * (bound // 3 + 1)
    r = http.post(C, json={"prompt": over, "max_tokens": 1})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt", r.text
    assert err["message"].startswith(f"the prompt has {len(over):,} characters, more than"), err
    under = over[: bound - 2]
    n = len(tok(under).input_ids)
    r = http.post(C, json={"prompt": under, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert f"However, you requested {n + 1} tokens ({n} in the prompt" in r.json()["error"]["message"], r.text
