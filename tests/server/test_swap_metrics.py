"""``/metrics`` exposes swap preemption: a server whose KV pool holds one request's four samples
but not two such requests at once swaps some out and back in, and the swap counters say so."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from .conftest import MODEL_NAME, assert_idle, metrics, running_server

SWAP_COUNTERS = (
    "pagedkv_swap_out_sequences_total",
    "pagedkv_swap_in_sequences_total",
    "pagedkv_swap_out_blocks_total",
    "pagedkv_swap_in_blocks_total",
    "pagedkv_swap_out_bytes_total",
    "pagedkv_swap_in_bytes_total",
    "pagedkv_swap_fallbacks_total",
)


def test_metrics_count_swaps(tiny_loaded):
    # 20 usable blocks of 16 tokens (512 bytes per token); 4 samples of up to 110 tokens
    # sharing a 50-token prompt need 19, two such requests 38.
    pool_bytes = 21 * 16 * 512
    with running_server(
        tiny_loaded,
        kv_cache_memory_bytes=pool_bytes,
        preemption_mode="swap",
        swap_space_bytes=1 << 20,
    ) as (url, _app):
        before = metrics(url)
        assert all(before[name] == 0 for name in SWAP_COUNTERS)

        def complete(letter: str) -> httpx.Response:
            body = {
                "model": MODEL_NAME,
                "prompt": letter * 50,
                "max_tokens": 60,
                "n": 4,
                "temperature": 1.0,
                "seed": 3,
                "ignore_eos": True,
            }
            return httpx.post(f"{url}/v1/completions", json=body, timeout=120)

        with ThreadPoolExecutor(2) as threads:
            responses = list(threads.map(complete, "xy"))
        for r in responses:
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"]) == 4
        assert_idle(url)
        m = metrics(url)
    assert m["pagedkv_swap_out_sequences_total"] > 0
    assert m["pagedkv_swap_in_sequences_total"] == m["pagedkv_swap_out_sequences_total"]
    assert m["pagedkv_swap_out_blocks_total"] >= m["pagedkv_swap_in_blocks_total"] > 0
    block_bytes = 16 * 512
    assert m["pagedkv_swap_out_bytes_total"] == m["pagedkv_swap_out_blocks_total"] * block_bytes
    assert m["pagedkv_swap_in_bytes_total"] == m["pagedkv_swap_in_blocks_total"] * block_bytes
    assert m["pagedkv_preemptions_total"] >= m["pagedkv_swap_out_sequences_total"]
