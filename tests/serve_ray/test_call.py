"""``run_asgi``: a ``ReplicaCall`` played against an ASGI app, as an engine replica plays it
against its ``pagedkv serve`` app: the head, the chunks as sent, and a caller that stops
reading turns into the app's client disconnecting."""

from __future__ import annotations

import asyncio

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from pagedkv.serve_ray.call import AnswerHead, ReplicaCall, call_block_hashes, call_pin, run_asgi


def _app(state: dict) -> Starlette:
    async def echo(request: Request) -> JSONResponse:
        body = await request.json()
        return JSONResponse(
            {"got": body, "q": request.url.query, "auth": request.headers.get("authorization")},
            status_code=201,
        )

    async def stream(request: Request) -> StreamingResponse:
        async def events():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n".encode()
                    await asyncio.sleep(0.01)
            finally:
                state["closed"] = True  # the app saw its client leave (or finished)

        return StreamingResponse(events(), media_type="text/event-stream")

    async def boom(request: Request):
        raise RuntimeError("the app failed")

    return Starlette(
        routes=[
            Route("/echo", echo, methods=["POST"]),
            Route("/stream", stream),
            Route("/boom", boom),
        ]
    )


def _call(path: str, body: bytes = b"", method: str = "GET", query: bytes = b"") -> ReplicaCall:
    return ReplicaCall(method, path, query, ((b"authorization", b"Bearer k"),), body)


async def _all(app, call) -> list:
    return [item async for item in run_asgi(app, call)]


def test_a_plain_answer_is_its_head_then_its_body():
    items = asyncio.run(_all(_app({}), _call("/echo", b'{"a": 1}', "POST", b"x=1")))
    head, body = items[0], b"".join(items[1:])
    assert isinstance(head, AnswerHead) and head.status == 201
    assert dict(head.headers)["content-type"] == "application/json"
    assert body == b'{"got":{"a":1},"q":"x=1","auth":"Bearer k"}'


def test_a_stream_arrives_event_by_event_and_closing_it_disconnects_the_client():
    state: dict = {}

    async def first_three():
        gen = run_asgi(_app(state), _call("/stream"))
        got = [await gen.__anext__() for _ in range(4)]
        await gen.aclose()  # the caller leaves mid-stream
        await asyncio.sleep(0.1)
        return got

    got = asyncio.run(first_three())
    assert got[1:] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    assert state["closed"]  # the app's generator ended: it noticed the disconnect


def test_an_app_failing_before_its_head_raises_to_the_caller():
    # Starlette's ServerErrorMiddleware answers 500 and re-raises: the caller sees the 500
    # head first, then the error.
    with pytest.raises(RuntimeError, match="the app failed"):
        asyncio.run(_all(_app({}), _call("/boom")))


def test_route_hints_are_read_defensively():
    good = ReplicaCall("POST", "/v1/completions", b"", (), b"", (b"\x01" * 32,), "r1")
    assert call_block_hashes([good]) == (b"\x01" * 32,) and call_pin([good]) == "r1"
    assert call_block_hashes(None) == () and call_pin([]) is None
    assert call_block_hashes(["not a call"]) == ()

    class Odd:
        block_hashes = [b"x"]  # a list, not a tuple
        replica = 7

    assert call_block_hashes([Odd()]) == () and call_pin([Odd()]) is None
    Odd.block_hashes = (b"x", "y")
    assert call_block_hashes([Odd()]) == ()
