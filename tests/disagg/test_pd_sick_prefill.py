"""A sick prefill instance, with real processes (two ``pagedkv serve`` and a redis-server on
loopback): stopped with SIGSTOP it costs at most the breaker's N requests a timeout (counted,
not timed), every request still answers with one engine's text (local prefill), and after
SIGCONT the breaker closes again; a stale handshake record in the store is refused at start-up.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from tests.disagg.test_pd_pair import (
    _metric,
    _refused_decode,
    _serve,
    _stop,
    _wait_healthy,
)
from tests.kvstore.redis_server import free_port

N_FAILURES = 2  # --prefill-breaker-failures
TIMEOUT_S = 3  # --prefill-timeout: short, the stopped instance costs it N times
BACKOFF_S = 4  # --prefill-breaker-backoff: above a local request's time on a busy machine
NUM_WHILE_OPEN = 4
CLOSE_DEADLINE_S = 180.0


def _prompt(k: int) -> list[int]:
    return [(7 * i + 3 + 11 * k) % 250 + 10 for i in range(60)]  # 3 full blocks of 16 + 12


def _complete(port: int, prompt: list[int]) -> dict:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text  # never a 500: a local prefill at worst
    return resp.json()


def _counts(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    local = "pagedkv_pd_local_prefills_total"
    return {
        "timeout": _metric(text, local, 'reason="timeout"'),
        "breaker_open": _metric(text, local, 'reason="breaker_open"'),
        "other": _metric(text, local, 'reason="unreachable"')
        + _metric(text, local, 'reason="error"'),
        "opens": _metric(text, "pagedkv_pd_prefill_breaker_opens_total", ""),
        "probes": _metric(text, "pagedkv_pd_prefill_breaker_probes_total", ""),
        "sent": _metric(text, "pagedkv_pd_prefill_requests_total", ""),
        "closed": _metric(text, "pagedkv_pd_prefill_breaker_state", 'state="closed"'),
    }


def test_a_stopped_prefill_instance_costs_at_most_n_timeouts_then_closes(tiny_folder, redis):
    num = N_FAILURES + NUM_WHILE_OPEN
    prompts = [_prompt(k) for k in range(num + 1)]
    ref = LLMEngine(EngineConfig(model=str(tiny_folder), kv_cache_memory_bytes=32 << 20,
                                 log_startup=False))  # fmt: skip
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].text for o in ref.generate(prompts, params)]
    p_port, d_port = free_port(), free_port()
    prefill = _serve(tiny_folder, p_port, "--role", "prefill", "--kv-store", redis.url)
    decode = None
    try:
        _wait_healthy(prefill, p_port)
        decode = _serve(tiny_folder, d_port, "--role", "decode", "--kv-store", redis.url,
                        "--prefill-url", f"http://127.0.0.1:{p_port}",
                        "--prefill-timeout", str(TIMEOUT_S),
                        "--prefill-breaker-failures", str(N_FAILURES),
                        "--prefill-breaker-backoff", str(BACKOFF_S))  # fmt: skip
        _wait_healthy(decode, d_port)
        os.kill(prefill.pid, signal.SIGSTOP)
        try:
            for k in range(num):
                assert _complete(d_port, prompts[k])["choices"][0]["text"] == want[k]
            c = _counts(d_port)
        finally:
            os.kill(prefill.pid, signal.SIGCONT)
        # Only the first N and the breaker's probes waited for the stopped instance (every
        # probe failed and reopened it); every other request was computed here at once.
        assert c["opens"] >= 1 and c["probes"] == c["opens"] - 1
        assert c["timeout"] == N_FAILURES + c["probes"]
        assert c["breaker_open"] + c["probes"] == NUM_WHILE_OPEN
        assert c["breaker_open"] >= 1 and c["other"] == 0
        # Resumed: after the back-off one request probes, the answer closes the breaker.
        deadline = time.monotonic() + CLOSE_DEADLINE_S
        while _counts(d_port)["closed"] != 1:
            assert time.monotonic() < deadline, "the breaker did not close after SIGCONT"
            _complete(d_port, prompts[0])
            time.sleep(0.5)
        sent = _counts(d_port)["sent"]
        out = _complete(d_port, prompts[num])  # a fresh prompt: the prefill instance's blocks
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        assert out["choices"][0]["text"] == want[num]
        assert _counts(d_port)["sent"] == sent + 1
    finally:
        if decode is not None:
            _stop(decode)
        _stop(prefill)


def test_a_stale_handshake_record_is_refused_at_start_up(tiny_folder, redis):
    """The store's record says block size 32 while the prefill instance runs 16: a decode
    instance at 32 used to start and share nothing."""
    import redis as redis_py

    p_port = free_port()
    prefill = _serve(tiny_folder, p_port, "--role", "prefill", "--kv-store", redis.url)
    try:
        _wait_healthy(prefill, p_port)
        store = redis_py.Redis.from_url(redis.url)
        key = "pagedkv:pd:default:prefill"
        record = json.loads(store.get(key))
        assert record["page_format"]["block_size"] == 16
        record["page_format"]["block_size"] = 32
        store.set(key, json.dumps(record))
        error = _refused_decode(tiny_folder, redis.url, p_port, "--block-size", "32")
        assert "block_size 32 (decode) vs 16 (prefill)" in error
        assert f"{key} is stale (block_size 32 (store record) vs 16 (prefill))" in error
    finally:
        _stop(prefill)


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://[::1"])
def test_a_prefill_url_that_cannot_work_is_refused_before_the_load(url):
    """``--prefill-url http://127.0.0.1:99999`` started and failed every request with 500
    ``internal error: ExceptionGroup``."""
    from pagedkv import cli

    argv = ["serve", "--role", "decode", "--kv-store", "redis://127.0.0.1:1", "--prefill-url", url]
    assert cli.main(argv) == 2
