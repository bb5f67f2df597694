"""End to end: ``pagedkv serve --kv-events redis://...`` (a real process, tiny model), found
through ``GET /pagedkv/info`` and read the way a router reads it: the hashes a router computes
for a prompt (``routing.prompt_block_hashes``) appear in the replica's stream once it ran."""

from __future__ import annotations

import time

import httpx

from pagedkv.kvcache.events import KVEventBatch, replay
from pagedkv.router.event_reader import KVEventReader
from pagedkv.routing import prompt_block_hashes
from tests.kvstore.redis_server import RedisServer, free_port
from tests.router.procs import Proc

PROMPT = [(7 * i + 3) % 250 + 10 for i in range(60)]  # 3 full blocks of 16 + 12 tokens


def test_serve_publishes_what_a_router_hashes(tmp_path):
    from tests.model.tiny import make_tiny_model

    make_tiny_model("llama", tmp_path / "model")
    redis = RedisServer(tmp_path).start()
    port = free_port()
    args = ["serve", "--model", str(tmp_path / "model"), "--port", str(port),
            "--kv-cache-memory", "4MiB", "--kv-events", redis.url]  # fmt: skip
    proc = Proc(args, port, tmp_path / "serve.log")
    base = proc.url
    reader = None
    try:
        proc.wait_healthy(60)
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
        proc.stop()
        redis.stop()
