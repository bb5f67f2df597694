"""P/D as a Serve graph on a real Ray (one local Ray for this module) and a real
redis-server: one prefill and one decode replica of a tiny random model.

* the graph answers, and the decode side loads the prompt's blocks the prefill deployment
  wrote to the store (its ``/metrics``: store hits, one prefill call per request);
* a pair whose page formats differ (blocks of 8 on the prefill side, 4 on the decode side,
  strict import) is refused when the application is built: it never answers a request, and
  the error names the field and both values.
"""

from __future__ import annotations

import pytest

from pagedkv.errors import UsageError
from pagedkv.serve_ray.launch import start_app
from tests.kvstore.redis_server import RedisServer
from tests.serve_ray.ray_app import app_config, cached_tokens, complete, local_ray, tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    model = tiny_model(tmp / "model", context_len=256)
    redis = RedisServer(tmp).start()
    try:
        with local_ray() as port:
            yield model, port, redis.url
    finally:
        redis.stop()


def _pd_config(model, port, store, prefill_block_size=4, **overrides):
    from dataclasses import replace

    from pagedkv.disagg import PDConfig

    base = app_config(model, port, num_replicas=1)
    engine = replace(base.engine, kv_store=store)
    decode = PDConfig(
        role="decode",
        prefill_url="http://pagedkvprefill.serve",
        kv_store=store,
        prefill_timeout_s=30.0,
        **overrides,
    )
    prefill = PDConfig(role="prefill", kv_store=store)
    return replace(
        base,
        engine=engine,
        prefill_replicas=1,
        pd_decode=decode,
        pd_prefill=prefill,
        prefill_engine=replace(engine, block_size=prefill_block_size),
    )


def _metric(text: str, name: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name))


def test_the_graph_answers_with_the_prefill_side_s_blocks(env):
    import httpx

    model, port, store = env
    start_app(_pd_config(model, port, store))
    base = f"http://127.0.0.1:{port}"
    prompt = "A prompt long enough to fill several blocks of four tokens each. " * 2
    first = complete(base, prompt)
    assert first.status_code == 200, first.text
    assert cached_tokens(first) >= len(prompt) // 4 * 4 - 4  # the prefill side computed it
    metrics = httpx.get(f"{base}/metrics").text
    assert _metric(metrics, "pagedkv_pd_prefill_requests_total") == 1
    assert _metric(metrics, "pagedkv_prefix_hit_tokens_by_tier_total{replica") > 0
    assert _metric(metrics, "pagedkv_pd_local_prefills_total") == 0
    store_hits = [
        ln
        for ln in metrics.splitlines()
        if ln.startswith("pagedkv_prefix_hit_tokens_by_tier_total") and 'tier="store"' in ln
    ]
    assert _metric("\n".join(store_hits), "pagedkv_prefix_hit_tokens_by_tier_total") > 0


def test_a_mismatched_pair_is_refused_when_the_application_is_built(env):
    from ray import serve

    model, port, store = env
    serve.delete("pagedkv")  # the route prefix / is the new application's
    cfg = _pd_config(model, port, store, prefill_block_size=8)
    with pytest.raises(UsageError) as err:
        start_app(cfg)
    message = str(err.value)
    assert "page format mismatch" in message and "block_size 4 (decode) vs 8 (prefill)" in message
    assert "mismatch" not in {
        name
        for name, a in serve.status().applications.items()
        if str(a.status) in ("RUNNING", "ApplicationStatus.RUNNING")
    }
