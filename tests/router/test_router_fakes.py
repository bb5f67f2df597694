"""The router against in-process fake replicas: forwarding, the policies' choices, retries on a
replica that fails before answering, the error event of a stream cut mid-way, 503 without
replicas, serve's 400s at the edge, and a replica that comes back with another format."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from pagedkv.kvcache.events import BlockStored, KVEventBatch
from pagedkv.router.app import create_router_app
from pagedkv.router.config import RouterConfig
from pagedkv.router.edge import Edge
from pagedkv.router.server import load_tokenizer
from tests.router.fakes import CUT_AFTER_EVENTS, NUM_STREAM_EVENTS, FakeFleet, FakeReader, serving

SYSTEM = "You are a careful assistant. " * 12


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture
def router(tokenizer, request):
    """``(url, fleet, app)`` of a router over 3 fake replicas; the policy is the fixture's
    parameter (default round-robin)."""
    fleet = FakeFleet(3)
    config = RouterConfig(tuple(r.url for r in fleet.replicas),
                          policy=getattr(request, "param", "round-robin"),
                          health_interval_s=0.1, request_timeout_s=10)  # fmt: skip
    FakeReader.READERS.clear()
    app = create_router_app(config, [r.info() for r in fleet.replicas], tokenizer,
                            reader_factory=FakeReader, transport=fleet.transport)  # fmt: skip
    with serving(app) as url:
        yield url, fleet, app


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=20)


def _counters(url: str, name: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) :].rsplit(" ", 1)
            out[labels] = float(value)
    return out


def _outcomes(url: str) -> dict[tuple[str, str], float]:
    out = {}
    for labels, v in _counters(url, "pagedkv_router_requests_total").items():
        d = dict(kv.split("=") for kv in labels.strip("{}").split(","))
        out[(d["replica"].strip('"'), d["outcome"].strip('"'))] = v
    return {k: v for k, v in out.items() if v}


def test_round_robin_spreads_requests_and_counts_each_once(router):
    url, fleet, _ = router
    seen = [_post(url, {"prompt": f"hello {i}", "max_tokens": 2}) for i in range(6)]
    assert all(r.status_code == 200 for r in seen)
    assert [len(r.bodies) for r in fleet.replicas] == [2, 2, 2]
    assert all(r.headers["x-pagedkv-replica"] == r.json()["replica"] for r in seen)
    assert _outcomes(url) == {(r.url, "finished"): 2 for r in fleet.replicas}
    # The body reaches the replica unchanged.
    assert fleet.replicas[0].bodies[0] in [
        {"prompt": f"hello {i}", "max_tokens": 2} for i in range(6)
    ]


@pytest.mark.parametrize("router", ["prefix-aware"], indirect=True)
def test_prefix_aware_follows_the_kv_events(router, tokenizer):
    url, fleet, app = router
    holder = fleet.replicas[2]
    edge: Edge = app.state.edge
    req = {"messages": [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "hi"}], "max_tokens": 2}  # fmt: skip
    hashes = edge.route_key(edge.parse(json.dumps(req).encode(), _chat())).block_hashes
    assert len(hashes) >= 5
    reader = next(r for r in FakeReader.READERS if r.stream == f"s-{holder.instance_id}")
    reader.on_batch(KVEventBatch(0.0, (BlockStored(tuple(hashes[:4]), None, 16),)))
    for _ in range(3):
        resp = httpx.post(f"{url}/v1/chat/completions", json=req, timeout=20)
        assert resp.headers["x-pagedkv-replica"] == holder.url
    decisions = _counters(url, "pagedkv_router_decisions_total")
    assert decisions == {'{policy="prefix-aware",reason="prefix"}': 3.0}
    hits = _counters(url, "pagedkv_router_predicted_hit_blocks_total")
    assert hits[f'{{replica="{holder.url}"}}'] == 12


def _chat():
    from pagedkv.server.protocol import ChatCompletionRequest

    return ChatCompletionRequest


@pytest.mark.parametrize("mode", ["down", "reset", "503"])
def test_a_replica_failing_before_answering_is_retried_elsewhere(router, mode):
    url, fleet, _ = router
    bad = fleet.replicas[1]
    bad.mode, bad.probes_ok = mode, True  # only generation fails: the router must notice
    answers = [_post(url, {"prompt": f"p{i}", "max_tokens": 2}) for i in range(4)]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    assert all(a.headers["x-pagedkv-replica"] != bad.url for a in answers)
    retries = _counters(url, "pagedkv_router_retries_total")
    assert list(retries) == [f'{{replica="{bad.url}"}}'] and retries[list(retries)[0]] >= 1
    assert sum(_outcomes(url).values()) == 4  # each request once, wherever it ended
    # Taken out at once; its probes answer, so the health loop takes it back.
    bad.mode = "ok"
    deadline = time.monotonic() + 5
    while _counters(url, "pagedkv_router_replica_up")[f'{{replica="{bad.url}"}}'] != 1:
        assert time.monotonic() < deadline, "the replica was not taken back"
        time.sleep(0.05)


def test_no_replica_left_is_a_clear_503(router):
    url, fleet, _ = router
    for r in fleet.replicas:
        r.mode, r.probes_ok = "down", True  # generation fails on each, probes still pass
    resp = _post(url, {"prompt": "x", "max_tokens": 2})
    assert resp.status_code == 503
    err = resp.json()["error"]
    assert err["code"] == "no_replica" and "failed before answering" in err["message"]
    assert all(r.url in err["message"] for r in fleet.replicas)
    for r in fleet.replicas:
        r.probes_ok = False  # down for good: the health loop takes every one out
    deadline = time.monotonic() + 5
    while httpx.get(f"{url}/health").status_code != 503:
        assert time.monotonic() < deadline, "the router still reports a healthy replica"
        time.sleep(0.05)
    resp = _post(url, {"prompt": "x", "max_tokens": 2})
    assert resp.status_code == 503 and "no healthy replica" in resp.json()["error"]["message"]
    assert _outcomes(url) == {("none", "unavailable"): 2}


def _stream(url: str) -> list[str]:
    body = {"prompt": "tell me", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=20) as resp:
        assert resp.status_code == 200
        return [line for line in resp.iter_lines() if line]


def test_a_stream_is_relayed_event_by_event(router):
    url, fleet, _ = router
    lines = _stream(url)
    assert lines[-1] == "data: [DONE]" and len(lines) == NUM_STREAM_EVENTS + 1
    assert sum(_outcomes(url).values()) == 1 and list(_outcomes(url))[0][1] == "finished"


def test_a_stream_cut_after_tokens_ends_with_an_error_event(router):
    url, fleet, _ = router
    for r in fleet.replicas:
        r.mode = "cut"
    lines = _stream(url)
    assert len(lines) == CUT_AFTER_EVENTS + 2 and lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: ") :])["error"]
    assert error["code"] == "replica_failed" and "incomplete" in error["message"]
    outcomes = _outcomes(url)
    assert sum(outcomes.values()) == 1 and list(outcomes)[0][1] == "failed"
    assert _counters(url, "pagedkv_router_retries_total") == {}  # tokens went out: no retry


def test_the_edge_answers_serves_400s_without_a_replica(router):
    url, fleet, _ = router
    resp = _post(url, {"prompt": "x", "max_tokens": "5"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"
    resp = _post(url, {"prompt": "word " * 2100, "max_tokens": 5})
    err = resp.json()["error"]
    assert resp.status_code == 400 and err["code"] == "context_length_exceeded"
    resp = _post(url, {"prompt": "x", "model": "gpt-4"})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    assert not any(r.bodies for r in fleet.replicas)
    assert _outcomes(url) == {("none", "rejected"): 3}


def test_a_replica_back_with_another_block_size_is_kept_out(router):
    url, fleet, _ = router
    odd = fleet.replicas[0]
    odd.instance_id, odd.block_size = "new1", 32
    deadline = time.monotonic() + 5
    while not _counters(url, "pagedkv_router_replica_refused_total"):
        assert time.monotonic() < deadline, "the restarted replica was not refused"
        time.sleep(0.05)
    state = httpx.get(f"{url}/pagedkv/replicas").json()["replicas"][0]
    assert (state["device"], state["dtype"]) == ("cuda:0", "bfloat16")  # the replica's words
    assert state["refused"] == f"block_size 32 ({odd.url}) vs 16 (the router's format)"
    answers = [_post(url, {"prompt": f"p{i}", "max_tokens": 2}) for i in range(4)]
    assert all(a.headers["x-pagedkv-replica"] != odd.url for a in answers)
    odd.instance_id, odd.block_size = "new2", 16  # restarted again, right format: back
    deadline = time.monotonic() + 5
    while httpx.get(f"{url}/pagedkv/replicas").json()["replicas"][0]["refused"] is not None:
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.parametrize("router", ["prefix-aware"], indirect=True)
def test_a_restarted_replica_loses_its_index_entries_and_is_read_anew(router):
    url, fleet, app = router
    rep = fleet.replicas[0]
    old = next(r for r in FakeReader.READERS if r.stream == f"s-{rep.instance_id}")
    old.on_batch(KVEventBatch(0.0, (BlockStored((b"h" * 32, b"i" * 32), None, 16),)))
    assert app.state.feed.num_blocks(rep.url) == 2
    rep.instance_id = "again"
    deadline = time.monotonic() + 5
    while not any(r.stream == "s-again" for r in FakeReader.READERS):
        assert time.monotonic() < deadline, "the new stream is not read"
        time.sleep(0.05)
    assert app.state.feed.num_blocks(rep.url) == 0
    old.on_batch(KVEventBatch(0.0, (BlockStored((b"j" * 32,), None, 16),)))  # a late batch
    assert app.state.feed.num_blocks(rep.url) == 0
    while not old.stopped:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    restarts = _counters(url, "pagedkv_router_replica_restarts_total")
    assert restarts[f'{{replica="{rep.url}"}}'] == 1


def test_a_client_leaving_a_stream_is_counted_aborted_and_frees_the_replica(router):
    url, fleet, app = router
    for r in fleet.replicas:
        r.mode = "slow"
    body = {"prompt": "tell me", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=20) as resp:
        first = next(resp.iter_lines())
        assert first.startswith("data: {")
    deadline = time.monotonic() + 5
    while _outcomes(url) != {(resp.headers["x-pagedkv-replica"], "aborted"): 1}:
        assert time.monotonic() < deadline, _outcomes(url)
        time.sleep(0.05)
    assert all(r.in_flight == 0 for r in app.state.replicas)


def test_the_router_serves_the_tokenizer_endpoints_itself(router, tokenizer):
    url, fleet, _ = router
    messages = [{"role": "user", "content": "Hi there"}]
    out = httpx.post(f"{url}/tokenize", json={"messages": messages}, timeout=10).json()
    assert out["tokens"] == tokenizer.encode_chat(messages)  # the replicas' own rendering
    back = httpx.post(f"{url}/detokenize", json={"tokens": out["tokens"]}, timeout=10).json()
    assert back["prompt"] == tokenizer.decode(out["tokens"], skip_special_tokens=False)
    info = httpx.get(f"{url}/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == tokenizer.token_text(tokenizer.eos_token_id)
    assert info["chat_template"] == tokenizer.chat_template
    assert info["fingerprint"] == tokenizer.fingerprint()
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [-1]}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert not any(r.bodies for r in fleet.replicas)  # no replica was asked
