"""Load, faults and fuzz against the shared `llmopt serve` subprocess (tiny random model, 256-token
context, a KV cache of 4 full-length requests, so a load of 32 running requests preempts):

- 64 concurrent streaming clients with random parameters, a third of them leaving mid-stream:
  afterwards /health is 200, no KV block is in use, every client that left was counted as an
  abort, and every completed greedy output equals the offline LLM API's for the same request, or
  first differs where the offline top-2 logprobs are within 1e-4 (a GEMV and a GEMM round
  differently, and the batches differ).
- A property-based fuzz (hypothesis, derandomized, 100 cases, max_tokens capped) of the request
  bodies of every POST endpoint finds no 5xx, and every 4xx is an OpenAI error body.
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_util import API_KEY, ENGINE_ARGS, MAX_MODEL_LEN, MODEL_NAME, TINY_CHAT, shared_server, wait_idle

C, CHAT = "/v1/completions", "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ABORTS = "llmopt:request_success_total{finished_reason=abort}"
WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be or "
         "river mountain seven quickly blue engine paper winter garden music north silver letter").split()
TIE = 1e-4


@pytest.fixture(scope="module")
def model(tiny_factory):
    return tiny_factory(**TINY_CHAT)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    return shared_server(model, tmp_path_factory.mktemp("serve-log"))


@pytest.fixture(scope="module")
def http(server):
    with server.http() as c:
        yield c


# -- load -------------------------------------------------------------------------------------------
def random_clients(rng: random.Random, count: int = 64) -> list[dict]:
    """`count` streaming requests: even ones greedy completions (checked against the offline API),
    odd ones sampled completions or chats with random parameters; every third one leaves after a
    few events (those are long, so they are still running when they leave)."""
    clients = []
    for i in range(count):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 60)))
        leave = i % 3 == 0
        body: dict = {"max_tokens": rng.randint(40, 64) if leave else rng.randint(1, 32), "stream": True}
        path = C
        if i % 2 == 0:
            body.update(prompt=prompt, temperature=0, logprobs=1, ignore_eos=leave or rng.random() < 0.5)
            if rng.random() < 0.3 and not leave:
                body["stop"] = [rng.choice([" the", "e", "\n", "ing", "s "])]
        else:
            if rng.random() < 0.5:
                path = CHAT
                body["messages"] = [{"role": "user", "content": prompt}]
                if rng.random() < 0.3:
                    body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
            else:
                body["prompt"] = prompt
                if rng.random() < 0.3:
                    body["logprobs"] = rng.randint(0, 5)
            body.update(temperature=rng.choice([0.3, 0.8, 1.0, 1.5]), top_p=rng.choice([1.0, 0.9, 0.5]),
                        top_k=rng.choice([0, -1, 5, 200]), min_p=rng.choice([0.0, 0.05]),
                        presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
                        repetition_penalty=rng.choice([1.0, 0.9, 1.2]), n=rng.choice([1, 1, 2, 3]),
                        ignore_eos=leave or rng.random() < 0.5, stream_options={"include_usage": True})
            if rng.random() < 0.5:
                body["seed"] = rng.randint(0, 2 ** 63)
            if rng.random() < 0.3 and not leave:
                body["stop"] = [rng.choice([" the", "e", "ing"])]
            if rng.random() < 0.3:
                body["min_tokens"] = rng.randint(0, min(4, body["max_tokens"]))
        clients.append({"path": path, "body": body, "leave_after": rng.randint(1, 3) if leave else None})
    return clients


async def run_client(c: httpx.AsyncClient, client: dict) -> dict:
    """Stream one request; returns its events and whether it left before finishing."""
    evs: list = []
    n = client["body"].get("n", 1)
    finished: set[int] = set()
    async with c.stream("POST", client["path"], json=client["body"]) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            ev = data if data == "[DONE]" else json.loads(data)
            evs.append(ev)
            if isinstance(ev, dict):
                assert "error" not in ev, ev
                finished |= {ch["index"] for ch in ev.get("choices", []) if ch.get("finish_reason")}
            if client["leave_after"] is not None and len(evs) >= client["leave_after"]:
                break
    left = len(finished) < n
    assert left == (client["leave_after"] is not None), (client, evs)
    return {"events": evs, "left": left}


def greedy_result(evs: list) -> tuple[str, list[str], str]:
    """(text, per-token strings, finish reason) of a streamed single-choice completion."""
    text, tokens, reason = "", [], None
    for ev in evs:
        if isinstance(ev, dict) and ev.get("choices"):
            ch = ev["choices"][0]
            text += ch["text"]
            tokens += (ch.get("logprobs") or {}).get("tokens") or []
            reason = ch["finish_reason"] or reason
    return text, tokens, reason


def test_64_concurrent_streaming_clients_with_random_parameters(server, http, model):
    from llmopt import LLM, SamplingParams
    clients = random_clients(random.Random(12))
    before = wait_idle(http)

    async def main():
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120, limits=limits) as c:
            return await asyncio.gather(*[run_client(c, cl) for cl in clients])

    results = asyncio.run(main())
    after = wait_idle(http, timeout=60)   # nothing runs or waits, and no KV block is in use
    assert http.get("/health").status_code == 200
    left = [cl for cl, res in zip(clients, results) if res["left"]]
    assert len(left) == len(clients) // 3 + 1
    assert after[ABORTS] - before[ABORTS] == sum(cl["body"].get("n", 1) for cl in left)
    assert after["llmopt:num_preemptions_total"] > before["llmopt:num_preemptions_total"]   # the KV cache ran out

    greedy = [(cl, res) for cl, res in zip(clients, results) if cl["body"].get("temperature") == 0 and not res["left"]]
    assert len(greedy) >= 20
    offline = LLM(str(model), **ENGINE_ARGS)
    refs = offline.generate([cl["body"]["prompt"] for cl, _ in greedy],
                            [SamplingParams(temperature=0, max_tokens=cl["body"]["max_tokens"], logprobs=2,
                                            ignore_eos=cl["body"]["ignore_eos"], stop=cl["body"].get("stop"))
                             for cl, _ in greedy])
    ties = 0
    for (cl, res), ref in zip(greedy, refs):
        text, tokens, reason = greedy_result(res["events"])
        out = ref.outputs[0]
        want = [offline.tokenizer.decode([t]) for t in out.token_ids]
        if tokens == want:
            assert text == out.text and reason == out.finish_reason, cl
            continue
        j = next((k for k, (a, b) in enumerate(zip(tokens, want)) if a != b), None)
        assert j is not None, f"one output is a prefix of the other: {tokens} vs {want}"
        top2 = sorted(out.logprobs[j].top.values(), reverse=True)[:2]
        assert top2[0] - top2[1] < TIE, (f"greedy output differs from the offline API at token {j} "
                                         f"where its top-2 logprobs differ by {top2[0] - top2[1]:.2e}", cl)
        ties += 1
    assert ties <= len(greedy) // 4


# -- fuzz -------------------------------------------------------------------------------------------
# Two kinds of bodies: well-typed ones with values in (and at the edges of) their ranges, which
# reach the engine in every combination (penalties, top-k/p, seeds, n, logprobs, stop strings), and
# junk ones (any JSON in any field, lone surrogates), which stress validation. max_tokens is capped.
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                    max_leaves=5)
NOT_NULL = JSON.filter(lambda x: x is not None)
TEXT = st.text(max_size=24)
SURROGATE = st.builds(lambda a, c, b: a + c + b, TEXT, st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), TEXT)
ANY_TEXT = TEXT | SURROGATE   # a lone surrogate is valid JSON ("\ud800") but not encodable text
MAX_TOKENS = st.integers(1, 6)
JUNK_MAX_TOKENS = st.integers(-2, 6) | st.sampled_from([0, 10 ** 20, -(10 ** 20), "5", 2.5, True, [], {}])
JUNK_NUM = st.floats(-3, 3) | st.sampled_from([0, 1e-9, 1e9, 1e300, -1e300]) | NOT_NULL

GOOD_SAMPLING = {
    "model": st.just(MODEL_NAME), "n": st.integers(1, 3), "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 300), "min_p": st.floats(0, 1),
    "seed": st.integers(0, 2 ** 63), "stop": st.lists(st.text(min_size=1, max_size=4), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=2), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2), "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 3), "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})}
JUNK_SAMPLING = {
    "model": st.sampled_from([MODEL_NAME, "other"]) | JSON, "n": st.integers(-1, 3) | NOT_NULL,
    "temperature": JUNK_NUM, "top_p": JUNK_NUM, "top_k": st.integers(-3, 60000) | NOT_NULL, "min_p": JUNK_NUM,
    "seed": st.integers(-(2 ** 65), 2 ** 65) | NOT_NULL,
    "stop": st.none() | ANY_TEXT | st.lists(ANY_TEXT, max_size=3) | JSON,
    "stop_token_ids": st.lists(st.integers(-2, 60000), max_size=3) | JSON, "presence_penalty": JUNK_NUM,
    "frequency_penalty": JUNK_NUM, "repetition_penalty": JUNK_NUM, "ignore_eos": st.booleans() | JSON,
    "min_tokens": st.integers(-1, 6) | NOT_NULL, "include_stop_str_in_output": st.booleans() | JSON,
    "skip_special_tokens": st.booleans() | JSON, "stream": st.booleans(),
    "stream_options": st.none() | st.fixed_dictionaries({"include_usage": st.booleans() | JSON}) | JSON,
    "priority": st.integers() | JSON, "user": JSON, "logit_bias": JSON}


def messages(text, role, part_types, content_junk) -> st.SearchStrategy:
    return st.lists(st.fixed_dictionaries(
        {"role": role, "content": text | st.lists(st.fixed_dictionaries(
            {"type": part_types, "text": text}), max_size=2) | content_junk}),
        min_size=1, max_size=3)


GOOD_COMPLETION = st.fixed_dictionaries(
    {"prompt": st.one_of(TEXT.filter(str.strip), TEXT.filter(str.strip), SURROGATE,
                         st.lists(st.integers(0, 49151), min_size=1, max_size=6))
     | st.lists(TEXT.filter(str.strip), min_size=1, max_size=2), "max_tokens": MAX_TOKENS},
    optional={**GOOD_SAMPLING, "logprobs": st.integers(0, 5), "echo": st.booleans()})
JUNK_COMPLETION = st.fixed_dictionaries(
    {"prompt": ANY_TEXT | st.lists(st.integers(-3, 50000), max_size=6) | st.lists(ANY_TEXT, max_size=3)
     | st.lists(st.lists(st.integers(-1, 50000), max_size=4), max_size=2) | JSON, "max_tokens": JUNK_MAX_TOKENS},
    optional={**JUNK_SAMPLING, "logprobs": st.integers(-1, 21) | NOT_NULL, "echo": st.booleans() | JSON,
              "suffix": st.none() | ANY_TEXT})
GOOD_CHAT = st.fixed_dictionaries(
    {"messages": messages(st.one_of(TEXT, TEXT, TEXT, SURROGATE), st.sampled_from(["system", "user", "assistant"]),
                          st.just("text"), st.nothing()),
     "max_tokens": MAX_TOKENS},
    optional={**GOOD_SAMPLING, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
              "add_generation_prompt": st.booleans()}).filter(lambda b: b.get("logprobs") or "top_logprobs" not in b)
JUNK_CHAT = st.fixed_dictionaries(
    {"messages": messages(ANY_TEXT, st.sampled_from(["user", "developer", "tool", "wizard"]) | JSON,
                          st.sampled_from(["text", "image_url"]) | JSON, st.none() | JSON)
     | JSON, "max_tokens": JUNK_MAX_TOKENS},
    optional={**JUNK_SAMPLING, "max_completion_tokens": JUNK_MAX_TOKENS, "logprobs": st.booleans() | JSON,
              "top_logprobs": st.integers(-1, 21) | JSON, "add_generation_prompt": st.booleans() | JSON,
              "chat_template_kwargs": st.none() | st.dictionaries(st.sampled_from(
                  ["add_generation_prompt", "tokenize", "continue_final_message", "tools", "documents", "x"]),
                  JSON, max_size=2) | JSON})
TOKENIZE = st.fixed_dictionaries({}, optional={"prompt": ANY_TEXT | JSON, "add_special_tokens": st.booleans() | JSON,
                                               "messages": messages(ANY_TEXT, st.just("user"), st.just("text"),
                                                                    JSON) | JSON,
                                               "model": JSON})
DETOKENIZE = st.fixed_dictionaries({"tokens": st.lists(st.integers(-5, 60000), max_size=5) | JSON},
                                   optional={"model": JSON})
CASES = st.one_of(st.tuples(st.just(C), GOOD_COMPLETION), st.tuples(st.just(CHAT), GOOD_CHAT),
                  st.tuples(st.just(C), GOOD_COMPLETION), st.tuples(st.just(CHAT), GOOD_CHAT),
                  st.tuples(st.just(C), JUNK_COMPLETION), st.tuples(st.just(CHAT), JUNK_CHAT),
                  st.tuples(st.just("/tokenize"), TOKENIZE), st.tuples(st.just("/detokenize"), DETOKENIZE))


def test_fuzz_request_bodies_get_no_5xx(http):
    seen: dict[int, int] = {}

    @settings(max_examples=100, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(CASES)
    def check(case):
        path, body = case
        content = json.dumps(body).encode()   # ASCII escapes: lone surrogates travel as \ud800
        r = http.post(path, content=content, headers={"content-type": "application/json"})
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, body, r.text)
        if r.status_code >= 400:
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == r.status_code, r.text
            return
        assert r.status_code == 200, r.text
        if r.headers["content-type"].startswith("text/event-stream"):
            events = [e[len("data: "):] for e in r.text.split("\n\n") if e]
            assert events[-1] == "[DONE]", r.text
            for e in events[:-1]:
                assert json.loads(e).get("error", {}).get("code", 0) < 500, (path, body, e)
        elif path in (C, CHAT):
            assert r.json()["choices"], r.text

    check()
    assert seen.get(200, 0) >= 10 and sum(v for k, v in seen.items() if 400 <= k < 500) >= 20, seen   # both paths
    assert http.get("/health").status_code == 200
    wait_idle(http)


def test_context_limit_is_exact(http):
    """A prompt plus max_tokens of exactly the context is served; one token more is a 400."""
    ids = http.post("/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    ok = http.post(C, json={"prompt": ids, "max_tokens": MAX_MODEL_LEN - len(ids), "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["total_tokens"] == MAX_MODEL_LEN
    over = http.post(C, json={"prompt": ids, "max_tokens": MAX_MODEL_LEN - len(ids) + 1})
    assert over.status_code == 400 and "maximum context length is 256" in over.json()["error"]["message"]
