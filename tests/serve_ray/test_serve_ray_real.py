"""pagedkv on a real Ray Serve (one local Ray for this module, 2 CPUs, replicas taking none):
two engine replicas of a tiny random model behind Serve's proxy, routed by
``PagedKVRequestRouter``.

* requests sharing a prefix land on the replica that holds it, with their prefix reused
  (``cached_tokens``); requests without a shared prefix spread over both replicas;
* the routes, errors, streaming and headers are ``pagedkv serve``'s (its own app answers);
  ``/metrics`` holds every replica's samples;
* a load imbalance (the holder busy with long streams) sends the next request to the other
  replica;
* a replica killed in the middle of a load is replaced by Serve; every request ends (answered,
  or a clear 503 / error event), none hangs, and requests after it succeed.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pagedkv.serve_ray.launch import start_app
from tests.serve_ray.ray_app import (
    TIMEOUT_S,
    app_config,
    cached_tokens,
    complete,
    engine_replicas,
    local_ray,
    replica_of,
    router_view,
    running_count,
    tiny_model,
    wait_for,
)

pytestmark = pytest.mark.slow

APP = "pagedkv"
PREFIX = "You are a careful assistant. Answer briefly and politely. " * 2  # ~29 blocks of 4


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    model = tiny_model(tmp_path_factory.mktemp("tiny-2k"))
    with local_ray() as port:
        start_app(app_config(model, port, balance_abs=1))
        yield f"http://127.0.0.1:{port}"


def _blocks(base: str) -> dict[str, int]:
    return {name: row["index_blocks"] for name, row in router_view(base).items()}


def _wait_indexed(base: str, replica: str, before: dict[str, int]) -> None:
    """The router learns of a replica's new blocks at its next stats poll (0.2 s here)."""
    wait_for(
        lambda: _blocks(base).get(replica, 0) > before.get(replica, 0),
        f"the router to see {replica}'s new prefix blocks",
    )


def test_same_prefix_requests_land_on_the_replica_holding_it(base):
    before = _blocks(base)
    first = complete(base, PREFIX + "Question 0?")
    assert first.status_code == 200, first.text
    holder = replica_of(first)
    _wait_indexed(base, holder, before)
    for i in range(1, 6):
        resp = complete(base, PREFIX + f"Question {i}?")
        assert resp.status_code == 200, resp.text
        assert replica_of(resp) == holder
        assert cached_tokens(resp) >= len(PREFIX) // 4 * 4 - 4  # the shared blocks reused
    decisions = httpx.get(f"{base}/pagedkv/replicas").json()["routers"][0]["decisions"]
    assert decisions.get("prefix", 0) >= 5


def test_requests_without_a_shared_prefix_spread_over_both_replicas(base):
    seen = {replica_of(complete(base, f"{i} unrelated prompt number {i * 7919}")) for i in range(6)}
    assert len(seen) == 2


def test_routes_errors_streaming_and_headers_are_serve_s(base):
    models = httpx.get(f"{base}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    bad = complete(base, "hi", max_tokens=-3)
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "max_tokens" and "x-pagedkv-replica" in bad.headers
    unknown = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "model": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    with httpx.stream(
        "POST",
        f"{base}/v1/chat/completions",
        timeout=TIMEOUT_S,
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
        },
    ) as resp:
        assert resp.status_code == 200 and resp.headers["x-pagedkv-replica"]
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
    # The tiny random model's five tokens may all be special or partial characters, which
    # stream no text (a batch's float order picks among near-tied logits): the usage chunk,
    # not the count of text chunks, says five tokens were streamed.
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 5
    metrics = httpx.get(f"{base}/metrics").text
    labelled = {
        ln.split('replica="')[1].split('"')[0]
        for ln in metrics.splitlines()
        if ln.startswith("pagedkv_kv_blocks_total{")
    }
    assert len(labelled) == 2


def test_a_busy_prefix_holder_loses_to_the_least_loaded_replica(base):
    """balance_abs 1: with two long streams running on the holder (load 2 > 0 + 1), a
    request with the held prefix goes to the other replica, which then holds it too. (The
    streams are read to their end: a client that stops reading is not busy
    work.)"""
    prefix = "Tell me a long story about the sea, the ships and the sailors. " * 2
    before = _blocks(base)
    holder = replica_of(complete(base, prefix + "Begin."))
    _wait_indexed(base, holder, before)
    body = {"prompt": prefix + "Go on.", "max_tokens": 1800, "ignore_eos": True, "stream": True}
    started = threading.Barrier(3)
    replicas: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=TIMEOUT_S) as r:
            lines = r.iter_lines()
            next(lines)  # running there
            replicas.append(replica_of(r))
            started.wait()
            for _ in lines:
                pass

    with ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(stream), pool.submit(stream)]
        started.wait()
        busy = complete(base, prefix + "Another one.")
        for s in streams:
            s.result()
    assert replicas == [holder, holder]
    assert busy.status_code == 200 and replica_of(busy) != holder
    wait_for(lambda: router_view(base)[holder]["in_flight"] == 0, "the streams to end")
    # Both replicas hold the prefix now (the busy request computed it there too): either
    # serves the next one from its cache.
    assert cached_tokens(complete(base, prefix + "The end.")) >= len(prefix) // 4 * 4 - 4


def test_a_killed_replica_is_replaced_and_requests_keep_succeeding(base):
    import ray

    before = engine_replicas(APP)
    assert len(before) == 2
    outcomes: list[str] = []
    stop = threading.Event()

    def client(i: int) -> None:
        while not stop.is_set():
            try:
                resp = complete(
                    base, f"load {i} {time.monotonic()}", max_tokens=20, ignore_eos=True
                )
                outcomes.append(
                    "ok"
                    if resp.status_code == 200
                    else f"{resp.status_code}:{resp.json()['error']['code']}"
                )
            except httpx.TimeoutException:
                outcomes.append("hung")

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(client, i) for i in range(3)]
        time.sleep(1.0)
        victim = sorted(before)[0]
        ray.kill(ray.get_actor(before[victim], namespace="serve"), no_restart=True)

        def replaced() -> bool:
            names = set(engine_replicas(APP))
            return len(names) == 2 and victim not in names and running_count(APP) == 2

        wait_for(replaced, "Serve to replace the killed replica", timeout_s=120)
        time.sleep(1.0)
        stop.set()
        for f in futures:
            f.result()
    assert "hung" not in outcomes and len(outcomes) >= 6
    now = set(engine_replicas(APP))
    assert len(now) == 2 and victim not in now and now != set(before)  # a new replica
    assert all(o == "ok" or o == "503:replica_failed" for o in outcomes), outcomes
    assert outcomes[-3:] == ["ok"] * 3  # the last ones, after the replacement
    after = {replica_of(complete(base, f"after {i}")) for i in range(6)}
    assert victim not in after and after <= set(engine_replicas(APP))
