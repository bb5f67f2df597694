"""The health loop against a replica that answers nonsense (issue 27's first finding): NaN or
1e400 in ``/metrics``, ``"block_size": 1e400`` or JSON nested 100k deep in ``/pagedkv/info``.
Each such answer takes the replica out with a reason, never raises out of ``check``, and the
loop goes on, so the replica comes back as soon as it answers sanely again."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pagedkv.router.health import HealthMonitor, scraped_requests
from pagedkv.router.metrics import RouterMetrics
from pagedkv.router.replicas import IndexFeed, ReplicaState
from tests.router.fakes import FakeReader, info_json

URL = "http://replica:1"
GOOD_INFO = json.dumps(info_json("one"))
BAD_INFOS = {
    "huge int": GOOD_INFO.replace('"block_size": 16', '"block_size": 1e400'),
    "deep nesting": "[" * 100_000 + "]" * 100_000,
    "not an object": "[1, 2]",
    "wrong kind": GOOD_INFO.replace('"page_format": {', '"page_format": 7, "x": {'),
}


class Hostile:
    def __init__(self) -> None:
        self.info, self.metrics = GOOD_INFO, "pagedkv_requests_in_flight 2.0\n"

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/pagedkv/info":
            return httpx.Response(200, text=self.info, headers={"content-type": "application/json"})
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        return httpx.Response(200, text=self.metrics)


def monitor(peer: Hostile) -> tuple[HealthMonitor, ReplicaState]:
    from pagedkv.router.handshake import ReplicaInfo

    info = ReplicaInfo.from_json(URL, info_json("one"))
    replica = ReplicaState(URL, info)
    feed = IndexFeed(FakeReader)
    client = httpx.AsyncClient(transport=httpx.MockTransport(peer.handle))
    mon = HealthMonitor([replica], feed, RouterMetrics([replica], feed, "round-robin"), client,
                        reference=info, interval_s=0.01, read_events=False)  # fmt: skip
    return mon, replica


@pytest.mark.parametrize("kind", list(BAD_INFOS))
def test_a_malformed_info_takes_the_replica_out_until_it_is_sane(kind):
    peer = Hostile()
    mon, replica = monitor(peer)
    peer.info = BAD_INFOS[kind]
    asyncio.run(mon.check(replica))  # must not raise
    assert not replica.up and replica.scraped_requests == 0
    peer.info = GOOD_INFO
    asyncio.run(mon.check(replica))
    assert replica.up and replica.scraped_requests == 2


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf", "1e400", "-3", "many", ""])
def test_a_load_that_is_not_a_count_counts_zero(value):
    text = f"pagedkv_requests_in_flight {value}\npagedkv_requests_queued 4\n"
    assert scraped_requests(text) == 4
    peer = Hostile()
    mon, replica = monitor(peer)
    peer.metrics = text
    asyncio.run(mon.check(replica))
    assert replica.up and replica.scraped_requests == 4


def test_the_loop_outlives_a_check_that_raises():
    peer = Hostile()
    mon, replica = monitor(peer)
    calls = {"n": 0}
    real = mon.check

    async def flaky(r):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("something no one foresaw")
        await real(r)

    mon.check = flaky

    async def drive():
        task = asyncio.create_task(mon.run())
        for _ in range(5000):  # deterministic: wait for the second round, whatever the clock
            if calls["n"] >= 3:
                break
            await asyncio.sleep(0.005)
        task.cancel()
        assert not task.done() or task.cancelled()

    asyncio.run(drive())
    assert calls["n"] >= 3 and replica.up  # taken out by the failure, back at the next round
