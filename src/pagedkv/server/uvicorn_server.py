"""Running the app under uvicorn: in the foreground (``pagedkv serve``) or on a background
thread (tests, benchmarks). The socket is bound here, so port 0 yields a free port that is
known before the first request.

Shutdown: uvicorn stops accepting connections and lets open requests run for
``graceful_shutdown_s``; shortly before that runs out we stop the engine loop, so that each
request still open ends with an explicit 503 error (an SSE error event on a stream) instead of
a cut connection.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from pagedkv.errors import UsageError
from pagedkv.server.config import ServerConfig


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on ``host:port`` (IPv6 if ``host`` is an IPv6 address);
    ``UsageError`` if the address cannot be had (in use, not this machine's). Cheap: call it
    before loading a model, so a taken port is reported at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}", "port") from None
    return sock


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, stop_engine: Callable[[], None]) -> None:
        super().__init__(config)
        self._stop_engine = stop_engine

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        grace_s = self.config.timeout_graceful_shutdown or 0.0
        # Leave the last part of the grace period for the error events to go out.
        fail_at_s = max(grace_s - min(1.0, grace_s / 2), 0.0)

        async def fail_leftovers() -> None:
            await asyncio.sleep(fail_at_s)
            await asyncio.to_thread(self._stop_engine)

        task = asyncio.create_task(fail_leftovers())
        try:
            await super().shutdown(sockets)
        finally:
            task.cancel()


def _uvicorn(app: FastAPI, config: ServerConfig) -> uvicorn.Server:
    """``app`` comes from ``create_app`` (its ``state.engine_loop`` is stopped at shutdown);
    the server is ``app.state.uvicorn_server`` (``should_exit`` ends it from any thread)."""
    server = _Server(
        uvicorn.Config(
            app,
            log_level=config.log_level,
            timeout_graceful_shutdown=config.graceful_shutdown_s,
            # Keep-alive connections of idle load-test clients should not pile up forever.
            timeout_keep_alive=30,
        ),
        app.state.engine_loop.stop,
    )
    app.state.uvicorn_server = server
    return server


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve_forever(app: FastAPI, config: ServerConfig, sock: socket.socket | None = None) -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM): uvicorn then lets open streams finish for
    ``graceful_shutdown_s`` and the app's lifespan stops the engine loop. ``sock``: a socket
    from ``bind`` (bound before the model loaded); by default one is bound here."""
    sock = sock or bind(config.host, config.port)
    print(f"pagedkv serve: listening on {url_of(sock)}/v1", flush=True)
    _uvicorn(app, config).run(sockets=[sock])


@dataclass
class BackgroundServer:
    """A server on a daemon thread. ``url`` is the base URL (no ``/v1``)."""

    url: str
    _server: uvicorn.Server
    _thread: threading.Thread

    def stop(self, timeout_s: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_in_background(
    app: FastAPI, config: ServerConfig, startup_timeout_s: float = 30.0
) -> BackgroundServer:
    """Start serving on a thread; returns once the server accepts connections."""
    sock = bind(config.host, config.port)
    server = _uvicorn(app, config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="pagedkv-http", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError("the server did not start (see its log above)")
        time.sleep(0.01)
    return BackgroundServer(url_of(sock), server, thread)
