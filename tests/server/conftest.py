"""Server fixtures: models are loaded once; each server runs on a free loopback port."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.engine import EngineConfig, LLMEngine
from pagedkv.engine.startup import build_parts
from pagedkv.model import load_model
from pagedkv.server import ServerConfig, create_app, start_in_background
from pagedkv.server.config import DEFAULT_MAX_SAMPLES_PER_REQUEST

LOOPBACK = "127.0.0.1"
MODEL_NAME = "test-model"


@pytest.fixture(scope="session")
def tiny_loaded(tmp_path_factory):
    """A tiny random Llama (vocab 300, context 128): fast, its text means nothing."""
    from tests.model.tiny import make_tiny_model

    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", folder)
    return load_model(folder, progress=False)


@pytest.fixture(scope="session")
def tiny_2k_loaded(tmp_path_factory):
    """A tiny random Llama with a context of 2048: its byte-level tokenizer makes a tool list
    and its instructions ~900 tokens long."""
    from tests.model.tiny import make_tiny_model

    folder = tmp_path_factory.mktemp("tiny-llama-2k")
    make_tiny_model("llama", folder, context_len=2048)
    return load_model(folder, progress=False)


@contextlib.contextmanager
def running_server(
    loaded,
    api_key: str | None = None,
    graceful_shutdown_s: float = 5.0,
    max_samples_per_request: int = DEFAULT_MAX_SAMPLES_PER_REQUEST,
    **engine_overrides,
) -> Iterator:
    """Yield ``(base_url, app)`` of a server on a free loopback port; stops it afterwards.
    ``app.state.server`` is the ``BackgroundServer`` (for tests that stop it themselves)."""
    engine_overrides.setdefault("log_startup", False)
    config = EngineConfig(**engine_overrides)
    engine = LLMEngine(config, parts=build_parts(config, loaded))
    server_config = ServerConfig(
        served_model_name=MODEL_NAME,
        host=LOOPBACK,
        port=0,
        api_key=api_key,
        log_level="warning",
        graceful_shutdown_s=graceful_shutdown_s,
        max_samples_per_request=max_samples_per_request,
    )
    app = create_app(engine, server_config)
    with start_in_background(app, server_config) as server:
        app.state.server = server
        yield server.url, app


def metrics(base_url: str) -> dict[str, float]:
    """``/metrics`` as {"name{label=value,...}": value}, labels sorted."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll until ``predicate()`` holds; fail the test with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def assert_idle(base_url: str, timeout_s: float = 10.0) -> None:
    """Eventually no block in use, nothing running, waiting or in flight."""

    def idle() -> bool:
        m = metrics(base_url)
        return (
            m["pagedkv_kv_blocks_used"] == 0
            and m["pagedkv_sequences_running"] == 0
            and m["pagedkv_sequences_waiting"] == 0
            and m["pagedkv_requests_in_flight"] == 0
        )

    wait_for(idle, timeout_s, "the server to hold no KV block and no request")
