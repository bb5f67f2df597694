"""Relaying an opened stream (``router/forward.py`` opened it) to the client, whole events only,
ending a stream its replica broke with an error event and ``data: [DONE]`` (docs/routing.md).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from pagedkv.router.bounded import EventTooLarge
from pagedkv.router.forward import AnswerTooLarge, Opened, ReplicaFailed
from pagedkv.server.errors import APIError

DONE_EVENT = b"data: [DONE]\n\n"
_ERROR_EVENT_START = b'data: {"error"'


class StreamRelay:
    """Relays an opened stream to the client, whole events only. ``outcome`` is what it
    reached (``aborted`` until it ends); ``cut`` says why a replica's stream broke (the caller
    takes the replica out), ``too_large`` why its answer was refused (it stays in). However
    the generator ends -- finished, cut, refused, closed or cancelled because the client
    left -- the replica's response is closed before it returns: nothing more is read."""

    def __init__(self, opened: Opened, request_timeout_s: float) -> None:
        self.opened, self.request_timeout_s = opened, request_timeout_s
        self.outcome = "aborted"
        self.cut: str | None = None
        self.too_large: str | None = None

    async def events(self) -> AsyncIterator[bytes]:
        o = self.opened
        assert o.chunks is not None and o.splitter is not None
        failed = False
        try:
            pending, done = list(o.first), False
            while not done:
                for event in pending:
                    failed = failed or event.startswith(_ERROR_EVENT_START)
                    yield event
                    if done := event == DONE_EVENT:
                        break  # nothing after it is relayed
                else:
                    try:
                        pending = o.splitter.feed(await anext(o.chunks))
                    except StopAsyncIteration:
                        raise ReplicaFailed("closed the stream before data: [DONE]") from None
        except EventTooLarge as exc:
            self.too_large = str(exc)
        except httpx.TimeoutException:
            self.cut = f"no event within {self.request_timeout_s:g} s (--request-timeout)"
        except (httpx.HTTPError, ReplicaFailed) as exc:
            self.cut = f"{type(exc).__name__}: {exc}"
        finally:  # also when the client left: the generator is closed or cancelled here
            await o.response.aclose()
        if self.cut is None and self.too_large is None:
            self.outcome = "failed" if failed else "finished"
            return
        self.outcome = "failed"
        if self.cut is not None:
            error = APIError(
                f"the replica {o.replica.url} serving this stream failed after "
                f"part of the answer was sent ({self.cut}); the answer is "
                "incomplete",
                503,
                code="replica_failed",
            )
        else:
            error = APIError(
                f"the replica {o.replica.url} sent {self.too_large}, more than "
                "the router relays; the answer is incomplete",
                502,
                code=AnswerTooLarge.CODE,
            )
        yield b"data: " + _json(error.body()) + b"\n\n" + DONE_EVENT


def _json(body: dict) -> bytes:
    import json

    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
