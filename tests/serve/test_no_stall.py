"""No request stalls the others: while multi-megabyte prompts (completions and chat) are refused, an
open stream keeps getting its tokens. Before the character bound and the off-loop tokenizer, a 5 MB
prompt held the event loop for 11.7 s before its 400 and every open stream waited that long; the
bound here (a gap under 1.5 s, while the streaming gap is tens of milliseconds) is loose on purpose:
it separates a stalled loop from a working one on a loaded 2-core machine, not fast from slow."""

from __future__ import annotations

import json
import threading
import time

import httpx

from serve_util import API_KEY, MODEL_NAME, TINY_CHAT, free_port, serve_cmd, spawn, stop

BIG = 5 << 20   # characters of each refused prompt


def _stream(url: str, stamps: list[float], started: threading.Event, usage: list) -> None:
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True,
            "stream": True, "temperature": 0, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    stamps.append(time.monotonic())
                    started.set()
                if chunk.get("usage"):
                    usage.append(chunk["usage"])


def test_an_open_stream_goes_on_while_huge_prompts_are_refused(tiny_factory, tmp_path):
    model = tiny_factory(**TINY_CHAT)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = spawn(serve_cmd(model, port, "--max-request-bytes", str(4 * BIG)), tmp_path / "server.log", url)
    try:
        stamps: list[float] = []
        started, usage = threading.Event(), []
        t = threading.Thread(target=_stream, args=(url, stamps, started, usage))
        t.start()
        assert started.wait(60)
        big = ("lorem ipsum dolor " * (BIG // 18 + 1))[:BIG]
        asks = [("/v1/completions", {"model": MODEL_NAME, "prompt": big, "max_tokens": 1}),
                ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": big}]}),
                ("/v1/completions", {"model": MODEL_NAME, "prompt": [big, "hi"], "max_tokens": 1})]
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as http:
            window = [time.monotonic()]
            for route, body in asks:
                r = http.post(route, json=body)
                assert r.status_code == 400, r.text[:300]
                assert "characters, more than this model's maximum context length" in r.json()["error"]["message"]
            window.append(time.monotonic())
        t.join(120)
        assert not t.is_alive() and usage and usage[-1]["completion_tokens"] == 200
        during = [b - a for a, b in zip(stamps, stamps[1:]) if b >= window[0] and a <= window[1]]
        assert during, "the stream ended before the big prompts were sent"
        assert max(during) < 1.5, f"an open stream waited {max(during):.2f} s while a huge prompt was refused"
    finally:
        stop(proc)
