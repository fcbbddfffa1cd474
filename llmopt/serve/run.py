"""Running the app under uvicorn with our own shutdown.

    sock = bind("127.0.0.1", 8000)            # before the model loads: a busy port fails at once
    sig = run_server(app, sock, shutdown_timeout=30)

uvicorn's own signal handling re-raises the signal after its shutdown (exit 143 on SIGTERM) and
does not drain the engine. Ours, on SIGTERM or SIGINT: new requests get 503 (and /health 503),
requests in flight may finish for up to `shutdown_timeout` seconds (0, the default as in vLLM:
abort at once; aborted clients get a 503 error), then uvicorn closes its connections and
`run_server` returns the signal's number, so the command exits 0 after SIGTERM. A second signal
stops at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading

import uvicorn

from llmopt.engine.async_engine import EngineStoppedError
from llmopt.errors import UserInputError

log = logging.getLogger("llmopt.serve")

SIGNALS = (signal.SIGINT, signal.SIGTERM)
CONNECTIONS_CLOSE_S = 5.0   # after the drain: how long uvicorn waits for connections to close


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (listening starts when the server does; until then connections
    are refused). A busy or unknown address is one UserInputError line."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserInputError(f"--host {host!r} does not resolve ({e.strerror}): give an address such as "
                             "127.0.0.1 or 0.0.0.0") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UserInputError(f"cannot listen on {host}:{port}: {e.strerror}; pick another --port or --host") from None
    return sock


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, openai, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.openai, self.shutdown_timeout = openai, shutdown_timeout
        self.signal_received: int | None = None
        self._drain: asyncio.Task | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in SIGNALS:
                loop.remove_signal_handler(sig)
                signal.signal(sig, previous[sig])
            if self._drain is not None and not self._drain.done():   # a second signal cut it short
                self._drain.cancel()

    def _on_signal(self, sig: int) -> None:
        openai = self.openai
        if self.signal_received is not None:   # a second signal: stop now
            log.info("%s again: stopping now", signal.Signals(sig).name)
            openai.engine.abort_all(EngineStoppedError("the server is shutting down: the request was aborted"))
            self.should_exit = True
            return
        self.signal_received = sig
        log.info("%s: shutting down (--shutdown-timeout %g s)", signal.Signals(sig).name, self.shutdown_timeout)

        async def drain() -> None:
            try:
                await openai.drain(self.shutdown_timeout)
            finally:
                self.should_exit = True

        self._drain = asyncio.ensure_future(drain())


def run_server(app, sock: socket.socket, shutdown_timeout: float = 0.0, log_level: str = "info") -> int | None:
    """Serve `app` (from build_app) on a socket from `bind` until SIGTERM or SIGINT, then shut
    down as the module says; returns the signal's number (None if uvicorn stopped by itself)."""
    # asyncio's loop, not uvloop (which uvicorn's "auto" would pick): per streamed chunk the event
    # loop's thread spent ~240 us of CPU on uvloop against ~195 on asyncio's, taken from the
    # engine's cores; uvicorn's "auto" HTTP parser is httptools where installed (~15% less than h11)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=CONNECTIONS_CLOSE_S, lifespan="on",
                            loop="asyncio")
    server = _Server(config, app.state.server, shutdown_timeout)
    server.run(sockets=[sock])
    return server.signal_received
