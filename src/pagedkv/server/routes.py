"""The routes: module-level handlers that read ``request.app.state`` (set by ``create_app``).

A generation request is parsed, judged and tokenized (``request_params``), then run as one
``RequestRun``; the answer is a JSON body or, with ``"stream": true``, server-sent events.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from pagedkv.server import protocol as p
from pagedkv.server.echo import Echo
from pagedkv.server.errors import APIError, from_validation
from pagedkv.server.http_edge import CLIENT_CLOSED_REQUEST, CONTENT_TYPE, read_body
from pagedkv.server.render import ResponseHeader, StreamRenderer, full_response
from pagedkv.server.request_params import engine_inputs
from pagedkv.server.request_run import ClientGone, RequestRun
from pagedkv.server.unknown_fields import ignored_header, sort_extra_fields

v1 = APIRouter(prefix="/v1")


async def health(request: Request) -> Response:
    """200 while the engine loop runs (one failed request does not change that)."""
    engine_loop = request.app.state.engine_loop
    if engine_loop.alive:
        return JSONResponse({"status": "ok"})
    reason = engine_loop.failed or "the engine loop is not running"
    return APIError(reason, 503, code="engine_unavailable").response()


async def prometheus(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)


async def replica_info(request: Request) -> JSONResponse:
    """This replica's self-description for routers (``engine/kv/events.describe_replica``;
    schema in docs/kv_events.md). Behind the API key like the ``/v1`` routes."""
    return JSONResponse(request.app.state.replica_info)


@v1.get("/models")
async def models(request: Request) -> JSONResponse:
    state = request.app.state
    card = p.ModelCard(
        id=state.config.served_model_name,
        created=state.started_s,
        max_model_len=state.info.max_model_len,
    )
    return JSONResponse(p.dump(p.ModelList(data=[card])))


@v1.post("/completions")
async def completions(request: Request) -> Response:
    return await _serve(request, p.CompletionRequest)


@v1.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _serve(request, p.ChatCompletionRequest)


async def _serve(request: Request, kind: type[BaseModel]) -> Response:
    state = request.app.state
    config, metrics = state.config, state.metrics
    try:
        req = await _parse(request, kind)
        headers = ignored_header(sort_extra_fields(req.model_extra))
        if req.model is not None and req.model != config.served_model_name:
            raise APIError(
                f"the model {req.model!r} does not exist; this server serves "
                f"{config.served_model_name!r}",
                404,
                param="model",
                code="model_not_found",
            )
        inputs = await asyncio.to_thread(
            engine_inputs, req, state.tokenizer, state.rules, config.max_samples_per_request
        )
        if not state.engine_loop.alive:
            raise APIError("the engine is not running", 503, code="engine_unavailable")
        if state.pd is not None:  # a decode instance: the prefill instance computes prompts
            await state.pd.before_admit(inputs.prompts, req.cache_salt)
    except APIError as exc:
        metrics.count_request("rejected" if exc.status_code < 500 else "failed")
        raise
    chat = isinstance(req, p.ChatCompletionRequest)
    head = ResponseHeader(
        id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        created_s=int(time.time()),
        model=config.served_model_name,
        chat=chat,
        n=inputs.params.n,
        want_logprobs=inputs.params.logprobs is not None,
        tools=inputs.tools,
    )
    run = RequestRun(
        state.engine_loop, metrics, head.id, inputs.prompts, inputs.params, req.cache_salt
    )
    return await _respond(request, req, head, run, inputs.echo, headers)


async def _respond(
    request: Request,
    req,
    head: ResponseHeader,
    run: RequestRun,
    echo: Echo,
    headers: dict[str, str],
) -> Response:
    metrics, tokenizer = request.app.state.metrics, request.app.state.tokenizer
    try:
        if not req.stream:
            outputs = await run.wait_finished(request)
            if request.app.state.flush_store is not None:  # a prefill instance of a P/D pair
                await asyncio.to_thread(request.app.state.flush_store)
            metrics.count_request("finished")
            body = p.dump(full_response(head, tokenizer, outputs, echo))
            return JSONResponse(body, headers=headers)
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
    # vLLM's rule: usage on every chunk only together with the final usage chunk
    continuous = include_usage and bool(
        req.stream_options and req.stream_options.continuous_usage_stats
    )
    outcome = ["aborted"]  # what the stream reached; counted once it is closed

    def on_close() -> None:
        run.abort()  # a no-op unless the client left or the stream never started
        metrics.count_request(outcome[0])

    renderer = StreamRenderer(head, tokenizer, continuous_usage=continuous, echo=echo)
    events = _events(run, renderer, first, include_usage, outcome)
    return _EventStream(events, on_close, headers)


async def _events(
    run: RequestRun, renderer: StreamRenderer, first, include_usage: bool, outcome: list[str]
) -> AsyncIterator[str]:
    """Server-sent events until ``[DONE]``. Starlette cancels this generator when the client
    disconnects (``_EventStream`` then aborts the run, which frees its blocks)."""
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


class _EventStream(StreamingResponse):
    """An SSE response that calls ``on_close`` however it ends: finished, cancelled by a
    disconnect, or never started because the client left before the first byte."""

    def __init__(
        self, events: AsyncIterator[str], on_close: Callable[[], None], headers: dict[str, str]
    ) -> None:
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers}
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _parse(request: Request, kind: type[BaseModel]):
    """The validated request model (``read_body`` refuses an oversized body)."""
    body = await read_body(request)
    try:
        return kind.model_validate_json(body or b"")
    except ValidationError as exc:
        raise from_validation(exc) from None


def _sse(body: dict) -> str:
    """One event; ``allow_nan=False`` as Starlette's JSONResponse: JSON has no infinity (the
    protocol's ``Logprob`` writes log-probabilities finite)."""
    text = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return f"data: {text}\n\n"
