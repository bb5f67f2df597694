"""The loop both decode kernels share: an online softmax over a range of one sequence's KV
blocks (``attend_blocks``), and the launch rules that size its tiles (``decode.py`` runs it over a
whole context, ``decode_split.py`` over one split of it)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.pages.triton_rules import MIN_TILE

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


# triton reads TRITON_INTERPRET when decorating: the kernel's own type says which mode it is in.
_INTERPRETED = type(attend_blocks).__name__ == "InterpretedFunction"


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


def pool_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
    """The (block, token, KV head) strides of the K pool, then the V pool: how every kernel
    addresses ``[num_blocks, block_size, num_kv_heads, head_dim]`` pools."""
    return (*k_cache.stride()[:3], *v_cache.stride()[:3])


def decode_constants(
    group_size: int, block_size: int, head_dim: int, cache_dtype: torch.dtype
) -> dict[str, object]:
    """The compile-time constants and warp count both decode kernels launch with."""
    return {
        "G": group_size,
        "G_PAD": group_rows(group_size),
        "B": block_size,
        "D": head_dim,
        "DOT_PRECISION": dot_precision(cache_dtype),
        "UPCAST_DOTS": upcast_dots(cache_dtype),
        "num_warps": num_warps_for(block_size, head_dim),
    }
