"""Store fixtures: one real redis-server per session (flushed before each test), and a factory
for tests that kill their own."""

from __future__ import annotations

from pathlib import Path

import pytest

from .redis_server import RedisServer


@pytest.fixture(scope="session")
def _redis_session(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(_redis_session) -> str:
    """The URL of a running, empty redis-server."""
    import redis

    client = redis.Redis.from_url(_redis_session.url)
    client.flushall()
    client.close()
    return _redis_session.url


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server of this test's own (it may kill it); stopped afterwards."""
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> Path:
    """A tiny random Llama checkpoint (vocab 300, context 128, 2 layers)."""
    from tests.model.tiny import make_tiny_model

    folder = tmp_path_factory.mktemp("tiny-store")
    make_tiny_model("llama", folder)
    return folder


@pytest.fixture(scope="session")
def tiny(tiny_folder):
    """``(config, model, tokenizer)`` of ``tiny_folder``, loaded once."""
    from pagedkv.model import load_model

    return load_model(tiny_folder, progress=False)
