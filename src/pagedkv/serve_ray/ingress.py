"""``Ingress``: the HTTP entry of the Serve application. Every request goes to one engine
replica through a ``DeploymentHandle`` whose request router is ``PagedKVRequestRouter``, and
the replica's own ``pagedkv serve`` app answers it (``call.py``): the same routes, errors,
streaming and headers as one ``pagedkv serve``, plus ``x-pagedkv-replica``.

For a generation request the ingress computes the route key first, with ``pagedkv route``'s
own edge (``router/edge.py``: the same parsing, tokenizer and block hashes): a request it
cannot parse or tokenize carries no hashes (routed by load) and the replica answers it with
serve's own 4xx. ``GET /pagedkv/replicas`` shows this ingress's router: each replica's load,
index blocks and the decisions so far.

A replica that dies: before its answer began, the client gets a 503 ``replica_failed``; in
the middle of a stream, an error event and ``data: [DONE]`` (as ``pagedkv route``). Serve
replaces the replica; the other requests go on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagedkv.router.edge import Edge
from pagedkv.router.relay import DONE_EVENT
from pagedkv.serve_ray.call import AnswerHead, ReplicaCall
from pagedkv.serve_ray.ranking import LIVE_RANKERS
from pagedkv.server import protocol as p
from pagedkv.server.errors import APIError
from pagedkv.server.http_edge import read_body

log = logging.getLogger("pagedkv.serve_ray")

METRICS_TIMEOUT_S = 5.0
ROUTED = {"/v1/completions": p.CompletionRequest, "/v1/chat/completions": p.ChatCompletionRequest}


def _failed(exc: BaseException, replica: str | None = None) -> APIError:
    """The 503 of a request whose replica died: before its answer began (``replica``
    unknown), or mid-stream (then the body of the stream's last event)."""
    if replica is None:
        return APIError(
            f"the replica serving this request failed before it answered "
            f"({type(exc).__name__}); Serve is replacing it",
            503,
            code="replica_failed",
        )
    return APIError(
        f"the replica {replica} serving this request failed after part of the "
        f"answer was sent ({type(exc).__name__}); the answer is incomplete",
        503,
        code="replica_failed",
    )


class Ingress:
    """``engine``: the handle to the engine deployment; ``model``: the engines' model path
    (its tokenizer is loaded here, never its weights)."""

    async def __init__(self, engine: Any, model: str | None) -> None:
        from pagedkv.router.server import load_tokenizer

        self.engine = engine
        info = await engine.info.remote()
        tokenizer = await asyncio.to_thread(load_tokenizer, model)
        if info.get("tokenizer") not in (None, tokenizer.fingerprint()):
            raise RuntimeError(
                f"the ingress's tokenizer ({model or 'the embedded model'}) is "
                "not the engines': give the engines' --model"
            )
        self.edge = Edge(
            tokenizer,
            model=info["model"],
            block_size=info["block_size"],
            hash_algorithm=info["hash_algorithm"],
            max_model_len=info["max_model_len"],
        )
        self.num_unhashed = 0

    async def __call__(self, request: Request) -> Response:
        if request.method == "GET" and request.url.path == "/pagedkv/replicas":
            return JSONResponse(self.replicas())
        if request.method == "GET" and request.url.path == "/metrics":
            return await self._metrics(request)
        try:
            body = await read_body(request)
        except APIError as exc:
            return exc.response()
        call = ReplicaCall(
            request.method,
            request.url.path,
            request.url.query.encode(),
            tuple(request.headers.raw),
            body,
            await self._hashes(request, body),
        )
        return await self._forward(call)

    async def _hashes(self, request: Request, body: bytes) -> tuple[bytes, ...]:
        kind = ROUTED.get(request.url.path)
        if kind is None or request.method != "POST":
            return ()
        try:
            req = self.edge.parse(body, kind)
            key = await asyncio.to_thread(self.edge.route_key, req)
        except Exception:  # noqa: BLE001 - the replica answers it (serve's own 4xx)
            self.num_unhashed += 1
            return ()
        return tuple(key.block_hashes)

    async def _forward(self, call: ReplicaCall) -> Response:
        answer = self.engine.options(stream=True).call.remote(call)
        try:
            head = await answer.__anext__()
        except Exception as exc:  # noqa: BLE001 - the replica died (or its app failed)
            answer.cancel()
            log.warning("a replica failed before answering: %r", exc)
            return _failed(exc).response()
        if not isinstance(head, AnswerHead):
            answer.cancel()
            return APIError(
                "the replica answered without a head", 502, code="bad_replica"
            ).response()
        headers = dict(head.headers)
        replica = headers.get("x-pagedkv-replica", "?")
        sse = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(
            self._rest(answer, replica, sse), status_code=head.status, headers=headers
        )

    async def _rest(self, answer: Any, replica: str, sse: bool) -> AsyncIterator[bytes]:
        """The body's chunks; a replica dying mid-answer ends a stream with an error event
        (a plain body is cut: its length no longer matches). Cancels the call however it
        ends, so a client leaving aborts the request on the replica."""
        try:
            async for chunk in answer:
                yield chunk
        except Exception as exc:  # noqa: BLE001 - the replica died mid-answer
            log.warning("replica %s failed mid-answer: %r", replica, exc)
            if not sse:
                raise
            import json

            error = _failed(exc, replica).body()
            yield b"data: " + json.dumps(error).encode() + b"\n\n" + DONE_EVENT
        finally:
            answer.cancel()

    async def _metrics(self, request: Request) -> Response:
        """Every replica's ``/metrics``, each sample labelled with its replica (with Serve's
        own router, which knows no pinned call: one replica's, unlabelled)."""
        from pagedkv.serve_ray.metrics_merge import merge_metrics
        from pagedkv.server.http_edge import CONTENT_TYPE

        names = sorted({n for r in list(LIVE_RANKERS) for n in r.replicas})
        headers = tuple(request.headers.raw)
        if not names:  # Serve's own router (power-of-two): one replica's page, as it is
            return await self._forward(ReplicaCall("GET", "/metrics", b"", headers, b""))
        pages = {}
        for name in names:  # one at a time: Serve gives this request's calls one request id
            page = await self._page(name, headers)
            if page is not None:
                pages[name] = page
        body = merge_metrics(pages)
        return Response(body, media_type=CONTENT_TYPE)

    async def _page(self, replica: str, headers: tuple) -> str | None:
        call = ReplicaCall("GET", "/metrics", b"", headers, b"", replica=replica)
        try:
            answer = self.engine.options(stream=True).call.remote(call)
            chunks = await asyncio.wait_for(_collect(answer), METRICS_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a replica gone or slow: left out of this scrape
            return None
        return b"".join(chunks).decode(errors="replace")

    def replicas(self) -> dict[str, Any]:
        return {
            "routers": [r.describe() for r in list(LIVE_RANKERS)],
            "unhashed_requests": self.num_unhashed,
        }


async def _collect(answer: Any) -> list[bytes]:
    """The body of a replica's answer (its head dropped); cancels the call if interrupted."""
    try:
        return [c async for c in answer if not isinstance(c, AnswerHead)]
    finally:
        answer.cancel()
