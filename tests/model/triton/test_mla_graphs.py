"""MLA decode under CUDA graphs (a CPU stand-in for the graph object, the Triton kernels under
the interpreter; issue 55): a replayed decode step of the tiny random DeepSeek-V3 gives the
eager step's logits (Triton and the native CPU path), and its padding row writes no latent
record."""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine import EngineConfig, LLMEngine
from pagedkv.engine.startup import build_parts
from pagedkv.model.attention_metadata import AttentionMetadata
from pagedkv.model.triton.attention import TritonPlan
from tests.model.triton.test_engine_triton import _Replayed


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    from pagedkv.model import load_model
    from tests.model.tiny import make_tiny_model

    folder = tmp_path_factory.mktemp("tiny-deepseek-graphs")
    make_tiny_model("deepseek_v3", folder)
    return load_model(folder, progress=False)


def test_mla_decode_graph_replays_equal_the_eager_step(deepseek):
    config = EngineConfig(max_model_len=128, kv_cache_memory_bytes=1 << 20, block_size=16,
                          attention_backend="triton", max_num_seqs=6, log_startup=False)  # fmt: skip
    runner = LLMEngine(config, parts=build_parts(config, deepseek)).parts.runner
    runner.capture_graphs(6, 128, graph_factory=_Replayed)
    tables = torch.tensor([[9, 0], [3, 12], [20, 7]], dtype=torch.int32)
    ctx = torch.tensor([6, 18, 31], dtype=torch.int32)
    pos = (ctx - 1).to(torch.int64)
    slots = tables[torch.arange(3), pos // 16].to(torch.int64) * 16 + pos % 16
    meta = AttentionMetadata(slots, tables, ctx, torch.arange(4, dtype=torch.int32))
    ids = torch.tensor([11, 22, 33])
    gen = torch.Generator().manual_seed(0)
    for (pool,) in runner.kv_caches:
        pool.copy_(torch.randn(pool.shape, generator=gen))
    before = [pool.clone() for (pool,) in runner.kv_caches]
    replayed = runner.graphs.run(ids, pos, meta)  # bucket 4: one padding row
    assert runner.graphs.replays == 1
    for old, (new,) in zip(before, runner.kv_caches, strict=True):
        old.view(-1, old.shape[-1])[slots] = new.view(-1, new.shape[-1])[slots]
        assert torch.equal(old, new)  # only the 3 real slots changed
    model = runner.model
    plan = TritonPlan(meta, 16, 1, torch.device("cpu"), runner.backend.kernels)
    eager = model.compute_logits(model(ids, pos, runner.kv_caches, meta, 16, plan))
    torch.testing.assert_close(replayed, eager, rtol=0, atol=1e-6)
    native = model.compute_logits(model(ids, pos, runner.kv_caches, meta, 16, None))
    torch.testing.assert_close(replayed, native, rtol=0, atol=1e-5)
