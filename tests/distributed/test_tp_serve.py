"""`llmopt serve --tensor-parallel-size 2`: it serves; a worker killed while the server is idle turns
/health into 503 within seconds, requests get 503, and the server still stops cleanly."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

from llmopt.serve.launch import serving


def spawned_workers(pid: int) -> list[int]:
    """The multiprocessing-spawned children of process `pid` (not its resource tracker)."""
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(c) for c in (task / "children").read_text().split()]
    return [k for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]


def test_health_turns_503_when_a_worker_dies(tiny_factory, tmp_path):
    t0 = time.monotonic()
    folder = tiny_factory(tokenizer=True, max_position_embeddings=256)
    args = ["--model", str(folder), "--tensor-parallel-size", "2", "--kv-cache-memory", "1MiB", "--max-model-len", "64"]
    with serving(args, log=tmp_path / "serve.log") as server:
        body = {"model": str(folder), "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        (worker,) = spawned_workers(server.proc.pid)
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while httpx.get(server.url + "/health", timeout=5).status_code == 200:
            assert time.monotonic() < deadline, "/health still 200 after a worker died"
            time.sleep(0.2)
        health = httpx.get(server.url + "/health", timeout=5)
        assert health.status_code == 503
        assert f"tensor-parallel worker rank 1 (pid {worker}) exited with code -9" in health.text
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 503
    assert server.proc.returncode == 0
    assert time.monotonic() - t0 < 60
