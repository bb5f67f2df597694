"""A real prefill/decode pair: two ``pagedkv serve`` processes, one redis-server, loopback.

The decode instance's greedy tokens equal a single engine's; its prompt blocks come from the
store (the prefill instance computed them); a decode instance with another block size exits
with status 2 and one line naming both sides' values.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from tests.kvstore.redis_server import free_port

START_TIMEOUT_S = 90.0
PROMPT = [(7 * i + 3) % 250 + 10 for i in range(60)]  # 3 full blocks of 16 + 12 tokens


def _serve(folder, port: int, *flags: str) -> subprocess.Popen:
    """``folder`` None: the embedded SmolLM2-135M."""
    env = {**os.environ, "PAGEDKV_API_KEY": "", "OMP_NUM_THREADS": "1"}
    model = ["--model", str(folder)] if folder is not None else []
    cmd = [sys.executable, "-m", "pagedkv", "serve", *model, "--port", str(port),
           "--kv-cache-memory", "32MiB", *flags]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)  # fmt: skip


def _wait_healthy(proc: subprocess.Popen, port: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("server did not become healthy")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _refused_decode(folder, store_url: str, prefill_port: int, *flags: str) -> str:
    """Start a decode instance paired with the prefill instance on ``prefill_port``; it must
    exit 2 with one ``error:`` line, which is returned."""
    decode = _serve(folder, free_port(), "--role", "decode", "--kv-store", store_url,
                    "--prefill-url", f"http://127.0.0.1:{prefill_port}", *flags)  # fmt: skip
    try:
        _, err = decode.communicate(timeout=START_TIMEOUT_S)
    finally:
        _stop(decode)
    assert decode.returncode == 2, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    return errors[0]


def _metric(text: str, name: str, label: str) -> float:
    for line in text.splitlines():
        if line.startswith(name) and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{label}}} not in /metrics")


def test_decode_instance_loads_the_prefill_instances_blocks(tiny_folder, redis):
    ref = LLMEngine(EngineConfig(model=str(tiny_folder), kv_cache_memory_bytes=32 << 20,
                                 log_startup=False))  # fmt: skip
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = ref.generate([PROMPT], params)[0].outputs[0].text
    p_port, d_port = free_port(), free_port()
    prefill = _serve(tiny_folder, p_port, "--role", "prefill", "--kv-store", redis.url)
    decode = None
    try:
        _wait_healthy(prefill, p_port)
        decode = _serve(tiny_folder, d_port, "--role", "decode", "--kv-store", redis.url,
                        "--prefill-url", f"http://127.0.0.1:{p_port}")  # fmt: skip
        _wait_healthy(decode, d_port)
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}  # fmt: skip
        resp = httpx.post(f"http://127.0.0.1:{d_port}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        # Every full prompt block but none of the partial tail came from the store.
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        metrics = httpx.get(f"http://127.0.0.1:{d_port}/metrics").text
        assert _metric(metrics, "pagedkv_prefix_hit_tokens_by_tier_total", 'tier="store"') == 48
        assert _metric(metrics, "pagedkv_pd_prefill_requests_total", "") == 1
        assert _metric(metrics, "pagedkv_pd_prefill_failures_total", "") == 0
        # The same greedy text as one engine that computed everything itself.
        assert out["usage"]["completion_tokens"] == 8
        assert out["choices"][0]["text"] == want
        # The prefill instance dies: the decode instance computes prompts itself, same text.
        _stop(prefill)
        body["prompt"] = PROMPT[::-1]
        want2 = ref.generate([PROMPT[::-1]], params)[0].outputs[0].text
        resp = httpx.post(f"http://127.0.0.1:{d_port}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == want2
        metrics = httpx.get(f"http://127.0.0.1:{d_port}/metrics").text
        assert _metric(metrics, "pagedkv_pd_prefill_failures_total", "") == 1
    finally:
        if decode is not None:
            _stop(decode)
        _stop(prefill)


def test_a_decode_instance_with_another_block_size_refuses_to_start(tiny_folder, redis):
    p_port = free_port()
    prefill = _serve(tiny_folder, p_port, "--role", "prefill", "--kv-store", redis.url)
    try:
        _wait_healthy(prefill, p_port)
        error = _refused_decode(tiny_folder, redis.url, p_port, "--block-size", "32")
        assert "block_size 32 (decode) vs 16 (prefill)" in error
    finally:
        _stop(prefill)


@pytest.mark.parametrize(
    ("embedded_model", "src", "dst", "prompt_len", "cached"),
    [(False, 16, 32, 60, 32), (False, 64, 16, 120, 64), (True, 128, 16, 300, 256)],
)
def test_relayout_pair_imports_another_block_size(
    tiny_folder, redis, embedded_model, src, dst, prompt_len, cached
):
    """16 -> 32: two source blocks make one of ours; 64 -> 16 and 128 -> 16 (the embedded
    SmolLM2, whose context holds a 128-token block): one source block makes four or eight.
    Only tokens the prefill side stored as full blocks are imported."""
    folder = None if embedded_model else tiny_folder
    prompt = [(5 * i + 1) % 250 + 10 for i in range(prompt_len)]
    ref = LLMEngine(EngineConfig(model=None if folder is None else str(folder),
                                 kv_cache_memory_bytes=32 << 20, block_size=dst,
                                 log_startup=False))  # fmt: skip
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = ref.generate([prompt], params)[0].outputs[0].text
    p_port, d_port = free_port(), free_port()
    prefill = _serve(folder, p_port, "--role", "prefill", "--kv-store", redis.url,
                     "--block-size", str(src))  # fmt: skip
    decode = None
    try:
        _wait_healthy(prefill, p_port)
        decode = _serve(folder, d_port, "--role", "decode", "--kv-store", redis.url,
                        "--prefill-url", f"http://127.0.0.1:{p_port}", "--block-size", str(dst),
                        "--kv-import", "relayout")  # fmt: skip
        _wait_healthy(decode, d_port)
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        resp = httpx.post(f"http://127.0.0.1:{d_port}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
        assert out["choices"][0]["text"] == want
        metrics = httpx.get(f"http://127.0.0.1:{d_port}/metrics").text
        assert _metric(metrics, "pagedkv_pd_relayout_blocks_total", "") == cached // dst
    finally:
        if decode is not None:
            _stop(decode)
        _stop(prefill)
