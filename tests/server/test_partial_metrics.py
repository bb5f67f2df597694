"""``/metrics`` and the API's usage with partial-block reuse (``--prefix-match-unit 1``): a
completion whose prompt shares a prefix ending inside a block reports every shared token as
cached, and the partial counters say how many came from that block and what was copied."""

from __future__ import annotations

import httpx

from .conftest import MODEL_NAME, assert_idle, metrics, running_server

PARTIAL_COUNTERS = (
    "pagedkv_partial_prefix_hits_total",
    "pagedkv_partial_prefix_hit_tokens_total",
    "pagedkv_prefix_copy_bytes_total",
    "pagedkv_partial_prefix_claims_total",
)


def test_partial_hits_are_cached_tokens_and_counted_apart(tiny_loaded):
    # Byte-level prompts: 37 shared characters are 37 shared tokens (after the BOS token).
    stem = "the quick brown fox jumps over a lazy"  # 37 characters
    with running_server(tiny_loaded, block_size=16, prefix_match_unit=1) as (url, _app):
        assert all(metrics(url)[name] == 0 for name in PARTIAL_COUNTERS)

        def cached(prompt: str) -> int:
            body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached(stem + " dog and runs away quickly") == 0
        # 38 tokens shared (BOS + 37): blocks 0 and 1 whole, 6 tokens of block 2.
        assert cached(stem + " cat sat") == 38
        assert_idle(url)
        m = metrics(url)
    assert m["pagedkv_partial_prefix_hits_total"] == 1
    assert m["pagedkv_partial_prefix_hit_tokens_total"] == 38 - 32
    # The first request's block 2 has its kept tail after it: copied, 6 slots of 512 bytes.
    assert m["pagedkv_prefix_copy_bytes_total"] == 6 * 512
    assert m["pagedkv_partial_prefix_claims_total"] == 0
