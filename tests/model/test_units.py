"""Small pieces checked against independent formulations."""

from __future__ import annotations

import torch

from pagedkv.model.gguf import unpermute_qk_rows
from pagedkv.pages.page_format import PageFormat


def _llama_cpp_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The row order llama.cpp's converter writes: per head, rows i and i + d/2 become a pair."""
    d = w.shape[0] // num_heads
    out = torch.empty_like(w)
    for h in range(num_heads):
        for i in range(d // 2):
            out[h * d + 2 * i] = w[h * d + i]
            out[h * d + 2 * i + 1] = w[h * d + d // 2 + i]
    return out


def test_unpermute_inverts_llama_cpp_row_order():
    w = torch.randn(3 * 8, 5)
    assert torch.equal(unpermute_qk_rows(_llama_cpp_permute(w, 3), 3), w)
    b = torch.randn(2 * 4)
    assert torch.equal(unpermute_qk_rows(_llama_cpp_permute(b[:, None], 2)[:, 0], 2), b)


def test_runner_prepare_lays_out_a_mixed_step_from_the_allocator():
    """The engine's one slot-mapping path (ModelRunner.prepare over an allocator), against
    slots computed here from each sequence's block table: slot = table[p // B] * B + p % B."""
    from pagedkv.engine.runner import ModelRunner
    from pagedkv.kvcache.paged import PagedAllocator
    from pagedkv.sched.batch import ScheduledBatch, ScheduledSeq
    from pagedkv.sched.sequence import Seq
    from tests.model.tiny import tiny_model_config

    block_size = 4
    allocator = PagedAllocator(16, block_size, prefix_caching=False)
    seqs = [Seq(i, f"r{i}", [10 * i + t for t in range(n)], 8) for i, n in enumerate((9, 5))]
    allocator.allocate(seqs[0], 6)  # seq 0: 6 tokens computed, then a 3-token chunk
    allocator.allocate(seqs[0], 3)
    allocator.allocate(seqs[1], 5)  # seq 1: a whole 5-token prefill
    batch = ScheduledBatch(
        0, (ScheduledSeq(seqs[0], 6, 3, 1, 0), ScheduledSeq(seqs[1], 0, 5, 0, 0))
    )
    cfg = tiny_model_config()
    page = PageFormat.mha(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, "fp32", block_size)
    runner = ModelRunner(None, cfg, page, 16)
    inputs = runner.prepare(batch, allocator)

    tables = [list(allocator.block_table(s)) for s in seqs]
    chunks = [(0, 6, 9), (1, 0, 5)]
    positions = [p for _, start, end in chunks for p in range(start, end)]
    slots = [tables[i][p // block_size] * block_size + p % block_size for i, s, e in chunks
             for p in range(s, e)]  # fmt: skip
    assert inputs.input_ids.tolist() == [6, 7, 8, 10, 11, 12, 13, 14]
    assert inputs.positions.tolist() == positions
    assert inputs.metadata.slot_mapping.tolist() == slots
    assert len(set(slots)) == len(slots) and 0 not in [t for row in tables for t in row]
    assert inputs.metadata.block_tables.tolist() == [tables[0], tables[1] + [0]]  # null-padded
    assert inputs.metadata.context_lens.tolist() == [9, 5]
    assert inputs.metadata.query_start_loc.tolist() == [0, 3, 8]
    assert inputs.logit_rows.tolist() == [2]  # only seq 0 samples
