"""Engine fixtures: the embedded model is loaded once; engines are cheap to build around it."""

from __future__ import annotations

import pytest

from pagedkv.engine import EngineConfig, LLMEngine
from pagedkv.engine.startup import build_parts


@pytest.fixture
def make_engine(embedded):
    """``make_engine(**config)`` -> an LLMEngine on the embedded model (fp32)."""

    def make(**overrides) -> LLMEngine:
        overrides.setdefault("log_startup", False)
        overrides.setdefault("max_model_len", 512)
        config = EngineConfig(**overrides)
        return LLMEngine(config, parts=build_parts(config, embedded))

    return make


def assert_no_leaks(engine: LLMEngine) -> None:
    engine.allocator.check_invariants()
    stats = engine.allocator.stats()
    assert stats.num_used_blocks == 0 and stats.num_seqs == 0, stats
    assert not engine.scheduler.has_unfinished()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """``(config, model, tokenizer)`` of a tiny random Llama (``tests/model/tiny.py``)."""
    from pagedkv.model import load_model
    from tests.model.tiny import make_tiny_model

    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", folder)
    return load_model(folder, progress=False)


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory):
    """The tests' tiny random Llama (tests/model/tiny.py) with a 512-token context."""
    from pagedkv.model import load_model
    from tests.model import tiny

    folder = tmp_path_factory.mktemp("tiny-llama-512")
    tiny.make_tiny_model("llama", folder, context_len=512)
    return load_model(folder, progress=False)


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on a free loopback port, killed by its PID afterwards."""
    from tests.kvstore.redis_server import RedisServer

    server = RedisServer(tmp_path).start()
    yield server
    server.stop()
