"""Paged MLA decode: one token per sequence, its ``H`` absorbed queries (``mla/latent.py``: the
nope part carried into latent space, then the rope part) against the sequence's latent records
``[R + Dr]``, read in tiles of ``T`` tokens gathered through its block table, as the MHA
kernels read K/V (``decode_tiles.tile_offsets``): **the tile is not the page**, so any block
size ``B >= 1`` runs, SGLang's 1 and one reserved region per sequence included (FlashMLA's tile
is its page and forces B = 64).

One program per (sequence, block of ``H_BLOCK`` query heads[, split]). Every head shares the one
latent "head" (MQA), so a program reads each record once for its heads: per tile, scores =
q_lat C^T + q_pe Pe^T (the record's two parts, each padded to a power of two >= 16 and masked:
any rank and rope width), an online softmax in fp32 (base 2), and acc += p C: the output stays
in latent space ``[H, R]`` (``expand_output`` carries it to the value heads). With
``num_splits > 1`` each program walks one split of the context's tiles and writes partials that
``_mla_reduce_kernel`` combines (log-sum-exp), as the MHA split kernel's reduction does.

No host reads: usable under CUDA-graph capture. A context of 0 (padding) reads nothing and
gives 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.model.triton.decode_split import MAX_SPLITS
from pagedkv.model.triton.decode_tiles import (
    LOG2_E,
    dot_precision,
    pipeline_stages,
    tile_offsets,
    upcast_dots,
)
from pagedkv.pages.triton_rules import MIN_TILE, MLA_DECODE, mla_head_block, mla_tile


@triton.jit
def _mla_decode_kernel(
    q_ptr,  # [S, H, R + Dr] absorbed queries
    cache_ptr,  # [N, B, 1, R + Dr] latent records
    bt_ptr,
    cl_ptr,
    out_ptr,  # [S, H, R] (one pass) or the partials [S, H, splits, R] fp32 (split)
    lse_ptr,  # [S, H, splits] fp32 (split; unread otherwise)
    qk_scale,
    num_splits,
    stride_qs,
    stride_qh,
    stride_cb,
    stride_ct,
    stride_bts,
    stride_os,
    stride_oh,
    H: tl.constexpr,
    H_BLOCK: tl.constexpr,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    RANK_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    B: tl.constexpr,
    T: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOTS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    SPLIT: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * H_BLOCK + tl.arange(0, H_BLOCK)
    split = tl.program_id(2)
    context_len = tl.load(cl_ptr + seq)
    token_start = 0
    token_end = context_len
    if SPLIT:  # this sequence's tiles shared out evenly; trailing splits may get none
        tiles_per_split = tl.cdiv(tl.cdiv(context_len, T), num_splits)
        token_start = split * tiles_per_split * T
        token_end = tl.minimum(token_start + tiles_per_split * T, context_len)
    offs_t = tl.arange(0, T)
    offs_r = tl.arange(0, RANK_PAD)
    offs_p = tl.arange(0, ROPE_PAD)
    row_ok = heads < H
    q_row = q_ptr + seq * stride_qs + heads[:, None] * stride_qh
    rank_ok = (offs_r < RANK)[None, :]
    rope_ok = (offs_p < ROPE)[None, :]
    q_lat = tl.load(q_row + offs_r[None, :], mask=row_ok[:, None] & rank_ok, other=0.0)
    q_pe = tl.load(q_row + RANK + offs_p[None, :], mask=row_ok[:, None] & rope_ok, other=0.0)
    q_lat = q_lat.to(cache_ptr.dtype.element_ty)
    q_pe = q_pe.to(cache_ptr.dtype.element_ty)
    if UPCAST_DOTS:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    row_max = tl.full([H_BLOCK], float("-inf"), tl.float32)
    row_sum = tl.zeros([H_BLOCK], tl.float32)
    acc = tl.zeros([H_BLOCK, RANK_PAD], tl.float32)
    table = bt_ptr + seq * stride_bts
    for first in tl.range(token_start, token_end, T, num_stages=NUM_STAGES):
        offs, valid = tile_offsets(table, first, token_end, offs_t, stride_cb, stride_ct, B, T)
        rows = cache_ptr + offs[:, None]
        # masked: slots past the context may hold anything, and 0 * NaN would poison a row
        c = tl.load(rows + offs_r[None, :], mask=valid[:, None] & rank_ok, other=0.0)
        pe = tl.load(rows + RANK + offs_p[None, :], mask=valid[:, None] & rope_ok, other=0.0)
        p_dtype = c.dtype
        if UPCAST_DOTS:
            c = c.to(tl.float32)
            pe = pe.to(tl.float32)
        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, tl.trans(pe), input_precision=DOT_PRECISION)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        max_new = tl.maximum(row_max, tl.max(s, 1))  # a tile in range has a valid token
        alpha = tl.exp2(row_max - max_new)
        p = tl.exp2(s - max_new[:, None])
        row_sum = row_sum * alpha + tl.sum(p, 1)
        pv = tl.dot(p.to(p_dtype).to(c.dtype), c, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        row_max = max_new
    has_keys = row_sum > 0
    out = acc / tl.where(has_keys, row_sum, 1.0)[:, None]
    out_mask = row_ok[:, None] & rank_ok
    if SPLIT:  # partial row (seq, head, split): ((seq * H + head) * num_splits + split)
        part = (seq * H + heads) * num_splits + split
        lse = tl.where(has_keys, row_max + tl.log2(tl.where(has_keys, row_sum, 1.0)), float("-inf"))
        tl.store(lse_ptr + part, lse, mask=row_ok)
        tl.store(out_ptr + part[:, None] * RANK + offs_r[None, :], out, mask=out_mask)
    else:
        dst = out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_r[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=out_mask)


def mla_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    *,
    num_splits: int = 1,
    tile: int | None = None,
) -> torch.Tensor:
    """Latent-space decode attention ``[S, H, R]`` (q's dtype) of absorbed queries ``q``
    ``[S, H, R + Dr]`` (contiguous last dim) over the latent pool ``cache`` ``[N, B, 1, R + Dr]``
    (any B >= 1), ``block_tables`` int32 ``[S, W]``, ``context_lens`` int32 ``[S]`` (0: padding,
    output 0). ``scale``: the softmax scale. Scores, softmax and sums in fp32; the dots in the
    cache's dtype (IEEE fp32 for an fp32 cache). ``num_splits`` > 1: split-K over the context
    (``decode_splits``'s rule, with ``mla_head_block``'s programs per sequence). Mutates nothing.
    ``UsageError`` for a rank ``MLA_DECODE`` refuses."""
    num_seqs, num_heads, _ = q.shape
    _check(q, cache, block_tables, context_lens, kv_lora_rank)
    out = torch.empty((num_seqs, num_heads, kv_lora_rank), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    constants = _constants(q, cache, kv_lora_rank, tile)
    splits = max(1, min(num_splits, MAX_SPLITS))
    grid = (num_seqs, triton.cdiv(num_heads, constants["H_BLOCK"]), splits)
    operands = (q, cache, block_tables, context_lens)
    strides = (q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), block_tables.stride(0))
    qk_scale = scale * LOG2_E
    if splits == 1:
        out_strides = (out.stride(0), out.stride(1))
        _mla_decode_kernel[grid](
            *operands, out, out, qk_scale, 1, *strides, *out_strides, SPLIT=False, **constants
        )
        return out
    parts = q.new_empty((num_seqs, num_heads, splits, kv_lora_rank), dtype=torch.float32)
    lse = q.new_empty((num_seqs, num_heads, splits), dtype=torch.float32)
    _mla_decode_kernel[grid](
        *operands, parts, lse, qk_scale, splits, *strides, 0, 0, SPLIT=True, **constants
    )
    _mla_reduce_kernel[(num_seqs, num_heads)](
        parts,
        lse,
        out,
        splits,
        out.stride(0),
        out.stride(1),
        RANK=kv_lora_rank,
        RANK_PAD=constants["RANK_PAD"],
        SPLITS_PAD=triton.next_power_of_2(splits),
    )
    return out


def _check(q, cache, block_tables, context_lens, kv_lora_rank: int) -> None:
    """Shapes, dtypes and layouts (metadata only: no device read); the rank against
    ``MLA_DECODE`` (UsageError)."""
    num_seqs, _, width = q.shape
    _, block_size, one, cache_width = cache.shape
    MLA_DECODE.check(block_size, kv_lora_rank)
    if one != 1 or cache_width != width or not 0 < kv_lora_rank < width:
        raise ValueError(f"q {tuple(q.shape)} does not match the latent pool {tuple(cache.shape)}")
    if q.stride(2) != 1 or cache.stride(3) != 1 or block_tables.stride(1) != 1:
        raise ValueError("q, the pool and the block tables must be contiguous in their last dim")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError("block_tables and context_lens must be int32")
    if block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError("q, block_tables and context_lens need one row per sequence")


def _constants(q, cache, kv_lora_rank: int, tile: int | None) -> dict:
    """The kernel's compile-time constants and warp count: heads a program
    (``mla_head_block``), each record part padded to a power of two >= 16, the tile
    (``mla_tile``'s rule unless given)."""
    num_heads, width, block_size = q.shape[1], q.shape[2], cache.shape[1]
    rope = width - kv_lora_rank
    head_block = mla_head_block(num_heads)
    return dict(
        H=num_heads,
        H_BLOCK=head_block,
        RANK=kv_lora_rank,
        ROPE=rope,
        RANK_PAD=max(MIN_TILE, triton.next_power_of_2(kv_lora_rank)),
        ROPE_PAD=max(MIN_TILE, triton.next_power_of_2(rope)),
        B=block_size,
        T=mla_tile(width, cache.element_size()) if tile is None else tile,
        DOT_PRECISION=dot_precision(cache.dtype),
        UPCAST_DOTS=upcast_dots(cache.dtype),
        NUM_STAGES=pipeline_stages(),
        num_warps=4 if head_block * kv_lora_rank <= 16 * 512 else 8,
    )


@triton.jit
def _mla_reduce_kernel(
    part_ptr,  # [S, H, splits, RANK] fp32
    lse_ptr,  # [S, H, splits] fp32
    out_ptr,
    num_splits,
    stride_os,
    stride_oh,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """One (sequence, head): its splits' outputs weighted by 2^(lse - max) (decode_split.py's
    combination; a split without keys weighs 0, a padding row's output is 0)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_split = tl.arange(0, SPLITS_PAD)
    offs_r = tl.arange(0, RANK_PAD)
    split_ok = offs_split < num_splits
    first = (seq * tl.num_programs(1) + head) * num_splits
    lse = tl.load(lse_ptr + first + offs_split, mask=split_ok, other=float("-inf"))
    mask = split_ok[:, None] & (offs_r < RANK)[None, :]
    part = tl.load(
        part_ptr + (first + offs_split)[:, None] * RANK + offs_r[None, :], mask=mask, other=0.0
    )
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp2(lse - top)
    total = tl.sum(weights, 0)
    out = tl.sum(weights[:, None] * part, 0) / tl.where(total > 0, total, 1.0)
    dst = out_ptr + seq * stride_os + head * stride_oh + offs_r
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=offs_r < RANK)
