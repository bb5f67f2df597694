"""``ReplicaCall``: one HTTP request as the ingress hands it to an engine replica through
Serve, and ``run_asgi``, which plays it against the replica's own ``pagedkv serve`` app.

The replica answers with its own app (``server.create_app``), so the routes, the validation,
the error bodies, the streaming and the ``x-pagedkv-*`` headers are ``pagedkv serve``'s, not a
copy of them. ``run_asgi`` yields an ``AnswerHead`` (status and headers) first, then the body's
chunks as the app sends them (one per server-sent event of a stream). Closing the generator
early (the client left, Serve cancelled the call) tells the app its client disconnected, so it
aborts the engine request and frees its blocks, as it does behind uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.kvcache.hashing import BlockHash

REPLICA_HEADER = "x-pagedkv-replica"  # names the replica that answered (as `pagedkv route`)
_MAX_ROUTE_HASHES = 1 << 16


@dataclass(frozen=True)
class ReplicaCall:
    """``block_hashes``: the prompt's full blocks' chained hashes for the request router
    (empty: route by load). ``replica``: this replica and no other (the ingress asking each
    replica for its ``/metrics``). ``headers``: lower-case names, as ASGI wants them."""

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    block_hashes: tuple[BlockHash, ...] = ()
    replica: str | None = None


def call_pin(args: Sequence[Any] | None) -> str | None:
    """The replica a routed call must go to, or None."""
    pin = getattr(args[0], "replica", None) if args else None
    return pin if isinstance(pin, str) else None


def call_block_hashes(args: Sequence[Any] | None) -> tuple[BlockHash, ...]:
    """The hashes of a routed call's first argument when it is a ``ReplicaCall`` carrying
    well-formed ones; ``()`` for anything else (the router then routes by load)."""
    call = args[0] if args else None
    hashes = getattr(call, "block_hashes", ())
    if not isinstance(hashes, tuple) or len(hashes) > _MAX_ROUTE_HASHES:
        return ()
    return hashes if all(isinstance(h, bytes) for h in hashes) else ()


@dataclass(frozen=True)
class AnswerHead:
    status: int
    headers: tuple[tuple[str, str], ...]


_END = object()


async def run_asgi(app: Any, call: ReplicaCall) -> AsyncIterator[AnswerHead | bytes]:
    """The app's answer to ``call``: one ``AnswerHead``, then body chunks. An app that
    fails before its head raises here (the caller's error answer)."""
    messages: asyncio.Queue[Any] = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()  # Starlette listens for the client leaving while it streams
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await messages.put(message)

    task = asyncio.ensure_future(app(_scope(call), receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(_END))
    try:
        while (msg := await messages.get()) is not _END:
            if msg["type"] == "http.response.start":
                yield AnswerHead(
                    msg["status"],
                    tuple(
                        (k.decode("latin-1"), v.decode("latin-1"))
                        for k, v in msg.get("headers", ())
                    ),
                )
            elif msg["type"] == "http.response.body":
                if msg.get("body"):
                    yield bytes(msg["body"])
                if not msg.get("more_body", False):
                    break
        if task.done() and not task.cancelled() and (exc := task.exception()) is not None:
            raise exc
    finally:
        gone.set()  # the app sees its client leave (a no-op once it answered in full)
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
            await asyncio.wait_for(asyncio.shield(task), timeout=5.0)
        if not task.done():
            task.cancel()


def _scope(call: ReplicaCall) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": call.method,
        "scheme": "http",
        "path": call.path,
        "raw_path": call.path.encode(),
        "root_path": "",
        "query_string": call.query,
        "headers": list(call.headers),
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
        "state": {},
    }
