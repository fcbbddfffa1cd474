"""The engine never dies of one request: validation when a request is added (before anything
streams), a step failure that belongs to one request finishing that request alone (blocks freed,
the others unharmed, /health 200), a failure no request explains marking the engine dead (/health
503, open requests 500), an idle loop that waits instead of spinning, arrival times taken when a
request arrives, and priority scheduling honoured. The app runs in this process (uvicorn in a
thread) so the tests can reach into its engine."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from engine_helpers import check_no_leak

from llmopt import LLM, SamplingParams
from llmopt.engine.args import EngineArgs
from llmopt.engine.async_engine import AsyncLLMEngine
from llmopt.engine.engine import LLMEngine
from llmopt.errors import UserInputError
from llmopt.serve.api_server import build_app
from llmopt.serve.server import ServeConfig
from serve_util import ENGINE_ARGS, TINY_CHAT, inprocess_server

C = "/v1/completions"
POISON = 4242   # the seed that marks the request whose step fails


@pytest.fixture(scope="module")
def model(tiny_factory):
    return tiny_factory(**TINY_CHAT)


@pytest.fixture(scope="module")
def loaded(model):
    from llmopt.models.loader import load_model
    return load_model(str(model), "auto", "cpu")


def make_engine(model, loaded, **kw) -> AsyncLLMEngine:
    return AsyncLLMEngine(LLMEngine(EngineArgs(model=str(model), **{**ENGINE_ARGS, **kw}), loaded=loaded))


def serve(engine: AsyncLLMEngine):
    return inprocess_server(build_app(engine, ServeConfig(model_name="tiny", log_interval=0)))


def wait_until(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def success(url: str, reason: str) -> float:
    text = httpx.get(url + "/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("llmopt:request_success_total")
                and f'finished_reason="{reason}"' in x)
    return float(line.rsplit(" ", 1)[1])


def events(raw: str) -> list:
    """The data of each SSE event: parsed JSON, or the string [DONE]."""
    out = []
    for e in raw.split("\n\n"):
        if e.startswith("data: "):
            data = e[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


GOOD = [{"prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        for p in ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Hello"]]


# -- validation when a request is added ---------------------------------------------------------------
def test_engine_refuses_what_would_fail_inside_a_step(tiny_factory):
    """The measured crash: logprobs or top_k above the vocabulary raised inside the sampler during
    step(). Now add_request refuses them (and out-of-vocabulary ids), and the limits themselves run."""
    from llmopt.models.loader import load_model
    path = tiny_factory(vocab_size=16)
    llm = LLM(str(path), loaded=load_model(str(path), "auto", "cpu", tokenizer=False), kv_cache_memory=1 << 20,
              max_model_len=64, detokenize=False)
    for prompt, params, message in [
        ([1, 2, 3], SamplingParams(logprobs=20), "logprobs 20 is larger than the vocabulary: use at most 16"),
        ([1, 2, 3], SamplingParams(top_k=17), "top_k 17 is larger than the vocabulary: use at most 16"),
        ([1, 2, 3], SamplingParams(stop_token_ids=[16]),
         r"stop token id 16 is outside the vocabulary: use ids in \[0, 16\)"),
        ([1, 16], SamplingParams(), r"prompt token id 16 is outside the vocabulary: use ids in \[0, 16\)"),
        ([1, -1], SamplingParams(), "prompt token id -1 is outside"),
    ]:
        with pytest.raises(UserInputError, match=message):
            llm.generate([prompt], params)
        assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[1, 2, 3]], SamplingParams(logprobs=16, top_k=16, max_tokens=3, stop_token_ids=[15]))[0]
    assert out.finished and all(len(lp.top) == 16 for lp in out.outputs[0].logprobs)
    check_no_leak(llm.engine)


def test_add_request_raises_before_any_await(model, loaded):
    engine = make_engine(model, loaded)

    async def main():
        with pytest.raises(UserInputError, match="cannot be tokenized"):
            engine.add_request("a", "lone \ud800 surrogate")
        with pytest.raises(UserInputError, match="top_k"):
            engine.add_request("b", [1, 2], SamplingParams(top_k=10 ** 6))
        with pytest.raises(UserInputError, match="no room to generate"):
            engine.add_request("c", [1] * ENGINE_ARGS["max_model_len"])
        stream = engine.add_request("d", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
        with pytest.raises(UserInputError, match="already in use"):
            engine.add_request("d", [1, 2, 3])
        outs = [o async for o in stream]
        await engine.stop()
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 2
    check_no_leak(engine.engine)


def test_arrival_time_is_when_the_request_is_added(model, loaded, monkeypatch):
    """A request added while a (slow) step runs keeps the time it was added, not the next step's."""
    engine = make_engine(model, loaded)
    runner = engine.engine.runner
    slow = threading.Event()
    execute = runner.execute_model

    def slow_execute(out):
        if slow.is_set():
            time.sleep(0.3)
        return execute(out)

    monkeypatch.setattr(runner, "execute_model", slow_execute)

    async def main():
        first = engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
        first_out = await first.__anext__()   # the loop is running
        slow.set()
        await asyncio.sleep(0.05)             # a 0.3 s step is under way
        added = time.monotonic()
        second = engine.add_request("b", [4, 5, 6], SamplingParams(max_tokens=1))
        outs = [o async for o in second]
        _ = [o async for o in first]
        await engine.stop()
        return added, first_out, outs[-1]

    added, _, out = asyncio.run(main())
    assert out.metrics.arrival_time <= added + 0.01
    assert out.metrics.first_scheduled_time - out.metrics.arrival_time > 0.1   # it waited for the step


# -- failures inside a step ---------------------------------------------------------------------------
def poisoned(llm: LLMEngine, scheduled, min_output: int = 0) -> bool:
    reqs = [llm.scheduler.requests.get(s.request_id) for s in scheduled]
    return any(r is not None and r.params.seed == POISON and r.num_output_tokens >= min_output for r in reqs)


@pytest.mark.parametrize("where", ["sampler", "runner mid-stream"])
def test_a_step_failure_of_one_request_fails_it_alone(model, loaded, monkeypatch, where):
    engine = make_engine(model, loaded)
    llm = engine.engine
    with serve(engine) as url:
        want = [httpx.post(url + C, json=g, timeout=60).json()["choices"][0]["text"] for g in GOOD]
        if where == "sampler":
            sample = llm.sampler.sample_scheduled

            def failing_sample(logits, scheduled, requests):
                if poisoned(llm, scheduled):
                    raise RuntimeError("injected sampler failure")
                return sample(logits, scheduled, requests)
            monkeypatch.setattr(llm.sampler, "sample_scheduled", failing_sample)
        else:
            execute = llm.runner.execute_model

            def failing_execute(out):
                if poisoned(llm, out.scheduled, min_output=3):
                    raise RuntimeError("injected forward failure")
                return execute(out)
            monkeypatch.setattr(llm.runner, "execute_model", failing_execute)
        stream = where != "sampler"
        bad = {"prompt": "poison", "max_tokens": 40, "seed": POISON, "ignore_eos": True, "stream": stream}
        errors_before = success(url, "error")

        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                return await asyncio.gather(c.post(C, json=bad), *[c.post(C, json=g) for g in GOOD])

        bad_r, *good_rs = asyncio.run(main())
        assert [r.json()["choices"][0]["text"] for r in good_rs] == want   # the others are unharmed
        if stream:   # the stream had started: 200, some text, then the error in-band
            assert bad_r.status_code == 200
            evs = events(bad_r.text)
            assert evs[-1] == "[DONE]" and evs[-2]["error"]["code"] == 500
            assert "injected forward failure" in evs[-2]["error"]["message"]
            assert any("choices" in e and e["choices"][0]["text"] for e in evs[:-2])
        else:
            assert bad_r.status_code == 500, bad_r.text
            err = bad_r.json()["error"]
            assert err["code"] == 500 and "injected sampler failure" in err["message"]
        assert httpx.get(url + "/health").status_code == 200
        assert success(url, "error") == errors_before + 1
        wait_until(lambda: not llm.has_unfinished_requests())
        check_no_leak(llm)                       # the failed request's blocks are free
        steps = engine.num_steps
        time.sleep(0.5)
        assert engine.num_steps == steps         # idle: the loop waits, it does not spin
        r = httpx.post(url + C, json=GOOD[0], timeout=60)    # and wakes for new work
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[0]


def test_a_failure_no_request_explains_kills_the_engine(model, loaded, monkeypatch):
    engine = make_engine(model, loaded)
    llm = engine.engine
    execute = llm.runner.execute_model
    broken = threading.Event()

    def failing_execute(out):
        if broken.is_set():
            raise RuntimeError("device lost")
        return execute(out)

    monkeypatch.setattr(llm.runner, "execute_model", failing_execute)
    with serve(engine) as url:
        long = {"max_tokens": 200, "ignore_eos": True}

        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                async def streamed(prompt):
                    async with c.stream("POST", C, json={"prompt": prompt, **long, "stream": True}) as r:
                        return r.status_code, "".join([line + "\n" async for line in r.aiter_lines()])
                tasks = [asyncio.create_task(streamed("a")), asyncio.create_task(streamed("b")),
                         asyncio.create_task(c.post(C, json={"prompt": "c", **long}))]
                await asyncio.to_thread(wait_until, lambda: len(llm.scheduler.running) == 3 and all(
                    r.num_output_tokens >= 2 for r in llm.scheduler.running))
                broken.set()
                return await asyncio.gather(*tasks)

        (s1, raw1), (s2, raw2), plain = asyncio.run(main())
        assert s1 == s2 == 200
        for raw in (raw1, raw2):
            evs = events(raw)
            assert evs[-1] == "[DONE]" and evs[-2]["error"]["code"] == 500
            assert "device lost" in evs[-2]["error"]["message"]
        assert plain.status_code == 500 and "device lost" in plain.json()["error"]["message"]
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "dead" in health.json()["error"]["message"]
        r = httpx.post(url + C, json=GOOD[0], timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        steps = engine.num_steps
        time.sleep(0.5)
        assert engine.num_steps == steps and not engine.stepping   # stopped, not spinning


# -- admission ---------------------------------------------------------------------------------------
def test_admission_counts_n_after_validation_and_frees_on_abort(model, loaded, monkeypatch):
    """max_num_queued_reqs 2 with one sequence in flight: n=2 more is a 503 and one more fits; a bad
    request is still a 400 in the engine's words (it is validated before admission); a request whose
    client leaves gives its place back."""
    engine = make_engine(model, loaded)
    execute = engine.engine.runner.execute_model

    def slow_execute(out):
        time.sleep(0.02)
        return execute(out)

    monkeypatch.setattr(engine.engine.runner, "execute_model", slow_execute)
    app = build_app(engine, ServeConfig(model_name="tiny", log_interval=0, max_num_queued_reqs=2))
    server = app.state.server
    with inprocess_server(app) as url:
        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                hold = asyncio.create_task(c.post(C, json={"prompt": "hold", "max_tokens": 200, "ignore_eos": True}))
                await asyncio.to_thread(wait_until, lambda: server.in_flight == 1)
                over = await c.post(C, json={"prompt": "x", "max_tokens": 2, "n": 2})
                bad = await c.post(C, json={"prompt": [1, 10 ** 9], "n": 2})
                fits = await c.post(C, json={"prompt": "y", "max_tokens": 2})
                assert not hold.done(), "the held request finished before the checks"
                hold.cancel()   # the client leaves: the request is aborted
                await asyncio.gather(hold, return_exceptions=True)
            return over, bad, fits

        over, bad, fits = asyncio.run(main())
        assert over.status_code == 503 and "at capacity (2 queued sequences)" in over.json()["error"]["message"]
        err = bad.json()["error"]
        assert bad.status_code == 400 and err["param"] == "prompt", bad.text
        assert err["message"].startswith("prompt token id 1000000000 is outside the vocabulary"), err
        assert fits.status_code == 200, fits.text
        wait_until(lambda: server.in_flight == 0)
        r = httpx.post(url + C, json={"prompt": "z", "max_tokens": 2, "n": 2}, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
        wait_until(lambda: not engine.engine.has_unfinished_requests())
        check_no_leak(engine.engine)


# -- scheduling policy -------------------------------------------------------------------------------
def test_priority_is_honoured(model, loaded):
    """One running slot, taken by a long request; three requests queue behind it in the order b, c,
    d with priorities 3, -2, 0: they run c, d, b (lower value first), where FCFS would run b, c, d."""
    engine = make_engine(model, loaded, scheduling_policy="priority", max_num_seqs=1)
    sched = engine.engine.scheduler
    with serve(engine) as url:
        async def main():
            order = []
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                async def one(name, priority):
                    r = await c.post(C, json={"prompt": name, "max_tokens": 2, "priority": priority})
                    assert r.status_code == 200, r.text
                    order.append(name)
                hold = asyncio.create_task(c.post(C, json={"prompt": "hold", "max_tokens": 240, "ignore_eos": True}))
                await asyncio.to_thread(wait_until, lambda: len(sched.running) == 1)
                tasks = []
                for k, (name, priority) in enumerate([("b", 3), ("c", -2), ("d", 0)]):
                    tasks.append(asyncio.create_task(one(name, priority)))
                    await asyncio.to_thread(wait_until, lambda: len(sched.waiting) == k + 1)
                assert len(sched.running) == 1, "the long request finished before the others queued"
                await asyncio.gather(hold, *tasks)
            return order

        assert asyncio.run(main()) == ["c", "d", "b"]


# -- keys, CORS, request ids -------------------------------------------------------------------------
def test_several_api_keys_cors_and_request_id_headers(model, loaded):
    """Any of several --api-key values opens /v1/*, another is a 401; a browser's CORS preflight
    passes without a key and gets the allowed origin; with --enable-request-id-headers every response
    (errors too) carries the client's X-Request-Id, or a new one."""
    engine = make_engine(model, loaded)
    config = ServeConfig(model_name="tiny", log_interval=0, api_keys=("k1", "k2"),
                         allowed_origins=("https://app.example",), request_id_headers=True)
    with inprocess_server(build_app(engine, config)) as url:
        def get(key, **headers):
            return httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {key}", **headers}, timeout=30)
        assert get("k1").status_code == 200 and get("k2").status_code == 200
        wrong = get("k3", **{"x-request-id": "abc-123"})
        assert wrong.status_code == 401 and wrong.headers["x-request-id"] == "abc-123"
        fresh = {get("k1").headers["x-request-id"] for _ in range(3)}
        assert len(fresh) == 3 and all(len(r) == 32 for r in fresh)
        pre = httpx.options(url + "/v1/chat/completions", timeout=30, headers={
            "origin": "https://app.example", "access-control-request-method": "POST",
            "access-control-request-headers": "authorization,content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example", pre
        other = httpx.options(url + "/v1/models", timeout=30, headers={
            "origin": "https://evil.example", "access-control-request-method": "GET"})
        assert "access-control-allow-origin" not in other.headers
        ok = get("k2", origin="https://app.example")
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
