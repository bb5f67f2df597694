"""Paged decode attention in one launch ("one pass"): one new query token per sequence attends
to that sequence's whole context, read in tiles of ``T`` tokens through its block table.

One program per (sequence, KV head). It holds all ``G = Hq / Hkv`` query heads sharing that KV
head as the rows of one tile (padded to at least 16 rows, masked, because ``tl.dot`` needs 16
along every dimension), so each K/V tile is read from memory once per group (GQA), not once per
query head. Per tile: scores = q K^T * scale in fp32, positions at or past the context length
masked, an online softmax (running max and sum in fp32) and acc += p V.

The loop itself, ``attend_tiles``, lives in decode_tiles.py: decode_split.py runs it on one
split of the context per program and combines the splits afterwards. ``rows`` (optional) maps
sequence ``s`` to its row of ``q`` and ``out``: the decode rows of a mixed step run here, among
prefill chunks, without a gather or a scatter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.model.triton.decode_split import launch_split
from pagedkv.model.triton.decode_tiles import (
    LOG2_E,
    attend_tiles,
    decode_constants,
    pool_strides,
    tile_tokens,
)
from pagedkv.pages.triton_rules import DECODE


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    cl_ptr,
    rows_ptr,
    out_ptr,
    qk_scale,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bts,
    stride_os,
    stride_oh,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    B: tl.constexpr,
    T: tl.constexpr,
    D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOTS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    HAS_ROWS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    context_len = tl.load(cl_ptr + seq)
    token = seq
    if HAS_ROWS:
        token = tl.load(rows_ptr + seq).to(tl.int64)
    rows = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    row_ok = rows < G
    heads = kv_head * G + rows
    q = tl.load(
        q_ptr + token * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    ).to(k_ptr.dtype.element_ty)
    if UPCAST_DOTS:
        q = q.to(tl.float32)
    acc, row_max, row_sum = attend_tiles(
        q,
        k_ptr + kv_head * stride_kh,
        v_ptr + kv_head * stride_vh,
        bt_ptr + seq * stride_bts,
        0,
        context_len,
        qk_scale,
        stride_kb,
        stride_kt,
        stride_vb,
        stride_vt,
        G_PAD,
        B,
        T,
        D,
        DOT_PRECISION,
        UPCAST_DOTS,
        NUM_STAGES,
    )
    # A padding row (context 0) read nothing: row_sum == 0 and its output is 0.
    out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    tl.store(
        out_ptr + token * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    tile: int | None = None,
) -> torch.Tensor:
    """Decode attention of one query token per sequence over its paged context.

    q [R, Hq, D] (any float dtype; contiguous in the last dim, other strides free),
    k_cache/v_cache [N, B, Hkv, D] (the pool's layout, any B >= 1; contiguous in the last dim),
    block_tables int32 [S, W], context_lens int32 [S] (a row with context 0 is padding: its
    output is 0 and nothing is read). ``rows`` int32 [S]: sequence s's row of q and out (None:
    row s, and R == S). Hq % Hkv == 0. q is cast to the cache's dtype for the dots; scores,
    softmax and accumulation are fp32. Returns out [R, Hq, D] in q's dtype, or ``out`` itself
    (written in place, in its dtype) when given; rows no sequence names are left as they were.
    Nothing else is mutated. num_splits > 1 runs decode_split's kernels (see ``decode_splits``
    for choosing it). ``tile``: tokens per K/V tile (None: ``triton_rules.kv_tile``'s rule).
    No host syncs: usable under CUDA-graph capture. Refused head dims raise UsageError
    (pagedkv.pages.triton_rules.DECODE).
    """
    num_rows, num_q_heads, head_dim = q.shape
    num_seqs = context_lens.shape[0]
    _, block_size, num_kv_heads, _ = k_cache.shape
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens, num_splits, rows)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"out {tuple(out.shape)} must be shaped like q and contiguous in D")
    if num_seqs == 0 or num_rows == 0:
        return out
    constants = decode_constants(
        num_q_heads // num_kv_heads, block_size, tile_tokens(k_cache, tile), head_dim, k_cache.dtype
    )
    if num_splits > 1:
        launch_split(
            q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, out, rows, constants
        )
        return out
    _launch(q, k_cache, v_cache, block_tables, context_lens, scale, out, rows, constants)
    return out


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_splits: int,
    rows: torch.Tensor | None,
) -> None:
    """Shape/dtype/layout checks on metadata only (no device reads); the head dim against
    ``DECODE``'s rule (UsageError)."""
    _, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    DECODE.check(block_size, head_dim)
    if cache_head_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q {tuple(q.shape)} does not match the cache {tuple(k_cache.shape)} "
            "(head dims must agree and Hq be a multiple of Hkv)"
        )
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache differ")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q and the caches must be contiguous in the head dim")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError("block_tables and context_lens must be int32")
    num_seqs = context_lens.shape[0]
    if block_tables.shape[0] != num_seqs or context_lens.dim() != 1:
        raise ValueError("block_tables and context_lens need one row per sequence")
    if rows is None and num_seqs != q.shape[0]:
        raise ValueError("without rows, q needs one row per sequence")
    if rows is not None and (rows.dtype != torch.int32 or rows.shape != (num_seqs,)):
        raise ValueError("rows must be int32 [num_seqs]")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables must be contiguous along a row")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    rows: torch.Tensor | None,
    constants: dict,
) -> None:
    """The one-pass kernel's launch: a program per (sequence, KV head)."""
    num_seqs, num_kv_heads = context_lens.shape[0], k_cache.shape[2]
    _decode_kernel[(num_seqs, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        context_lens if rows is None else rows,  # unread without rows
        out,
        scale * LOG2_E,
        q.stride(0),
        q.stride(1),
        *pool_strides(k_cache, v_cache),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        HAS_ROWS=rows is not None,
        **constants,
    )
