"""``GET /pagedkv/info``: the replica's self-description a router codes against."""

from __future__ import annotations

import httpx
import pytest

from pagedkv.pages.page_format import PageFormat
from tests.kvstore.redis_server import RedisServer
from tests.server.conftest import MODEL_NAME, running_server

KEYS = {
    "instance_id",
    "model",
    "model_identity",
    "page_format",
    "allocator",
    "block_size",
    "prefix_caching",
    "hash_algorithm",
    "max_model_len",
    "kv_events",
    "tokenizer",
    "device",
    "dtype",
    "attention_backend",
    "tensor_parallel",
}


@pytest.mark.parametrize(
    ("policy", "allocator", "block_size", "prefix_caching"),
    [
        ("vllm", "paged", 16, True),
        ("radix:4", "radix", 4, True),
        ("reserved", "reserved", 64, False),
    ],
)
def test_info_schema(tiny_loaded, policy, allocator, block_size, prefix_caching):
    with running_server(tiny_loaded, policy=policy, max_model_len=64) as (url, _):
        info = httpx.get(f"{url}/pagedkv/info", timeout=10).json()
    assert set(info) == KEYS
    assert info["allocator"] == allocator and info["block_size"] == block_size
    assert info["prefix_caching"] is prefix_caching
    assert info["model"] == MODEL_NAME and info["hash_algorithm"] == "sha256"
    assert info["max_model_len"] == 64 and info["kv_events"] is None
    assert PageFormat.from_dict(info["page_format"]).block_size == block_size
    assert len(info["instance_id"]) == 32 and int(info["instance_id"], 16) >= 0
    assert isinstance(info["model_identity"], str) and len(info["model_identity"]) == 32
    assert info["tokenizer"] == tiny_loaded[2].fingerprint()
    assert (info["device"], info["dtype"], info["attention_backend"]) == (
        "cpu",
        "float32",
        "native",
    )


def test_info_is_fresh_per_engine_and_needs_the_key(tiny_loaded):
    with running_server(tiny_loaded, api_key="k") as (url, _):
        assert httpx.get(f"{url}/pagedkv/info", timeout=10).status_code == 401
        auth = {"Authorization": "Bearer k"}
        first = httpx.get(f"{url}/pagedkv/info", headers=auth, timeout=10).json()
    with running_server(tiny_loaded) as (url, _):
        second = httpx.get(f"{url}/pagedkv/info", timeout=10).json()
    assert first["instance_id"] != second["instance_id"]
    assert first["model_identity"] == second["model_identity"]  # the same weights
    assert first["tokenizer"] == second["tokenizer"]


def test_info_names_the_event_stream_and_metrics_count(tiny_loaded, tmp_path):
    redis = RedisServer(tmp_path).start()
    try:
        with running_server(tiny_loaded, kv_events_url=redis.url) as (url, app):
            info = httpx.get(f"{url}/pagedkv/info", timeout=10).json()
            stream = f"pagedkv:kv-events:{info['instance_id']}"
            assert info["kv_events"] == {"url": f"{redis.url}/0", "stream": stream}
            body = {"prompt": list(range(10, 50)), "max_tokens": 2, "temperature": 0}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
            assert app.state.engine_loop.engine.parts.kv_events.publisher.flush(5)
            text = httpx.get(f"{url}/metrics", timeout=10).text
        assert "pagedkv_kv_events_published_total" in text
        published = _value(text, "pagedkv_kv_events_published_total")
        assert published >= 2  # the opening AllBlocksCleared, then the prompt's two blocks
        assert _value(text, "pagedkv_kv_event_batches_total") >= 2
        assert _value(text, "pagedkv_kv_events_dropped_total") == 0
        assert _value(text, "pagedkv_kv_event_stream_resets_total") == 0  # nobody spoiled it
    finally:
        redis.stop()


def _value(text: str, name: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def test_kv_events_flag_is_checked_at_the_edge():
    import argparse

    from pagedkv.commands import serve
    from pagedkv.commands.engine_flags import engine_config
    from pagedkv.engine import EngineConfig
    from pagedkv.errors import UsageError

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--kv-events", "redis://127.0.0.1:6399"])
    assert engine_config(args).kv_events_url == "redis://127.0.0.1:6399"
    for bad in ("http://127.0.0.1:6399", "redis://h:notaport", "redis://u:p@h:1"):
        with pytest.raises(UsageError) as exc:
            EngineConfig(kv_events_url=bad)
        assert exc.value.param == "kv_events" and "--kv-events" in str(exc.value)
