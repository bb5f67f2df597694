"""End to end: ``pagedkv serve --kv-events redis://...`` (a real process, tiny model), found
through ``GET /pagedkv/info`` and read the way a router reads it: the hashes a router computes
for a prompt (``routing.prompt_block_hashes``) appear in the replica's stream once it ran."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from pagedkv.kvcache.events import KVEventBatch, replay
from pagedkv.router.event_reader import KVEventReader
from pagedkv.routing import prompt_block_hashes
from tests.kvstore.redis_server import RedisServer, free_port

START_TIMEOUT_S = 60.0
PROMPT = [(7 * i + 3) % 250 + 10 for i in range(60)]  # 3 full blocks of 16 + 12 tokens


def _wait_healthy(proc: subprocess.Popen, base: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(f"{base}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("server did not become healthy")


def test_serve_publishes_what_a_router_hashes(tmp_path):
    from tests.model.tiny import make_tiny_model

    make_tiny_model("llama", tmp_path / "model")
    redis = RedisServer(tmp_path).start()
    port = free_port()
    env = {**os.environ, "PAGEDKV_API_KEY": "", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pagedkv", "serve", "--model", str(tmp_path / "model"),
           "--port", str(port), "--kv-cache-memory", "4MiB", "--kv-events", redis.url]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    reader = None
    try:
        _wait_healthy(proc, base)
        info = httpx.get(f"{base}/pagedkv/info", timeout=5).json()
        assert info["kv_events"]["stream"] == f"pagedkv:kv-events:{info['instance_id']}"
        held: set[bytes] = set()
        batches: list[KVEventBatch] = []

        def on_batch(batch: KVEventBatch) -> None:
            batches.append(batch)
            replay(batch.events, held)

        reader = KVEventReader.from_info(info["kv_events"], on_batch, block_ms=20).start()
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=30).status_code == 200
        wanted = prompt_block_hashes(PROMPT, info["block_size"], hash_algorithm="sha256")
        assert len(wanted) == 3
        deadline = time.monotonic() + 10
        while not set(wanted) <= held:
            assert time.monotonic() < deadline, f"{len(batches)} batches, {len(held)} hashes"
            time.sleep(0.02)
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
        assert "pagedkv_kv_events_published_total" in metrics
    finally:
        if reader is not None:
            reader.stop()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        redis.stop()
