"""What one `llmopt bench` invocation measures (BenchConfig), how it reports progress and is
stopped (Hooks), and what one run hands back (RunOutput)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from llmopt import defaults
from llmopt.bench.datasets import Workload
from llmopt.bench.metrics import RequestRecord, ServerStats
from llmopt.bench.schedule import Load
from llmopt.errors import UserInputError

SPEC_METHODS = ("none", "ngram", "draft_model", "eagle", "eagle3")
# vLLM's --backend names of the two OpenAI endpoints (vllm/benchmarks/lib/endpoint_request_func.py)
BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
ENDPOINTS = tuple(BACKENDS.values())


def resolve_backend(backend: str | None, endpoint: str | None) -> str:
    """--backend and --endpoint -> the endpoint: either one implies the other (neither: openai's,
    /v1/completions); given both, they must agree."""
    if backend is not None and backend not in BACKENDS:
        raise UserInputError(f"--backend {backend}: use one of {', '.join(BACKENDS)}")
    if endpoint is None:
        return BACKENDS[backend or "openai"]
    if endpoint.rstrip("/") not in ENDPOINTS:
        raise UserInputError(f"--endpoint {endpoint}: use {' or '.join(ENDPOINTS)}")
    if backend is not None and BACKENDS[backend] != endpoint.rstrip("/"):
        raise UserInputError(f"--backend {backend} posts to {BACKENDS[backend]}, not --endpoint {endpoint}")
    return endpoint


def server_url(base_url: str | None, host: str | None, port: int | None) -> str:
    """vLLM's: --base-url, else http://--host:--port (127.0.0.1:8000 by default)."""
    if base_url is not None:
        return base_url
    host = host or defaults.BENCH_HOST
    port = defaults.BENCH_PORT if port is None else port
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@dataclass
class SamplingSpec:
    """What each request asks for beyond its prompt and length (None: not sent, the server's default)."""
    temperature: float = defaults.BENCH_TEMPERATURE
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False


@dataclass
class BenchConfig:
    workload: Workload = field(default_factory=Workload)
    load: Load = field(default_factory=Load)
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    base_url: str | None = None            # online: the server's root (or .../v1); None: offline
    endpoint: str = defaults.BENCH_ENDPOINT
    model: str | None = None               # online: the served name (default: the server's first model)
    tokenizer: str | None = None           # default: --model (online: else the server model's root)
    api_key: str | None = None
    num_warmups: int = 0
    percentiles: list[float] = field(default_factory=lambda: [99.0])
    percentile_metrics: list[str] = field(default_factory=lambda: ["ttft", "tpot", "itl"])
    goodput: dict[str, float] = field(default_factory=dict)
    request_timeout: float = defaults.BENCH_REQUEST_TIMEOUT
    engine_args: Any = None                # offline: llmopt.engine.args.EngineArgs
    compare_hf: bool = False
    sweep: bool = False
    sweep_size: int = defaults.BENCH_SWEEP_SIZE
    spec: str = "none"
    kv_sample_interval: float = defaults.BENCH_KV_SAMPLE_INTERVAL
    label: str | None = None               # vLLM's --label (the result file's prefix)
    metadata: dict[str, str] = field(default_factory=dict)   # vLLM's --metadata KEY=VALUE, into the result

    @property
    def online(self) -> bool:
        return self.base_url is not None

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    @property
    def backend(self) -> str:
        """vLLM's --backend name of the endpoint."""
        return "openai-chat" if self.chat else "openai"

    def __post_init__(self) -> None:
        if self.endpoint.rstrip("/") not in ENDPOINTS:
            raise UserInputError(f"--endpoint {self.endpoint}: use {' or '.join(ENDPOINTS)}")
        if self.spec not in SPEC_METHODS:
            raise UserInputError(f"--spec {self.spec!r}: use one of {', '.join(SPEC_METHODS)}")
        if self.spec != "none" and self.online:
            raise UserInputError(f"--spec {self.spec} configures the offline engine: a server (--base-url) speculates "
                                 "as its own --speculative-config says")
        if self.num_warmups < 0:
            raise UserInputError("--num-warmups must be >= 0")
        if not self.request_timeout > 0:
            raise UserInputError("--request-timeout must be > 0 seconds")
        if self.sweep and self.sweep_size < 2:
            raise UserInputError("--sweep-size must be at least 2 (synchronous and throughput)")
        if self.sweep and self.load.duration is not None and self.load.max_concurrency is None:
            raise UserInputError("--sweep with --duration needs --max-concurrency: its throughput benchmark has no "
                                 "request rate")
        if self.compare_hf and self.online:
            raise UserInputError("--compare hf runs transformers in-process: it is for offline runs (no --base-url)")


class Hooks:
    """Progress and stopping, as plain callbacks (the CLI draws the bar; a test passes nothing).
    start(description, total) opens a new bar (total None: unknown); advance(n) moves it; stop (a
    threading.Event) set by Ctrl-C ends the sending."""

    def __init__(self, start: Callable[[str, int | None], None] | None = None,
                 advance: Callable[[int], None] | None = None, stop: threading.Event | None = None) -> None:
        self._start, self._advance = start, advance
        self.stop = stop or threading.Event()

    def start(self, description: str, total: int | None) -> None:
        if self._start:
            self._start(description, total)

    def advance(self, n: int = 1) -> None:
        if self._advance:
            self._advance(n)



@dataclass
class RunOutput:
    """One benchmark run: its requests, its duration (first send to last completion, or to Ctrl-C)
    and the server's (or engine's) own counters."""
    records: list[RequestRecord]
    duration: float
    server: ServerStats
    interrupted: bool = False
    model_id: str | None = None
    tokenizer_id: str | None = None
