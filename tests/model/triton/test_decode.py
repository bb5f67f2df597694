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


def run_and_compare(batch, tol, num_splits=1, tile=None):
    q, k_cache, v_cache, block_tables, context_lens = batch
    scale = q.shape[-1] ** -0.5
    got = paged_decode(
        q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=num_splits, tile=tile
    )
    assert got.shape == q.shape and got.dtype == q.dtype
    want = reference(q, k_cache, v_cache, block_tables, context_lens)
    err = (got.double().cpu() - want).abs().max().item()
    print(
        f"\n  B={k_cache.shape[1]} T={tile} Hq/Hkv={q.shape[1]}/{k_cache.shape[2]} "
        f"D={q.shape[2]} splits={num_splits} {q.dtype}: max abs err {err:.2e}"
    )
    assert err < tol
    for s, n in enumerate(context_lens.tolist()):
        if n == 0:  # padding row: exactly zero
            assert torch.count_nonzero(got[s]) == 0
    return got


def edge_contexts(block_size: int, tile: int) -> list[int]:
    """1, B - 1, B, B + 1, T - 1, T, T + 1, a padding row and a longer one, ragged."""
    b, t = block_size, tile
    return sorted({1, max(b - 1, 1), b, b + 1, t - 1, t, t + 1}) + [0, 2 * t + 5]


@pytest.mark.parametrize("tile", [16, 32])
@pytest.mark.parametrize("block_size", [1, 2, 3, 8, 16, 64, 256])
def test_every_block_size_and_tile_with_edge_contexts(block_size, tile):
    """The tile is not the page: a tile gathers ceil(T / B) blocks (B < T), straddles two
    (B = 3 or 8 with T = 16 or 32... and non-powers of two), or is a slice of one (B >= T)."""
    lens = edge_contexts(block_size, tile)
    batch = make_batch(lens, block_size, 8, 2, 64, torch.float32, seed=block_size + tile)
    run_and_compare(batch, FP32_TOL, tile=tile)


def test_a_max_model_len_region_per_sequence():
    """The reserved policy's block: one region of max_model_len (here 300, no power of two)
    per sequence, contexts from 1 to the whole region, one pass and split."""
    lens = [1, 31, 33, 299, 300, 0]
    batch = make_batch(lens, 300, 8, 2, 64, torch.float32, seed=300)
    one_pass = run_and_compare(batch, FP32_TOL, tile=32)
    split = run_and_compare(batch, FP32_TOL, num_splits=3, tile=32)
    assert (split - one_pass).abs().max().item() < FP32_TOL


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_every_gqa_ratio_and_head_dim(group, head_dim):
    """Query heads per KV head 1 (MHA, padded to 16 rows), 4, 8; head dims 64 and 128; B = 3
    (tiles straddle blocks) and the tile the rule picks for fp32."""
    lens = [1, 15, 16, 17, 0, 70]
    batch = make_batch(lens, 3, 2 * group, 2, head_dim, torch.float32, seed=group + head_dim)
    run_and_compare(batch, FP32_TOL)


@pytest.mark.parametrize("block_size", [5, 16])
def test_split_matches_one_pass_and_reference(block_size):
    """2 and 3 splits of whole tiles: several tiles per split on long contexts; context 32
    (2 tiles) leaves the third split empty; context 1 leaves two; a padding row leaves all."""
    lens = [300, 32, 1, 0, 17, 150]
    batch = make_batch(lens, block_size, 4, 1, 64, torch.float32, seed=7)
    one_pass = run_and_compare(batch, FP32_TOL, tile=16)
    for num_splits in (2, 3):
        split = run_and_compare(batch, FP32_TOL, num_splits=num_splits, tile=16)
        assert (split - one_pass).abs().max().item() < FP32_TOL


@pytest.mark.parametrize("block_size", [3, 32])
def test_bf16_pool_and_out_written_in_place(block_size):
    """bf16 q and pools (bf16 dots, fp32 softmax) against the fp32-exact reference of the same
    bf16 values; the split path writes into a given ``out``."""
    lens = [100, 33, 0, 64]
    batch = make_batch(lens, block_size, 4, 1, 64, torch.bfloat16, seed=3)
    run_and_compare(batch, 2e-2)
    q, k_cache, v_cache, block_tables, context_lens = batch
    out = torch.full(q.shape, 7.0, dtype=torch.bfloat16, device=DEVICE)
    got = paged_decode(
        q, k_cache, v_cache, block_tables, context_lens, 0.125, num_splits=2, out=out
    )
    assert got is out
    want = reference(q, k_cache, v_cache, block_tables, context_lens)
    assert (out.double().cpu() - want).abs().max().item() < 2e-2


@pytest.mark.parametrize("num_splits", [1, 2])
def test_rows_place_decode_rows_among_a_mixed_steps_rows(num_splits):
    """A mixed step's decode rows: sequence s reads q[rows[s]] and writes out[rows[s]]; the
    rows no sequence names (a prefill chunk's) are left as they were."""
    lens = [40, 1, 17]
    q, k_cache, v_cache, tables, context = make_batch(lens, 6, 8, 2, 64, torch.float32, seed=11)
    rows = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEVICE)
    wide_q = torch.randn((6, 8, 64)).to(DEVICE)
    wide_q[rows.long()] = q
    out = torch.full_like(wide_q, 5.0)
    paged_decode(wide_q, k_cache, v_cache, tables, context, 64**-0.5, num_splits=num_splits,
                 out=out, rows=rows, tile=16)  # fmt: skip
    want = reference(q, k_cache, v_cache, tables, context)
    assert (out[rows.long()].double().cpu() - want).abs().max().item() < FP32_TOL
    untouched = [r for r in range(6) if r not in rows.tolist()]
    assert bool((out[untouched] == 5.0).all())


@pytest.mark.parametrize(("block_size", "head_dim"), [(0, 64), (16, 80), (16, 512)])
def test_refused_sizes_raise_usage_error(block_size, head_dim):
    """Only the head dim (a tl.arange extent) and non-positive block sizes are refused."""
    k_cache = torch.zeros((1, max(block_size, 1), 1, head_dim))
    q = torch.zeros((1, 1, head_dim))
    tables = torch.zeros((1, 1), dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    if block_size == 0:
        k_cache = torch.zeros((1, 0, 1, head_dim))
    with pytest.raises(UsageError, match="triton paged decode"):
        paged_decode(q, k_cache, k_cache, tables, lens, 1.0)


@pytest.mark.parametrize(
    ("num_seqs", "num_kv_heads", "max_context_len", "num_sms", "want"),
    [
        (1, 8, 4096, 132, 33),  # 264 // 8 = 33 programs per (seq, head); 4096 // 64 allow 64
        (64, 8, 4096, 132, 1),  # 512 programs >= 264: the grid already fills the GPU
        (33, 8, 4096, 132, 1),  # exactly 264 programs: full
        (1, 8, 100, 132, 1),  # 100 tokens: not two splits of 64
        (1, 8, 128, 132, 2),  # 128 tokens: two splits of 64
        (2, 4, 512, 132, 8),  # 512 // 64 = 8 caps 264 // 8 = 33
        (1, 1, 1 << 20, 132, 64),  # MAX_SPLITS caps 264
        (3, 2, 4096, 10, 3),  # 20 // 6 = 3
        (0, 8, 4096, 132, 1),  # empty batch
        (1, 8, 0, 132, 1),  # no context
    ],
)
def test_decode_splits_rule(num_seqs, num_kv_heads, max_context_len, num_sms, want):
    assert decode_splits(num_seqs, num_kv_heads, max_context_len, num_sms) == want
