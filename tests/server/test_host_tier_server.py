"""The host tier behind the HTTP server: a prompt whose prefix the device evicted comes back
from host memory; ``usage.prompt_tokens_details.cached_tokens`` counts those tokens and
``/metrics`` says which tier they came from."""

from __future__ import annotations

import random

import httpx

from .conftest import MODEL_NAME, assert_idle, metrics, running_server

RECORD_BYTES = 512  # the tiny llama: 2 layers x 2 KV heads x 16 dims x K,V x fp32
_rng = random.Random(5)
PROMPT = [_rng.randrange(256) for _ in range(60)]  # 3 full blocks of 16 can hit
DISTRACTORS = [[_rng.randrange(256) for _ in range(90)] for _ in range(2)]


def complete(base_url: str, prompt: list[int]) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_host_hit_is_cached_tokens_and_a_host_series(tiny_loaded):
    with running_server(
        tiny_loaded,
        block_size=16,
        kv_cache_memory_bytes=(96 + 16) * RECORD_BYTES,  # 6 usable blocks (+ the null block)
        host_kv_memory_bytes=1 << 20,
        max_model_len=128,
    ) as (base_url, _):
        cold = complete(base_url, PROMPT)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        for d in DISTRACTORS:  # evict every block of PROMPT from the device
            complete(base_url, d)
        before = metrics(base_url)
        again = complete(base_url, PROMPT)
        after = metrics(base_url)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        assert again["choices"][0]["text"] == cold["choices"][0]["text"]

        def series(m, tier):
            return m[f"pagedkv_prefix_hit_tokens_by_tier_total{{tier={tier}}}"]

        assert series(after, "host") - series(before, "host") == 48
        assert series(after, "device") == series(before, "device")
        assert series(after, "store") == 0
        loaded = after["pagedkv_kv_tier_blocks_total{kind=loaded,tier=host}"]
        assert loaded - before["pagedkv_kv_tier_blocks_total{kind=loaded,tier=host}"] == 3
        assert after["pagedkv_kv_tier_bytes_total{kind=offloaded,tier=host}"] > 0
        assert_idle(base_url)
