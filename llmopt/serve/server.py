"""What every endpoint of one server shares: its configuration (`ServeConfig`) and its state
(`OpenAIServer`: the engine and the model's facts, the metrics, the admission count, whether it is
draining), with the periodic stats line and the shutdown drain.

Shutdown (`OpenAIServer.drain`, called by run.py on SIGTERM): new requests get 503, in-flight ones
may finish for `--shutdown-timeout` seconds, the rest are aborted with a 503 error."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from llmopt import defaults
from llmopt.engine.async_engine import AsyncLLMEngine, EngineStoppedError
from llmopt.serve.metrics import ServerMetrics

log = logging.getLogger("llmopt.serve")


@dataclass
class ServeConfig:
    model_name: str
    api_keys: tuple[str, ...] = ()           # /v1/* needs one of these (none: open)
    # CORS, with vLLM's defaults (--allowed-origins, --allowed-methods, --allowed-headers,
    # --allow-credentials): Starlette's CORSMiddleware; no origin: no CORS headers at all
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    request_id_headers: bool = False         # X-Request-Id on every response
    max_num_queued_reqs: int | None = None   # running + waiting (n counted as n) above this: 503
    max_n: int | None = None                 # cap on n (default: the engine's max_num_seqs)
    max_request_bytes: int = defaults.SERVE_MAX_REQUEST_BYTES   # a larger body: 413
    log_interval: float = defaults.SERVE_LOG_INTERVAL       # periodic stats line every this many seconds (0: never)
    log_requests: bool = True                # one line per finished request
    # sampling defaults for fields a request leaves out (models/generation_config.py; vLLM's
    # --generation-config): temperature, top_p, top_k, min_p, repetition_penalty, max_tokens
    generation_defaults: dict = field(default_factory=dict)
    chat_template: str | None = None         # --chat-template: used instead of the tokenizer's
    enable_auto_tool_choice: bool = False    # tool_choice auto, with tool_call_parser reading the output
    tool_call_parser: str | None = None      # serve/tool_parsers.py: PARSERS


class OpenAIServer:
    """The state of one server, shared by its serving classes (serving_engine.py and after)."""

    def __init__(self, engine: AsyncLLMEngine, config: ServeConfig) -> None:
        self.engine = engine
        self.llm = engine.engine
        self.config = config
        self.tokenizer = self.llm.tokenizer
        self.vocab_size = self.llm.loaded.config.vocab_size
        self.max_model_len = self.llm.max_model_len
        self.max_n = config.max_n or self.llm.args.max_num_seqs
        # the longest vocabulary entry (byte-level or SentencePiece form: at least as many characters
        # as its text): a prompt of more than max_model_len times this many characters cannot fit
        self.max_token_chars = max((len(k) for k in self.tokenizer.get_vocab()), default=1) \
            if self.tokenizer is not None else None
        self.metrics = ServerMetrics(config.model_name, self.llm.stats, self.max_model_len, self.llm.cache_config())
        engine.iteration_listeners.append(self.metrics.iteration)
        self.in_flight = 0   # sequences (n counted as n) the server has queued and not finished
        self.draining = False   # shutting down: new requests get 503

    def models(self) -> dict:
        """The body of /v1/models: the one model served."""
        return {"object": "list", "data": [{"id": self.config.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "llmopt", "root": str(self.llm.loaded.path),
                                            "max_model_len": self.max_model_len}]}

    async def log_stats_forever(self, interval: float) -> None:
        """Every `interval` seconds while there is work (and once when it stops): prompt and
        generation throughput, running/waiting requests, KV-cache usage, prefix-cache hit rate."""
        tp = self.engine.throughput
        last_t, last_p, last_g = time.monotonic(), tp.prompt_tokens, tp.generation_tokens
        was_idle = True
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            s = self.llm.stats()
            dp, dg = tp.prompt_tokens - last_p, tp.generation_tokens - last_g
            idle = not (dp or dg or s.num_running or s.num_waiting)
            if not (idle and was_idle):
                dt = max(now - last_t, 1e-9)
                log.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                         "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                         dp / dt, dg / dt, s.num_running, s.num_waiting, 100 * s.kv_cache_usage,
                         100 * s.prefix_cache_hit_rate)
            was_idle = idle
            last_t, last_p, last_g = now, tp.prompt_tokens, tp.generation_tokens

    async def drain(self, timeout: float) -> None:
        """Shut down: new requests get 503 from now on; in-flight ones may finish for up to
        `timeout` seconds; the rest are aborted (their clients get a 503 error)."""
        self.draining = True
        loop = asyncio.get_running_loop()
        if self.in_flight:
            log.info("shutting down: %d sequences in flight, waiting up to %g s for them", self.in_flight, timeout)
        deadline = loop.time() + timeout
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight:
            log.info("shutting down: aborting %d sequences", self.in_flight)
            self.engine.abort_all(EngineStoppedError("the server is shutting down: the request was aborted"))
            deadline = loop.time() + 5
            while self.in_flight and loop.time() < deadline:   # their responses end
                await asyncio.sleep(0.02)
        await self.engine.stop()
