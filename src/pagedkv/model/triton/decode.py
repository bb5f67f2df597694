"""Paged decode attention in one launch ("one pass"): one new query token per sequence attends
to that sequence's whole context, read block by block through its block table.

One program per (sequence, KV head). It holds all ``G = Hq / Hkv`` query heads sharing that KV
head as the rows of one tile (padded to at least 16 rows, masked, because ``tl.dot`` needs 16
along every dimension), so each K/V block is read from memory once per group (GQA), not once per
query head. Per block: scores = q K^T * scale in fp32, positions at or past the context length
masked, an online softmax (running max and sum in fp32) and acc += p V.

The loop itself, ``attend_blocks``, lives in decode_blocks.py: decode_split.py runs it on one
split of the context per program and combines the splits afterwards.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.model.triton.decode_blocks import (
    LOG2_E,
    attend_blocks,
    decode_constants,
    pool_strides,
)
from pagedkv.model.triton.decode_split import launch_split
from pagedkv.pages.triton_rules import DECODE


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    cl_ptr,
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
    D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOTS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    context_len = tl.load(cl_ptr + seq)
    rows = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    row_ok = rows < G
    heads = kv_head * G + rows
    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    ).to(k_ptr.dtype.element_ty)
    if UPCAST_DOTS:
        q = q.to(tl.float32)
    acc, row_max, row_sum = attend_blocks(
        q,
        k_ptr + kv_head * stride_kh,
        v_ptr + kv_head * stride_vh,
        bt_ptr + seq * stride_bts,
        context_len,
        0,
        tl.cdiv(context_len, B),
        qk_scale,
        stride_kb,
        stride_kt,
        stride_vb,
        stride_vt,
        G_PAD,
        B,
        D,
        DOT_PRECISION,
        UPCAST_DOTS,
    )
    # A padding row (context 0) read nothing: row_sum == 0 and its output is 0.
    out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    tl.store(
        out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
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
) -> torch.Tensor:
    """Decode attention of one query token per sequence over its paged context.

    q [S, Hq, D] (any float dtype; contiguous in the last dim, other strides free),
    k_cache/v_cache [N, B, Hkv, D] (the pool's layout; contiguous in the last dim),
    block_tables int32 [S, W], context_lens int32 [S] (a row with context 0 is padding: its
    output is 0 and nothing is read). Hq % Hkv == 0. q is cast to the cache's dtype for the
    dots; scores, softmax and accumulation are fp32. Returns out [S, Hq, D] in q's dtype, or
    ``out`` itself (written in place, in its dtype) when given. Nothing else is mutated.
    num_splits > 1 runs decode_split's kernels (see ``decode_splits`` for choosing it).
    No host syncs: usable under CUDA-graph capture. Refused block sizes / head dims raise
    UsageError (pagedkv.pages.triton_rules.DECODE).
    """
    num_seqs, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    DECODE.check(block_size, head_dim)
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens, num_splits)
    if cache_head_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q {tuple(q.shape)} does not match the cache {tuple(k_cache.shape)} "
            "(head dims must agree and Hq be a multiple of Hkv)"
        )
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"out {tuple(out.shape)} must be shaped like q and contiguous in D")
    if num_seqs == 0:
        return out
    if num_splits > 1:
        launch_split(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, out)
        return out
    group_size = num_q_heads // num_kv_heads
    _decode_kernel[(num_seqs, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        scale * LOG2_E,
        q.stride(0),
        q.stride(1),
        *pool_strides(k_cache, v_cache),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        **decode_constants(group_size, block_size, head_dim, k_cache.dtype),
    )
    return out


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_splits: int,
) -> None:
    """Shape/dtype/layout checks on metadata only (no device reads)."""
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache differ")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q and the caches must be contiguous in the head dim")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError("block_tables and context_lens must be int32")
    if block_tables.shape[0] != q.shape[0] or context_lens.shape != (q.shape[0],):
        raise ValueError("block_tables and context_lens need one row per sequence of q")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables must be contiguous along a row")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
