"""Forwarding one request: choose a replica, send the body unchanged, retry on another replica
if it fails before answering; ``router/relay.py`` then relays a stream event by event.

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
* an answer over the router's caps (``RouterConfig.max_answer_bytes`` for a body,
  ``max_event_bytes`` for one event; ``router/bounded.py``): before anything was sent, a 502
  ``replica_answer_too_large``; in a stream, the error event above with that code. The replica
  connection is closed; the replica is not taken out (it answered; the answer was too big).
* a replica whose circuit breaker is open (``RouterConfig.breaker_failures`` consecutive
  failures or timeouts before answering; ``breaker.py``) is skipped as if tried, until its
  back-off has passed and one probe request answers; a 504 therefore costs at most that many
  requests their full ``--request-timeout`` before the router stops sending there.
* the client leaving: the replica's response is closed at once (``StreamRelay.events`` in
  ``router/relay.py`` when its generator is closed or cancelled; ``app._route`` while the
  answer is awaited), so the replica sees its client gone and aborts the request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx

from pagedkv.router.bounded import EventTooLarge, SSESplitter, read_at_most, read_head
from pagedkv.router.config import DEFAULT_MAX_ANSWER_BYTES, DEFAULT_MAX_EVENT_BYTES
from pagedkv.router.edge import RouteKey
from pagedkv.router.metrics import RouterMetrics
from pagedkv.router.replicas import Chooser, ReplicaState
from pagedkv.routing import RouteDecision
from pagedkv.server.errors import APIError

# Response headers passed through from the replica (the rest are the router's own).
_PASSED_HEADERS = ("content-type", "cache-control")
# How much of a replica's 503 body its failure message quotes (the rest is not read).
_QUOTED_BYTES = 200


class ReplicaFailed(Exception):
    """The replica failed before answering: the request may go to another one."""


class ReplicaTimeout(APIError):
    def __init__(self, replica: str, timeout_s: float) -> None:
        super().__init__(
            f"replica {replica} did not answer within {timeout_s:g} s (--request-timeout)",
            504,
            code="replica_timeout",
        )
        self.replica = replica


class AnswerTooLarge(APIError):
    """A replica's answer over a cap of the router, refused before anything reached the
    client: a 502 naming the cap."""

    CODE = "replica_answer_too_large"

    def __init__(self, replica: str, what: str) -> None:
        super().__init__(
            f"the replica {replica} sent {what}, more than the router relays; "
            "the answer is dropped",
            502,
            code=self.CODE,
        )
        self.replica = replica


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

    def __init__(
        self,
        chooser: Chooser,
        metrics: RouterMetrics,
        client: httpx.AsyncClient,
        take_out: Callable[[ReplicaState, str], None],
        *,
        api_key: str | None,
        request_timeout_s: float,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
    ) -> None:
        self.chooser, self.metrics, self.client, self.take_out = chooser, metrics, client, take_out
        self.request_timeout_s = request_timeout_s
        self.max_event_bytes, self.max_answer_bytes = max_event_bytes, max_answer_bytes
        # identity: the caps count the bytes that arrive (no decompression bomb behind them),
        # and a stream's raw bytes are its events.
        self._headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
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
                    raise APIError(
                        "every replica tried failed before answering: " + "; ".join(failures),
                        503,
                        code="no_replica",
                    )
                raise APIError(
                    "no healthy replica: every replica is down or refused (see the "
                    "router's /metrics)",
                    503,
                    code="no_replica",
                )
            replica, decision = pick
            if not replica.breaker.allow():  # open: skipped, like a replica that failed
                tried.add(replica.url)
                failures.append(
                    f"{replica.url} (circuit open: failed "
                    f"{replica.breaker.failure_threshold} times in a row)"
                )
                continue
            if failed_url is not None:
                self.metrics.count_retry(failed_url)
            self.metrics.count_decision(decision, len(key.block_hashes))
            tried.add(replica.url)
            replica.in_flight += 1
            try:
                opened = await self._send(replica, decision, path, body, key.stream)
            except ReplicaFailed as exc:
                replica.in_flight -= 1
                replica.breaker.record_failure()
                self.take_out(replica, str(exc))
                failures.append(f"{replica.url} ({exc})")
                failed_url = replica.url
                continue
            except ReplicaTimeout:
                replica.in_flight -= 1
                replica.breaker.record_failure()
                raise
            except AnswerTooLarge:  # it answered: healthy, the answer was too big
                replica.in_flight -= 1
                replica.breaker.record_success()
                raise
            except BaseException:  # cancelled (the client left): no verdict on the replica
                replica.in_flight -= 1
                replica.breaker.release()
                raise
            replica.breaker.record_success()
            return opened

    async def _send(
        self, replica: ReplicaState, decision: RouteDecision, path: str, body: bytes, stream: bool
    ) -> Opened:
        request = self.client.build_request(
            "POST", replica.url + path, content=body, headers=self._headers
        )
        resp: httpx.Response | None = None
        try:
            resp = await self.client.send(request, stream=True)
            if resp.status_code == 503:  # the replica's engine is gone (or shutting down)
                text = (await read_head(resp, _QUOTED_BYTES)).decode(errors="replace")
                raise ReplicaFailed(f"answered 503: {text}")
            opened = Opened(replica, decision, resp)
            if not (stream and resp.status_code == 200):
                answer = await read_at_most(resp, self.max_answer_bytes)
                if answer is None:
                    raise AnswerTooLarge(
                        replica.url, f"an answer of more than {self.max_answer_bytes} bytes"
                    )
                opened.body = answer
                await resp.aclose()
                return opened
            opened.chunks = resp.aiter_raw()
            opened.splitter = SSESplitter(self.max_event_bytes)
            while not opened.first:
                opened.first = opened.splitter.feed(await anext(opened.chunks))
            return opened
        except EventTooLarge as exc:
            await _close(resp)
            raise AnswerTooLarge(replica.url, str(exc)) from None
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
