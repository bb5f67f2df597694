"""Engine fixtures: the embedded model is loaded once; engines are cheap to build around it."""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine import EngineConfig, LLMEngine
from pagedkv.engine.startup import build_parts
from pagedkv.model import load_model


@pytest.fixture(scope="package", autouse=True)
def _one_torch_thread():
    """One intra-op thread: a two-thread OpenMP team that loses a core to another process
    stalls at every barrier; speed is measured in benchmarks/, not here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def embedded_model():
    return load_model(None, progress=False)


@pytest.fixture
def make_engine(embedded_model):
    """``make_engine(**config)`` -> an LLMEngine on the embedded model (fp32)."""

    def make(**overrides) -> LLMEngine:
        overrides.setdefault("log_startup", False)
        overrides.setdefault("max_model_len", 512)
        config = EngineConfig(**overrides)
        return LLMEngine(config, parts=build_parts(config, embedded_model))

    return make


def assert_no_leaks(engine: LLMEngine) -> None:
    engine.allocator.check_invariants()
    stats = engine.allocator.stats()
    assert stats.num_used_blocks == 0 and stats.num_seqs == 0, stats
    assert not engine.scheduler.has_unfinished()
