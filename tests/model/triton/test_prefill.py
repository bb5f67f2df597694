"""paged_prefill against a plain torch reference: each sequence's K/V gathered through its block
table, the bottom-right causal mask built explicitly, softmax attention in float64.

Runs under the Triton interpreter (conftest.py), so shapes stay tiny: a covering set of block
sizes, GQA ratios and head dims, not their cross product.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.errors import UsageError
from pagedkv.model.triton.prefill import paged_prefill, prefill_tiles
from pagedkv.pages.triton_rules import kv_tile

FP32_TOL = 1e-5
BF16_TOL = 3e-2


def make_batch(block_size, num_kv_heads, group, head_dim, seqs, dtype=torch.float32, seed=0):
    """A pool holding every sequence's K/V in shuffled blocks and the new tokens' queries.
    ``seqs``: (context_len, q_len) per sequence. Slots no sequence owns are NaN, so a kernel
    that reads past a context shows it."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for ctx, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks: the ids are not 0..n-1
    ids = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_seq)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    used = 0
    for s, (ctx, _) in enumerate(seqs):
        tables[s, : blocks_per_seq[s]] = ids[used : used + blocks_per_seq[s]].to(torch.int32)
        used += blocks_per_seq[s]
        for pos in range(ctx):
            block, offset = int(tables[s, pos // block_size]), pos % block_size
            k_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen)
            v_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen)
    q_lens = [q_len for _, q_len in seqs]
    query_start_loc = [0]
    for q_len in q_lens:
        query_start_loc.append(query_start_loc[-1] + q_len)
    q = torch.randn(query_start_loc[-1], num_kv_heads * group, head_dim, generator=gen).to(dtype)
    context_lens = torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32)
    return q, k_cache, v_cache, tables, context_lens, query_start_loc


def reference(q, k_cache, v_cache, tables, context_lens, query_start_loc, scale):
    """softmax(q k^T * scale) v per sequence and query head, float64."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for s in range(len(query_start_loc) - 1):
        start, end = query_start_loc[s], query_start_loc[s + 1]
        ctx, q_len = int(context_lens[s]), end - start
        positions = torch.arange(ctx)
        slots = tables[s, positions // block_size].long() * block_size + positions % block_size
        k = k_cache.reshape(-1, num_kv_heads, k_cache.shape[3])[slots].double()
        v = v_cache.reshape(-1, num_kv_heads, v_cache.shape[3])[slots].double()
        k = k.repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].double(), k) * scale
        query_positions = ctx - q_len + torch.arange(q_len)
        visible = positions[None, :] <= query_positions[:, None]  # [q_len, ctx]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    return out


def run_and_compare(
    block_size, num_kv_heads, group, head_dim, seqs, *, block_m=16, dtype=None, tile=None
):
    dtype = dtype or torch.float32
    q, k_cache, v_cache, tables, context_lens, qsl = make_batch(
        block_size, num_kv_heads, group, head_dim, seqs, dtype
    )
    scale = head_dim**-0.5
    tiles = torch.tensor(prefill_tiles(qsl, block_m), dtype=torch.int32)
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    out = paged_prefill(
        q, k_cache, v_cache, tables, context_lens, qsl_t, tiles, scale, block_m=block_m,
        tile=tile,
    )  # fmt: skip
    assert out.dtype == q.dtype and out.shape == q.shape
    expected = reference(q, k_cache, v_cache, tables, context_lens, qsl, scale)
    err = (out.double() - expected).abs().max().item()
    print(
        f"\nprefill B={block_size} Hkv={num_kv_heads} group={group} D={head_dim} {dtype}: "
        f"max abs error {err:.2e}"
    )
    return err


@pytest.mark.parametrize(
    ("block_size", "num_kv_heads", "group", "head_dim"),
    [(1, 1, 1, 64), (3, 2, 4, 128), (16, 1, 8, 64), (64, 2, 3, 128), (256, 1, 4, 64)],
)
@pytest.mark.parametrize("tile", [16, 32])
def test_whole_prompts_of_lengths_around_a_block_and_a_tile(
    block_size, num_kv_heads, group, head_dim, tile
):
    """Prompts of 1, B - 1, B, B + 1, T - 1, T + 1 tokens: the tile is not the page, any B."""
    lengths = sorted({1, max(block_size - 1, 1), block_size, block_size + 1, tile - 1, tile + 1})
    seqs = [(n, n) for n in lengths]
    err = run_and_compare(block_size, num_kv_heads, group, head_dim, seqs, tile=tile)
    assert err < FP32_TOL


def test_a_max_model_len_region_with_a_chunk_on_a_prefix():
    """The reserved policy's block (one region of 200 slots a sequence): a whole prompt, a
    chunk on a cached prefix, a decode row."""
    seqs = [(150, 150), (199, 40), (77, 1)]
    assert run_and_compare(200, 1, 4, 64, seqs, tile=32) < FP32_TOL


@pytest.mark.parametrize(("block_size", "group"), [(2, 8), (16, 4), (32, 1)])
def test_ragged_batch_prompt_prefix_chunk_and_decode_row(block_size, group):
    # A whole prompt, 7 new tokens on a cached prefix of 2B-2 (context 2B+5), a decode row.
    seqs = [(20, 20), (2 * block_size + 5, 7), (block_size + 3, 1)]
    assert run_and_compare(block_size, 1, group, 64, seqs) < FP32_TOL


@pytest.mark.parametrize("block_m", [16, 32])
def test_tile_boundary(block_m):
    # q_len = block_m + 1: a second tile of one row, alone and on top of a prefix.
    seqs = [(block_m + 1, block_m + 1), (block_m + 1 + 40, block_m + 1)]
    assert run_and_compare(16, 1, 2, 64, seqs, block_m=block_m) < FP32_TOL


def test_bf16():
    seqs = [(20, 20), (37, 7), (19, 1)]
    assert run_and_compare(16, 1, 4, 64, seqs, dtype=torch.bfloat16) < BF16_TOL


def test_out_is_written_in_place():
    q, k_cache, v_cache, tables, context_lens, qsl = make_batch(16, 1, 2, 64, [(5, 5)])
    tiles = torch.tensor(prefill_tiles(qsl, 16), dtype=torch.int32)
    out = torch.zeros_like(q)
    got = paged_prefill(
        q,
        k_cache,
        v_cache,
        tables,
        context_lens,
        torch.tensor(qsl, dtype=torch.int32),
        tiles,
        0.125,
        out=out,
    )
    assert got is out
    expected = reference(q, k_cache, v_cache, tables, context_lens, qsl, 0.125)
    assert (out.double() - expected).abs().max().item() < FP32_TOL


def test_prefill_tiles():
    assert prefill_tiles([0, 17, 17, 18, 50], 16) == [(0, 0), (0, 16), (2, 0), (3, 0), (3, 16)]
    assert prefill_tiles([0], 16) == []
    # min_q_len 2: the decode rows (sequence 2's one token) are left to the decode kernel.
    assert prefill_tiles([0, 17, 17, 18, 50], 16, 2) == [(0, 0), (0, 16), (3, 0), (3, 16)]


@pytest.mark.parametrize(("block_size", "head_dim"), [(16, 80), (16, 512), (3, 8)])
def test_refused_head_dims(block_size, head_dim):
    """Every block size runs; a head dim that is no tl.arange extent in [16, 256] does not."""
    k_cache = torch.zeros(1, block_size, 1, head_dim)
    q = torch.zeros(1, 1, head_dim)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(UsageError):
        paged_prefill(
            q,
            k_cache,
            k_cache,
            torch.zeros(1, 1, dtype=torch.int32),
            one,
            torch.tensor([0, 1], dtype=torch.int32),
            torch.zeros(1, 2, dtype=torch.int32),
            1.0,
        )


def test_kv_tile_rule_by_hand():
    """16 KiB a K (or V) tile, at most 64 tokens, never under tl.dot's 16."""
    assert kv_tile(128, 2) == 64  # bf16: 64 x 128 x 2 = 16 KiB
    assert kv_tile(128, 4) == 32  # fp32
    assert kv_tile(64, 4) == 64
    assert kv_tile(256, 2) == 32
    assert kv_tile(256, 4) == 16
    assert kv_tile(512, 4) == 16  # never under 16
