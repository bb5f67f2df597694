"""Store fixtures: one real redis-server per session (flushed before each test), and a factory
for tests that kill their own."""

from __future__ import annotations

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
