"""A P/D pair whose sides run different tensor-parallel sizes: KV moves by head slices.

The store keeps whole blocks (every KV head); a TP 2 prefill side joins its two ranks' head
slices on the way there, a TP 2 decode side splits them on the way back. Each direction
(1 -> 2, 2 -> 1) gives the single TP 1 engine's greedy text, with every full prompt block
read from the store (the decode side computed none of them).
"""

from __future__ import annotations

import httpx
import pytest

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from tests.disagg.test_pd_pair import PROMPT, _metric, _serve, _stop, _wait_healthy
from tests.kvstore.redis_server import free_port


@pytest.fixture(scope="module")
def single_engine_text(tiny_folder):
    ref = LLMEngine(
        EngineConfig(model=str(tiny_folder), kv_cache_memory_bytes=32 << 20, log_startup=False)
    )
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return ref.generate([PROMPT], params)[0].outputs[0].text


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1)])
def test_pair_of_different_tensor_parallel_sizes(
    tiny_folder, redis, single_engine_text, prefill_tp, decode_tp
):
    p_port, d_port = free_port(), free_port()
    prefill_args = ["--role", "prefill", "--kv-store", redis.url]
    prefill = _serve(tiny_folder, p_port, *prefill_args, "--tensor-parallel-size", str(prefill_tp))
    decode = None
    try:
        _wait_healthy(prefill, p_port)
        decode_args = ["--role", "decode", "--kv-store", redis.url]
        decode_args += ["--prefill-url", f"http://127.0.0.1:{p_port}"]
        decode = _serve(tiny_folder, d_port, *decode_args, "--tensor-parallel-size", str(decode_tp))
        _wait_healthy(decode, d_port)
        info = httpx.get(f"http://127.0.0.1:{d_port}/pagedkv/info").json()
        assert info["tensor_parallel"]["size"] == decode_tp
        assert info["page_format"]["num_kv_heads"] == 2 // decode_tp  # the tiny llama: 2
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        resp = httpx.post(f"http://127.0.0.1:{d_port}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        # Every full prompt block (3 of 16 tokens) came from the store, none computed here.
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        metrics = httpx.get(f"http://127.0.0.1:{d_port}/metrics").text
        assert _metric(metrics, "pagedkv_prefix_hit_tokens_by_tier_total", 'tier="store"') == 48
        assert out["choices"][0]["text"] == single_engine_text
    finally:
        if decode is not None:
            _stop(decode)
        _stop(prefill)
