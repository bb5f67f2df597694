"""Fixtures of the real-process P/D tests: a tiny random Llama and a redis-server."""

from __future__ import annotations

import pytest

from tests.kvstore.redis_server import RedisServer


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from tests.model.tiny import make_tiny_model

    folder = tmp_path_factory.mktemp("tiny-pd")
    make_tiny_model("llama", folder)
    return folder


@pytest.fixture
def redis(tmp_path):
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()
