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
