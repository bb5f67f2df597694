"""Split-K ("flash-decoding") paged decode: the context of each sequence is cut into
``num_splits`` ranges of whole K/V tiles, one program per (sequence, KV head, split) computes a partial
softmax-attention over its range, and a reduction kernel combines the partials.

Why: decode has one query token per sequence, so the one-pass kernel launches only
``num_seqs * num_kv_heads`` programs. A small batch with long contexts leaves most SMs idle
while a few programs walk thousands of blocks; splitting the context multiplies the programs.

Combining (log-sum-exp): split i stores its normalised output o_i and lse_i = log2(sum of its
exp2 scores) (base 2, as the kernels' scores). With M = max_i lse_i and w_i = 2^(lse_i - M),
the full output is sum_i w_i o_i / sum_i w_i; subtracting M keeps every 2^x <= 1. A split that
gets no block stores lse = -inf and o = 0, so its weight is 0; a padding row (context 0) has
only such splits and its output is 0.

``decode_splits`` is the rule choosing ``num_splits`` (``pages/triton_splits.py``: torch-free,
the simulator prices the same rule).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.model.triton.decode_tiles import LOG2_E, attend_tiles, pool_strides

# The split rule is pure integer math shared with the simulator's clock: one copy, in pages/.
from pagedkv.pages.triton_splits import (  # noqa: F401 (re-exported: kernels.decode_splits)
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    PROGRAMS_PER_SM,
    decode_splits,
)


@triton.jit
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    cl_ptr,
    rows_ptr,
    part_out_ptr,  # [S, Hq, num_splits, D] fp32, contiguous
    part_lse_ptr,  # [S, Hq, num_splits] fp32, contiguous
    qk_scale,
    num_splits,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bts,
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
    split = tl.program_id(2)
    context_len = tl.load(cl_ptr + seq)
    token = seq
    if HAS_ROWS:
        token = tl.load(rows_ptr + seq).to(tl.int64)
    # Each sequence's tiles are shared out evenly among the splits, so a split's length
    # follows its own sequence, not the batch's longest; trailing splits may get none.
    tiles_per_split = tl.cdiv(tl.cdiv(context_len, T), num_splits)
    token_start = split * tiles_per_split * T
    token_end = tl.minimum(token_start + tiles_per_split * T, context_len)
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
        token_start,
        token_end,
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
    has_blocks = row_sum > 0
    part_out = acc / tl.where(has_blocks, row_sum, 1.0)[:, None]
    lse = tl.where(has_blocks, row_max + tl.log2(tl.where(has_blocks, row_sum, 1.0)), float("-inf"))
    # Row (seq, head, split) of the partials: ((seq * Hq + head) * num_splits + split).
    part_row = (seq * (tl.num_programs(1) * G) + heads) * num_splits + split
    tl.store(part_lse_ptr + part_row, lse, mask=row_ok)
    tl.store(part_out_ptr + part_row[:, None] * D + offs_d[None, :], part_out, mask=row_ok[:, None])


@triton.jit
def _reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    rows_ptr,
    out_ptr,
    num_splits,
    stride_os,
    stride_oh,
    SPLITS_PAD: tl.constexpr,
    D: tl.constexpr,
    HAS_ROWS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    token = seq
    if HAS_ROWS:
        token = tl.load(rows_ptr + seq).to(tl.int64)
    offs_split = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D)
    split_ok = offs_split < num_splits
    first_row = (seq * tl.num_programs(1) + head) * num_splits
    lse = tl.load(part_lse_ptr + first_row + offs_split, mask=split_ok, other=float("-inf"))
    part = tl.load(
        part_out_ptr + (first_row + offs_split)[:, None] * D + offs_d[None, :],
        mask=split_ok[:, None],
        other=0.0,
    )
    top = tl.max(lse, 0)
    # All splits empty (context 0): top is -inf; use 0 so every weight is 2^-inf = 0.
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp2(lse - top)
    total = tl.sum(weights, 0)
    out = tl.sum(weights[:, None] * part, 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + token * stride_os + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty)
    )


def launch_split(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    out: torch.Tensor,
    rows: torch.Tensor | None,
    constants: dict,
) -> None:
    """Writes the split-K decode attention into ``out`` [R, Hq, D]. Called by
    decode.paged_decode after its checks, with its launch constants (same contracts). The fp32
    partials (S * Hq * num_splits * (D + 1) floats) are allocated per call: the torch caching
    allocator makes that cheap, and under CUDA-graph capture they come from the graph's own
    pool, so replays reuse them."""
    num_seqs = context_lens.shape[0]
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    num_splits = min(num_splits, MAX_SPLITS)
    parts = (num_seqs, num_q_heads, num_splits)
    part_out = torch.empty((*parts, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty(parts, dtype=torch.float32, device=q.device)
    row_index = context_lens if rows is None else rows  # unread without rows
    _split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        row_index,
        part_out,
        part_lse,
        scale * LOG2_E,
        num_splits,
        q.stride(0),
        q.stride(1),
        *pool_strides(k_cache, v_cache),
        block_tables.stride(0),
        HAS_ROWS=rows is not None,
        **constants,
    )
    _reduce_kernel[(num_seqs, num_q_heads)](
        part_out,
        part_lse,
        row_index,
        out,
        num_splits,
        out.stride(0),
        out.stride(1),
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        D=head_dim,
        HAS_ROWS=rows is not None,
    )
