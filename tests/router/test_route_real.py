"""``pagedkv route`` for real: redis-server, 3 ``pagedkv serve --kv-events`` replicas of the
embedded SmolLM2 and the router, all processes on loopback, stopped by PID.

* prefix-aware: chats sharing a long system prompt land on the replica holding it, each with
  ``cached_tokens`` > 0; round-robin scatters the same kind of chats, so the first chat on each
  other replica computes the prompt itself;
* a replica with another ``--block-size`` is refused at start-up (exit 2, one line);
* one replica killed (SIGKILL) in the middle of a 48-request load: every request completes or
  ends with a clear error, none hangs, and the router counts each exactly once.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.kvstore.redis_server import RedisServer
from tests.router.procs import metric_values, route, serve

pytestmark = pytest.mark.slow

QUESTIONS = ["What is 2 + 2?", "Name a colour.", "Say hi.", "Name a fruit.", "Name a city.",
             "Name an animal."]  # fmt: skip
REQUEST_TIMEOUT_S = 120.0


def _system(topic: str) -> str:
    """~150 tokens: several blocks of 16."""
    return (f"You are a helpful assistant who knows a great deal about {topic}. Answer in one "
            "short sentence, politely, without lists, without code, and without repeating the "
            "question. " * 4)  # fmt: skip


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Redis, 3 replicas publishing KV events, and a 4th replica with blocks of 32."""
    tmp = tmp_path_factory.mktemp("route")
    redis = RedisServer(tmp).start()
    procs = [serve(tmp, f"replica{i}", "--kv-events", redis.url) for i in range(3)]
    odd = serve(tmp, "replica-b32", "--block-size", "32")
    try:
        for p in [*procs, odd]:
            p.wait_healthy()
        yield procs, odd, tmp
    finally:
        for p in [*procs, odd]:
            p.stop()
        redis.stop()


def _chat(url: str, system: str, question: str) -> tuple[str, int]:
    body = {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}],
            "max_tokens": 4, "temperature": 0}  # fmt: skip
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    assert resp.status_code == 200, resp.text
    return resp.headers["x-pagedkv-replica"], resp.json()["usage"]["prompt_tokens_details"][
        "cached_tokens"
    ]


def _wait_indexed(router_url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(metric_values(router_url, "pagedkv_router_replica_index_blocks").values()) == 0:
        assert time.monotonic() < deadline, "no KV event reached the router's index"
        time.sleep(0.1)


def test_prefix_aware_sends_a_shared_system_prompt_to_its_holder(fleet):
    procs, _, tmp = fleet
    urls = [p.url for p in procs]
    routers = {
        pol: route(tmp, pol, urls, "--policy", pol) for pol in ("prefix-aware", "round-robin")
    }
    try:
        seen: dict[str, list[tuple[str, int]]] = {}
        for policy, router in routers.items():
            router.wait_healthy()
            system = _system("geography" if policy == "prefix-aware" else "astronomy")
            first = _chat(router.url, system, QUESTIONS[0])
            if policy == "prefix-aware":
                _wait_indexed(router.url)
            seen[policy] = [first] + [_chat(router.url, system, q) for q in QUESTIONS[1:]]
        print("\ncached_tokens by (replica, request):", json.dumps(seen, indent=1))
        holder = seen["prefix-aware"][0][0]
        assert all(rep == holder and cached > 0 for rep, cached in seen["prefix-aware"][1:])
        rr = seen["round-robin"]
        assert {rep for rep, _ in rr} == set(urls)  # scattered over every replica
        assert sum(cached == 0 for _, cached in rr) >= 2  # each new replica computes it again
        reasons = metric_values(routers["prefix-aware"].url, "pagedkv_router_decisions_total")
        assert reasons['{policy="prefix-aware",reason="prefix"}'] == len(QUESTIONS) - 1
    finally:
        for r in routers.values():
            r.stop()


def test_a_replica_with_another_block_size_is_refused(fleet):
    procs, odd, tmp = fleet
    router = route(tmp, "refused", [procs[0].url, odd.url])
    try:
        router.proc.wait(60)
    finally:
        router.stop()
    errors = [line for line in router.log().splitlines() if "error:" in line]
    assert router.proc.returncode == 2, router.log()
    assert len(errors) == 1, router.log()
    assert f"block_size 32 ({odd.url}) vs 16 ({procs[0].url})" in errors[0]
    odd.stop()  # frees a core for the load test


def _one_request(url: str, i: int) -> tuple[str, str]:
    """``(outcome, detail)``: ``ok`` (a whole answer) or ``error`` (a clear error message)."""
    stream = i % 2 == 1
    # Streams run longer, so that some are mid-answer when the replica dies.
    body = {"prompt": f"Request {i}: the best thing about the sea is",
            "max_tokens": 24 if stream else 8, "ignore_eos": True,
            "temperature": 0, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}  # fmt: skip
    if not stream:
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
        if resp.status_code == 200:
            return "ok", resp.json()["choices"][0]["text"]
        return "error", resp.json()["error"]["message"]
    with httpx.stream("POST", f"{url}/v1/completions", json=body,
                      timeout=REQUEST_TIMEOUT_S) as resp:  # fmt: skip
        if resp.status_code != 200:
            return "error", json.loads(resp.read())["error"]["message"]
        events = [line[len("data: ") :] for line in resp.iter_lines() if line]
    assert events[-1] == "[DONE]", events  # never a silent cut
    errors = [json.loads(e)["error"] for e in events[:-1] if e.startswith('{"error"')]
    if errors:
        return "error", errors[0]["message"]
    assert json.loads(events[-2])["usage"]["completion_tokens"] >= 1
    return "ok", ""


def test_a_replica_killed_under_load_costs_no_request_its_answer_or_count(fleet):
    procs, _, tmp = fleet
    router = route(tmp, "load", [p.url for p in procs]).wait_healthy()
    victim = procs[1]
    try:
        with ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(_one_request, router.url, i) for i in range(48)]
            while sum(f.done() for f in futures) < 12:
                time.sleep(0.05)
            victim.kill()
            results = [f.result(timeout=REQUEST_TIMEOUT_S + 30) for f in futures]
        ok = sum(o == "ok" for o, _ in results)
        errors = [d for o, d in results if o == "error"]
        print(f"\nkill test: {ok} answered, {len(errors)} errors: {errors}")
        assert ok + len(errors) == 48 and all(errors)
        counts = metric_values(router.url, "pagedkv_router_requests_total")
        assert sum(counts.values()) == 48
        finished = sum(v for k, v in counts.items() if 'outcome="finished"' in k)
        assert finished == ok and sum(counts.values()) - finished == len(errors)
        retries = sum(metric_values(router.url, "pagedkv_router_retries_total").values())
        up = metric_values(router.url, "pagedkv_router_replica_up")
        nonzero = {k: v for k, v in counts.items() if v}
        print(f"kill test: router counts {nonzero}; retries {retries}")
        assert up[f'{{replica="{victim.url}"}}'] == 0
    finally:
        router.stop()
