"""Paged decode attention in one launch ("one pass"): one new query token per sequence attends
to that sequence's whole context, read block by block through its block table.

One program per (sequence, KV head). It holds all ``G = Hq / Hkv`` query heads sharing that KV
head as the rows of one tile (padded to at least 16 rows, masked, because ``tl.dot`` needs 16
along every dimension), so each K/V block is read from memory once per group (GQA), not once per
query head. Per block: scores = q K^T * scale in fp32, positions at or past the context length
masked, an online softmax (running max and sum in fp32) and acc += p V.

``attend_blocks`` is that loop over a range of a sequence's blocks; decode_split.py runs it on
one split of the context per program and combines the splits afterwards.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.pages.triton_rules import DECODE, MIN_TILE

# exp2 is the GPU's native exponential: scores are kept in base 2 (scale * log2(e)), which gives
# the same softmax since 2^(x log2 e) = e^x.
LOG2_E = 1.4426950408889634


@triton.jit
def attend_blocks(
    q,  # [G_PAD, D] in the cache's dtype (fp32 if UPCAST_DOTS), padding rows zero
    k_ptr,
    v_ptr,
    bt_ptr,  # this sequence's row of the block table
    context_len,
    block_start,
    block_end,
    qk_scale,  # scale * log2(e)
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    G_PAD: tl.constexpr,
    B: tl.constexpr,
    D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOTS: tl.constexpr,
):
    """Online softmax over blocks [block_start, block_end) of one sequence; k_ptr/v_ptr already
    point at this KV head. Returns (acc [G_PAD, D] fp32 unnormalised, row_max [G_PAD] the
    running max in base-2 units, row_sum [G_PAD] the running sum of 2^(score - row_max)); an
    empty range gives (0, -inf, 0)."""
    offs_t = tl.arange(0, B)
    offs_d = tl.arange(0, D)
    row_max = tl.full([G_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for i in range(block_start, block_end):
        # int64: block_id * block stride overflows int32 on a pool of a few GiB.
        block_id = tl.load(bt_ptr + i).to(tl.int64)
        pos = i * B + offs_t
        valid = pos < context_len
        # Masked loads: slots past the context may hold anything (a host tier's pool is
        # uninitialised), and 0 * NaN would poison the row.
        k = tl.load(
            k_ptr + block_id * stride_kb + offs_t[:, None] * stride_kt + offs_d[None, :],
            mask=valid[:, None],
            other=0.0,
        )
        v = tl.load(
            v_ptr + block_id * stride_vb + offs_t[:, None] * stride_vt + offs_d[None, :],
            mask=valid[:, None],
            other=0.0,
        )
        p_dtype = v.dtype
        if UPCAST_DOTS:  # see upcast_dots(): only under the interpreter
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        # Every block in range holds at least one valid position, so max_new is finite.
        max_new = tl.maximum(row_max, tl.max(s, 1))
        alpha = tl.exp2(row_max - max_new)
        p = tl.exp2(s - max_new[:, None])
        row_sum = row_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(p_dtype).to(v.dtype), v, input_precision=DOT_PRECISION
        )
        row_max = max_new
    return acc, row_max, row_sum


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


# triton reads TRITON_INTERPRET when decorating: the kernel's own type says which mode it is in.
_INTERPRETED = type(_decode_kernel).__name__ == "InterpretedFunction"


def group_rows(group_size: int) -> int:
    """Rows of the query tile for ``group_size`` query heads: a power of two (tl.arange) and at
    least tl.dot's 16."""
    return max(MIN_TILE, triton.next_power_of_2(group_size))


def num_warps_for(block_size: int, head_dim: int) -> int:
    """4 warps for tiles up to 64 x 128; a larger K/V tile spreads over 8 to stay in registers."""
    return 4 if block_size * head_dim <= 64 * 128 else 8


def dot_precision(cache_dtype: torch.dtype) -> str:
    """fp32 caches multiply in IEEE fp32 (TF32 flips greedy tokens); 16-bit ones take the
    default ("tf32", which only affects fp32 operands)."""
    return "ieee" if cache_dtype == torch.float32 else "tf32"


def upcast_dots(cache_dtype: torch.dtype) -> bool:
    """True only under the Triton interpreter with a 16-bit cache: triton 3.9's interpreter
    multiplies bf16 dot operands as their raw uint16 bits (numpy has no bf16). The operands are
    then widened to fp32 after being rounded to the cache's dtype, which computes the same
    products as a 16-bit tensor-core dot with fp32 accumulation. Compiled kernels never upcast.
    """
    return _INTERPRETED and cache_dtype != torch.float32


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
        # Imported here: decode_split imports attend_blocks from this module.
        from pagedkv.model.triton.decode_split import launch_split

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
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        G=group_size,
        G_PAD=group_rows(group_size),
        B=block_size,
        D=head_dim,
        DOT_PRECISION=dot_precision(k_cache.dtype),
        UPCAST_DOTS=upcast_dots(k_cache.dtype),
        num_warps=num_warps_for(block_size, head_dim),
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
