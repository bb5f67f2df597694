"""Paged decode attention (one pass and split-K) against a torch reference that gathers each
sequence's K/V through its block table and runs plain softmax attention in float64.

Runs under the Triton interpreter on CPU (conftest.py); with TRITON_INTERPRET=0 on a GPU machine
the same tests run on cuda. Shapes are small: the interpreter executes every program in Python.
"""

from __future__ import annotations

import os

import pytest
import torch

from pagedkv.errors import UsageError
from pagedkv.model.triton.decode import paged_decode
from pagedkv.model.triton.decode_split import decode_splits

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
FP32_TOL = 2e-5


def make_batch(context_lens, block_size, num_q_heads, num_kv_heads, head_dim, dtype, seed=0):
    """q [S, Hq, D] as a strided view (every other head of a wider tensor), pools with spare
    blocks, block tables of shuffled (non-contiguous) block ids padded with 0."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen)
    width = max(max(blocks_per_seq), 1) + 1
    block_tables = torch.zeros((len(context_lens), width), dtype=torch.int32)
    taken = 0
    for row, n in enumerate(blocks_per_seq):
        block_tables[row, :n] = ids[taken : taken + n]
        taken += n
    wide_q = torch.randn((len(context_lens), 2 * num_q_heads, head_dim), generator=gen)
    q = wide_q.to(dtype)[:, ::2]
    context = torch.tensor(context_lens, dtype=torch.int32)
    return [t.to(DEVICE) for t in (q, k_cache, v_cache, block_tables, context)]


def reference(q, k_cache, v_cache, block_tables, context_lens):
    """float64 softmax(q K^T * scale) V per sequence, K/V gathered slot by slot."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    k_flat = k_cache.double().reshape(-1, num_kv_heads, head_dim).cpu()
    v_flat = v_cache.double().reshape(-1, num_kv_heads, head_dim).cpu()
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s, n in enumerate(context_lens.tolist()):
        if n == 0:
            continue
        t = torch.arange(n)
        slots = block_tables[s].cpu().long()[t // block_size] * block_size + t % block_size
        k = k_flat[slots].repeat_interleave(group, dim=1)  # [n, Hq, D]: head h reads h // group
        v = v_flat[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[s].double().cpu(), k) / head_dim**0.5
        out[s] = torch.einsum("ht,thd->hd", scores.softmax(-1), v)
    return out


def run_and_compare(batch, tol, num_splits=1):
    q, k_cache, v_cache, block_tables, context_lens = batch
    scale = q.shape[-1] ** -0.5
    got = paged_decode(
        q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=num_splits
    )
    assert got.shape == q.shape and got.dtype == q.dtype
    want = reference(q, k_cache, v_cache, block_tables, context_lens)
    err = (got.double().cpu() - want).abs().max().item()
    print(
        f"\n  B={k_cache.shape[1]} Hq/Hkv={q.shape[1]}/{k_cache.shape[2]} D={q.shape[2]} "
        f"splits={num_splits} {q.dtype}: max abs err {err:.2e}"
    )
    assert err < tol
    for s, n in enumerate(context_lens.tolist()):
        if n == 0:  # padding row: exactly zero
            assert torch.count_nonzero(got[s]) == 0
    return got


@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
def test_every_block_size_with_edge_contexts(block_size):
    """Contexts 1, B-1, B, B+1, a longer one and a padding row, ragged in one call; GQA 4."""
    b = block_size
    lens = [1, b - 1, b, b + 1, 0, 2 * b + 5]
    run_and_compare(make_batch(lens, b, 8, 2, 64, torch.float32, seed=b), FP32_TOL)


@pytest.mark.parametrize("group", [1, 3, 8])
def test_every_gqa_ratio_head_dim_128(group):
    """Query heads per KV head 1 (MHA), 3 (group padded to 16 rows), 8; block size 16."""
    lens = [1, 15, 16, 17, 0, 70]
    batch = make_batch(lens, 16, 2 * group, 2, 128, torch.float32, seed=group)
    run_and_compare(batch, FP32_TOL)


def test_split_matches_one_pass_and_reference():
    """2 and 3 splits: several blocks per split on long contexts; context 32 (2 blocks) leaves
    the third split empty; context 1 leaves two; a padding row leaves all empty."""
    lens = [300, 32, 1, 0, 17, 150]
    batch = make_batch(lens, 16, 4, 1, 64, torch.float32, seed=7)
    one_pass = run_and_compare(batch, FP32_TOL)
    for num_splits in (2, 3):
        split = run_and_compare(batch, FP32_TOL, num_splits=num_splits)
        assert (split - one_pass).abs().max().item() < FP32_TOL


def test_bf16_pool_and_out_written_in_place():
    """bf16 q and pools (bf16 dots, fp32 softmax) against the fp32-exact reference of the same
    bf16 values; the split path writes into a given ``out``."""
    lens = [100, 33, 0, 64]
    batch = make_batch(lens, 32, 4, 1, 64, torch.bfloat16, seed=3)
    run_and_compare(batch, 2e-2)
    q, k_cache, v_cache, block_tables, context_lens = batch
    out = torch.full(q.shape, 7.0, dtype=torch.bfloat16, device=DEVICE)
    got = paged_decode(
        q, k_cache, v_cache, block_tables, context_lens, 0.125, num_splits=2, out=out
    )
    assert got is out
    want = reference(q, k_cache, v_cache, block_tables, context_lens)
    assert (out.double().cpu() - want).abs().max().item() < 2e-2


@pytest.mark.parametrize(("block_size", "head_dim"), [(12, 64), (8, 64), (512, 64), (16, 80)])
def test_refused_sizes_raise_usage_error(block_size, head_dim):
    k_cache = torch.zeros((1, block_size, 1, head_dim))
    q = torch.zeros((1, 1, head_dim))
    tables = torch.zeros((1, 1), dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    with pytest.raises(UsageError, match="triton paged decode"):
        paged_decode(q, k_cache, k_cache, tables, lens, 1.0)


@pytest.mark.parametrize(
    ("num_seqs", "num_kv_heads", "max_context_len", "block_size", "num_sms", "want"),
    [
        (1, 8, 4096, 16, 132, 33),  # 264 // 8 = 33 programs per (seq, head); 64 blocks allow it
        (64, 8, 4096, 16, 132, 1),  # 512 programs >= 264: the grid already fills the GPU
        (33, 8, 4096, 16, 132, 1),  # exactly 264 programs: full
        (1, 8, 100, 16, 132, 1),  # 7 blocks: not two splits of 4 blocks
        (1, 8, 128, 16, 132, 2),  # 8 blocks: two splits of 4
        (2, 4, 4096, 128, 132, 8),  # 32 blocks // 4 = 8 caps 264 // 8 = 33
        (1, 1, 1 << 20, 16, 132, 64),  # MAX_SPLITS caps 264
        (3, 2, 4096, 16, 10, 3),  # 20 // 6 = 3
        (0, 8, 4096, 16, 132, 1),  # empty batch
        (1, 8, 0, 16, 132, 1),  # no context
    ],
)
def test_decode_splits_rule(num_seqs, num_kv_heads, max_context_len, block_size, num_sms, want):
    assert decode_splits(num_seqs, num_kv_heads, max_context_len, block_size, num_sms) == want
