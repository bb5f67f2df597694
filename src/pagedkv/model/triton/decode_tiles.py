"""The loop both decode kernels share: an online softmax over a range of one sequence's context
in tiles of ``T`` tokens gathered through its block table (``attend_tiles``), and the launch
rules that size them (``decode.py`` runs it over a whole context, ``decode_split.py`` over one
split of it).

**The tile is not the page.** Token ``t`` of a sequence lives at ``table[t // B] * B + t % B``
whatever the block size ``B``: a tile of ``T`` tokens gathers ``ceil(T / B)`` blocks when
``B < T`` (SGLang's page of 1 included), and is a slice of one block when ``B`` is a multiple of
``T`` (then one block-table entry is read per tile, not one per token). ``tl.dot``'s 16-row
minimum and ``tl.arange``'s power of two apply to ``T``, never to ``B``, so any ``B >= 1`` runs,
up to one ``max_model_len`` region per sequence (the reserved policy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.pages.triton_rules import MIN_TILE, kv_tile

# exp2 is the GPU's native exponential: scores are kept in base 2 (scale * log2(e)), which gives
# the same softmax since 2^(x log2 e) = e^x.
LOG2_E = 1.4426950408889634


@triton.jit
def tile_offsets(
    bt_ptr, first, last, offs_t, stride_kb, stride_kt, B: tl.constexpr, T: tl.constexpr
):
    """(element offsets [T] of tokens ``first + offs_t`` in a pool with strides
    ``stride_kb``/``stride_kt``, their mask ``< last``): one table entry for the tile when B is a
    multiple of T (``first`` is then a multiple of T, so the tile lies in one block), else one
    per token. int64: a block id times the block stride overflows int32 on a large pool."""
    pos = first + offs_t
    valid = pos < last
    if B % T == 0:
        block_id = tl.load(bt_ptr + first // B).to(tl.int64)
        offs = block_id * stride_kb + ((first % B) + offs_t).to(tl.int64) * stride_kt
    else:
        block_ids = tl.load(bt_ptr + pos // B, mask=valid, other=0).to(tl.int64)
        offs = block_ids * stride_kb + (pos % B).to(tl.int64) * stride_kt
    return offs, valid


@triton.jit
def attend_tiles(
    q,  # [G_PAD, D] in the cache's dtype (fp32 if UPCAST_DOTS), padding rows zero
    k_ptr,
    v_ptr,
    bt_ptr,  # this sequence's row of the block table
    token_start,  # a multiple of T
    token_end,  # <= the context length
    qk_scale,  # scale * log2(e)
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    G_PAD: tl.constexpr,
    B: tl.constexpr,
    T: tl.constexpr,
    D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOTS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Online softmax over tokens [token_start, token_end) of one sequence, T at a time;
    k_ptr/v_ptr already point at this KV head. Returns (acc [G_PAD, D] fp32 unnormalised,
    row_max [G_PAD] the running max in base-2 units, row_sum [G_PAD] the running sum of
    2^(score - row_max)); an empty range gives (0, -inf, 0). ``NUM_STAGES``: the loop's software
    pipelining depth (the next tiles' table entries and K/V load while this one is scored)."""
    offs_t = tl.arange(0, T)
    offs_d = tl.arange(0, D)
    row_max = tl.full([G_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for first in tl.range(token_start, token_end, T, num_stages=NUM_STAGES):
        k_offs, valid = tile_offsets(bt_ptr, first, token_end, offs_t, stride_kb, stride_kt, B, T)
        v_offs, _ = tile_offsets(bt_ptr, first, token_end, offs_t, stride_vb, stride_vt, B, T)
        # Masked loads: slots past the context may hold anything (a host tier's pool is
        # uninitialised), and 0 * NaN would poison the row.
        k = tl.load(k_ptr + k_offs[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + v_offs[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        p_dtype = v.dtype
        if UPCAST_DOTS:  # see upcast_dots(): only under the interpreter
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        # Every tile in range holds at least one valid token, so max_new is finite.
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
_INTERPRETED = type(attend_tiles).__name__ == "InterpretedFunction"
# Tiles in flight per loop: the next table entries and K/V load while one is scored.
NUM_STAGES = 3


def pipeline_stages() -> int:
    """The key loops' ``num_stages``: ``NUM_STAGES`` compiled, 1 under the interpreter (which
    runs the loop as written)."""
    return 1 if _INTERPRETED else NUM_STAGES


def group_rows(group_size: int) -> int:
    """Rows of the query tile for ``group_size`` query heads: a power of two (tl.arange) and at
    least tl.dot's 16."""
    return max(MIN_TILE, triton.next_power_of_2(group_size))


def num_warps_for(tile_tokens: int, head_dim: int) -> int:
    """4 warps for K/V tiles up to 64 x 128; a larger tile spreads over 8 to stay in registers."""
    return 4 if tile_tokens * head_dim <= 64 * 128 else 8


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


def tile_tokens(k_cache: torch.Tensor, tile: int | None) -> int:
    """``tile`` (a power of two >= 16: a caller's choice, e.g. the tests' or a benchmark's), or
    the rule's for this pool's head dim and dtype (``triton_rules.kv_tile``)."""
    if tile is None:
        return kv_tile(k_cache.shape[3], k_cache.element_size())
    if tile < MIN_TILE or tile & (tile - 1):
        raise ValueError(f"tile {tile} is not a power of two >= {MIN_TILE} (tl.dot's tile)")
    return tile


def decode_constants(
    group_size: int, block_size: int, tile: int, head_dim: int, cache_dtype: torch.dtype
) -> dict[str, object]:
    """The compile-time constants and warp count both decode kernels launch with."""
    return {
        "G": group_size,
        "G_PAD": group_rows(group_size),
        "B": block_size,
        "T": tile,
        "D": head_dim,
        "DOT_PRECISION": dot_precision(cache_dtype),
        "UPCAST_DOTS": upcast_dots(cache_dtype),
        "NUM_STAGES": pipeline_stages(),
        "num_warps": num_warps_for(tile, head_dim),
    }
