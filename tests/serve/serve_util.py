"""A real `llmopt serve` for the tests: a subprocess on a free port, over a tiny random Llama with
SmolLM2's tokenizer (and chat template), with an API key so the 401 path is tested too. One such
server is shared by every module of tests/serve (`shared_server`); `inprocess_server` runs an app
under uvicorn in a thread, for tests that reach into the engine. (Not a conftest.py: a second
module named conftest would shadow tests/conftest.py.)"""

from __future__ import annotations

import atexit
import contextlib
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from conftest import REPO
from prometheus_client.parser import text_string_to_metric_families

from llmopt.ports import free_port  # noqa: F401 (re-exported to the tests)
from llmopt.serve.launch import launch, stop  # noqa: F401 (re-exported to the tests)

API_KEY = "test-key"
MODEL_NAME = "tiny"
MAX_MODEL_LEN = 256
MAX_REQUEST_BYTES = 64 << 10
# 512 KiB of KV cache on the tiny model = 64 blocks of 16 tokens: 4 full-length requests, so a load
# of 32 running requests preempts
KV_BYTES = 512 << 10
ENGINE_ARGS = dict(max_model_len=MAX_MODEL_LEN, kv_cache_memory=KV_BYTES, block_size=16, max_num_seqs=32)
TINY_CHAT = dict(tokenizer=True, max_position_embeddings=512)   # tiny_factory(**TINY_CHAT): the served model


@dataclass
class Server:
    url: str
    model_path: Path
    proc: subprocess.Popen | None
    log: Path | None = None

    def client(self, **kw):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60, **kw)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


def serve_cmd(model: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "llmopt", "serve", "--model", str(model), "--port", str(port),
            "--served-model-name", MODEL_NAME, "--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN),
            "--kv-cache-memory-bytes", str(KV_BYTES), "--block-size", "16", "--max-num-seqs", "32",
            "--max-request-bytes", str(MAX_REQUEST_BYTES), "--uvicorn-log-level", "warning", *extra]


def spawn(cmd: list[str], log: Path, url: str, timeout: float = 120) -> subprocess.Popen:
    """Start a server command (stdout and stderr to `log`) and wait until /health answers 200."""
    port = int(url.rsplit(":", 1)[1])
    return launch(cmd, url, port, log=log, env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}, cwd=REPO,
                  timeout=timeout).proc


_SHARED: dict[Path, Server] = {}


def shared_server(model: Path, log_dir: Path) -> Server:
    """The one server of tests/serve on `model` (started on first use, stopped at exit)."""
    if model not in _SHARED or _SHARED[model].proc.poll() is not None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = log_dir / "server.log"
        proc = spawn(serve_cmd(model, port), log, url)
        atexit.register(stop, proc)
        _SHARED[model] = Server(url, model, proc, log)
    return _SHARED[model]


@contextlib.contextmanager
def inprocess_server(app):
    """Serve a build_app() app with uvicorn in a thread of this process; yields its base URL."""
    import uvicorn

    from llmopt.serve.run import bind
    sock = bind("127.0.0.1", 0)
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the in-process server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def metrics(http) -> dict[str, float]:
    """Every sample of /metrics (parsed by prometheus_client), by name and labels."""
    text = http.get("/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                                           if k not in ("model_name", "engine")) + "}"
                            if set(s.labels) - {"model_name", "engine"} else "")
            out[key] = s.value
    return out


def wait_idle(http, timeout: float = 20) -> dict[str, float]:
    """/metrics once no request runs or waits and no KV block is in use (a request's or a leak's)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        if (m["llmopt:num_requests_running"] == 0 and m["llmopt:num_requests_waiting"] == 0
                and m["llmopt:kv_cache_usage_perc"] == 0):
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
