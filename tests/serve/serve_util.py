"""A real `llmopt serve` for the tests: a subprocess on a free port, over a tiny random Llama with
SmolLM2's tokenizer (and chat template), with an API key so the 401 path is tested too. (Not a
conftest.py: a second module named conftest would shadow tests/conftest.py.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from conftest import REPO, make_tiny

API_KEY = "test-key"
MODEL_NAME = "tiny"
MAX_MODEL_LEN = 256
ENGINE_ARGS = dict(max_model_len=MAX_MODEL_LEN, kv_cache_memory=8 << 20, block_size=16, max_num_seqs=32)


@dataclass
class Server:
    url: str
    model_path: Path
    proc: subprocess.Popen

    def client(self, **kw):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60, **kw)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_chat_model(path: Path) -> Path:
    path = make_tiny(path, tokenizer=True, max_position_embeddings=512)
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(str(path)).chat_template, "the tiny model needs a chat template"
    return path


def start_server(tiny_chat_model: Path, log: Path):
    """Yields a Server running until the generator is closed."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "llmopt", "serve", "--model", str(tiny_chat_model), "--port", str(port),
           "--served-model-name", MODEL_NAME, "--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN),
           "--kv-cache-memory-bytes", "8MiB", "--block-size", "16", "--max-num-seqs", "32",
           "--uvicorn-log-level", "warning"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"llmopt serve exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"llmopt serve did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    try:
        yield Server(url, tiny_chat_model, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

