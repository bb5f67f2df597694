"""The router's FastAPI app: serve's OpenAI routes in front of N replicas, plus ``/health``,
``/metrics`` and ``/pagedkv/replicas`` (each replica's state, as JSON).

``create_router_app(config, infos, tokenizer)`` takes the replicas' infos fetched at start-up
(``handshake.fetch_all_infos``, already checked to agree). Its lifespan opens the HTTP client
to the replicas, starts one KV event reader per replica and the health loop, and stops them
at shutdown. Every generation request is counted exactly once in ``/metrics``, when it ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedkv.model.tokenizer import Tokenizer
from pagedkv.router.config import RouterConfig
from pagedkv.router.edge import Edge, RoutedKind
from pagedkv.router.forward import AnswerTooLarge, Forwarder, Opened, ReplicaTimeout
from pagedkv.router.handshake import ReplicaInfo
from pagedkv.router.health import HealthMonitor
from pagedkv.router.metrics import NO_REPLICA, RouterMetrics
from pagedkv.router.relay import StreamRelay
from pagedkv.router.replicas import Chooser, IndexFeed, ReplicaState
from pagedkv.server import protocol as p
from pagedkv.server.errors import APIError, install_error_handlers
from pagedkv.server.http_edge import CLIENT_CLOSED_REQUEST, CONTENT_TYPE, BearerAuth, read_body
from pagedkv.server.tokenize_routes import TokenizerFacts, install_tokenizer_routes


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    st = app.state
    cfg: RouterConfig = st.config
    st.client = httpx.AsyncClient(
        timeout=httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s),
        limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64),
        transport=st.transport,
        headers={"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None,
    )
    st.health = HealthMonitor(
        st.replicas,
        st.feed,
        st.metrics,
        st.client,
        reference=st.replicas[0].info,
        interval_s=cfg.health_interval_s,
        kv_events_url=cfg.kv_events_url,
        read_events=st.chooser.policy.uses_prefix_index,
    )
    st.forwarder = Forwarder(
        st.chooser,
        st.metrics,
        st.client,
        st.health.take_out,
        api_key=cfg.api_key,
        request_timeout_s=cfg.request_timeout_s,
        max_event_bytes=cfg.max_event_bytes,
        max_answer_bytes=cfg.max_answer_bytes,
    )
    for r in st.replicas:
        st.health.follow_events(r)
    task = asyncio.create_task(st.health.run())
    try:
        yield
    finally:
        task.cancel()
        for reader in st.feed.readers():
            await asyncio.to_thread(reader.stop)
        await st.client.aclose()


def create_router_app(
    config: RouterConfig,
    infos: Sequence[ReplicaInfo],
    tokenizer: Tokenizer,
    *,
    reader_factory: Callable[..., object] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> FastAPI:
    """``reader_factory`` (tests): builds the KV event readers (default ``KVEventReader``);
    ``transport`` (tests): the HTTP transport to the replicas."""
    ref = infos[0]
    app = FastAPI(title="pagedkv route", lifespan=_lifespan, docs_url=None, redoc_url=None)
    st = app.state
    st.config, st.transport, st.started_s = config, transport, int(time.time())
    st.replicas = [ReplicaState(i.url, i, breaker=config.make_breaker()) for i in infos]
    st.feed = IndexFeed(reader_factory)
    st.chooser = Chooser(st.replicas, config.make_policy(), st.feed)
    st.metrics = RouterMetrics(st.replicas, st.feed, config.policy)
    st.edge = Edge(
        tokenizer,
        model=ref.model,
        block_size=ref.block_size,
        hash_algorithm=ref.hash_algorithm,
        max_model_len=ref.max_model_len,
    )
    install_error_handlers(app)
    app.add_middleware(BearerAuth, api_key=config.api_key)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", prometheus, methods=["GET"])
    app.add_api_route("/pagedkv/replicas", replicas, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    install_tokenizer_routes(app, TokenizerFacts(tokenizer, ref.model, ref.max_model_len))
    return app


async def health(request: Request) -> Response:
    """200 while at least one replica is routable."""
    up = sum(r.routable for r in request.app.state.replicas)
    if up:
        return JSONResponse({"status": "ok", "replicas_up": up})
    return APIError("no healthy replica", 503, code="no_replica").response()


async def prometheus(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)


async def replicas(request: Request) -> JSONResponse:
    st = request.app.state
    return JSONResponse(
        {
            "policy": st.config.policy,
            "replicas": [
                {
                    "url": r.url,
                    "up": r.up,
                    "refused": r.refused,
                    "instance_id": r.info.instance_id,
                    "device": r.info.device,
                    "dtype": r.info.dtype,
                    "load": r.load,
                    "in_flight": r.in_flight,
                    "scraped_requests": r.scraped_requests,
                    "index_blocks": st.feed.num_blocks(r.url),
                }
                for r in st.replicas
            ],
        }
    )


async def models(request: Request) -> JSONResponse:
    st = request.app.state
    card = p.ModelCard(
        id=st.edge.model, created=st.started_s, max_model_len=st.edge.rules.info.max_model_len
    )
    return JSONResponse(p.dump(p.ModelList(data=[card])))


async def completions(request: Request) -> Response:
    return await _route(request, p.CompletionRequest, "/v1/completions")


async def chat_completions(request: Request) -> Response:
    return await _route(request, p.ChatCompletionRequest, "/v1/chat/completions")


async def _route(request: Request, kind: RoutedKind, path: str) -> Response:
    st = request.app.state
    metrics: RouterMetrics = st.metrics
    started_s = time.perf_counter()
    try:
        body = await read_body(request)
        req = st.edge.parse(body, kind)
        key = await asyncio.to_thread(st.edge.route_key, req)
        metrics.observe_edge(time.perf_counter() - started_s)
        opened = await _unless_client_leaves(request, st.forwarder.open(path, body, key))
    except (ReplicaTimeout, AnswerTooLarge) as exc:
        metrics.count_request(exc.replica, "failed")
        raise
    except APIError as exc:
        outcome = "rejected" if exc.status_code < 500 else "failed"
        metrics.count_request(NO_REPLICA, "unavailable" if exc.code == "no_replica" else outcome)
        raise
    except asyncio.CancelledError:  # the router is shutting down
        metrics.count_request(NO_REPLICA, "aborted")
        raise
    except Exception:  # a bug: the client gets serve's 500, the request is still counted
        metrics.count_request(NO_REPLICA, "failed")
        raise
    if opened is None:
        metrics.count_request(NO_REPLICA, "aborted")
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    replica = opened.replica
    if opened.chunks is None:  # a whole answer (or a replica's error status)
        replica.in_flight -= 1
        status = opened.response.status_code
        outcome = "finished" if status < 400 else "rejected" if status < 500 else "failed"
        metrics.count_request(replica.url, outcome)
        return Response(opened.body, status, headers=opened.headers())
    relay = StreamRelay(opened, st.config.request_timeout_s)

    async def on_close() -> None:
        replica.in_flight -= 1
        metrics.count_request(replica.url, relay.outcome)
        if relay.cut is not None:
            st.health.take_out(replica, relay.cut)
        await opened.response.aclose()

    return _RelayResponse(relay.events(), on_close, opened.headers())


async def _unless_client_leaves(request: Request, opening: Awaitable[Opened]) -> Opened | None:
    """What ``opening`` returns or raises, or None when the client disconnects first: then
    ``opening`` is cancelled, which closes the replica's response (the replica aborts the
    request) and releases its in-flight count, before this returns."""
    work = asyncio.ensure_future(opening)
    gone = asyncio.ensure_future(_disconnected(request.receive))
    try:
        done, _ = await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        if gone in done and gone.exception() is not None:  # no word of the client: wait on
            await asyncio.wait((work,))
    finally:
        gone.cancel()
        if not work.done():  # the client left first (or the router is stopping)
            work.cancel()
    if not work.done():
        await asyncio.wait((work,))  # its clean-up: the replica's answer closed
    return None if work.cancelled() else work.result()  # the answer wins a tie


async def _disconnected(receive: Receive) -> None:
    """Returns once the client has gone (the body was read already: nothing else arrives)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class _RelayResponse(StreamingResponse):
    """A relayed stream that runs ``on_close`` however it ends: finished, cut, cancelled by
    the client leaving, or never started. It watches for the client leaving itself: under
    ASGI spec 2.4 Starlette stops doing so, and uvicorn's ``send`` to a gone client just
    returns, so a relay would read its replica until the replica stops."""

    def __init__(
        self,
        events: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]],
        headers: dict[str, str],
    ) -> None:
        headers = {k: v for k, v in headers.items() if k.lower() != "content-type"}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def until_gone() -> None:
                    await _disconnected(receive)
                    group.cancel_scope.cancel()  # closes the relay: the replica's answer too

                group.start_soon(until_gone)
                await super().__call__(scope, receive, send)
                group.cancel_scope.cancel()
        finally:
            await self._on_close()
