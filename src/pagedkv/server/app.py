"""The FastAPI app: OpenAI routes over one engine loop, plus ``/health``, ``/metrics`` and
``/pagedkv/info`` (the replica's self-description for routers, ``engine/kv/events.py``).

``create_app(engine, config)`` takes ownership of ``engine``: the app's lifespan starts the
engine loop (the only thread that touches the engine) and stops it at shutdown. The routes
(``pagedkv.server.routes``) find what they need on ``app.state``: ``engine_loop``, ``metrics``,
``config``, ``info`` (the engine's fixed facts), ``rules`` (its thread-safe request check),
``tokenizer``, ``started_s`` and ``replica_info``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from pagedkv.engine import LLMEngine
from pagedkv.server import routes
from pagedkv.server.config import ServerConfig
from pagedkv.server.engine_loop import ADMIT_AHEAD_SEQS, EngineLoop
from pagedkv.server.errors import install_error_handlers
from pagedkv.server.http_edge import BearerAuth
from pagedkv.server.kv_event_metrics import KVEventCollector
from pagedkv.server.metrics import PREFIX, ServerMetrics
from pagedkv.server.pd_front import PDFront
from pagedkv.server.tokenize_routes import TokenizerFacts, install_tokenizer_routes


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    app.state.engine_loop.start()
    yield
    await asyncio.to_thread(app.state.engine_loop.stop)
    await asyncio.to_thread(app.state.engine_loop.engine.close)  # the other ranks, if any
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
    state.metrics = ServerMetrics(
        lambda: engine_loop.snapshot, engine.info.labels(), engine.info.placement()
    )
    state.pd = pd
    state.flush_store = engine.flush_kv_store if flush_store else None
    if pd is not None:
        state.metrics.registry.register(pd.collector())
    state.metrics.registry.register(KVEventCollector(PREFIX, engine.kv_event_counts()))
    state.replica_info = engine.describe(config.served_model_name)  # once, before the loop
    install_error_handlers(app)
    app.add_middleware(BearerAuth, api_key=config.api_key)
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/health", routes.health, methods=["HEAD"], include_in_schema=False)
    app.add_api_route("/metrics", routes.prometheus, methods=["GET"])
    app.add_api_route("/pagedkv/info", routes.replica_info, methods=["GET"])
    install_tokenizer_routes(
        app, TokenizerFacts(engine.tokenizer, config.served_model_name, engine.info.max_model_len)
    )
    app.include_router(routes.v1)
    return app
