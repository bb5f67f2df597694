"""The FastAPI app: OpenAI routes over one engine loop, plus ``/health``, ``/metrics`` and
``/pagedkv/info`` (the replica's self-description for routers, ``engine/kv_events.py``).

``create_app(engine, config)`` takes ownership of ``engine``: the app's lifespan starts the
engine loop (the only thread that touches the engine) and stops it at shutdown. The routes
(``pagedkv.server.routes``) find what they need on ``app.state``: ``engine_loop``, ``metrics``,
``config``, ``info`` (the engine's fixed facts), ``rules`` (its thread-safe request check),
``tokenizer``, ``started_s`` and ``replica_info``.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedkv.engine import LLMEngine
from pagedkv.engine.kv_events import describe_replica
from pagedkv.engine.kv_transfer import model_identity
from pagedkv.server import routes
from pagedkv.server.config import ServerConfig
from pagedkv.server.engine_loop import ADMIT_AHEAD_SEQS, EngineLoop
from pagedkv.server.errors import APIError, install_error_handlers
from pagedkv.server.kv_event_metrics import KVEventCollector
from pagedkv.server.metrics import PREFIX, ServerMetrics
from pagedkv.server.pd_front import PDFront

# Probes answer without the key: a load balancer or Prometheus must not need it.
OPEN_PATHS = frozenset({"/health", "/metrics"})


class BearerAuth:
    """ASGI middleware: with a key, every path but ``OPEN_PATHS`` -- ``/v1`` routes, the
    OpenAPI schema, unknown paths -- needs ``Authorization: Bearer <key>`` (401 otherwise).
    The scheme is matched without regard to case (RFC 7235, section 2.1)."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self._key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._key and scope["type"] == "http" and scope.get("path") not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.strip().partition(b" ")
            ok = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
            if not ok:
                error = APIError("missing or wrong API key (send Authorization: Bearer <key>)",
                                 401, code="invalid_api_key")  # fmt: skip
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    app.state.engine_loop.start()
    yield
    await asyncio.to_thread(app.state.engine_loop.stop)
    if app.state.pd is not None:
        await app.state.pd.aclose()


def create_app(
    engine: LLMEngine,
    config: ServerConfig,
    *,
    admit_ahead_seqs: int = ADMIT_AHEAD_SEQS,
    pd: PDFront | None = None,
    flush_store: bool = False,
) -> FastAPI:
    """The app serving ``engine``; reads only the engine's face (``info``, ``snapshot`` via
    the loop, ``check_request``, ``tokenizer``). ``admit_ahead_seqs``: the fair queue's depth
    (see ``engine_loop``), a knob for benchmarks; a huge value is first come, first served.
    ``pd``: the decode side of a prefill/decode pair (the app closes it at shutdown).
    ``flush_store``: a prefill instance answers only once the request's blocks are in the KV
    store (its decode instance reads them right after the answer)."""
    engine_loop = EngineLoop(engine, admit_ahead_seqs=admit_ahead_seqs)
    app = FastAPI(title="pagedkv", lifespan=_lifespan, docs_url=None, redoc_url=None)
    state = app.state
    state.engine_loop, state.config, state.info = engine_loop, config, engine.info
    state.rules, state.tokenizer, state.started_s = engine, engine.tokenizer, int(time.time())
    state.metrics = ServerMetrics(lambda: engine_loop.snapshot, engine.info.labels())
    state.pd = pd
    state.flush_store = engine.flush_kv_store if flush_store else None
    if pd is not None:
        state.metrics.registry.register(pd.collector())
    kv_events = engine.parts.kv_events
    state.metrics.registry.register(KVEventCollector(PREFIX, kv_events and kv_events.counts))
    # The weights digest reads ~4K elements per tensor (milliseconds), once, before the loop.
    identity = model_identity(engine.parts.model)
    state.replica_info = describe_replica(engine, config.served_model_name, identity)
    install_error_handlers(app)
    app.add_middleware(BearerAuth, api_key=config.api_key)
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/health", routes.health, methods=["HEAD"], include_in_schema=False)
    app.add_api_route("/metrics", routes.prometheus, methods=["GET"])
    app.add_api_route("/pagedkv/info", routes.replica_info, methods=["GET"])
    app.include_router(routes.v1)
    return app
