"""``/metrics`` and the engine's stats carry the store tier's counters."""

from __future__ import annotations

import httpx

from .test_engine_store import PROMPTS, make_engine, run, store_of


def test_stats_rows_and_snapshot_name_the_store(tiny, redis_url):
    writer = make_engine(tiny, redis_url)
    run(writer, PROMPTS[:1])
    assert store_of(writer).flush(30)
    reader = make_engine(tiny, redis_url)
    run(reader, PROMPTS[:1])
    snap = dict(reader.snapshot().kv_store)
    assert snap["bytes_read"] > 0 and snap["errors"] == 0
    assert dict(reader.snapshot().tier_hit_tokens)["store"] > 0
    labels = [label for label, _ in reader.stats().rows()]
    assert "KV store read / written" in labels
    assert make_engine(tiny, None).snapshot().kv_store == ()


def test_metrics_export_store_series(tiny, redis_url):
    from tests.server.conftest import metrics, running_server

    with running_server(tiny, max_model_len=128, kv_store=redis_url) as (url, _app):
        body = {"prompt": PROMPTS[0], "max_tokens": 2, "ignore_eos": True}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        m = metrics(url)
    assert m["pagedkv_kv_store_errors_total"] == 0
    assert m["pagedkv_kv_store_rejected_payloads_total{reason=bad_checksum}"] == 0
    assert "pagedkv_kv_store_bytes_total{direction=written}" in m
    assert m["pagedkv_prefix_hit_tokens_by_tier_total{tier=store}"] == 0
