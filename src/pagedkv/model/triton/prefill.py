"""Paged prefill attention: a batch of query chunks of any lengths against the KV pool.

Every sequence of the batch brings ``q_len`` new tokens (a whole prompt, a chunk on top of a
cached prefix, or a single decode row); their K/V are already in the pool. New token ``i`` sits
at position ``context_len - q_len + i`` and attends keys ``0..position`` (causal, aligned to the
bottom right), so a prefix hit or an earlier chunk is read straight through the block table:
nothing is gathered into a contiguous copy.

Grid: one program per (query tile, query head). A query tile is ``block_m`` consecutive new
tokens of one sequence (``prefill_tiles`` lists them on the host, so tiles never straddle two
sequences; a step's decode rows may be left to the decode kernel).
Why per query head and not per KV head with the GQA group folded into rows: the tile's rows are
then always exactly ``block_m`` (no padding of odd groups such as 3 up to a power of two), and
the group's programs read the same K/V blocks close together in time, so the repeat loads are
served from L2. A program walks the sequence's keys through the block table only up to the last
position its last row may see; blocks beyond it are never loaded.

The keys come in K/V tiles of ``T`` tokens gathered through the block table
(``decode_tiles.tile_offsets``): the tile is not the page, so any block size runs, from 1 to one
``max_model_len`` region; ``T`` is ``triton_rules.kv_tile``'s, so that K and V of a few
pipelined tiles fit a program's shared memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.model.triton.decode_tiles import (
    LOG2_E,
    dot_precision,
    pipeline_stages,
    pool_strides,
    tile_offsets,
    tile_tokens,
    upcast_dots,
)
from pagedkv.pages.triton_rules import PREFILL

RULE = PREFILL  # any block size; head dim a power of two in [16, 256]


def prefill_tiles(
    query_start_loc: list[int], block_m: int, min_q_len: int = 1
) -> list[tuple[int, int]]:
    """(sequence index, first query row of the tile within that sequence) for every
    ``block_m``-row tile of queries, sequence by sequence: pure Python, host side (the caller
    makes an int32 [num_tiles, 2] tensor of it). A sequence with fewer than ``min_q_len`` new
    tokens has no tile (``min_q_len`` 2: the decode rows run on the decode kernel)."""
    tiles = []
    for seq in range(len(query_start_loc) - 1):
        q_len = query_start_loc[seq + 1] - query_start_loc[seq]
        if q_len >= min_q_len:
            tiles.extend((seq, row) for row in range(0, q_len, block_m))
    return tiles


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    block_tables_ptr,
    context_lens_ptr,
    query_start_loc_ptr,
    tiles_ptr,
    scale_log2,  # softmax scale times log2(e)
    stride_qt,
    stride_qh,
    stride_kn,
    stride_kb,
    stride_kh,
    stride_vn,
    stride_vb,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_table,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # query rows per tile
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block: any >= 1
    BLOCK_N: tl.constexpr,  # keys per K/V tile (T), gathered through the block table
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (TF32 breaks greedy equality)
    UPCAST_DOTS: tl.constexpr,  # decode_tiles.upcast_dots: the interpreter's 16-bit dots
    NUM_STAGES: tl.constexpr,  # the key loop's software pipelining depth
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq = tl.load(tiles_ptr + tile * 2)
    first_row = tl.load(tiles_ptr + tile * 2 + 1)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - tl.load(query_start_loc_ptr + seq)
    context_len = tl.load(context_lens_ptr + seq)
    past_len = context_len - q_len  # keys before the first new token (cached prefix)

    rows = first_row + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    positions = past_len + rows  # each row's own position: the last key it sees
    dims = tl.arange(0, HEAD_DIM)
    offs_in_tile = tl.arange(0, BLOCK_N)

    q_offs = (q_start + rows.to(tl.int64))[:, None] * stride_qt + head * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None], other=0.0)
    q = q.to(k_ptr.dtype.element_ty)  # both dot operands in the cache dtype
    if UPCAST_DOTS:
        q = q.to(tl.float32)

    # The tile's last valid row sees the most keys; rows past q_len are never stored.
    last_row = tl.minimum(first_row + BLOCK_M, q_len) - 1
    key_end = past_len + last_row + 1

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (base-2 scores)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    for first_key in tl.range(0, key_end, BLOCK_N, num_stages=NUM_STAGES):
        keys = first_key + offs_in_tile
        k_offs, key_ok = tile_offsets(
            table_row, first_key, key_end, offs_in_tile, stride_kn, stride_kb, BLOCK_SIZE, BLOCK_N
        )
        v_offs, _ = tile_offsets(
            table_row, first_key, key_end, offs_in_tile, stride_vn, stride_vb, BLOCK_SIZE, BLOCK_N
        )
        # Slots past the context hold stale or uninitialised data (maybe NaN): load zeros there,
        # since a masked score still multiplies V in the P@V dot (0 * NaN is NaN).
        k = tl.load(k_head + k_offs[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)
        v = tl.load(v_head + v_offs[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)
        p_dtype = v.dtype  # the probabilities are rounded to V's dtype, as a 16-bit dot takes
        if UPCAST_DOTS:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        visible = (keys[None, :] <= positions[:, None]) & key_ok[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        # Tile 0 always shows key 0 to every row (positions >= 0), so m_new is finite from
        # the first tile on and exp2 never sees -inf - -inf.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc += tl.dot(p.to(p_dtype).to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    o_offs = (q_start + rows.to(tl.int64))[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tiles: torch.Tensor,
    scale: float,
    *,
    block_m: int = 16,
    out: torch.Tensor | None = None,
    tile: int | None = None,
) -> torch.Tensor:
    """Varlen paged attention of a batch of chunks.

    q [T, Hq, D]: the new tokens of every sequence, concatenated in batch order as
    ``query_start_loc`` int32 [S+1] says. k_cache / v_cache [N, B, Hkv, D] already hold the new
    tokens' K/V. block_tables int32 [S, W]; context_lens int32 [S]: each sequence's total
    context including its new tokens; tiles int32 [num_tiles, 2] from ``prefill_tiles`` with
    the same ``block_m``. New token i of sequence s attends keys 0..context_lens[s] - q_len + i.

    Returns ``out`` [T, Hq, D] in q's dtype (written in place when given; rows no tile covers
    are left as they were). ``tile``: keys per K/V tile (None: ``triton_rules.kv_tile``'s
    rule). UsageError for a head dim the kernel refuses (``PREFILL``; any block size is fine).
    Reads only shapes on the host, never values: usable inside CUDA-graph capture.
    """
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_q_heads = q.shape[1]
    out = torch.empty_like(q) if out is None else out
    _check(q, k_cache, v_cache, out, block_m)
    if tiles.shape[0] == 0:
        return out
    grid = (tiles.shape[0], num_q_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        context_lens,
        query_start_loc,
        tiles,
        scale * LOG2_E,
        q.stride(0),
        q.stride(1),
        *pool_strides(k_cache, v_cache),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        GROUP=num_q_heads // num_kv_heads,
        BLOCK_M=block_m,
        BLOCK_SIZE=block_size,
        BLOCK_N=tile_tokens(k_cache, tile),
        HEAD_DIM=head_dim,
        DOT_PRECISION=dot_precision(k_cache.dtype),
        UPCAST_DOTS=upcast_dots(k_cache.dtype),
        NUM_STAGES=pipeline_stages(),
    )
    return out


def _check(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, block_m: int
) -> None:
    """``paged_prefill``'s argument checks (UsageError or ValueError)."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    RULE.check(block_size, head_dim)
    _, num_q_heads, q_head_dim = q.shape
    if q_head_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} / v {tuple(v_cache.shape)} do not match the pool")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads}")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m {block_m} is not a power of two >= 16 (tl.dot's tile)")
    if any(t.stride(-1) != 1 for t in (q, k_cache, v_cache, out)):
        raise ValueError("the head dim of q, out and the caches must be contiguous")
