"""The FastAPI app: OpenAI routes over one engine loop, plus ``/health`` and ``/metrics``.

``create_app(engine, config)`` takes ownership of ``engine``: the app's lifespan starts the
engine loop (the only thread that touches the engine) and stops it at shutdown.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedkv.engine import LLMEngine
from pagedkv.server import protocol as p
from pagedkv.server.config import ServerConfig
from pagedkv.server.engine_loop import EngineLoop
from pagedkv.server.errors import APIError, from_validation, install_error_handlers
from pagedkv.server.metrics import CONTENT_TYPE, ServerMetrics
from pagedkv.server.render import ResponseHeader, StreamRenderer, full_response
from pagedkv.server.run import ClientGone, Run
from pagedkv.server.sampling import (
    PoolLimits,
    chat_prompt,
    check_unsupported,
    completion_prompts,
    sampling_params,
)

# Sent instead of a response to a client that already left (nginx's convention).
CLIENT_CLOSED_REQUEST = 499
# Far above any prompt that fits a context of 128k tokens as JSON (token ids or text).
MAX_BODY_BYTES = 8 << 20


class BearerAuth:
    """ASGI middleware: every ``/v1`` path, known or not, needs the key (401 otherwise)."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (
            self._expected
            and scope["type"] == "http"
            and (path == "/v1" or path.startswith("/v1/"))
        ):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                error = APIError("missing or wrong API key (send Authorization: Bearer <key>)",
                                 401, code="invalid_api_key")  # fmt: skip
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def page_format_labels(engine: LLMEngine) -> dict[str, str]:
    parts = engine.parts
    labels = {k: str(v) for k, v in parts.page_format.to_dict().items()}
    labels.update(policy=parts.policy.name, backend=parts.resolution.backend)
    return labels


def create_app(engine: LLMEngine, config: ServerConfig) -> FastAPI:
    engine_loop = EngineLoop(engine)
    metrics = ServerMetrics(lambda: engine_loop.snapshot, page_format_labels(engine))
    tokenizer = engine.tokenizer
    limits = PoolLimits(
        max_model_len=engine.max_model_len,
        block_size=engine.allocator.block_size,
        num_total_blocks=engine.allocator.num_total_blocks,
        vocab_size=engine.parts.model_config.vocab_size,
    )
    started_s = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_loop.start()
        yield
        await asyncio.to_thread(engine_loop.stop)

    app = FastAPI(title="pagedkv", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine_loop, app.state.metrics = engine_loop, metrics
    install_error_handlers(app)
    app.add_middleware(BearerAuth, api_key=config.api_key)

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine_loop.alive:
            return JSONResponse({"status": "ok"})
        reason = engine_loop.failed or "the engine loop is not running"
        return APIError(reason, 503, code="engine_unavailable").response()

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def models() -> JSONResponse:
        card = p.ModelCard(id=config.served_model_name, created=started_s,
                           max_model_len=limits.max_model_len)  # fmt: skip
        return JSONResponse(p.dump(p.ModelList(data=[card])))

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await _serve(request, p.CompletionRequest)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _serve(request, p.ChatCompletionRequest)

    async def _serve(request: Request, kind: type[BaseModel]) -> Response:
        try:
            req = await _parse(request, kind)
            if req.model is not None and req.model != config.served_model_name:
                raise APIError(f"the model {req.model!r} does not exist; this server serves "
                               f"{config.served_model_name!r}", 404, param="model",
                               code="model_not_found")  # fmt: skip
            check_unsupported(req)
            if isinstance(req, p.ChatCompletionRequest):
                prompts = [await asyncio.to_thread(chat_prompt, req, tokenizer)]
            else:
                prompts = await asyncio.to_thread(completion_prompts, req, tokenizer)
            params = sampling_params(req, prompts, limits)
            if not engine_loop.alive:
                raise APIError("the engine is not running", 503, code="engine_unavailable")
        except APIError as exc:
            metrics.count_request("rejected" if exc.status_code < 500 else "failed")
            raise
        head = ResponseHeader(
            id=f"{'chatcmpl' if isinstance(req, p.ChatCompletionRequest) else 'cmpl'}-"
            f"{uuid.uuid4().hex}",
            created_s=int(time.time()),
            model=config.served_model_name,
            chat=isinstance(req, p.ChatCompletionRequest),
            n=params.n,
            want_logprobs=params.logprobs is not None,
            holdback_chars=max((len(s) - 1 for s in params.stop), default=0),
        )
        return await _respond(request, req, head, prompts, params)

    async def _respond(request, req, head, prompts, params) -> Response:
        run = Run(engine_loop, metrics, head.id, prompts, params, req.cache_salt)
        try:
            if not req.stream:
                outputs = await run.wait_finished(request)
                metrics.count_request("finished")
                return JSONResponse(p.dump(full_response(head, tokenizer, outputs)))
            # Wait for the first output before answering, so that a refusal is still a status.
            first = await run.next(request)
        except ClientGone:  # ``next`` aborted the run already
            metrics.count_request("aborted")
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except APIError as exc:  # likewise
            metrics.count_request("rejected" if exc.status_code < 500 else "failed")
            raise
        except BaseException:  # cancelled while waiting (server shutdown)
            run.abort()
            raise
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        outcome = ["aborted"]  # what the stream reached; counted once it is closed

        def on_close() -> None:
            run.abort()  # a no-op unless the client left or the stream never started
            metrics.count_request(outcome[0])

        events = _events(run, StreamRenderer(head, tokenizer), first, include_usage, outcome)
        return _EventStream(events, on_close)

    async def _events(run: Run, renderer: StreamRenderer, first, include_usage: bool, outcome):
        """Server-sent events until ``[DONE]``. Starlette cancels this generator when the
        client disconnects (``_EventStream`` then aborts the run, which frees its blocks)."""
        try:
            item = first
            while True:
                for body in renderer.chunks(*item):
                    yield _sse(body)
                if run.finished:
                    break
                item = await run.next(None)
            if include_usage:
                yield _sse(renderer.usage_chunk([o for o in run.latest if o is not None]))
            outcome[0] = "finished"
        except APIError as exc:  # a failure after the status line went out: an error event
            outcome[0] = "rejected" if exc.status_code < 500 else "failed"
            yield _sse(exc.body())
        yield "data: [DONE]\n\n"

    app.include_router(v1)
    return app


class _EventStream(StreamingResponse):
    """An SSE response that calls ``on_close`` however it ends: finished, cancelled by a
    disconnect, or never started because the client left before the first byte."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})  # fmt: skip
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _parse(request: Request, kind: type[BaseModel]):
    """The validated request model; a body over ``MAX_BODY_BYTES`` is refused (413) while it
    is still arriving, before it is held in memory whole."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(f"the body exceeds {MAX_BODY_BYTES} bytes", 413, code="body_too_large")
        chunks.append(chunk)
    body = b"".join(chunks)
    try:
        return kind.model_validate_json(body or b"")
    except ValidationError as exc:
        raise from_validation(exc) from None


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"
