"""Start `llmopt serve` (or any OpenAI-compatible server command) in a subprocess and wait until it
answers: the one launcher the main job, the benchmark scripts and the server tests share.

    with serving(["--model", "smollm2-135m"], log=Path("serve.log")) as server:
        httpx.post(server.url + "/v1/completions", json={...})
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from llmopt.errors import LLMOptError
from llmopt.ports import free_port


@dataclass
class Launched:
    proc: subprocess.Popen
    url: str                 # the server root, e.g. http://127.0.0.1:8000
    port: int
    log: Path | None
    seconds_to_ready: float


def serve_command(args: list[str], port: int) -> list[str]:
    """`python -m llmopt serve ARGS --port PORT` with this interpreter."""
    return [sys.executable, "-m", "llmopt", "serve", *args, "--port", str(port)]


def _log_tail(log: Path | None) -> str:
    return log.read_text(errors="replace")[-3000:] if log is not None and log.is_file() else ""


def wait_ready(proc: subprocess.Popen, url: str, timeout: float = 120, log: Path | None = None,
               path: str = "/health", poll: float = 0.2) -> float:
    """Poll `url + path` until it answers 200; raise LLMOptError (with the log's tail) when the process
    exits first or `timeout` seconds pass. Returns the seconds waited."""
    import httpx
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise LLMOptError(f"the server exited with code {proc.returncode} before it was ready\n{_log_tail(log)}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > timeout:
            proc.kill()
            proc.wait()
            raise LLMOptError(f"the server was not ready after {timeout:.0f} s\n{_log_tail(log)}")
        time.sleep(poll)


def launch(cmd: list[str], url: str, port: int, *, log: Path | None = None, env: dict | None = None,
           cwd: str | Path | None = None, timeout: float = 120, health_path: str = "/health") -> Launched:
    """Start `cmd` (stdout and stderr to `log`, else inherited) and wait until it is ready."""
    out = open(log, "wb") if log is not None else None
    try:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None,
                                env={**os.environ, **(env or {})}, cwd=cwd)
    finally:
        if out is not None:
            out.close()
    try:
        waited = wait_ready(proc, url, timeout, log, health_path)
    except BaseException:
        stop(proc, grace=5)
        raise
    return Launched(proc, url, port, log, waited)


def stop(proc: subprocess.Popen, grace: float = 20, sig: int = signal.SIGTERM) -> int:
    """Send `sig` (SIGTERM: `llmopt serve` drains and exits 0), kill after `grace` seconds; the exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@contextmanager
def serving(args: list[str], *, log: Path | None = None, env: dict | None = None, cwd: str | Path | None = None,
            timeout: float = 120) -> Iterator[Launched]:
    """`llmopt serve ARGS` on a free port for the duration of the block, stopped with SIGTERM after."""
    port = free_port()
    server = launch(serve_command(args, port), f"http://127.0.0.1:{port}", port, log=log, env=env, cwd=cwd,
                    timeout=timeout)
    try:
        yield server
    finally:
        stop(server.proc)
