"""The decode side's prefill client behind its circuit breaker: a sick prefill instance turns
into local prefill (counted by reason), never an exception; while the breaker is open the
instance is not asked at all. Fake transports and a fake clock: nothing waits."""

from __future__ import annotations

import asyncio
import builtins

import httpx
import pytest

from pagedkv.breaker import CLOSED, OPEN, CircuitBreaker
from pagedkv.disagg import PDConfig
from pagedkv.disagg.prefill_client import PrefillClient, prefill_client
from pagedkv.server.pd_front import PDFront
from tests.kvstore.redis_server import free_port

PROMPTS = [[1, 2, 3, 4]]


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class Peer:
    """A fake prefill instance: ``outcome`` is what the next call meets ("ok", "timeout",
    "refused", "500", "group": an ExceptionGroup as httpx raised for port 99999, "hang")."""

    def __init__(self) -> None:
        self.outcome = "ok"
        self.num_calls = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.num_calls += 1
        if self.outcome == "timeout":
            raise httpx.ReadTimeout("timed out", request=request)
        if self.outcome == "refused":
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if self.outcome == "group":  # anyio's connect to port 99999 (Python >= 3.11)
            group = getattr(builtins, "ExceptionGroup", None)
            if group is None:
                raise RuntimeError("unhandled errors in a TaskGroup")
            raise group("unhandled errors in a TaskGroup", [OverflowError("port")])
        if self.outcome == "hang":
            await asyncio.Event().wait()
        return httpx.Response(500 if self.outcome == "500" else 200, json={})


def client(peer: Peer, failures: int = 2, backoff_s: float = 10.0):
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=failures, backoff_s=backoff_s,
                             max_backoff_s=8 * backoff_s, clock=clock)  # fmt: skip
    c = PrefillClient("http://prefill", 120.0, breaker=breaker,
                      transport=httpx.MockTransport(peer))  # fmt: skip
    return c, clock


def run(c: PrefillClient, times: int = 1) -> list[bool]:
    async def go():
        return [await c.prefill(PROMPTS, None) for _ in range(times)]

    return asyncio.run(go())


def test_timeouts_open_the_breaker_and_later_requests_do_not_ask():
    peer = Peer()
    c, clock = client(peer)
    peer.outcome = "timeout"
    assert run(c, 2) == [False, False]  # N = 2 requests waited for the timeout ...
    assert c.breaker.state == OPEN and peer.num_calls == 2
    assert run(c, 5) == [False] * 5  # ... and no other: the instance is not asked
    assert peer.num_calls == 2
    assert c.local_prefills == {"timeout": 2, "breaker_open": 5, "unreachable": 0, "error": 0}
    assert (c.num_requests, c.num_failures) == (2, 2)
    # The back-off passes and the instance answers again: one probe closes the breaker.
    peer.outcome = "ok"
    clock.now_s += 10.0
    assert run(c, 3) == [True, True, True]
    assert c.breaker.state == CLOSED and peer.num_calls == 5 and c.prompt_tokens == 12


def test_a_failed_probe_reopens_for_twice_as_long():
    peer = Peer()
    c, clock = client(peer)
    peer.outcome = "refused"
    run(c, 2)
    clock.now_s += 10.0
    assert run(c, 1) == [False] and peer.num_calls == 3  # the probe, refused
    assert c.breaker.retry_in_s() == 20.0
    clock.now_s += 19.0
    run(c, 4)
    assert peer.num_calls == 3 and c.local_prefills["breaker_open"] == 4
    assert c.local_prefills["unreachable"] == 3


@pytest.mark.parametrize(("outcome", "reason"),
                         [("500", "error"), ("group", "error"), ("refused", "unreachable")])  # fmt: skip
def test_every_failure_is_a_local_prefill_never_an_exception(outcome, reason):
    """``group``: the ExceptionGroup that ``--prefill-url http://127.0.0.1:99999`` made of every
    request (a 500 ``internal error: ExceptionGroup``)."""
    peer = Peer()
    peer.outcome = outcome
    c, _ = client(peer, failures=5)
    front = PDFront(c)

    async def go():
        await front.before_admit(PROMPTS, None)

    asyncio.run(go())  # does not raise
    assert c.local_prefills[reason] == 1 and c.num_failures == 1


def test_a_refused_connection_fails_fast_and_counts():
    """A real loopback port nobody listens on: the call comes back refused at once (the
    generous deadline is far below the 600 s timeout), counted as unreachable."""
    c = PrefillClient(f"http://127.0.0.1:{free_port()}", 600.0,
                      breaker=CircuitBreaker(failure_threshold=1, clock=Clock()))  # fmt: skip

    async def go():
        try:
            return await asyncio.wait_for(c.prefill(PROMPTS, None), 60.0)
        finally:
            await c.aclose()

    assert asyncio.run(go()) is False
    assert c.local_prefills["unreachable"] == 1 and c.breaker.state == OPEN


def test_a_cancelled_probe_frees_the_breaker_for_the_next_request():
    peer = Peer()
    c, clock = client(peer)
    peer.outcome = "timeout"
    run(c, 2)
    clock.now_s += 10.0
    peer.outcome = "hang"

    async def go():
        task = asyncio.create_task(c.prefill(PROMPTS, None))
        while peer.num_calls < 3:  # the probe is in flight
            await asyncio.sleep(0)
        assert not await c.prefill(PROMPTS, None)  # short-circuited meanwhile
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        peer.outcome = "ok"
        return await c.prefill(PROMPTS, None)  # probes at once

    assert asyncio.run(go()) is True
    assert c.breaker.state == CLOSED and c.local_prefills["breaker_open"] == 1


def test_the_metrics_name_each_reason_and_the_breaker():
    peer = Peer()
    peer.outcome = "timeout"
    c, _ = client(peer, failures=1)
    run(c, 3)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for m in PDFront(c).collector().collect() for s in m.samples}  # fmt: skip
    assert samples[("pagedkv_pd_local_prefills_total", (("reason", "timeout"),))] == 1
    assert samples[("pagedkv_pd_local_prefills_total", (("reason", "breaker_open"),))] == 2
    assert samples[("pagedkv_pd_prefill_breaker_state", (("state", "open"),))] == 1
    assert samples[("pagedkv_pd_prefill_breaker_state", (("state", "closed"),))] == 0
    assert samples[("pagedkv_pd_prefill_breaker_opens_total", ())] == 1
    assert samples[("pagedkv_pd_prefill_breaker_short_circuits_total", ())] == 2


def test_the_config_builds_the_breaker():
    cfg = PDConfig(role="decode", kv_store="redis://h:1", prefill_url="http://h:2/v1/",
                   breaker_failures=4, breaker_backoff_s=0.5)  # fmt: skip
    c = prefill_client(cfg, None)
    assert cfg.prefill_url == "http://h:2"
    assert (c.breaker.failure_threshold, c.breaker.base_backoff_s) == (4, 0.5)
    assert c.breaker.max_backoff_s == 60.0
