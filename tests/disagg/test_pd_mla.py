"""A real prefill/decode pair carrying MLA latent pages (issue 55): two ``pagedkv serve``
processes on the tiny random DeepSeek-V3 (``tests/model/tiny.py``), one redis-server. The
decode instance's greedy text equals one engine's that computed everything (whose tokens are
checked here against transformers' ``generate``), its prompt blocks from the store, at the
prefill side's block size and re-paged to another (``--kv-import relayout``); a decode instance
of an MHA model refuses the MLA prefill side with one line naming the page field."""

from __future__ import annotations

import httpx
import pytest

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from tests.disagg.test_pd_pair import _refused_decode, _serve, _stop, _wait_healthy
from tests.kvstore.redis_server import free_port

PROMPT = [(7 * i + 3) % 250 + 10 for i in range(60)]  # 3 full blocks of 16 + 12 tokens


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """``(folder, transformers' greedy tokens of PROMPT)``."""
    from tests.model.test_deepseek import hf_greedy
    from tests.model.tiny import make_tiny_model

    folder = tmp_path_factory.mktemp("tiny-deepseek-pd")
    hf = make_tiny_model("deepseek_v3", folder)
    return folder, hf_greedy(hf, PROMPT)


def _reference(deepseek, block_size: int) -> str:
    """The text of one engine that computes everything, its tokens transformers'."""
    folder, hf_tokens = deepseek
    ref = LLMEngine(EngineConfig(model=str(folder), kv_cache_memory_bytes=32 << 20,
                                 block_size=block_size, log_startup=False))  # fmt: skip
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = ref.generate([PROMPT], params)[0].outputs[0]
    assert out.token_ids == hf_tokens
    return out.text


def _complete(port: int) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_pair_carries_latent_pages(deepseek, tiny_folder, redis):
    """One prefill instance (B = 16); decode instances at its block size, re-paged to 32, and
    one of an MHA model (refused), in turn."""
    deepseek_folder = deepseek[0]
    p_port = free_port()
    prefill = _serve(deepseek_folder, p_port, "--role", "prefill", "--kv-store", redis.url)
    try:
        _wait_healthy(prefill, p_port)
        for dst in (16, 32):
            d_port = free_port()
            relayout = ["--kv-import", "relayout"] if dst != 16 else []
            decode = _serve(deepseek_folder, d_port, "--role", "decode", "--kv-store", redis.url,
                            "--prefill-url", f"http://127.0.0.1:{p_port}",
                            "--block-size", str(dst), *relayout)  # fmt: skip
            try:
                _wait_healthy(decode, d_port)
                out = _complete(d_port)
            finally:
                _stop(decode)
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 48 // dst * dst
            assert out["choices"][0]["text"] == _reference(deepseek, dst)
        # an MHA model's decode side cannot read latent pages: one line, exit 2
        error = _refused_decode(tiny_folder, redis.url, p_port)
        assert "attention mha (decode) vs mla (prefill)" in error
    finally:
        _stop(prefill)
