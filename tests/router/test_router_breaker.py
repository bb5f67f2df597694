"""The router's circuit breaker per replica (``breaker.py`` in ``router/forward.py``): a replica
that keeps timing out (a SIGSTOPped process passes no request but is not refused either) costs
at most ``breaker_failures`` requests their timeout; then the router skips it until a probe
answers. Counted, never timed: the fake replica's timeout is immediate."""

from __future__ import annotations

import time

import httpx
import pytest

from pagedkv.router.app import create_router_app
from pagedkv.router.config import RouterConfig
from pagedkv.router.server import load_tokenizer
from tests.router.fakes import FakeFleet, FakeReader, serving


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def _router(tokenizer, backoff_s: float):
    fleet = FakeFleet(3)
    config = RouterConfig(tuple(r.url for r in fleet.replicas), policy="round-robin",
                          health_interval_s=0.1, request_timeout_s=10, breaker_failures=3,
                          breaker_backoff_s=backoff_s)  # fmt: skip
    app = create_router_app(config, [r.info() for r in fleet.replicas], tokenizer,
                            reader_factory=FakeReader, transport=fleet.transport)  # fmt: skip
    return fleet, app


def _metric(url: str, name: str, replica: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(f'{name}{{replica="{replica}"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} for {replica} not in /metrics")


def _post(url: str, i: int) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": f"p{i}", "max_tokens": 2},
                      timeout=20)  # fmt: skip


def test_a_replica_that_keeps_timing_out_is_skipped_after_n_timeouts(tokenizer):
    fleet, app = _router(tokenizer, backoff_s=600.0)  # stays open for the whole test
    bad = fleet.replicas[1]
    bad.mode, bad.probes_ok = "timeout", True  # health checks pass: only the breaker sees it
    with serving(app) as url:
        answers = [_post(url, i) for i in range(15)]
        timeouts = [a for a in answers if a.status_code == 504]
        assert len(timeouts) == 3  # round-robin reached it 5 times: only 3 waited
        assert all(a.status_code == 200 for a in answers if a.status_code != 504)
        assert len(bad.bodies) == 3  # the two after the third never reached it
        assert _metric(url, "pagedkv_router_replica_breaker_open", bad.url) == 1.0
        assert _metric(url, "pagedkv_router_replica_breaker_opens_total", bad.url) == 1.0
        assert _metric(url, "pagedkv_router_replica_breaker_short_circuits_total", bad.url) >= 2
        good = fleet.replicas[0].url
        assert _metric(url, "pagedkv_router_replica_breaker_open", good) == 0.0


def test_the_router_sends_again_once_a_probe_answers(tokenizer):
    fleet, app = _router(tokenizer, backoff_s=0.2)
    bad = fleet.replicas[2]
    bad.mode, bad.probes_ok = "timeout", True
    with serving(app) as url:
        for i in range(9):
            _post(url, i)
        assert len(bad.bodies) == 3  # opened
        bad.mode = "ok"  # SIGCONT
        deadline = time.monotonic() + 30  # a generous bound; the check is on what it served
        i = 100
        while not any(b["prompt"] == f"p{i - 1}" for b in bad.bodies[3:]) or i == 100:
            assert time.monotonic() < deadline, "the router never probed the replica again"
            assert _post(url, i).status_code == 200
            i += 1
        assert _metric(url, "pagedkv_router_replica_breaker_open", bad.url) == 0.0
        before = len(bad.bodies)
        for j in range(6):  # closed again: round-robin reaches it every third request
            assert _post(url, 1000 + j).status_code == 200
        assert len(bad.bodies) - before == 2
