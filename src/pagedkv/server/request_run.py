"""``RequestRun``: the engine requests of one HTTP request, seen from the asyncio side.

A completions request may carry a batch of prompts: each becomes its own engine request, and
the engine loop admits them fairly beside other HTTP requests' prompts. Their outputs arrive from the engine thread through
``loop.call_soon_threadsafe``. Each output is a complete snapshot (text, tokens and logprobs so
far), so only the newest one per prompt is kept: a slow client costs one pending snapshot per
prompt, not one per step, and gets larger deltas instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

from starlette.requests import Request

from pagedkv.engine import RequestOutput, SamplingParams
from pagedkv.server.engine_loop import Delivery, EngineLoop, Failure, Submission
from pagedkv.server.errors import APIError
from pagedkv.server.metrics import ServerMetrics

# How often a request that waits for the engine checks whether its client is still there.
DISCONNECT_POLL_S = 0.25


class ClientGone(Exception):
    """The client closed its connection; the run has been aborted."""


class RequestRun:
    """Submits one engine request per prompt, as one group, on construction (call it on the
    event loop).

    ``next`` yields ``(prompt_index, output)`` until ``finished``; the caller must call
    ``abort`` (idempotent) if it stops early, so that the engine frees the blocks.
    """

    def __init__(
        self,
        engine_loop: EngineLoop,
        metrics: ServerMetrics,
        request_id: str,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        cache_salt: str | None,
    ) -> None:
        self._engine_loop = engine_loop
        self._metrics = metrics
        self._loop = asyncio.get_running_loop()
        self._pending: dict[int, Delivery] = {}  # prompt index -> newest undelivered item
        self._ready = asyncio.Event()
        self.arrival_s = time.monotonic()
        self._next_check_s = self.arrival_s + DISCONNECT_POLL_S
        self.request_ids = (
            [request_id]
            if len(prompts) == 1
            else [f"{request_id}-{i}" for i in range(len(prompts))]
        )
        self.latest: list[RequestOutput | None] = [None] * len(prompts)
        self._first_token_seen = [False] * len(prompts)
        self._open = set(range(len(prompts)))
        engine_loop.submit_group(
            [
                Submission(self.request_ids[i], prompt, params, cache_salt, self._deliverer(i))
                for i, prompt in enumerate(prompts)
            ]
        )

    def _deliverer(self, index: int):
        loop, push = self._loop, self._push

        def deliver(item: Delivery) -> None:  # runs on the engine thread
            # A closed event loop (server shut down) raises: nobody is listening then.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(push, index, item)

        return deliver

    def _push(self, index: int, item: Delivery) -> None:  # on the event loop
        # A newer snapshot supersedes an older one; nothing follows a final item.
        self._pending[index] = item
        self._ready.set()

    async def _take(self) -> tuple[int, Delivery]:
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()
        index = next(iter(self._pending))  # oldest first: insertion order
        return index, self._pending.pop(index)

    @property
    def finished(self) -> bool:
        return not self._open

    async def next(self, request: Request | None) -> tuple[int, RequestOutput]:
        """The next output. Raises ``APIError`` for a failure or a refusal (the rest of the
        run is aborted then), ``ClientGone`` when ``request``'s client disconnected."""
        while True:
            # Checked on a clock, not only when idle: a busy engine delivers more often than
            # the poll period, and a gone client must still be noticed.
            if request is not None and time.monotonic() >= self._next_check_s:
                self._next_check_s = time.monotonic() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    self.abort()
                    raise ClientGone()
            try:
                index, item = await asyncio.wait_for(self._take(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue
            if isinstance(item, Failure):  # this request only: the others of the run end too
                self._open.discard(index)
                self.abort()
                raise APIError(item.message, item.status_code, param=item.param, code=item.code)
            self.latest[index] = item
            if not self._first_token_seen[index] and any(c.token_ids for c in item.outputs):
                self._first_token_seen[index] = True
                self._metrics.observe_ttft(time.monotonic() - self.arrival_s)
            if item.finished:
                self._open.discard(index)
            return index, item

    async def wait_finished(self, request: Request | None) -> list[RequestOutput]:
        """Every prompt's final output, in prompt order."""
        while not self.finished:
            await self.next(request)
        return [out for out in self.latest if out is not None]

    def abort(self) -> None:
        """Abort every engine request of this run that has not finished (frees its blocks)."""
        for index in sorted(self._open):
            self._engine_loop.abort(self.request_ids[index])
        self._open.clear()
