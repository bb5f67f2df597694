"""Forwarding one request: choose a replica, send the body unchanged, retry on another replica
if it fails before answering, and relay a stream event by event.

Failure rules (docs/routing.md):

* connection refused or reset, or the replica closing the connection (or answering 503)
  before the first byte of its answer -- for a stream, before its first complete event: the
  replica is taken out and the request goes to another replica not yet tried (a retry,
  counted); when none is left the client gets a 503 naming each replica's failure. Nothing was
  sent to the client, so nothing is answered twice.
* no answer within ``--request-timeout`` (between two reads of a stream): a 504, or in a
  stream an error event; not retried (the replica may still be working on it).
* a stream whose replica dies after events went out: an OpenAI-style error event
  (``code: "replica_failed"``) and ``data: [DONE]`` end the stream, so a client never mistakes
  a cut for a finished answer. Only whole events are relayed: a half-received one is dropped.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx

from pagedkv.router.edge import RouteKey
from pagedkv.router.metrics import RouterMetrics
from pagedkv.router.replicas import Chooser, ReplicaState
from pagedkv.routing import RouteDecision
from pagedkv.server.errors import APIError

DONE_EVENT = b"data: [DONE]\n\n"
_ERROR_EVENT_START = b'data: {"error"'
# Response headers passed through from the replica (the rest are the router's own).
_PASSED_HEADERS = ("content-type", "cache-control")


class ReplicaFailed(Exception):
    """The replica failed before answering: the request may go to another one."""


class ReplicaTimeout(APIError):
    def __init__(self, replica: str, timeout_s: float) -> None:
        super().__init__(f"replica {replica} did not answer within {timeout_s:g} s "
                         "(--request-timeout)", 504, code="replica_timeout")  # fmt: skip
        self.replica = replica


class SSESplitter:
    """Bytes in, whole server-sent events out (each ends with a blank line)."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        data = self._pending + chunk
        *events, self._pending = data.split(b"\n\n")
        return [e + b"\n\n" for e in events]


@dataclass
class Opened:
    """A replica's answer, open: ``body`` for a plain answer; for a stream, ``first`` holds
    its first whole events and ``chunks``/``splitter`` continue it."""

    replica: ReplicaState
    decision: RouteDecision
    response: httpx.Response
    body: bytes = b""
    first: list[bytes] = field(default_factory=list)
    chunks: AsyncIterator[bytes] | None = None
    splitter: SSESplitter | None = None

    def headers(self) -> dict[str, str]:
        out = {k: v for k, v in self.response.headers.items() if k.lower() in _PASSED_HEADERS}
        out["x-pagedkv-replica"] = self.replica.url
        return out


class Forwarder:
    """``open`` sends a request to the chosen replica, retrying as above. ``take_out`` marks a
    replica down (the health loop brings it back). The caller must ``close`` what ``open``
    returns (it releases the connection and the replica's in-flight count)."""

    def __init__(self, chooser: Chooser, metrics: RouterMetrics, client: httpx.AsyncClient,
                 take_out: Callable[[ReplicaState, str], None], *, api_key: str | None,
                 request_timeout_s: float) -> None:  # fmt: skip
        self.chooser, self.metrics, self.client, self.take_out = chooser, metrics, client, take_out
        self.request_timeout_s = request_timeout_s
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    async def open(self, path: str, body: bytes, key: RouteKey) -> Opened:
        tried: set[str] = set()
        failures: list[str] = []  # "URL (why)" of each replica that failed, in order
        failed_url: str | None = None
        while True:
            pick = self.chooser.choose(key.block_hashes, tried)
            if pick is None:
                if failures:
                    raise APIError("every replica tried failed before answering: "
                                   + "; ".join(failures), 503, code="no_replica")  # fmt: skip
                raise APIError("no healthy replica: every replica is down or refused (see the "
                               "router's /metrics)", 503, code="no_replica")  # fmt: skip
            replica, decision = pick
            if failed_url is not None:
                self.metrics.count_retry(failed_url)
            self.metrics.count_decision(decision, len(key.block_hashes))
            tried.add(replica.url)
            replica.in_flight += 1
            try:
                return await self._send(replica, decision, path, body, key.stream)
            except ReplicaFailed as exc:
                replica.in_flight -= 1
                self.take_out(replica, str(exc))
                failures.append(f"{replica.url} ({exc})")
                failed_url = replica.url
            except BaseException:
                replica.in_flight -= 1
                raise

    async def _send(self, replica: ReplicaState, decision: RouteDecision, path: str,
                    body: bytes, stream: bool) -> Opened:  # fmt: skip
        request = self.client.build_request("POST", replica.url + path, content=body,
                                            headers=self._headers)  # fmt: skip
        resp: httpx.Response | None = None
        try:
            resp = await self.client.send(request, stream=True)
            if resp.status_code == 503:  # the replica's engine is gone (or shutting down)
                text = (await resp.aread()).decode(errors="replace")[:200]
                raise ReplicaFailed(f"answered 503: {text}")
            opened = Opened(replica, decision, resp)
            if not (stream and resp.status_code == 200):
                opened.body = await resp.aread()
                await resp.aclose()
                return opened
            opened.chunks, opened.splitter = resp.aiter_raw(), SSESplitter()
            while not opened.first:
                opened.first = opened.splitter.feed(await anext(opened.chunks))
            return opened
        except StopAsyncIteration:
            await _close(resp)
            raise ReplicaFailed("closed the stream before its first event") from None
        except (httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            await _close(resp)
            raise ReplicaFailed(f"{type(exc).__name__}") from None
        except httpx.TimeoutException:
            await _close(resp)
            raise ReplicaTimeout(replica.url, self.request_timeout_s) from None
        except httpx.HTTPError as exc:  # refused, reset, closed before the answer
            await _close(resp)
            raise ReplicaFailed(f"{type(exc).__name__}: {exc}") from None
        except ReplicaFailed:
            await _close(resp)
            raise
        except BaseException:
            await _close(resp)
            raise


async def _close(resp: httpx.Response | None) -> None:
    if resp is not None:
        await resp.aclose()


class StreamRelay:
    """Relays an opened stream to the client, whole events only. ``outcome`` is what it
    reached (``aborted`` until it ends); ``cut`` says why a replica's stream broke."""

    def __init__(self, opened: Opened, request_timeout_s: float) -> None:
        self.opened, self.request_timeout_s = opened, request_timeout_s
        self.outcome = "aborted"
        self.cut: str | None = None

    async def events(self) -> AsyncIterator[bytes]:
        o = self.opened
        assert o.chunks is not None and o.splitter is not None
        done = failed = False
        try:
            pending = list(o.first)
            while True:
                for event in pending:
                    done = done or event == DONE_EVENT
                    failed = failed or event.startswith(_ERROR_EVENT_START)
                    yield event
                if done:
                    break
                try:
                    pending = o.splitter.feed(await anext(o.chunks))
                except StopAsyncIteration:
                    raise ReplicaFailed("closed the stream before data: [DONE]") from None
        except httpx.TimeoutException:
            self.cut = f"no event within {self.request_timeout_s:g} s (--request-timeout)"
        except (httpx.HTTPError, ReplicaFailed) as exc:
            self.cut = f"{type(exc).__name__}: {exc}"
        if self.cut is not None:
            self.outcome = "failed"
            message = (f"the replica {o.replica.url} serving this stream failed after part of "
                       f"the answer was sent ({self.cut}); the answer is incomplete")  # fmt: skip
            error = APIError(message, 503, code="replica_failed")
            yield b"data: " + _json(error.body()) + b"\n\n" + DONE_EVENT
            return
        self.outcome = "failed" if failed else "finished"


def _json(body: dict) -> bytes:
    import json

    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
